//! Slot and publication management over the SQL connection.

use tokio_postgres::Client;

use super::publication::{self, PublicationProblem};
use super::{SourceError, sql_err};
use crate::config::{Config, OutboxConfig, TableName, quote_ident};
use crate::lsn::Lsn;
use crate::outbox::OutboxOids;

/// A row of `pg_replication_slots`, as far as the relay cares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotInfo {
    /// Output plugin; must be `pgoutput`.
    pub plugin: Option<String>,
    /// Position confirmed by the consumer.
    pub confirmed_flush_lsn: Option<Lsn>,
    /// Oldest WAL the slot keeps.
    pub restart_lsn: Option<Lsn>,
    /// `reserved`, `extended`, `unreserved` or `lost`.
    pub wal_status: Option<String>,
    /// PID of the walsender using it, if any.
    pub active_pid: Option<i32>,
    /// Database the slot belongs to.
    pub database: Option<String>,
    /// Whether that is the database the relay connects to.
    pub in_this_database: bool,
    /// A slot created for two-phase decoding (it would stream prepared
    /// transactions before their COMMIT PREPARED).
    pub two_phase: bool,
    /// Why the server invalidated it (17+: `wal_removed`, `rows_removed`,
    /// `wal_level_insufficient`; 18: also `idle_timeout`).
    pub invalidation_reason: Option<String>,
    /// Since when no walsender has used it (17+).
    pub inactive_since: Option<String>,
}

fn parse_lsn(s: Option<String>) -> Option<Lsn> {
    s.and_then(|s| s.parse().ok())
}

/// Reads the slot, `None` when it does not exist.
pub async fn slot_info(client: &Client, cfg: &Config) -> Result<Option<SlotInfo>, SourceError> {
    let row = client
        .query_opt(
            // invalidation_reason and inactive_since are 17's: read
            // through to_jsonb, NULL on a server without them.
            "SELECT plugin::text, confirmed_flush_lsn::text, restart_lsn::text, wal_status, \
             active_pid, database::text, database IS NOT DISTINCT FROM current_database(), \
             two_phase, to_jsonb(s) ->> 'invalidation_reason', to_jsonb(s) ->> 'inactive_since' \
             FROM pg_replication_slots s WHERE slot_name = $1",
            &[&cfg.postgres.slot],
        )
        .await
        .map_err(sql_err(&cfg.postgres, "reading pg_replication_slots"))?;
    Ok(row.map(|r| SlotInfo {
        plugin: r.get(0),
        confirmed_flush_lsn: parse_lsn(r.get(1)),
        restart_lsn: parse_lsn(r.get(2)),
        wal_status: r.get(3),
        active_pid: r.get(4),
        database: r.get(5),
        in_this_database: r.get(6),
        two_phase: r.get(7),
        invalidation_reason: r.get(8),
        inactive_since: r.get(9),
    }))
}

/// What the catalog says is wrong with the slot, in the order `run` meets
/// them. One verdict for both commands: `run` stops (or waits, or
/// recovers) on the first; `check` shows each.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SlotProblem {
    /// No such slot: never made, dropped, or not carried over a failover.
    Missing,
    /// Made with another output plugin.
    Plugin(String),
    /// A slot of another database.
    OtherDatabase(String),
    /// Made for two-phase decoding.
    TwoPhase,
    /// Invalidated (`wal_status = lost`, or an `invalidation_reason`: the
    /// server's, if it says).
    Lost(Option<String>),
    /// Another process streams from it (its walsender's pid).
    Busy(i32),
    /// No confirmed position (not a logical slot).
    NoPosition,
}

impl SlotInfo {
    /// Every problem with the slot; none: `run` may stream from it.
    pub fn problems(&self) -> Vec<SlotProblem> {
        let mut found = Vec::new();
        if self.plugin.as_deref() != Some("pgoutput") {
            found.push(SlotProblem::Plugin(self.plugin.clone().unwrap_or_default()));
        }
        if !self.in_this_database {
            found.push(SlotProblem::OtherDatabase(
                self.database.clone().unwrap_or_default(),
            ));
        }
        if self.two_phase {
            found.push(SlotProblem::TwoPhase);
        }
        if self.wal_status.as_deref() == Some("lost") || self.invalidation_reason.is_some() {
            found.push(SlotProblem::Lost(self.invalidation_reason.clone()));
        }
        if let Some(pid) = self.active_pid {
            found.push(SlotProblem::Busy(pid));
        }
        if self.confirmed_flush_lsn.is_none() {
            found.push(SlotProblem::NoPosition);
        }
        found
    }
}

