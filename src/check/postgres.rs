//! The PostgreSQL checks: reachable, wal_level, slots and senders, the role, the slot.

use super::{CHECK_TIMEOUT, CheckError, Level, Line};
use crate::config::Config;
use crate::config::quote_ident;
use crate::config::shown_url;
use crate::source::SourceError;
use crate::source::connect_sql;
use crate::source::slot::{self, SlotProblem};
use tokio_postgres::Client;
use tokio_postgres::error::SqlState;

/// The text of a PostgreSQL error: the server's message for a server error,
/// otherwise the error and its causes.
pub(super) fn pg_error_text(e: &tokio_postgres::Error) -> String {
    if let Some(db) = e.as_db_error() {
        let mut s = format!("{}: {}", db.severity(), db.message());
        if let Some(hint) = db.hint() {
            s.push_str(&format!(" (hint: {hint})"));
        }
        return s;
    }
    let mut s = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        s.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    s
}

/// Whether PostgreSQL proves who it is: a warning for every `sslmode`
/// that authenticates no server.
pub(super) fn server_identity(cfg: &Config) -> Line {
    use crate::tls::SslMode;
    let pg = &cfg.postgres;
    let what = format!("postgres.sslmode = {}", pg.sslmode);
    let unix = (pg.targets.iter()).all(|t| matches!(t, crate::pgurl::PgTarget::Unix { .. }));
    match pg.sslmode {
        SslMode::VerifyCa | SslMode::VerifyFull => Line::ok(
            what,
            "the server's certificate is verified against postgres.ca_file",
        ),
        _ if unix => Line::ok(what, "a Unix socket: its directory vouches for the server"),
        _ => Line::warn(
            what,
            "authenticates no server: whoever answers at its address gets the connection and \
             what it carries (the relay never sends it the password in the clear or as MD5, \
             and SCRAM does not reveal it); set postgres.sslmode = \"verify-full\" with \
             postgres.ca_file",
        ),
    }
}

pub(super) async fn postgres_connect(cfg: &Config) -> (Line, Option<Client>) {
    let url = shown_url(cfg.postgres.url.expose());
    let what = format!("PostgreSQL reachable at {url}");
    // connect_sql has its own deadline (15 s), the same as CHECK_TIMEOUT.
    let client = match connect_sql(&cfg.postgres)
        .await
        .map_err(SourceError::without_rotation)
    {
        Ok(c) => c,
        Err(SourceError::Sql { source, .. }) => {
            let why = describe_pg_connect_error(&source, cfg.postgres.url.password_key());
            return (Line::fail(what, why), None);
        }
        Err(e) => {
            return (
                Line::fail(
                    what,
                    format!(
                        "{e}: is PostgreSQL running, and are the host and port in postgres.url right?"
                    ),
                ),
                None,
            );
        }
    };
    let who = tokio::time::timeout(
        CHECK_TIMEOUT,
        client.query_one(
            "SELECT current_user::text, current_database()::text, current_setting('server_version')",
            &[],
        ),
    )
    .await;
    match who {
        Ok(Ok(row)) => {
            let user: String = row.get(0);
            let db: String = row.get(1);
            let version: String = row.get(2);
            // "15.18 (Debian 15.18-0+deb12u1)" -> "15.18"
            let version = version.split_whitespace().next().unwrap_or_default();
            (
                Line::ok(
                    what,
                    format!("logged in as {user} to database {db} (PostgreSQL {version})"),
                ),
                Some(client),
            )
        }
        Ok(Err(e)) => (
            Line::fail(
                what,
                format!(
                    "connected, but the first query failed: {}",
                    pg_error_text(&e)
                ),
            ),
            None,
        ),
        Err(_) => (
            Line::fail(
                what,
                format!(
                    "connected, but the first query got no answer within {} s",
                    CHECK_TIMEOUT.as_secs()
                ),
            ),
            None,
        ),
    }
}

