//! `outbox-relay check`: a preflight of everything `run` needs, against the
//! real servers, without changing anything on them.
//!
//! One line per check, in a fixed order:
//!
//! ```text
//! ok <what>[: <details>]
//! warn <what>: <what to know>
//! FAIL <what>: <what is wrong and how to fix it>
//! ```
//!
//! 1. PostgreSQL reachable and authenticated (when not, the other PostgreSQL
//!    checks are skipped, in one line saying so);
//! 2. `wal_level = logical`;
//! 3. a free replication slot (unless ours exists) and a free WAL sender;
//! 4. the role may replicate;
//! 5. the publication exists, covers the outbox table, publishes inserts;
//! 6. the outbox table has every mapped column, each of a supported type;
//! 7. the replication slot exists, uses pgoutput, is not lost; active or not;
//! 8. RabbitMQ reachable, credentials and vhost accepted (when not, the
//!    exchange checks are skipped);
//! 9. the exchange exists (when it is not a template), and the dead-letter
//!    exchange when configured.
//!
//! Each check has its own deadline ([`CHECK_TIMEOUT`]). Passwords are never
//! printed: URLs go through [`redact_url`], and errors from the drivers do
//! not carry them.

use std::fmt;
use std::future::Future;
use std::process::ExitCode;
use std::time::Duration;

use lapin::options::ExchangeDeclareOptions;
use lapin::protocol::{AMQPErrorKind, AMQPHardError, AMQPSoftError};
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties, ExchangeKind};
use tokio_postgres::Client;
use tokio_postgres::error::SqlState;

use crate::config::{Config, quote_ident, redact_url};
use crate::outbox::PayloadKind;
use crate::source::{SourceError, connect_sql, slot};
use crate::tls::TlsFailure;

/// Deadline of each check (connecting included).
pub const CHECK_TIMEOUT: Duration = Duration::from_secs(15);

/// Type OIDs the checks name.
mod oid {
    pub const JSON: u32 = 114;
    pub const JSONB: u32 = 3802;
    pub const TIMESTAMP: u32 = 1114;
    pub const TIMESTAMPTZ: u32 = 1184;
}

/// How a check came out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    /// Fine.
    Ok,
    /// Fine for `run`, but worth knowing.
    Warn,
    /// `run` would fail, or misbehave, until this is fixed.
    Fail,
}

impl Level {
    /// The word that starts the line.
    pub fn word(self) -> &'static str {
        match self {
            Level::Ok => "ok",
            Level::Warn => "warn",
            Level::Fail => "FAIL",
        }
    }
}

/// One output line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Line {
    /// Outcome.
    pub level: Level,
    /// What was checked, e.g. `publication "outbox_pub"`.
    pub what: String,
    /// Details; for `warn` and `FAIL`, what is wrong and how to fix it.
    pub detail: Option<String>,
}

impl Line {
    fn new(level: Level, what: impl Into<String>, detail: Option<String>) -> Line {
        Line {
            level,
            what: what.into(),
            detail,
        }
    }
    fn ok(what: impl Into<String>, detail: impl Into<String>) -> Line {
        Line::new(Level::Ok, what, Some(detail.into()))
    }
    fn warn(what: impl Into<String>, detail: impl Into<String>) -> Line {
        Line::new(Level::Warn, what, Some(detail.into()))
    }
    fn fail(what: impl Into<String>, detail: impl Into<String>) -> Line {
        Line::new(Level::Fail, what, Some(detail.into()))
    }
}

impl fmt::Display for Line {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.level.word(), self.what)?;
        if let Some(d) = &self.detail {
            write!(f, ": {d}")?;
        }
        Ok(())
    }
}

/// Why a check could not be completed (a query failed).
#[derive(Debug)]
struct CheckError(String);

impl From<tokio_postgres::Error> for CheckError {
    fn from(e: tokio_postgres::Error) -> Self {
        CheckError(pg_error_text(&e))
    }
}