impl SlotProblem {
    /// What is wrong and what to do, after the slot's name.
    pub fn text(&self, slot: &str) -> String {
        match self {
            SlotProblem::Missing => "does not exist (postgres.slot): on a first start, create it \
                 with `outbox-relay setup`; if it existed and was dropped (or the database failed \
                 over to a standby, which PostgreSQL before 17 does not give the slot), run \
                 `outbox-relay recover` to recreate it and re-publish the outbox rows written \
                 since the last checkpoint, or set postgres.on_slot_lost = \"recover\" to have \
                 `run` do it"
                .to_owned(),
            SlotProblem::Plugin(plugin) => format!(
                "uses plugin {plugin:?}, not pgoutput: drop it \
                 (SELECT pg_drop_replication_slot('{slot}')) and run `outbox-relay setup`, or \
                 choose another postgres.slot"
            ),
            SlotProblem::OtherDatabase(db) => format!(
                "belongs to database {db:?}, not the one postgres.url names: use a slot of this \
                 database (postgres.slot), or fix the database in postgres.url"
            ),
            SlotProblem::TwoPhase => format!(
                "was created with two-phase decoding, which would stream prepared transactions \
                 before they commit: drop it (SELECT pg_drop_replication_slot('{slot}')) and run \
                 `outbox-relay setup`"
            ),
            SlotProblem::Lost(reason) => format!(
                "is invalidated ({}), so events committed since its last confirmed position \
                 cannot be replayed from WAL; run `outbox-relay recover` to recreate the slot and \
                 re-publish the outbox rows written since the last checkpoint (`--dry-run` shows \
                 them first)",
                match reason.as_deref() {
                    None | Some("wal_removed") =>
                        "wal_status = lost: the WAL it needed was removed".to_owned(),
                    Some("idle_timeout") => "invalidation_reason idle_timeout: unused for longer \
                        than idle_replication_slot_timeout; raise or unset it"
                        .to_owned(),
                    Some("rows_removed") => "invalidation_reason rows_removed: rows it needed \
                        were vacuumed away (a standby's slot, without hot_standby_feedback)"
                        .to_owned(),
                    Some("wal_level_insufficient") => "invalidation_reason \
                        wal_level_insufficient: wal_level is below logical"
                        .to_owned(),
                    Some(other) => format!("invalidation_reason {other}"),
                }
            ),
            SlotProblem::Busy(pid) => format!(
                "is active (pid {pid}): another relay is streaming from it; a second `run` waits \
                 until it stops"
            ),
            SlotProblem::NoPosition => {
                "has no confirmed_flush_lsn: is it a logical slot? Drop it and run `outbox-relay \
                 setup`, or choose another postgres.slot"
                    .to_owned()
            }
        }
    }

    /// What `run` does about it: recover (a lost slot), wait (a busy
    /// one), or stop naming the fix.
    pub fn error(&self, slot: &str) -> SourceError {
        let text = format!("replication slot {slot:?} {}", self.text(slot));
        match self {
            SlotProblem::Missing | SlotProblem::Lost(_) => SourceError::SlotLost(text),
            SlotProblem::Busy(pid) => SourceError::SlotBusy {
                slot: slot.to_owned(),
                pid: *pid,
            },
            _ => SourceError::Setup(text),
        }
    }

    /// `check` shows it as a warning, not a failure: `run` waits it out.
    pub fn passes(&self) -> bool {
        matches!(self, SlotProblem::Busy(_))
    }
}

/// Checks the slot is usable for `run` and returns its confirmed position.
pub async fn usable_slot(client: &Client, cfg: &Config) -> Result<Lsn, SourceError> {
    let slot = &cfg.postgres.slot;
    let info = slot_info(client, cfg).await?;
    let first = match &info {
        None => Some(SlotProblem::Missing),
        Some(info) => info.problems().into_iter().next(),
    };
    match (first, info.and_then(|i| i.confirmed_flush_lsn)) {
        (None, Some(lsn)) => Ok(lsn),
        (Some(problem), _) => Err(problem.error(slot)),
        (None, None) => Err(SlotProblem::NoPosition.error(slot)),
    }
}