/// `e`, a failed connect, with what to fix; `password_key` is the
/// setting the password comes from when not the URL (`password_file`).
pub(super) fn describe_pg_connect_error(
    e: &tokio_postgres::Error,
    password_key: Option<&str>,
) -> String {
    let text = pg_error_text(e);
    match e.code() {
        Some(c) if c.code().starts_with("28") => format!(
            "authentication failed ({text}): fix the user name in postgres.url (or \
             OUTBOX_RELAY_POSTGRES_URL) or the password in {}, or the server's pg_hba.conf \
             entry for this client",
            password_key.unwrap_or("the same URL")
        ),
        Some(c) if *c == SqlState::INVALID_CATALOG_NAME => {
            format!("{text}: fix the database name in postgres.url")
        }
        Some(c) if *c == SqlState::TOO_MANY_CONNECTIONS => {
            format!("{text}: close idle connections or raise max_connections (restart needed)")
        }
        Some(_) => text,
        None => format!(
            "cannot connect ({text}): is PostgreSQL running, and are the host and port in postgres.url right?"
        ),
    }
}

pub(super) async fn wal_level(client: &Client) -> Result<Vec<Line>, CheckError> {
    let level: String = client.query_one("SHOW wal_level", &[]).await?.get(0);
    let commit_ts: String = client
        .query_one("SHOW track_commit_timestamp", &[])
        .await?
        .get(0);
    let commit_ts = if commit_ts == "on" {
        Line::ok(
            "track_commit_timestamp",
            "on: `recover` finds every row committed since the checkpoint",
        )
    } else {
        Line::warn(
            "track_commit_timestamp",
            "is off: after a lost slot, `recover` can only select rows by created_at, \
             widened by the longest transaction the relay has seen; a longer one may be \
             missed. Set track_commit_timestamp = on (restart needed) for an exact window",
        )
    };
    Ok(vec![
        commit_ts,
        if level == "logical" {
            Line::new(Level::Ok, "wal_level = logical", None)
        } else {
            Line::fail(
                "wal_level",
                format!(
                    "is {level}, but logical replication needs wal_level = logical: set it in \
                 postgresql.conf (or ALTER SYSTEM SET wal_level = logical) and restart PostgreSQL"
                ),
            )
        },
    ])
}

pub(super) async fn slots_and_senders(
    client: &Client,
    cfg: &Config,
) -> Result<Vec<Line>, CheckError> {
    let slot = &cfg.postgres.slot;
    let row = client
        .query_one(
            "SELECT current_setting('max_replication_slots')::int, \
                    (SELECT count(*) FROM pg_replication_slots)::int, \
                    current_setting('max_wal_senders')::int, \
                    (SELECT count(*) FROM pg_stat_replication)::int, \
                    EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1)",
            &[slot],
        )
        .await?;
    let (max_slots, used_slots, max_senders, used_senders, ours): (i32, i32, i32, i32, bool) =
        (row.get(0), row.get(1), row.get(2), row.get(3), row.get(4));
    let slots = if ours {
        Line::ok(
            "replication slots",
            format!("{used_slots} of {max_slots} used, {slot:?} among them"),
        )
    } else if used_slots < max_slots {
        Line::ok(
            "replication slots",
            format!(
                "{used_slots} of {max_slots} used, {} free for {slot:?}",
                max_slots - used_slots
            ),
        )
    } else {
        Line::fail(
            "replication slots",
            format!(
                "all {max_slots} in use (max_replication_slots) and {slot:?} does not exist yet: \
                 drop slots nobody uses (see pg_replication_slots; SELECT pg_drop_replication_slot('name')), \
                 or raise max_replication_slots and restart PostgreSQL"
            ),
        )
    };
    let senders = if used_senders < max_senders {
        Line::ok(
            "WAL senders",
            format!("{used_senders} of {max_senders} in use"),
        )
    } else {
        Line::fail(
            "WAL senders",
            format!(
                "{used_senders} of {max_senders} in use (max_wal_senders), none free for the relay's \
                 replication connection: stop replication clients nobody needs (see pg_stat_replication), \
                 or raise max_wal_senders and restart PostgreSQL"
            ),
        )
    };
    Ok(vec![slots, senders])
}