impl From<SourceError> for CheckError {
    fn from(e: SourceError) -> Self {
        match e {
            SourceError::Sql { what, source, .. } => {
                CheckError(format!("{what}: {}", pg_error_text(&source)))
            }
            other => CheckError(other.to_string()),
        }
    }
}

/// `check`: prints one line per check to stdout as each completes; exit code
/// 1 when any check failed.
pub async fn run(cfg: &Config) -> ExitCode {
    use std::io::Write;
    let lines = check(cfg, |line| {
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{line}");
        let _ = out.flush();
    })
    .await;
    let failed = lines.iter().filter(|l| l.level == Level::Fail).count();
    if failed == 0 {
        ExitCode::SUCCESS
    } else {
        let s = if failed == 1 { "" } else { "s" };
        eprintln!("outbox-relay: check: {failed} check{s} failed");
        ExitCode::FAILURE
    }
}

/// Runs every check in order, handing each line to `emit` as soon as it is
/// known; returns them all.
pub async fn check(cfg: &Config, mut emit: impl FnMut(&Line)) -> Vec<Line> {
    let mut lines = Vec::new();
    let mut push = |new: Vec<Line>| {
        for l in new {
            emit(&l);
            lines.push(l);
        }
    };

    // PostgreSQL.
    let (line, client) = postgres_connect(cfg).await;
    push(vec![line]);
    match client {
        Some(client) => {
            let pg = &cfg.postgres;
            let table = &cfg.outbox.table;
            push(guarded("wal_level", wal_level(&client)).await);
            push(
                guarded(
                    "replication slots and WAL senders",
                    slots_and_senders(&client, cfg),
                )
                .await,
            );
            push(guarded("replication role", role(&client)).await);
            push(
                guarded(
                    &format!("publication {:?}", pg.publication),
                    publication(&client, cfg),
                )
                .await,
            );
            push(guarded(&format!("outbox table {table}"), outbox_table(&client, cfg)).await);
            push(
                guarded(
                    &format!("replication slot {:?}", pg.slot),
                    replication_slot(&client, cfg),
                )
                .await,
            );
        }
        None => push(vec![Line::warn(
            "PostgreSQL checks skipped",
            "wal_level, replication slots and WAL senders, replication role, publication, \
             outbox table and replication slot were not checked because PostgreSQL is not reachable",
        )]),
    }

    // RabbitMQ.
    let (line, conn) = broker_connect(cfg).await;
    push(vec![line]);
    match conn {
        Some(conn) => {
            push(exchanges(cfg, &conn).await);
            let _ = tokio::time::timeout(
                Duration::from_secs(5),
                conn.close(200, "outbox-relay check done".into()),
            )
            .await;
        }
        None => push(vec![Line::warn(
            "RabbitMQ checks skipped",
            "the exchange and the dead-letter exchange were not checked because RabbitMQ is not reachable",
        )]),
    }
    lines
}

/// Runs one check under [`CHECK_TIMEOUT`]; a failed query or the deadline
/// becomes a `FAIL` line for `what`.
async fn guarded(
    what: &str,
    fut: impl Future<Output = Result<Vec<Line>, CheckError>>,
) -> Vec<Line> {
    match tokio::time::timeout(CHECK_TIMEOUT, fut).await {
        Ok(Ok(lines)) => lines,
        Ok(Err(CheckError(e))) => vec![Line::fail(what, format!("could not be checked: {e}"))],
        Err(_) => vec![Line::fail(
            what,
            format!(
                "could not be checked: no answer within {} s",
                CHECK_TIMEOUT.as_secs()
            ),
        )],
    }
}

// ------------------------------------------------------------- PostgreSQL

