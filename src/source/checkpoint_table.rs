//! The relay's own record of progress, in a small table next to the slot.
//!
//! The slot is the source of truth while it lives. This table outlives it:
//! when the slot is lost (dropped, or invalidated by `max_slot_wal_keep_size`),
//! `outbox-relay recover` re-publishes the outbox rows written after the last
//! recorded commit time.

use tokio_postgres::Client;

use super::{SourceError, sql_err};
use crate::checkpoint::Progress;
use crate::config::Config;

/// DDL of the checkpoint table (also in `sql/checkpoint.sql`): created, and
/// brought up to date when an older version made it (by its owner: another
/// role gets a warning, and the relay works without the new columns). The table is created
/// and the columns added only when missing, so a role that may not create
/// in the schema nor owns the table (`sql/role.sql`'s) can run it once
/// they exist: PostgreSQL checks CREATE on the schema even for `CREATE
/// TABLE IF NOT EXISTS` of a table that exists.
pub fn create_sql(cfg: &Config) -> String {
    let t = cfg.postgres.checkpoint_table.quoted();
    let literal = t.replace('\'', "''");
    format!(
        "DO $outbox_relay$ BEGIN\n\
           IF to_regclass('{literal}') IS NULL THEN\n\
             CREATE TABLE {t} (\n  \
               slot_name        text PRIMARY KEY,\n  \
               confirmed_lsn    pg_lsn NOT NULL,\n  \
               last_commit_time timestamptz,\n  \
               written_at       timestamptz NOT NULL DEFAULT now()\n);\n\
           END IF;\n\
           IF NOT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = '{literal}'::regclass \
                          AND attname = 'coverage_since' AND NOT attisdropped) THEN\n\
             BEGIN\n\
             ALTER TABLE {t}\n  \
               ADD COLUMN IF NOT EXISTS longest_tx_secs        float8,\n  \
               ADD COLUMN IF NOT EXISTS recovery_since         timestamptz,\n  \
               ADD COLUMN IF NOT EXISTS recovery_after_created timestamptz,\n  \
               ADD COLUMN IF NOT EXISTS recovery_after_id      text,\n  \
               ADD COLUMN IF NOT EXISTS recovery_done          bigint,\n  \
               ADD COLUMN IF NOT EXISTS system_identifier      text,\n  \
               ADD COLUMN IF NOT EXISTS coverage               jsonb,\n  \
               ADD COLUMN IF NOT EXISTS coverage_since         timestamptz;\n\
             EXCEPTION WHEN insufficient_privilege THEN\n\
               RAISE WARNING 'outbox-relay: cannot add the newest columns of the checkpoint \
                 table (not its owner): run sql/checkpoint.sql as its owner';\n\
             END;\n\
           END IF;\n\
         END $outbox_relay$"
    )
}

/// Records the longest-running transaction seen (seconds), if longer than
/// the one recorded: `recover` sizes its window from it when
/// `track_commit_timestamp` is off.
pub async fn record_longest_tx(
    client: &Client,
    cfg: &Config,
    secs: f64,
) -> Result<(), SourceError> {
    let sql = format!(
        "UPDATE {} SET longest_tx_secs = $2 WHERE slot_name = $1 \
         AND (longest_tx_secs IS NULL OR longest_tx_secs < $2)",
        cfg.postgres.checkpoint_table.quoted()
    );
    client
        .execute(&sql, &[&cfg.postgres.slot, &secs])
        .await
        .map_err(sql_err(&cfg.postgres, "recording the longest transaction"))?;
    Ok(())
}

/// A recovery recorded before its slot was made, and how far it got.
#[derive(Debug, Clone, PartialEq)]
pub struct Recovery {
    /// Rows created (or committed) at or after this are re-published
    /// (PostgreSQL's text form of a timestamptz).
    pub since: String,
    /// The last row confirmed so far, as (created_at, id) in text form.
    pub after: Option<(String, String)>,
    /// Rows confirmed so far.
    pub done: i64,
}

/// The recovery under way for the configured slot, if any (`None` also
/// when the table predates recoveries).
pub async fn pending_recovery(
    client: &Client,
    cfg: &Config,
) -> Result<Option<Recovery>, SourceError> {
    let sql = format!(
        "SELECT recovery_since::text, recovery_after_created::text, recovery_after_id, \
                coalesce(recovery_done, 0) \
         FROM {} WHERE slot_name = $1 AND recovery_since IS NOT NULL",
        cfg.postgres.checkpoint_table.quoted()
    );
    match client.query_opt(&sql, &[&cfg.postgres.slot]).await {
        Ok(row) => Ok(row.map(|r| Recovery {
            since: r.get(0),
            after: r
                .get::<_, Option<String>>(1)
                .zip(r.get::<_, Option<String>>(2)),
            done: r.get(3),
        })),
        // 42P01 no table, 42703 no column: no recovery was ever recorded.
        Err(e)
            if e.code()
                .is_some_and(|c| ["42P01", "42703"].contains(&c.code())) =>
        {
            Ok(None)
        }
        Err(e) => Err(sql_err(&cfg.postgres, "reading the recovery")(e)),
    }
}