pub(super) async fn role(client: &Client) -> Result<Vec<Line>, CheckError> {
    let row = client
        .query_one(
            "SELECT current_user::text, rolreplication, rolsuper FROM pg_roles WHERE rolname = current_user",
            &[],
        )
        .await?;
    let (user, replication, superuser): (String, bool, bool) = (row.get(0), row.get(1), row.get(2));
    let what = format!("role {user} may replicate");
    let mut lines = vec![if superuser {
        Line::ok(what, "superuser")
    } else if replication {
        Line::ok(what, "REPLICATION attribute")
    } else {
        Line::fail(
            what,
            format!(
                "it has neither the REPLICATION attribute nor SUPERUSER, so the replication \
                 connection would be refused: as a superuser, run ALTER ROLE {} REPLICATION",
                quote_ident(&user)
            ),
        )
    }];
    if superuser {
        lines.push(Line::warn(
            format!("role {user}"),
            "is a superuser: the relay needs only REPLICATION, SELECT on the outbox and its own \
             checkpoint row, and a superuser's password (which the relay holds) opens everything; \
             run it as the role of sql/role.sql (postgres.url)",
        ));
    }
    Ok(lines)
}

/// The checkpoint table: who owns it and what triggers it has. Its owner
/// can change what the relay records, and every trigger on it runs as the
/// relay's role (which may replicate) each time the relay records its
/// position: both must be people the relay trusts anyway, the relay's own
/// role, a superuser or the owner of an outbox table.
pub(super) async fn checkpoint_table(
    client: &Client,
    cfg: &Config,
) -> Result<Vec<Line>, CheckError> {
    let table = &cfg.postgres.checkpoint_table;
    let what = format!("checkpoint table {table}");
    let outboxes: Vec<String> = (cfg.outboxes.iter())
        .filter_map(|o| Some(o.table()?.quoted()))
        .collect();
    let row = client
        .query_opt(
            "SELECT o.rolname::text, o.rolsuper OR o.rolname = current_user \
                    OR EXISTS (SELECT 1 FROM unnest($2::text[]) t(name) \
                               JOIN pg_class x ON x.oid = to_regclass(t.name) \
                               WHERE x.relowner = c.relowner), \
                    ARRAY(SELECT tgname::text FROM pg_trigger \
                          WHERE tgrelid = c.oid AND NOT tgisinternal ORDER BY 1) \
             FROM pg_class c JOIN pg_roles o ON o.oid = c.relowner \
             WHERE c.oid = to_regclass($1)",
            &[&table.quoted(), &outboxes],
        )
        .await?;
    let Some(row) = row else {
        return Ok(vec![Line::warn(
            what,
            "does not exist yet (postgres.checkpoint_table): `outbox-relay setup` creates it, \
             or run sql/checkpoint.sql",
        )]);
    };
    let (owner, trusted, triggers): (String, bool, Vec<String>) =
        (row.get(0), row.get(1), row.get(2));
    let mut lines = Vec::new();
    if !trusted {
        lines.push(Line::warn(
            what.clone(),
            format!(
                "is owned by role {owner}, which is neither the relay's role, a superuser nor an \
                 outbox table's owner: it can rewrite what the relay records and add triggers \
                 that run as the relay's role; as a superuser, run ALTER TABLE {} OWNER TO \
                 <the outbox table's owner>",
                table.quoted()
            ),
        ));
    }
    if !triggers.is_empty() {
        let drop: Vec<String> = (triggers.iter())
            .map(|t| format!("DROP TRIGGER {} ON {}", quote_ident(t), table.quoted()))
            .collect();
        lines.push(Line::warn(
            what.clone(),
            format!(
                "has triggers ({}): they run as the relay's role each time it records its \
                 position; unless you put them there, {}",
                triggers.join(", "),
                drop.join("; ")
            ),
        ));
    }
    if let Some(lacks) = checkpoint_access(client, cfg).await? {
        lines.push(Line::warn(what.clone(), lacks));
    }
    if lines.is_empty() {
        lines.push(Line::ok(
            what,
            format!("owned by {owner}, no triggers, the relay's role granted what its row needs (a policy's condition not checked)"),
        ));
    }
    Ok(lines)
}