/// How `setup` (and `recover`) make the slot on a server of
/// `server_version_num`. From PostgreSQL 17 a slot can be a failover slot:
/// a standby with `sync_replication_slots = on` keeps a copy, and after a
/// promotion the relay streams on from it, with nothing to re-publish.
pub fn create_slot_sql(version_num: i32) -> &'static str {
    if version_num >= 170_000 {
        // (name, plugin, temporary, twophase, failover)
        "SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput', false, false, true)"
    } else {
        "SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput')"
    }
}

/// What `check` says about surviving a failover with the slot, on a
/// server of `version_num` whose slot has `failover` (17+, `None` before)
/// and whose `sync_replication_slots` is `sync` (17+, this server: it
/// matters on the standby).
pub fn failover_note(
    version_num: i32,
    failover: Option<bool>,
    sync: Option<&str>,
) -> (bool, String) {
    if version_num < 170_000 {
        return (
            false,
            format!(
                "PostgreSQL {} does not carry logical slots to a standby: after a failover the slot \
                 is gone and the outbox rows since the last checkpoint must be re-published \
                 (`outbox-relay recover`, or postgres.on_slot_lost = \"recover\")",
                version_num / 10_000
            ),
        );
    }
    match (failover, sync) {
        (Some(true), Some("on")) => (
            true,
            "a failover slot, and this server syncs slots (sync_replication_slots = on)".into(),
        ),
        (Some(true), _) => (
            true,
            "a failover slot: a standby with sync_replication_slots = on (and \
             hot_standby_feedback, a physical slot named in primary_slot_name) keeps it \
             through a promotion; name that physical slot in the primary's \
             synchronized_standby_slots, or the relay may confirm what the standby never got"
                .into(),
        ),
        _ => (
            false,
            "not a failover slot (made before PostgreSQL 17, or by hand): with the relay \
             stopped, `outbox-relay setup` makes it one in place; else it is lost at a \
             failover"
                .into(),
        ),
    }
}

/// Refuses when `wal_level` is not `logical`.
pub async fn require_logical_wal(client: &Client, cfg: &Config) -> Result<(), SourceError> {
    let level: String = client
        .query_one("SHOW wal_level", &[])
        .await
        .map_err(sql_err(&cfg.postgres, "reading wal_level"))?
        .get(0);
    if level != "logical" {
        return Err(SourceError::Setup(format!(
            "wal_level is {level:?} but logical replication needs wal_level = logical: \
             set it in postgresql.conf (or ALTER SYSTEM SET wal_level = logical) and restart PostgreSQL"
        )));
    }
    Ok(())
}

/// The relation ids of the outbox table and its partitions, read when a
/// session starts: the decoder recognises the outbox by them (and by name),
/// so a RENAME while streaming is followed rather than skipped.
///
/// When the name no longer resolves but this process followed the table
/// by its id (`known`, a RENAME seen while streaming), the id is kept, so a
/// reconnect does not lose the table; a restart needs `outbox.table`
/// updated.
pub async fn outbox_oids(
    client: &Client,
    cfg: &Config,
    outbox: &OutboxConfig,
    known: Option<&OutboxOids>,
) -> Result<Option<OutboxOids>, SourceError> {
    let Some(table) = outbox.table() else {
        return Ok(None);
    };
    // pg_partition_tree lists nothing for a table that is not partitioned.
    let row = client
        .query_opt(
            "SELECT c.oid, ARRAY(SELECT t.relid::oid FROM pg_partition_tree(c.oid) t \
             WHERE t.relid <> c.oid) \
             FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
             WHERE n.nspname = $1 AND c.relname = $2",
            &[&table.schema, &table.name],
        )
        .await
        .map_err(sql_err(&cfg.postgres, "looking up the outbox table"))?;
    if let Some(row) = row {
        return Ok(Some(OutboxOids {
            root: row.get(0),
            partitions: row.get(1),
        }));
    }
    if let Some(known) = known {
        let renamed: Option<String> = client
            .query_opt(
                "SELECT oid::regclass::text FROM pg_class WHERE oid = $1",
                &[&known.root],
            )
            .await
            .map_err(sql_err(&cfg.postgres, "looking up the outbox table"))?
            .map(|r| r.get(0));
        if let Some(now) = renamed {
            tracing::warn!(
                table = %now,
                configured = %table,
                "the outbox table was renamed; following it by its relation id until the relay \
                 restarts (update {})",
                outbox.key_of("table")
            );
            return Ok(Some(known.clone()));
        }
    }
    let key = outbox.key_of("table");
    Err(SourceError::Setup(format!(
        "outbox table {table} does not exist ({key}); if it was renamed, set {key} to its new \
         name"
    )))
}