/// The text of a PostgreSQL error: the server's message for a server error,
/// otherwise the error and its causes.
fn pg_error_text(e: &tokio_postgres::Error) -> String {
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

async fn postgres_connect(cfg: &Config) -> (Line, Option<Client>) {
    let url = redact_url(cfg.postgres.url.expose());
    let what = format!("PostgreSQL reachable at {url}");
    // connect_sql has its own deadline (15 s), the same as CHECK_TIMEOUT.
    let client = match connect_sql(&cfg.postgres).await {
        Ok(c) => c,
        Err(SourceError::Sql { source, .. }) => {
            return (Line::fail(what, describe_pg_connect_error(&source)), None);
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

fn describe_pg_connect_error(e: &tokio_postgres::Error) -> String {
    let text = pg_error_text(e);
    match e.code() {
        Some(c) if c.code().starts_with("28") => format!(
            "authentication failed ({text}): fix the user name or password in postgres.url \
             (or OUTBOX_RELAY_POSTGRES_URL), or the server's pg_hba.conf entry for this client"
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

async fn wal_level(client: &Client) -> Result<Vec<Line>, CheckError> {
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

async fn slots_and_senders(client: &Client, cfg: &Config) -> Result<Vec<Line>, CheckError> {
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

async fn role(client: &Client) -> Result<Vec<Line>, CheckError> {
    let row = client
        .query_one(
            "SELECT current_user::text, rolreplication, rolsuper FROM pg_roles WHERE rolname = current_user",
            &[],
        )
        .await?;
    let (user, replication, superuser): (String, bool, bool) = (row.get(0), row.get(1), row.get(2));
    let what = format!("role {user} may replicate");
    Ok(vec![if superuser {
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
    }])
}

/// One column of the outbox table.
struct TableColumn {
    name: String,
    type_oid: u32,
    type_name: String,
}

/// `None` when the table does not exist; else its kind and columns.
async fn table_columns(
    client: &Client,
    cfg: &Config,
) -> Result<Option<(String, Vec<TableColumn>)>, CheckError> {
    let t = &cfg.outbox.table;
    let Some(kind) = client
        .query_opt(
            "SELECT c.relkind::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
             WHERE n.nspname = $1 AND c.relname = $2",
            &[&t.schema, &t.name],
        )
        .await?
    else {
        return Ok(None);
    };
    let rows = client
        .query(
            "SELECT a.attname::text, a.atttypid::oid, format_type(a.atttypid, a.atttypmod) \
             FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid \
             JOIN pg_namespace n ON n.oid = c.relnamespace \
             WHERE n.nspname = $1 AND c.relname = $2 AND a.attnum > 0 AND NOT a.attisdropped \
             ORDER BY a.attnum",
            &[&t.schema, &t.name],
        )
        .await?;
    let columns = rows
        .iter()
        .map(|r| TableColumn {
            name: r.get(0),
            type_oid: r.get(1),
            type_name: r.get(2),
        })
        .collect();
    Ok(Some((kind.get(0), columns)))
}

/// Required columns, by config key: `run` cannot map a row without them.
fn required_columns(cfg: &Config) -> Vec<(&'static str, &str)> {
    let c = &cfg.outbox.columns;
    vec![
        ("outbox.id", c.id.as_str()),
        ("outbox.aggregate_type", c.aggregate_type.as_str()),
        ("outbox.aggregate_id", c.aggregate_id.as_str()),
        ("outbox.event_type", c.event_type.as_str()),
        ("outbox.payload", c.payload.as_str()),
    ]
}

/// Columns the exchange and routing key templates read, with their key.
fn template_columns(cfg: &Config) -> Vec<(&'static str, &str)> {
    let cols = &cfg.outbox.columns;
    let r = &cfg.rabbitmq;
    r.exchange
        .columns()
        .map(|c| ("rabbitmq.exchange", cols.resolve(c)))
        .chain(
            r.routing_key
                .columns()
                .map(|c| ("rabbitmq.routing_key", cols.resolve(c))),
        )
        .collect()
}

async fn publication(client: &Client, cfg: &Config) -> Result<Vec<Line>, CheckError> {
    let pg = &cfg.postgres;
    let t = &cfg.outbox.table;
    let what = format!("publication {:?}", pg.publication);
    let pub_q = quote_ident(&pg.publication);
    let Some(row) = client
        .query_opt(
            "SELECT pubinsert, pubviaroot FROM pg_publication WHERE pubname = $1",
            &[&pg.publication],
        )
        .await?
    else {
        return Ok(vec![Line::fail(
            what,
            format!(
                "does not exist (postgres.publication): run `outbox-relay setup`, or \
                 CREATE PUBLICATION {pub_q} FOR TABLE {} \
                 WITH (publish = 'insert', publish_via_partition_root = true)",
                t.quoted()
            ),
        )]);
    };
    let inserts: bool = row.get(0);
    let via_root: bool = row.get(1);
    let version: i32 = client
        .query_one("SELECT current_setting('server_version_num')::int", &[])
        .await?
        .get(0);
    // PostgreSQL 15 added column lists and row filters.
    let covered = if version >= 150_000 {
        client
            .query_opt(
                "SELECT attnames::text[], rowfilter FROM pg_publication_tables \
                 WHERE pubname = $1 AND schemaname = $2 AND tablename = $3",
                &[&pg.publication, &t.schema, &t.name],
            )
            .await?
            .map(|r| {
                (
                    r.get::<_, Option<Vec<String>>>(0),
                    r.get::<_, Option<String>>(1),
                )
            })
    } else {
        client
            .query_opt(
                "SELECT 1 FROM pg_publication_tables \
                 WHERE pubname = $1 AND schemaname = $2 AND tablename = $3",
                &[&pg.publication, &t.schema, &t.name],
            )
            .await?
            .map(|_| (None, None))
    };
    let table = table_columns(client, cfg).await?;

    let mut problems = Vec::new();
    let mut lines = Vec::new();
    if !inserts {
        problems.push(format!(
            "does not publish inserts: ALTER PUBLICATION {pub_q} SET (publish = 'insert')"
        ));
    }
    let partitioned = matches!(&table, Some((kind, _)) if kind == "p");
    match (&covered, &table) {
        (None, Some(_)) if partitioned && !via_root => problems.push(format!(
            "publishes the partitions of {t} under their own names: \
             ALTER PUBLICATION {pub_q} SET (publish_via_partition_root = true)"
        )),
        (None, None) => problems.push(format!(
            "does not cover {t}, which does not exist (see the outbox table check)"
        )),
        (None, Some(_)) => problems.push(format!(
            "does not cover {t}: ALTER PUBLICATION {pub_q} ADD TABLE {}",
            t.quoted()
        )),
        (Some((attnames, rowfilter)), table) => {
            if let (Some(attnames), Some((_, columns))) = (attnames, table) {
                // Mapped columns the table has but the column list leaves out.
                let mut left_out: Vec<&str> = Vec::new();
                for c in required_columns(cfg)
                    .into_iter()
                    .map(|(_, c)| c)
                    .chain(template_columns(cfg).into_iter().map(|(_, c)| c))
                    .chain([cfg.outbox.columns.headers.as_str()])
                {
                    if columns.iter().any(|tc| tc.name == c)
                        && !attnames.iter().any(|a| a == c)
                        && !left_out.contains(&c)
                    {
                        left_out.push(c);
                    }
                }
                if !left_out.is_empty() {
                    problems.push(format!(
                        "its column list for {t} leaves out {}: publish all columns with \
                         ALTER PUBLICATION {pub_q} SET TABLE {}",
                        left_out.join(", "),
                        t.quoted()
                    ));
                }
            }
            if let Some(filter) = rowfilter {
                lines.push(Line::warn(
                    what.clone(),
                    format!(
                        "has a row filter on {t} (WHERE {filter}): outbox rows it excludes are never relayed"
                    ),
                ));
            }
        }
    }
    // Anything else it publishes would stop the relay at its first INSERT.
    let others: Vec<String> = client
        .query_one(
            "SELECT ARRAY(SELECT format('%I.%I', pt.schemaname, pt.tablename) \
             FROM pg_publication_tables pt JOIN pg_namespace n ON n.nspname = pt.schemaname \
             JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = pt.tablename \
             WHERE pt.pubname = $1 AND c.oid <> ALL (ARRAY( \
               SELECT r.oid FROM pg_class r JOIN pg_namespace rn ON rn.oid = r.relnamespace \
               WHERE rn.nspname = $2 AND r.relname = $3 \
               UNION ALL SELECT t.relid::oid FROM pg_class r \
               JOIN pg_namespace rn ON rn.oid = r.relnamespace \
               CROSS JOIN LATERAL pg_partition_tree(r.oid) t \
               WHERE rn.nspname = $2 AND r.relname = $3)) ORDER BY 1 LIMIT 5)",
            &[&pg.publication, &t.schema, &t.name],
        )
        .await?
        .get(0);
    if !others.is_empty() {
        problems.push(format!(
            "also publishes {}: an INSERT into any of them stops the relay (it never skips a \
             change); publish only the outbox: ALTER PUBLICATION {pub_q} SET TABLE {}",
            others.join(", "),
            t.quoted()
        ));
    }
    if problems.is_empty() {
        let via = if partitioned {
            " (partitioned, via its root)"
        } else {
            ""
        };
        lines.insert(
            0,
            Line::ok(what, format!("publishes inserts into {t}{via}")),
        );
    } else {
        lines.insert(0, Line::fail(what, problems.join("; ")));
    }
    Ok(lines)
}

async fn outbox_table(client: &Client, cfg: &Config) -> Result<Vec<Line>, CheckError> {
    let t = &cfg.outbox.table;
    let what = format!("outbox table {t}");
    let Some((kind, columns)) = table_columns(client, cfg).await? else {
        return Ok(vec![Line::fail(
            what,
            "does not exist (outbox.table): create it, e.g. with sql/outbox.sql, or fix outbox.table",
        )]);
    };
    if kind != "r" && kind != "p" {
        return Ok(vec![Line::fail(
            what,
            format!(
                "is not a table (pg_class.relkind {kind:?}); only tables can be published: fix outbox.table"
            ),
        )]);
    }
    let find = |name: &str| columns.iter().find(|c| c.name == name);
    let cols = &cfg.outbox.columns;

    let mut problems = Vec::new();
    let mut found = Vec::new();
    let mut reported: Vec<&str> = Vec::new();
    for (key, name) in required_columns(cfg) {
        match find(name) {
            None => {
                problems.push(format!("no column {name:?} ({key})"));
                reported.push(name);
            }
            Some(c) => {
                if key == "outbox.payload" && PayloadKind::of_type(c.type_oid).is_none() {
                    problems.push(format!(
                        "payload column {name:?} ({key}) has type {} (use jsonb, json, text, varchar, char or bytea)",
                        c.type_name
                    ));
                }
                found.push(format!("{name} {}", c.type_name));
            }
        }
    }
    for (key, name) in template_columns(cfg) {
        if find(name).is_none() && !reported.contains(&name) {
            problems.push(format!("no column {name:?} (a placeholder of {key})"));
            reported.push(name);
        }
    }

    let mut warnings = Vec::new();
    match find(&cols.headers) {
        None => warnings.push(Line::warn(
            what.clone(),
            format!(
                "no headers column {:?} (outbox.headers): messages carry no extra headers",
                cols.headers
            ),
        )),
        Some(c) if c.type_oid != oid::JSON && c.type_oid != oid::JSONB => problems.push(format!(
            "headers column {:?} (outbox.headers) has type {} (use jsonb or json, holding a JSON object)",
            cols.headers, c.type_name
        )),
        Some(c) => found.push(format!("{} {}", c.name, c.type_name)),
    }
    match find(&cols.created_at) {
        None => warnings.push(Line::warn(
            what.clone(),
            format!(
                "no column {:?} (outbox.created_at): `outbox-relay recover` and `republish --since` need it",
                cols.created_at
            ),
        )),
        Some(c) if c.type_oid != oid::TIMESTAMPTZ && c.type_oid != oid::TIMESTAMP => {
            warnings.push(Line::warn(
                what.clone(),
                format!(
                    "column {:?} (outbox.created_at) has type {}; `outbox-relay recover` and \
                     `republish --since` expect timestamptz",
                    cols.created_at, c.type_name
                ),
            ))
        }
        Some(c) => found.push(format!("{} {}", c.name, c.type_name)),
    }

    let partitioned = if kind == "p" {
        "partitioned (its partitions' rows are relayed as the table's); "
    } else {
        ""
    };
    let mut lines = vec![if problems.is_empty() {
        Line::ok(what, format!("{partitioned}columns {}", found.join(", ")))
    } else {
        Line::fail(
            what,
            format!(
                "{}: add the columns, or change the config keys named",
                problems.join("; ")
            ),
        )
    }];
    lines.extend(warnings);
    Ok(lines)
}

async fn replication_slot(client: &Client, cfg: &Config) -> Result<Vec<Line>, CheckError> {
    let name = &cfg.postgres.slot;
    let what = format!("replication slot {name:?}");
    let Some(info) = slot::slot_info(client, cfg).await? else {
        return Ok(vec![Line::fail(
            what,
            "does not exist (postgres.slot): on a first start, create it with `outbox-relay setup`; \
             if it existed and was dropped, run `outbox-relay recover` to recreate it and re-publish \
             the outbox rows written since the last checkpoint",
        )]);
    };
    if info.plugin.as_deref() != Some("pgoutput") {
        return Ok(vec![Line::fail(
            what,
            format!(
                "uses plugin {:?}, not pgoutput: drop it (SELECT pg_drop_replication_slot('{name}')) \
                 and run `outbox-relay setup`, or choose another postgres.slot",
                info.plugin.unwrap_or_default()
            ),
        )]);
    }
    if info.two_phase {
        return Ok(vec![Line::fail(
            what,
            format!(
                "was created with two-phase decoding, which streams prepared transactions before \
                 they commit: drop it (SELECT pg_drop_replication_slot('{name}')) and run \
                 `outbox-relay setup`"
            ),
        )]);
    }
    let db: String = client
        .query_one("SELECT current_database()::text", &[])
        .await?
        .get(0);
    if let Some(slot_db) = info.database.as_deref().filter(|d| *d != db) {
        return Ok(vec![Line::fail(
            what,
            format!(
                "belongs to database {slot_db}, but postgres.url connects to {db}: \
                 fix the database in postgres.url, or choose another postgres.slot"
            ),
        )]);
    }
    let wal_status = info.wal_status.as_deref().unwrap_or("-");
    if wal_status == "lost" {
        return Ok(vec![Line::fail(
            what,
            "is invalidated (wal_status = lost): the WAL it needed was removed, so events committed \
             since its last confirmed position cannot be replayed from WAL; run `outbox-relay recover` \
             to recreate the slot and re-publish the outbox rows written since the last checkpoint \
             (`--dry-run` shows them first)",
        )]);
    }
    let lsn = info
        .confirmed_flush_lsn
        .map_or_else(|| "-".to_owned(), |l| l.to_string());
    let mut lines = Vec::new();
    match info.active_pid {
        Some(pid) => lines.push(Line::warn(
            what.clone(),
            format!(
                "slot is active (pid {pid}): another relay is streaming from it; a second `run` waits \
                 until it stops (pgoutput, wal_status {wal_status}, confirmed_flush_lsn {lsn})"
            ),
        )),
        None => lines.push(Line::ok(
            what.clone(),
            format!("pgoutput, wal_status {wal_status}, confirmed_flush_lsn {lsn}, not active"),
        )),
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

// ------------------------------------------------------------- RabbitMQ

/// What the broker check says about an AMQP error.
fn describe_amqp_error(e: &lapin::Error, user: &str, vhost: &str) -> String {
    match e.kind() {
        lapin::ErrorKind::ProtocolError(p) => match p.kind() {
            AMQPErrorKind::Soft(AMQPSoftError::ACCESSREFUSED) => format!(
                "the broker refused user {user:?} ({}): fix the user name or password \
                 in rabbitmq.url (or OUTBOX_RELAY_RABBITMQ_URL)",
                p.get_message()
            ),
            AMQPErrorKind::Hard(AMQPHardError::NOTALLOWED) => format!(
                "user {user:?} may not use vhost {vhost:?} ({}): create the vhost or grant \
                 access (rabbitmqctl set_permissions -p '{vhost}' '{user}' '.*' '.*' '.*'), or fix the \
                 vhost in rabbitmq.url",
                p.get_message()
            ),
            _ => format!("the broker refused the connection ({p})"),
        },
        lapin::ErrorKind::IOError(io) => {
            let what = if io.kind() == std::io::ErrorKind::ConnectionRefused {
                "connection refused".to_owned()
            } else {
                format!("cannot connect ({io})")
            };
            format!("{what}: is RabbitMQ running, and are the host and port in rabbitmq.url right?")
        }
        _ => e.to_string(),
    }
}

async fn broker_connect(cfg: &Config) -> (Line, Option<Connection>) {
    let url = cfg.rabbitmq.url.expose();
    let what = format!("RabbitMQ reachable at {}", redact_url(url));
    let uri = match crate::sink::parse_amqp_url(url) {
        Ok(u) => u,
        Err(e) => return (Line::fail(what, format!("not a valid AMQP URL: {e}")), None),
    };
    let (user, vhost) = (uri.authority.userinfo.username.clone(), uri.vhost.clone());
    let props = ConnectionProperties::default().with_connection_name("outbox-relay check".into());
    // The same TLS set-up as the relay's own connection (amqps:// only).
    // `ca_file` is set for every amqps:// URL (the configured CA, or the
    // system bundle); lapin then trusts it alone.
    let tls = match cfg
        .rabbitmq
        .ca_file
        .as_deref()
        .map(crate::tls::rabbitmq_tls)
    {
        Some(Ok(t)) => t,
        Some(Err(e)) => return (Line::fail(what, format!("rabbitmq.ca_file: {e}")), None),
        None => lapin::tcp::OwnedTLSConfig::default(),
    };
    if let Some(roots) = cfg.rabbitmq.ca_file.as_deref() {
        if uri.scheme == lapin::uri::AMQPScheme::AMQPS {
            let host = uri.authority.host.as_str();
            let host = host.trim_start_matches('[').trim_end_matches(']');
            let port = uri.authority.port;
            let shake = crate::tls::rabbitmq_handshake(host, port, roots);
            if let Ok(Err(e)) = tokio::time::timeout(CHECK_TIMEOUT, shake).await {
                if let Some(f) = TlsFailure::find(&e).filter(TlsFailure::is_permanent) {
                    let msg = crate::tls::rabbitmq_failure(&f, &redact_url(url));
                    return (Line::fail(what, msg), None);
                }
            }
        }
    }
    let builder = match lapin::DefaultConnectionBuilder::new() {
        Ok(b) => b
            .with_uri(uri.clone())
            .with_properties(props)
            .with_tls_config(tls),
        Err(e) => return (Line::fail(what, e.to_string()), None),
    };
    let conn = match tokio::time::timeout(CHECK_TIMEOUT, builder.connect()).await {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => {
            return (
                Line::fail(what, describe_amqp_error(&e, &user, &vhost)),
                None,
            );
        }
        Err(_) => {
            return (
                Line::fail(
                    what,
                    format!(
                        "no answer within {} s: is the host and port in rabbitmq.url a RabbitMQ broker?",
                        CHECK_TIMEOUT.as_secs()
                    ),
                ),
                None,
            );
        }
    };
    // The relay publishes on a channel of its own: open one too.
    match tokio::time::timeout(CHECK_TIMEOUT, conn.create_channel()).await {
        Ok(Ok(ch)) => {
            let _ = tokio::time::timeout(Duration::from_secs(5), ch.close(200, "ok".into())).await;
            (
                Line::ok(what, format!("logged in as {user}, vhost {vhost}")),
                Some(conn),
            )
        }
        Ok(Err(e)) => (
            Line::fail(
                what,
                format!(
                    "logged in, but opening a channel failed: {}",
                    describe_amqp_error(&e, &user, &vhost)
                ),
            ),
            None,
        ),
        Err(_) => (
            Line::fail(
                what,
                format!(
                    "logged in, but opening a channel got no answer within {} s",
                    CHECK_TIMEOUT.as_secs()
                ),
            ),
            None,
        ),
    }
}

async fn exchanges(cfg: &Config, conn: &Connection) -> Vec<Line> {
    let r = &cfg.rabbitmq;
    let mut lines = Vec::new();
    match r.exchange.as_literal() {
        Some("") => lines.push(Line::ok(
            "exchange \"\"",
            "the default exchange always exists",
        )),
        Some(name) => lines.push(exchange(conn, name, "exchange", "rabbitmq.exchange").await),
        None => {
            let text: String = r
                .exchange
                .parts()
                .iter()
                .map(|p| match p {
                    crate::template::Part::Literal(s) => s.replace('{', "{{").replace('}', "}}"),
                    crate::template::Part::Column(c) => format!("{{{c}}}"),
                })
                .collect();
            lines.push(Line::warn(
                format!("exchange template {text:?}"),
                "depends on each row's columns, so it cannot be checked statically: make sure every \
                 exchange it can name exists",
            ));
        }
    }
    if let Some(dlx) = &r.dead_letter_exchange {
        lines.push(
            exchange(
                conn,
                dlx,
                "dead-letter exchange",
                "rabbitmq.dead_letter_exchange",
            )
            .await,
        );
    }
    lines
}

/// Passive declare of `name` on a throwaway channel (a failed passive
/// declare closes the channel it ran on).
async fn exchange(conn: &Connection, name: &str, role: &str, key: &str) -> Line {
    let what = format!("{role} {name:?}");
    let res = tokio::time::timeout(CHECK_TIMEOUT, async {
        let ch = conn.create_channel().await?;
        ch.exchange_declare(
            name.into(),
            ExchangeKind::Topic,
            ExchangeDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
        let _ = ch.close(200, "ok".into()).await;
        Ok::<(), lapin::Error>(())
    })
    .await;
    match res {
        Ok(Ok(())) => Line::ok(what, "exists"),
        Ok(Err(e)) => match e.kind() {
            lapin::ErrorKind::ProtocolError(p)
                if matches!(p.kind(), AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND)) =>
            {
                Line::fail(
                    what,
                    format!(
                        "does not exist on the broker ({key}): declare it (e.g. a durable topic \
                         exchange), or fix {key}"
                    ),
                )
            }
            lapin::ErrorKind::ProtocolError(p)
                if matches!(p.kind(), AMQPErrorKind::Soft(AMQPSoftError::ACCESSREFUSED)) =>
            {
                Line::fail(
                    what,
                    format!(
                        "access refused ({}): grant the user permissions on it, or fix {key}",
                        p.get_message()
                    ),
                )
            }
            _ => Line::fail(what, format!("could not be checked: {e}")),
        },
        Err(_) => Line::fail(
            what,
            format!(
                "could not be checked: no answer within {} s",
                CHECK_TIMEOUT.as_secs()
            ),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_start_with_their_level() {
        assert_eq!(
            Line::new(Level::Ok, "wal_level = logical", None).to_string(),
            "ok wal_level = logical"
        );
        assert_eq!(
            Line::warn("slot", "is active (pid 7)").to_string(),
            "warn slot: is active (pid 7)"
        );
        assert_eq!(
            Line::fail("publication \"p\"", "does not exist").to_string(),
            "FAIL publication \"p\": does not exist"
        );
    }
}