/// What keeps the relay's role (this connection's) from reading and
/// upserting its row of the checkpoint table, if anything: a privilege, or
/// row-level security with no policy that lets it. Without them the relay
/// streams on, warning at every write, and `recover` has no checkpoint to
/// start from. (A policy's own condition is not evaluated: that would take
/// a write.)
async fn checkpoint_access(client: &Client, cfg: &Config) -> Result<Option<String>, CheckError> {
    let table = cfg.postgres.checkpoint_table.quoted();
    // Row-level security binds a role that is not a superuser, has no
    // BYPASSRLS, and does not have the owner's privileges (or the table
    // forces it); a policy applies to PUBLIC (0) or a role whose privileges
    // it has, as PostgreSQL's own rowsecurity.c decides.
    let row = client
        .query_one(
            "SELECT ARRAY(SELECT p FROM unnest(ARRAY['SELECT', 'INSERT', 'UPDATE']) p \
                          WHERE NOT has_table_privilege(c.oid, p)), \
                    c.relrowsecurity AND NOT r.rolsuper AND NOT r.rolbypassrls \
                      AND (c.relforcerowsecurity OR NOT pg_has_role(c.relowner, 'USAGE')), \
                    ARRAY(SELECT k.name \
                          FROM (VALUES ('SELECT', 'r'), ('INSERT', 'a'), ('UPDATE', 'w')) k(name, cmd) \
                          WHERE NOT EXISTS ( \
                            SELECT 1 FROM pg_policy p \
                            WHERE p.polrelid = c.oid AND p.polpermissive \
                              AND p.polcmd IN ('*', k.cmd) \
                              AND EXISTS (SELECT 1 FROM unnest(p.polroles) pr \
                                          WHERE pr = 0 OR pg_has_role(pr, 'USAGE')))) \
             FROM pg_class c, pg_roles r \
             WHERE c.oid = to_regclass($1) AND r.rolname = current_user",
            &[&table],
        )
        .await?;
    let (privileges, rls, no_policy): (Vec<String>, bool, Vec<String>) =
        (row.get(0), row.get(1), row.get(2));
    let slot = &cfg.postgres.slot;
    if !privileges.is_empty() {
        return Ok(Some(format!(
            "the relay's role lacks {} on it, so it cannot record its position (`recover` would \
             have no checkpoint): GRANT SELECT, INSERT, UPDATE ON {table} TO <the relay's role> \
             (sql/role.sql does)",
            privileges.join(", ")
        )));
    }
    if rls && !no_policy.is_empty() {
        return Ok(Some(format!(
            "row-level security is on and no policy lets the relay's role {} its row, so it \
             cannot record its position (`recover` would have no checkpoint): CREATE POLICY \
             ... ON {table} TO <the relay's role> USING (slot_name = '{slot}') WITH CHECK \
             (slot_name = '{slot}') (sql/role.sql does)",
            no_policy.join(", ")
        )));
    }
    Ok(None)
}