/// Records (`Some`) or ends (`None`) the recovery of the configured slot.
/// The checkpoint row exists: a recovery starts from it.
pub async fn set_recovery(
    client: &Client,
    cfg: &Config,
    r: Option<&Recovery>,
) -> Result<(), SourceError> {
    let sql = format!(
        "UPDATE {} SET recovery_since = $2::text::timestamptz, \
            recovery_after_created = $3::text::timestamptz, recovery_after_id = $4, \
            recovery_done = $5 WHERE slot_name = $1",
        cfg.postgres.checkpoint_table.quoted()
    );
    let (since, created, id, done) = match r {
        Some(r) => (
            Some(r.since.as_str()),
            r.after.as_ref().map(|a| a.0.as_str()),
            r.after.as_ref().map(|a| a.1.as_str()),
            Some(r.done),
        ),
        None => (None, None, None, None),
    };
    let n = client
        .execute(&sql, &[&cfg.postgres.slot, &since, &created, &id, &done])
        .await
        .map_err(sql_err(
            &cfg.postgres,
            "recording the recovery (run `outbox-relay setup` to update the checkpoint table)",
        ))?;
    if n == 0 && r.is_some() {
        return Err(SourceError::Setup(format!(
            "no checkpoint row for slot {:?} in {}",
            cfg.postgres.slot, cfg.postgres.checkpoint_table
        )));
    }
    Ok(())
}

/// What a checkpoint row says besides the position.
#[derive(Debug, Clone, Copy)]
pub struct Stamp<'a> {
    /// The cluster it was written on.
    pub system_id: &'a str,
    /// The time from which rows of an outbox table changed since may date
    /// (see `source::coverage`).
    pub coverage_since: &'a str,
}

/// Records `p` for the configured slot, with its [`Stamp`]. A table made
/// before it recorded these gets the rest.
pub async fn write(
    client: &Client,
    cfg: &Config,
    p: Progress,
    Stamp {
        system_id,
        coverage_since,
    }: Stamp<'_>,
) -> Result<(), SourceError> {
    let t = cfg.postgres.checkpoint_table.quoted();
    let commit_us = p.commit_time_us.map(|t| t as f64);
    let lsn = p.lsn.to_string();
    // The newest columns first; 42703 (no such column: `setup` not run
    // since upgrading) falls back to the columns of older versions.
    let extra: [(&str, &str); 3] = [
        (
            ", system_identifier, coverage_since",
            ", $4, $5::text::timestamptz",
        ),
        (", system_identifier", ", $4"),
        ("", ""),
    ];
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 5] = [
        &cfg.postgres.slot,
        &lsn,
        &commit_us,
        &system_id,
        &coverage_since,
    ];
    for (i, (columns, values)) in extra.iter().enumerate() {
        let set: String = (columns.split(", ").filter(|c| !c.is_empty()))
            .map(|c| format!(", {c} = EXCLUDED.{c}"))
            .collect();
        let sql = format!(
            "INSERT INTO {t} (slot_name, confirmed_lsn, last_commit_time, written_at{columns}) \
             VALUES ($1, $2::text::pg_lsn, to_timestamp($3::float8 / 1e6), now(){values}) \
             ON CONFLICT (slot_name) DO UPDATE SET confirmed_lsn = EXCLUDED.confirmed_lsn, \
             last_commit_time = EXCLUDED.last_commit_time, written_at = EXCLUDED.written_at{set}"
        );
        let r = client.execute(&sql, &params[..params.len() - i]).await;
        match r {
            Err(e) if e.code().is_some_and(|c| c.code() == "42703") && i + 1 < extra.len() => {}
            r => {
                r.map_err(sql_err(&cfg.postgres, "writing the checkpoint"))?;
                return Ok(());
            }
        }
    }
    unreachable!("the last form of the write returns")
}

/// A recorded checkpoint.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Recorded {
    /// The confirmed LSN recorded.
    pub confirmed_lsn: String,
    /// Commit time of the newest durable transaction (RFC 3339).
    pub last_commit_time: Option<String>,
    /// Same, as µs since the Unix epoch.
    #[serde(skip)]
    pub last_commit_time_us: Option<i64>,
    /// When it was written (RFC 3339).
    pub written_at: String,
    /// Seconds since it was written.
    pub age_seconds: f64,
    /// The longest-running transaction the relay has seen, in seconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub longest_tx_secs: Option<f64>,
    /// The cluster it was written on (`None` before the table recorded it).
    #[serde(skip)]
    pub system_identifier: Option<String>,
}

/// Reads the checkpoint of the configured slot; `None` if none was recorded
/// or the table does not exist.
pub async fn read(client: &Client, cfg: &Config) -> Result<Option<Recorded>, SourceError> {
    let sql = format!(
        "SELECT confirmed_lsn::text, \
                to_char(last_commit_time AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"'), \
                (extract(epoch FROM last_commit_time) * 1e6)::bigint, \
                to_char(written_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"'), \
                extract(epoch FROM now() - written_at)::float8, \
                (to_jsonb(c) ->> 'longest_tx_secs')::float8, \
                to_jsonb(c) ->> 'system_identifier' \
         FROM {} c WHERE slot_name = $1",
        cfg.postgres.checkpoint_table.quoted()
    );
    match client.query_opt(&sql, &[&cfg.postgres.slot]).await {
        Ok(row) => Ok(row.map(|r| Recorded {
            confirmed_lsn: r.get(0),
            last_commit_time: r.get(1),
            last_commit_time_us: r.get(2),
            written_at: r.get(3),
            age_seconds: r.get(4),
            longest_tx_secs: r.get(5),
            system_identifier: r.get(6),
        })),
        // 42P01: the table does not exist (setup not run since upgrading).
        Err(e) if e.code().is_some_and(|c| c.code() == "42P01") => Ok(None),
        Err(e) => Err(sql_err(&cfg.postgres, "reading the checkpoint")(e)),
    }
}
