//! The relay's own record of progress, in a small table next to the slot.
//!
//! The slot is the source of truth while it lives. This table outlives it:
//! when the slot is lost (dropped, or invalidated by `max_slot_wal_keep_size`),
//! `outbox-relay recover` re-publishes the outbox rows written after the last
//! recorded commit time.

use tokio_postgres::Client;

use super::{SourceError, sql_err};
use crate::config::Config;
use crate::sink::publisher::Progress;

/// DDL of the checkpoint table (also in `sql/checkpoint.sql`).
pub fn create_sql(cfg: &Config) -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS {} (\n  \
           slot_name        text PRIMARY KEY,\n  \
           confirmed_lsn    pg_lsn NOT NULL,\n  \
           last_commit_time timestamptz,\n  \
           written_at       timestamptz NOT NULL DEFAULT now()\n)",
        cfg.postgres.checkpoint_table.quoted()
    )
}

/// Records `p` for the configured slot.
pub async fn write(client: &Client, cfg: &Config, p: Progress) -> Result<(), SourceError> {
    let sql = format!(
        "INSERT INTO {} (slot_name, confirmed_lsn, last_commit_time, written_at) \
         VALUES ($1, $2::text::pg_lsn, to_timestamp($3::float8 / 1e6), now()) \
         ON CONFLICT (slot_name) DO UPDATE SET confirmed_lsn = EXCLUDED.confirmed_lsn, \
         last_commit_time = EXCLUDED.last_commit_time, written_at = EXCLUDED.written_at",
        cfg.postgres.checkpoint_table.quoted()
    );
    let commit_us = p.commit_time_us.map(|t| t as f64);
    client
        .execute(&sql, &[&cfg.postgres.slot, &p.lsn.to_string(), &commit_us])
        .await
        .map_err(sql_err(&cfg.postgres, "writing the checkpoint"))?;
    Ok(())
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
}

/// Reads the checkpoint of the configured slot; `None` if none was recorded
/// or the table does not exist.
pub async fn read(client: &Client, cfg: &Config) -> Result<Option<Recorded>, SourceError> {
    let sql = format!(
        "SELECT confirmed_lsn::text, \
                to_char(last_commit_time AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"'), \
                (extract(epoch FROM last_commit_time) * 1e6)::bigint, \
                to_char(written_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"'), \
                extract(epoch FROM now() - written_at)::float8 \
         FROM {} WHERE slot_name = $1",
        cfg.postgres.checkpoint_table.quoted()
    );
    match client.query_opt(&sql, &[&cfg.postgres.slot]).await {
        Ok(row) => Ok(row.map(|r| Recorded {
            confirmed_lsn: r.get(0),
            last_commit_time: r.get(1),
            last_commit_time_us: r.get(2),
            written_at: r.get(3),
            age_seconds: r.get(4),
        })),
        // 42P01: the table does not exist (setup not run since upgrading).
        Err(e) if e.code().is_some_and(|c| c.code() == "42P01") => Ok(None),
        Err(e) => Err(sql_err(&cfg.postgres, "reading the checkpoint")(e)),
    }
}