/// Two outboxes on one partition tree (a table and one of its partitions)
/// would claim the same rows twice: refused, naming both.
pub fn check_overlap(cfg: &Config, oids: &[Option<OutboxOids>]) -> Result<(), SourceError> {
    let all = |o: &OutboxOids| {
        let mut v = o.partitions.clone();
        v.push(o.root);
        v
    };
    for (i, a) in oids.iter().enumerate() {
        for (j, b) in oids.iter().enumerate().skip(i + 1) {
            if let (Some(a), Some(b)) = (a, b) {
                let (a, b) = (all(a), all(b));
                if a.iter().any(|x| b.contains(x)) {
                    return Err(SourceError::Setup(format!(
                        "{} and {} are the same table or partitions of one another: list the \
                         partitioned table once (its partitions' rows are relayed as its own)",
                        cfg.outboxes[i].key_of("table"),
                        cfg.outboxes[j].key_of("table"),
                    )));
                }
            }
        }
    }
    Ok(())
}

/// `run` streams only when the publication still publishes the outbox's
/// inserts, whole: a table dropped and created again is no longer in a
/// `FOR TABLE` publication, and its rows would never be decoded while the
/// slot moved on (see [`super::publication`]).
pub async fn require_publication(
    client: &Client,
    cfg: &Config,
    oids: &[Option<OutboxOids>],
) -> Result<(), SourceError> {
    let pg = &cfg.postgres;
    let tables: Vec<(TableName, Option<u32>)> = (cfg.outboxes.iter().zip(oids))
        .filter_map(|(o, oids)| Some((o.table()?.clone(), Some(oids.as_ref()?.root))))
        .collect();
    // Table-less outboxes need the publication too: pgoutput starts from it.
    let problem = match publication::read(client, &pg.publication, &tables)
        .await
        .map_err(sql_err(pg, "reading the publication"))?
    {
        None => Some(PublicationProblem::Missing),
        Some(info) => info.problems().into_iter().find(|p| p.stops_run()),
    };
    match problem {
        Some(p) => Err(SourceError::Setup(p.sentence(&pg.publication))),
        None => Ok(()),
    }
}

/// What `setup` did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct SetupReport {
    /// The publication was created now.
    pub created_publication: bool,
    /// The slot was created now.
    pub created_slot: bool,
    /// Outbox tables added to an existing publication now.
    pub added_tables: Vec<String>,
    /// An existing slot made a failover slot now (PostgreSQL 17+).
    pub made_failover: bool,
    /// An existing slot that is not a failover slot and could not be
    /// made one now: why (in use by a walsender).
    pub not_failover: Option<String>,
}