pub(super) async fn replication_slot(
    client: &Client,
    cfg: &Config,
) -> Result<Vec<Line>, CheckError> {
    let name = &cfg.postgres.slot;
    let what = format!("replication slot {name:?}");
    // The verdict `run` applies (slot::usable_slot): each problem a line.
    let Some(info) = slot::slot_info(client, cfg).await? else {
        return Ok(vec![Line::fail(what, SlotProblem::Missing.text(name))]);
    };
    let problems = info.problems();
    let wal_status = info.wal_status.as_deref().unwrap_or("-");
    let lsn = info
        .confirmed_flush_lsn
        .map_or_else(|| "-".to_owned(), |l| l.to_string());
    let state = format!("pgoutput, wal_status {wal_status}, confirmed_flush_lsn {lsn}");
    let mut lines: Vec<Line> = (problems.iter())
        .map(|p| match p {
            SlotProblem::Busy(_) => {
                Line::warn(what.clone(), format!("slot {} ({state})", p.text(name)))
            }
            _ => Line::fail(what.clone(), p.text(name)),
        })
        .collect();
    if problems.iter().any(|p| !p.passes()) {
        return Ok(lines);
    }
    if problems.is_empty() {
        lines.push(Line::ok(what.clone(), format!("{state}, not active")));
    }
    // Surviving a failover: a failover slot (17+), or a re-publish.
    let version: i32 = client
        .query_one("SELECT current_setting('server_version_num')::int", &[])
        .await?
        .get(0);
    let (failover, sync) = if version >= 170_000 {
        let row = client
            .query_one(
                "SELECT (SELECT failover FROM pg_replication_slots WHERE slot_name = $1), \
                 current_setting('sync_replication_slots', true)",
                &[name],
            )
            .await?;
        (
            row.get::<_, Option<bool>>(0),
            row.get::<_, Option<String>>(1),
        )
    } else {
        (None, None)
    };
    let (survives, note) = slot::failover_note(version, failover, sync.as_deref());
    let recovers = cfg.postgres.on_slot_lost == crate::config::OnSlotLost::Recover;
    lines.push(match (survives, recovers) {
        (true, _) => Line::ok(format!("{what} across a failover"), note),
        (false, true) => Line::ok(
            format!("{what} across a failover"),
            format!("{note}; run does it (on_slot_lost = \"recover\")"),
        ),
        (false, false) => Line::warn(format!("{what} across a failover"), note),
    });
    // 18: a slot no walsender uses for this long is invalidated at the
    // next checkpoint, so a relay stopped (or failing) that long loses it.
    if version >= 180_000 {
        let secs: Option<i64> = client
            .query_one(
                "SELECT extract(epoch FROM current_setting('idle_replication_slot_timeout', true)::interval)::bigint",
                &[],
            )
            .await
            .ok()
            .and_then(|r| r.get(0));
        if let Some(secs) = secs.filter(|s| *s > 0) {
            lines.push(idle_timeout_line(&what, secs));
        }
    }
    if wal_status == "unreserved" {
        lines.push(Line::warn(
            what,
            "wal_status = unreserved: it retains more WAL than max_slot_wal_keep_size and is \
             invalidated at the next checkpoint unless the relay catches up first",
        ));
    }
    Ok(lines)
}

/// Lines for the hosts of `postgres.url` (when it names more than one)
/// other than the primary `check` reached, whatever the state of the
/// slot: a host of another cluster, or a second primary of this one,
/// fails (were it the one reached, the relay would stream another
/// database, or a primary about to be fenced). With a failover slot
/// (PostgreSQL 17+), a line per standby: whether it keeps a synchronized,
/// usable copy of the slot, with the settings that make it one
/// (`sync_replication_slots`, `hot_standby_feedback`,
/// `primary_slot_name`, named in the primary's
/// `synchronized_standby_slots`), read on the standby itself.
pub(super) async fn hosts(client: &Client, cfg: &Config) -> Result<Vec<Line>, CheckError> {
    if cfg.postgres.targets.len() < 2 {
        return Ok(Vec::new());
    }
    // What makes a failover slot (17+) survive is set on the standbys.
    let row = client
        .query_one(
            "SELECT current_setting('server_version_num')::int >= 170000 \
                     AND coalesce((SELECT (to_jsonb(s) ->> 'failover')::bool \
                         FROM pg_replication_slots s WHERE slot_name = $1), false), \
                 coalesce(current_setting('synchronized_standby_slots', true), '')",
            &[&cfg.postgres.slot],
        )
        .await?;
    let slot_sync: bool = row.try_get(0).unwrap_or(false);
    let guarded: Option<String> = row.try_get(1).ok();
    // None: unread (then the hosts' clusters are not compared).
    let reached = Identity::read(client).await;
    let mut lines = Vec::new();
    if reached.is_none() {
        lines.push(Line::warn(
            "hosts of postgres.url",
            "the primary's system identifier is unread (pg_control_system() not executable \
             by the relay's role?): whether each host is of this cluster is not checked",
        ));
    }
    // All at once, each within HOST_TIMEOUT (connect and read), under
    // CHECK_TIMEOUT in all.
    let reads = cfg.postgres.targets.iter().map(|target| {
        let guarded = guarded.as_deref().filter(|_| slot_sync);
        let reached = reached.as_ref();
        async move {
            let read = host(cfg, target, reached, guarded, slot_sync);
            match tokio::time::timeout(HOST_TIMEOUT, read).await {
                Ok(line) => line,
                Err(_) => Some(Line::warn(
                    format!("host {target}"),
                    format!("no answer within {} s, unread", HOST_TIMEOUT.as_secs()),
                )),
            }
        }
    });
    let read: Vec<Line> = futures_util::future::join_all(reads)
        .await
        .into_iter()
        .flatten()
        .collect();
    // A primary that restarted while its hosts were read looks like a
    // second primary of its cluster: read it again before saying so.
    if reached.is_some() && Identity::read(client).await != reached {
        lines.push(Line::warn(
            "hosts of postgres.url",
            "the primary restarted (or its connection was lost) while the other hosts were \
             read: run check again",
        ));
        return Ok(lines);
    }
    lines.extend(read);
    Ok(lines)
}

