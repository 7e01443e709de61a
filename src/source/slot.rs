//! Slot and publication management over the SQL connection.

use tokio_postgres::Client;

use super::{SourceError, sql_err};
use crate::config::{Config, quote_ident};
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
}

fn parse_lsn(s: Option<String>) -> Option<Lsn> {
    s.and_then(|s| s.parse().ok())
}

/// Reads the slot, `None` when it does not exist.
pub async fn slot_info(client: &Client, cfg: &Config) -> Result<Option<SlotInfo>, SourceError> {
    let row = client
        .query_opt(
            "SELECT plugin::text, confirmed_flush_lsn::text, restart_lsn::text, wal_status, \
             active_pid, database::text, database IS NOT DISTINCT FROM current_database(), \
             two_phase FROM pg_replication_slots WHERE slot_name = $1",
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
    }))
}

/// Checks the slot is usable for `run` and returns its confirmed position.
pub async fn usable_slot(client: &Client, cfg: &Config) -> Result<Lsn, SourceError> {
    let slot = &cfg.postgres.slot;
    let info = slot_info(client, cfg).await?.ok_or_else(|| {
        SourceError::Setup(format!(
            "replication slot {slot:?} does not exist (postgres.slot): on a first start, create it with \
             `outbox-relay setup`; if it existed and was dropped, run `outbox-relay recover` to recreate it \
             and re-publish the outbox rows written since the last checkpoint"
        ))
    })?;
    if info.plugin.as_deref() != Some("pgoutput") {
        return Err(SourceError::Setup(format!(
            "replication slot {slot:?} uses plugin {:?}, not pgoutput; drop it and run `outbox-relay setup`",
            info.plugin.unwrap_or_default()
        )));
    }
    if !info.in_this_database {
        return Err(SourceError::Setup(format!(
            "replication slot {slot:?} belongs to database {:?}, not the one postgres.url names; \
             use a slot of this database (postgres.slot), or fix the database in postgres.url",
            info.database.unwrap_or_default()
        )));
    }
    if info.two_phase {
        return Err(SourceError::Setup(format!(
            "replication slot {slot:?} was created with two-phase decoding, which would stream \
             prepared transactions before they commit; drop it \
             (SELECT pg_drop_replication_slot('{slot}')) and run `outbox-relay setup`"
        )));
    }
    if info.wal_status.as_deref() == Some("lost") {
        return Err(SourceError::Setup(format!(
            "replication slot {slot:?} is invalidated (wal_status = lost): the WAL it needed was removed. \
             Events committed since its last confirmed position cannot be replayed from WAL; \
             run `outbox-relay recover` to recreate the slot and re-publish the outbox rows written since \
             the last checkpoint (`--dry-run` shows them first)"
        )));
    }
    if let Some(pid) = info.active_pid {
        return Err(SourceError::SlotBusy {
            slot: slot.clone(),
            pid,
        });
    }
    info.confirmed_flush_lsn.ok_or_else(|| {
        SourceError::Setup(format!(
            "replication slot {slot:?} has no confirmed_flush_lsn; is it a logical slot?"
        ))
    })
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
    known: Option<&OutboxOids>,
) -> Result<OutboxOids, SourceError> {
    let table = &cfg.outbox.table;
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
        return Ok(OutboxOids {
            root: row.get(0),
            partitions: row.get(1),
        });
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
                 restarts (update outbox.table)"
            );
            return Ok(known.clone());
        }
    }
    Err(SourceError::Setup(format!(
        "outbox table {table} does not exist (outbox.table); if it was renamed, set \
         outbox.table to its new name"
    )))
}