/// Creates the publication and the slot when missing; checks them when present.
pub async fn setup(client: &Client, cfg: &Config) -> Result<SetupReport, SourceError> {
    require_logical_wal(client, cfg).await?;
    let pg = &cfg.postgres;
    let mut report = SetupReport::default();
    let tables: Vec<(&OutboxConfig, &TableName)> = cfg
        .outboxes
        .iter()
        .filter_map(|o| Some((o, o.table()?)))
        .collect();
    let mut roots = Vec::new();
    let mut all_oids = Vec::new();
    for (outbox, table) in &tables {
        let exists = client
        .query_opt("SELECT 1 FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = $1 AND c.relname = $2",
            &[&table.schema, &table.name])
        .await
        .map_err(sql_err(pg, "looking up the outbox table"))?;
        if exists.is_none() {
            return Err(SourceError::Setup(format!(
                "outbox table {table} does not exist ({}); create it first, e.g. with sql/outbox.sql",
                outbox.key_of("table")
            )));
        }
        let oids = outbox_oids(client, cfg, outbox, None).await?;
        roots.push(((*table).clone(), oids.as_ref().map(|o| o.root)));
        all_oids.push((*table, oids));
    }
    let aligned: Vec<Option<OutboxOids>> = (cfg.outboxes.iter())
        .map(|o| {
            let t = o.table()?;
            all_oids
                .iter()
                .find(|(n, _)| *n == t)
                .and_then(|(_, x)| x.clone())
        })
        .collect();
    check_overlap(cfg, &aligned)?;

    let publication = quote_ident(&pg.publication);
    let read = |roots: &[(TableName, Option<u32>)]| {
        let roots = roots.to_vec();
        async move {
            publication::read(client, &pg.publication, &roots)
                .await
                .map_err(sql_err(pg, "reading the publication"))
        }
    };
    if read(&[]).await?.is_none() {
        // Every outbox table in one publication; none at all for table-less
        // outboxes only (logical messages do not go through publications).
        let list: Vec<String> = tables.iter().map(|(_, t)| t.quoted()).collect();
        let for_tables = if list.is_empty() {
            String::new()
        } else {
            format!(" FOR TABLE {}", list.join(", "))
        };
        let sql = format!(
            "CREATE PUBLICATION {publication}{for_tables} \
             WITH (publish = 'insert', publish_via_partition_root = true)"
        );
        client
            .batch_execute(&sql)
            .await
            .map_err(sql_err(pg, "creating the publication"))?;
        report.created_publication = true;
    }
    let info = read(&roots).await?;
    for problem in info.map(|i| i.problems()).unwrap_or_default() {
        match problem {
            // An outbox added to the config since the publication was
            // made: its inserts are published from this WAL position on.
            PublicationProblem::NotCovered(table) => {
                client
                    .batch_execute(&format!(
                        "ALTER PUBLICATION {publication} ADD TABLE {}",
                        table.quoted()
                    ))
                    .await
                    .map_err(sql_err(pg, "adding an outbox table to the publication"))?;
                report.added_tables.push(table.to_string());
            }
            PublicationProblem::NoInserts => {
                return Err(SourceError::Setup(format!(
                    "publication {:?} exists but does not publish inserts (postgres.publication); \
                     drop it or run: ALTER PUBLICATION {publication} SET (publish = 'insert')",
                    pg.publication,
                )));
            }
            // Left to `check` and `run`, as before.
            _ => {}
        }
    }

    // Relays of several deployments may run `setup` at once on a fresh
    // database, and CREATE TABLE IF NOT EXISTS is not safe against a
    // concurrent create (unique violation on pg_type): serialize it.
    client
        .batch_execute(&format!(
            "BEGIN; SET LOCAL client_min_messages = warning; \
             SELECT pg_advisory_xact_lock(hashtext('outbox-relay setup')); {}; COMMIT",
            super::checkpoint_table::create_sql(cfg)
        ))
        .await
        .map_err(sql_err(
            pg,
            "creating the checkpoint table (postgres.checkpoint_table)",
        ))?;

    match slot_info(client, cfg).await? {
        None => {
            let version: i32 = client
                .query_one("SELECT current_setting('server_version_num')::int", &[])
                .await
                .map_err(sql_err(pg, "reading server_version_num"))?
                .get(0);
            client
                .query_one(create_slot_sql(version), &[&pg.slot])
                .await
                .map_err(sql_err(pg, "creating the replication slot"))?;
            report.created_slot = true;
        }
        Some(info) if info.plugin.as_deref() != Some("pgoutput") => {
            return Err(SourceError::Setup(format!(
                "replication slot {:?} exists with plugin {:?}; it must use pgoutput (postgres.slot)",
                pg.slot,
                info.plugin.unwrap_or_default()
            )));
        }
        Some(info) => {
            // Made before PostgreSQL 17 (an upgrade), or by hand: a failover
            // slot in place, rather than one dropped and made again (which
            // would skip what was committed meanwhile).
            let failover: Option<bool> = client
                .query_one(
                    "SELECT CASE WHEN current_setting('server_version_num')::int >= 170000 \
                     THEN (to_jsonb(s) ->> 'failover')::bool END \
                     FROM pg_replication_slots s WHERE slot_name = $1",
                    &[&pg.slot],
                )
                .await
                .map_err(sql_err(pg, "reading whether the slot is a failover slot"))?
                .get(0);
            // Only this database's slot, and a live one (altering takes
            // the slot: a lost one is refused on 18, and pointless on 17).
            let usable = info.in_this_database
                && info.invalidation_reason.is_none()
                && info.wal_status.as_deref() != Some("lost");
            if failover == Some(false) && usable {
                match info.active_pid {
                    None => match super::make_failover_slot(pg).await {
                        Ok(()) => report.made_failover = true,
                        Err(e) => report.not_failover = Some(e.to_string()),
                    },
                    Some(pid) => {
                        report.not_failover = Some(format!(
                            "in use by PID {pid} (a relay?): stop it and run setup again to make \
                             it a failover slot"
                        ));
                    }
                }
            }
        }
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn healthy() -> SlotInfo {
        SlotInfo {
            plugin: Some("pgoutput".into()),
            confirmed_flush_lsn: Some(Lsn(16)),
            restart_lsn: Some(Lsn(8)),
            wal_status: Some("reserved".into()),
            active_pid: None,
            database: Some("app".into()),
            in_this_database: true,
            two_phase: false,
            invalidation_reason: None,
            inactive_since: None,
        }
    }

    /// One verdict for `run` and `check`: every problem, in the order
    /// `run` meets them, and what `run` does about each.
    #[test]
    fn the_slot_verdict_lists_every_problem_in_order() {
        assert_eq!(healthy().problems(), vec![]);
        let mut bad = healthy();
        bad.plugin = Some("test_decoding".into());
        bad.in_this_database = false;
        bad.database = Some("other".into());
        bad.two_phase = true;
        bad.wal_status = Some("lost".into());
        bad.active_pid = Some(42);
        bad.confirmed_flush_lsn = None;
        assert_eq!(
            bad.problems(),
            vec![
                SlotProblem::Plugin("test_decoding".into()),
                SlotProblem::OtherDatabase("other".into()),
                SlotProblem::TwoPhase,
                SlotProblem::Lost(None),
                SlotProblem::Busy(42),
                SlotProblem::NoPosition,
            ]
        );
        // run: a lost or missing slot is recovered (or names `recover`),
        // a busy one waited for, the rest stop naming the fix.
        assert!(matches!(
            SlotProblem::Missing.error("s"),
            SourceError::SlotLost(_)
        ));
        assert!(matches!(
            SlotProblem::Lost(None).error("s"),
            SourceError::SlotLost(_)
        ));
        // 17+: a slot invalidated for another cause than removed WAL (18's
        // idle timeout, a standby's vacuumed rows) is lost too, and says
        // why, with what to change.
        let mut idle = healthy();
        idle.invalidation_reason = Some("idle_timeout".into());
        assert_eq!(
            idle.problems(),
            vec![SlotProblem::Lost(Some("idle_timeout".into()))]
        );
        let text = idle.problems()[0].text("s");
        assert!(
            text.contains("idle_replication_slot_timeout") && text.contains("recover"),
            "{text}"
        );
        assert!(matches!(
            idle.problems()[0].error("s"),
            SourceError::SlotLost(_)
        ));
        let busy = SlotProblem::Busy(42).error("s");
        assert!(matches!(busy, SourceError::SlotBusy { pid: 42, .. }) && busy.is_transient());
        let e = SlotProblem::TwoPhase.error("s");
        assert!(matches!(&e, SourceError::Setup(t) if t.contains("pg_drop_replication_slot('s')")));
        assert!(!e.is_transient());
        // check: only the busy slot passes (a warning).
        let passing: Vec<bool> = bad.problems().iter().map(SlotProblem::passes).collect();
        assert_eq!(passing, [false, false, false, false, true, false]);
    }

    /// This machine has PostgreSQL 15 only: the 17+ branch is shown here.
    #[test]
    fn failover_slots_from_postgresql_17() {
        assert!(!create_slot_sql(150_004).contains("true"));
        assert!(create_slot_sql(170_000).ends_with("false, false, true)"));
        let (ok, note) = failover_note(150_004, None, None);
        assert!(!ok && note.contains("PostgreSQL 15") && note.contains("on_slot_lost"));
        assert!(failover_note(170_002, Some(true), Some("on")).0);
        let (ok, note) = failover_note(170_002, Some(true), Some("off"));
        assert!(ok && note.contains("sync_replication_slots"));
        assert!(!failover_note(170_002, Some(false), None).0);
    }
}