/// How long `check` waits for each host.
const HOST_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Which server a connection reached: the cluster's system identifier,
/// and when the server started (two servers of one cluster, a primary
/// and a promoted standby, never start in the same microsecond).
#[derive(PartialEq, Eq)]
struct Identity {
    cluster: String,
    /// Microseconds since 1970: a number, not a time, so that a session's
    /// TimeZone or DateStyle cannot change it.
    started: i64,
}

impl Identity {
    /// The identity of the server behind `client`; `None` if unread. A
    /// statement of its own: a role may not call `pg_control_system()`
    /// (its EXECUTE revoked), and the server checks that when it plans a
    /// query, whatever a CASE around the call says.
    async fn read(client: &Client) -> Option<Identity> {
        let row = client
            .query_one(
                "SELECT system_identifier::text, \
                 (extract(epoch FROM pg_postmaster_start_time()) * 1000000)::bigint \
                 FROM pg_control_system()",
                &[],
            )
            .await
            .ok()?;
        Some(Identity {
            cluster: row.try_get(0).ok()?,
            started: row.try_get(1).ok()?,
        })
    }
}

/// [`hosts`]' line for `target`: `None` for the primary reached
/// (`reached`, when read), for a host the relay does not connect to (read
/// only, not in recovery: a fenced old primary), and for a standby of its
/// cluster unless `slot_sync`.
async fn host(
    cfg: &Config,
    target: &crate::pgurl::PgTarget,
    reached: Option<&Identity>,
    guarded: Option<&str>,
    slot_sync: bool,
) -> Option<Line> {
    let slot = &cfg.postgres.slot;
    let mut one = cfg.postgres.clone();
    one.targets = vec![target.clone()];
    one.read_write = false;
    let unread = |e: String| Some(Line::warn(format!("host {target}"), format!("unread: {e}")));
    let client = match connect_sql(&one).await {
        Ok(c) => c,
        Err(e) => {
            return Some(Line::warn(
                format!("host {target}"),
                format!("not reachable, unread: {}", e.without_rotation()),
            ));
        }
    };
    let row = client
        .query_one(
            "SELECT pg_is_in_recovery(), \
                 coalesce(current_setting('sync_replication_slots', true), ''), \
                 current_setting('hot_standby_feedback'), current_setting('primary_slot_name'), \
                 (SELECT (to_jsonb(s) ->> 'synced')::bool AND NOT temporary \
                     AND to_jsonb(s) ->> 'invalidation_reason' IS NULL \
                  FROM pg_replication_slots s WHERE slot_name = $1), \
                 current_setting('transaction_read_only') = 'on'",
            &[slot],
        )
        .await;
    let row = match row {
        Ok(r) => r,
        Err(e) => return unread(pg_error_text(&e)),
    };
    type Settings = (bool, String, String, String, Option<bool>, bool);
    let read = (|| -> Result<Settings, tokio_postgres::Error> {
        Ok((
            row.try_get(0)?,
            row.try_get(1)?,
            row.try_get(2)?,
            row.try_get(3)?,
            row.try_get(4)?,
            row.try_get(5)?,
        ))
    })();
    let (in_recovery, sync, feedback, primary_slot, ready, read_only) = match read {
        Ok(settings) => settings,
        Err(e) => return unread(e.to_string()),
    };
    let theirs = Identity::read(&client).await;
    let what = match in_recovery {
        true => format!("standby {target}"),
        false => format!("host {target}"),
    };
    if reached.is_some() && theirs.is_none() {
        return Some(Line::warn(
            what,
            "its system identifier is unread (pg_control_system() not executable by the \
             relay's role there?): whether it is of this cluster is not checked",
        ));
    }
    if let (Some(ours), Some(theirs)) = (reached, &theirs) {
        if ours.cluster != theirs.cluster {
            let (role, promoted) = match in_recovery {
                true => ("in recovery", "were it promoted"),
                false => ("a primary", "were it the first read-write host reached"),
            };
            return Some(Line::fail(
                what,
                format!(
                    "{role}, but of another cluster (system identifier {}, the \
                     primary's {}): it never holds this primary's slot, and {promoted} \
                     the relay would connect to another database; take it out of postgres.url",
                    theirs.cluster, ours.cluster
                ),
            ));
        }
        if !in_recovery && !read_only && ours.started != theirs.started {
            return Some(Line::fail(
                what,
                format!(
                    "a second primary of this cluster (system identifier {}): an old primary \
                     not fenced after a failover? The relay connects to the first read-write \
                     host of postgres.url, which may be this one: stop or demote the one that \
                     is not the primary",
                    theirs.cluster
                ),
            ));
        }
    }
    if !in_recovery || !slot_sync {
        return None;
    }
    let mut missing = Vec::new();
    if sync != "on" {
        missing.push("sync_replication_slots = on".to_owned());
    }
    if feedback != "on" {
        missing.push("hot_standby_feedback = on".to_owned());
    }
    if primary_slot.is_empty() {
        missing.push("primary_slot_name (a physical slot on the primary)".to_owned());
    } else if let Some(guarded) = guarded
        && !guarded.split(',').any(|s| s.trim() == primary_slot)
    {
        missing.push(format!(
            "{primary_slot:?} in the primary's synchronized_standby_slots (else the relay may \
             confirm what this standby never got)"
        ));
    }
    Some(match (ready, missing.is_empty()) {
        (Some(true), true) => Line::ok(
            what,
            format!(
                "keeps a synchronized copy of slot {slot:?}, ready for a promotion \
                 (sync_replication_slots, hot_standby_feedback, primary_slot_name \
                 {primary_slot:?} guarded by the primary)"
            ),
        ),
        (ready, _) => {
            let copy = match ready {
                Some(true) => "its copy of the slot is ready".to_owned(),
                Some(false) => "its copy of the slot is not ready: temporary (ready once the \
                                relay confirms past what the standby has), invalidated, or a \
                                slot of that name not synchronized from the primary (drop that \
                                one on the standby)"
                    .to_owned(),
                None => format!(
                    "it has no copy of slot {slot:?} (its primary_conninfo must name a dbname \
                     too)"
                ),
            };
            let set = if missing.is_empty() {
                String::new()
            } else {
                format!("; set {}", missing.join(", "))
            };
            let risk = if ready == Some(true) {
                ""
            } else {
                ": a promotion now would lose the slot"
            };
            Line::warn(what, format!("{copy}{set}{risk}"))
        }
    })
}

/// `check`'s word on PostgreSQL 18's `idle_replication_slot_timeout` of
/// `secs` (> 0): the relay may be down for maintenance or an outage for
/// hours; under a day is a warning, a day or more is said all the same.
fn idle_timeout_line(what: &str, secs: i64) -> Line {
    let text = format!(
        "idle_replication_slot_timeout = {secs} s: if no relay streams from the slot for longer \
         (stopped, crashing, cut off), PostgreSQL invalidates it at the next checkpoint and the \
         events in between are re-published by `recover` (table-less ones are lost)"
    );
    if secs < 86_400 {
        Line::warn(
            format!("{what} idle timeout"),
            format!("{text}; set it longer than the longest the relay may be down, or to 0"),
        )
    } else {
        Line::ok(format!("{what} idle timeout"), text)
    }
}

// ------------------------------------------------------------- RabbitMQ