/// Whether the publication publishes inserts, and covers the outbox table
/// (listed itself, or through its partitions); `None`: no publication.
async fn publication_state(
    client: &Client,
    cfg: &Config,
    root: u32,
) -> Result<Option<(bool, bool)>, SourceError> {
    let pg = &cfg.postgres;
    let Some(row) = client
        .query_opt(
            "SELECT pubinsert FROM pg_publication WHERE pubname = $1",
            &[&pg.publication],
        )
        .await
        .map_err(sql_err(pg, "reading pg_publication"))?
    else {
        return Ok(None);
    };
    let covers = client
        .query_opt(
            "SELECT 1 FROM pg_publication_tables pt \
             JOIN pg_namespace n ON n.nspname = pt.schemaname \
             JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = pt.tablename \
             WHERE pt.pubname = $1 AND (c.oid = $2 OR c.oid IN ( \
               SELECT t.relid FROM pg_partition_tree($2::oid::regclass) t)) LIMIT 1",
            &[&pg.publication, &root],
        )
        .await
        .map_err(sql_err(pg, "reading pg_publication_tables"))?;
    Ok(Some((row.get(0), covers.is_some())))
}

/// `run` streams only when the publication still publishes the outbox's
/// inserts: a table dropped and created again is no longer in a `FOR
/// TABLE` publication, and its rows would never be decoded while the slot
/// moved on.
pub async fn require_publication(
    client: &Client,
    cfg: &Config,
    oids: &OutboxOids,
) -> Result<(), SourceError> {
    let pg = &cfg.postgres;
    let table = &cfg.outbox.table;
    match publication_state(client, cfg, oids.root).await? {
        Some((true, true)) => Ok(()),
        None => Err(SourceError::Setup(format!(
            "publication {:?} does not exist (postgres.publication); run `outbox-relay setup`",
            pg.publication
        ))),
        Some(_) => Err(SourceError::Setup(format!(
            "publication {:?} does not publish inserts into {table} (was the table dropped and \
             created again?); run: ALTER PUBLICATION {} ADD TABLE {}; ALTER PUBLICATION {} SET \
             (publish = 'insert'), then `outbox-relay recover` if rows were written meanwhile",
            pg.publication,
            quote_ident(&pg.publication),
            table.quoted(),
            quote_ident(&pg.publication),
        ))),
    }
}

/// What `setup` did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct SetupReport {
    /// The publication was created now.
    pub created_publication: bool,
    /// The slot was created now.
    pub created_slot: bool,
}

/// Creates the publication and the slot when missing; checks them when present.
pub async fn setup(client: &Client, cfg: &Config) -> Result<SetupReport, SourceError> {
    require_logical_wal(client, cfg).await?;
    let pg = &cfg.postgres;
    let table = &cfg.outbox.table;
    let mut report = SetupReport::default();

    let exists = client
        .query_opt("SELECT 1 FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = $1 AND c.relname = $2",
            &[&table.schema, &table.name])
        .await
        .map_err(sql_err(pg, "looking up the outbox table"))?;
    if exists.is_none() {
        return Err(SourceError::Setup(format!(
            "outbox table {table} does not exist (outbox.table); create it first, e.g. with sql/outbox.sql"
        )));
    }

    let root = outbox_oids(client, cfg, None).await?.root;
    match publication_state(client, cfg, root).await? {
        None => {
            let sql = format!(
                "CREATE PUBLICATION {} FOR TABLE {} \
                 WITH (publish = 'insert', publish_via_partition_root = true)",
                quote_ident(&pg.publication),
                table.quoted()
            );
            client
                .batch_execute(&sql)
                .await
                .map_err(sql_err(pg, "creating the publication"))?;
            report.created_publication = true;
        }
        Some((true, true)) => {}
        Some(_) => {
            return Err(SourceError::Setup(format!(
                "publication {:?} exists but does not publish inserts into {table} (postgres.publication); \
                 drop it or run: ALTER PUBLICATION {} ADD TABLE {}; ALTER PUBLICATION {} SET (publish = 'insert')",
                pg.publication,
                quote_ident(&pg.publication),
                table.quoted(),
                quote_ident(&pg.publication),
            )));
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
            client
                .query_one(
                    "SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput')",
                    &[&pg.slot],
                )
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
        Some(_) => {}
    }
    Ok(report)
}
