//! `prune`: keeps the outbox table bounded. With CDC nothing ever deletes
//! outbox rows (the relay reads the WAL, not the table); this deletes the
//! ones that are both older than the operator's age limit and safely
//! behind the last checkpoint: confirmed by the broker, and outside the
//! window `recover` would re-publish from (the checkpoint's commit time
//! minus its overlap). Rows are deleted in batches, each its own short
//! transaction, so no long lock is held and vacuum keeps up. The
//! publication publishes inserts only: the deletes never become messages.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::{DEFAULT_OVERLAP_SECS, LONGEST_TX_MARGIN_SECS};
use crate::config::{Config, quote_ident};
use crate::error::RelayError;
use crate::source::{SourceError, connect_sql, sql_err};

/// What `prune` found and did.
#[derive(Debug, Clone, PartialEq)]
pub struct PruneReport {
    /// Rows created before this (PostgreSQL's text form) were deleted.
    pub cutoff: String,
    /// Rows deleted (or, on a dry run, that would be).
    pub deleted: i64,
    /// Rows older than the age limit, kept because the last checkpoint
    /// does not cover them yet (unconfirmed, or in `recover`'s window).
    pub kept: i64,
}

/// Deletes (unless `dry_run`) the outbox rows older than `older_than` and
/// behind the last checkpoint, `batch` rows per transaction, in every
/// outbox table (or the one `table` names). Table-less outboxes store
/// nothing. Returns each table's report.
pub async fn prune(
    cfg: &Config,
    older_than: Duration,
    batch: i64,
    dry_run: bool,
    table: Option<&str>,
    stop: &CancellationToken,
) -> Result<Vec<(String, PruneReport)>, RelayError> {
    let tables = super::rows::tables(cfg, table)?;
    let client = connect_sql(&cfg.postgres).await?;
    // No recovery may start while rows go (`recover`, or `run` with
    // on_slot_lost = "recover", take the same lock)...
    if super::lock_recovery(&client, cfg).await.is_err() {
        return Err(SourceError::Setup(
            "a recovery of this slot is running; prune after it finished".into(),
        )
        .into());
    }
    // ...and none may be due: a lost slot needs its window's rows.
    let slot_ok = crate::source::slot::slot_info(&client, cfg)
        .await?
        .is_some_and(|i| i.wal_status.as_deref() != Some("lost"));
    if !slot_ok {
        return Err(SourceError::Setup(format!(
            "replication slot {:?} is missing or lost: `outbox-relay recover` needs the rows \
             since the checkpoint; prune after it",
            cfg.postgres.slot
        ))
        .into());
    }
    // Every checkpoint row of the table counts (several relays, several
    // slots may read this outbox): the oldest position wins, and any
    // recovery under way stops the prune.
    let t = cfg.postgres.checkpoint_table.quoted();
    // Under row-level security (sql/role.sql's policy) a role that neither
    // owns the table nor bypasses RLS sees only its own slot's row: the
    // oldest position would be this slot's alone, and rows other slots
    // have not confirmed would go.
    let hidden: bool = client
        .query_one(
            "SELECT c.relrowsecurity AND c.relowner <> r.oid AND NOT r.rolbypassrls \
               AND NOT r.rolsuper \
             FROM pg_class c, pg_roles r WHERE c.oid = $1::text::regclass \
               AND r.rolname = current_user",
            &[&t],
        )
        .await
        .map_err(sql_err(&cfg.postgres, format!("reading who may see {t}")))?
        .get(0);
    if hidden {
        return Err(SourceError::Setup(format!(
            "{t} has row-level security and this role sees only its own slot's checkpoint:              pruning from it could delete rows other slots have not confirmed; run `prune` as              the table's owner (or a role with BYPASSRLS), see sql/role.sql"
        ))
        .into());
    }
    let row = client
        .query_one(
            &format!(
                "SELECT (min(extract(epoch FROM last_commit_time)) * 1e6)::float8, \
                        max((to_jsonb(c) ->> 'longest_tx_secs')::float8), \
                        bool_or(to_jsonb(c) ->> 'recovery_since' IS NOT NULL), \
                        bool_or(slot_name = $1 AND last_commit_time IS NOT NULL) FROM {t} c"
            ),
            &[&cfg.postgres.slot],
        )
        .await
        .map_err(sql_err(
            &cfg.postgres,
            format!("reading the checkpoints in {t}"),
        ))?;
    let (oldest, longest): (Option<f64>, Option<f64>) = (row.get(0), row.get(1));
    let (recovering, mine): (Option<bool>, Option<bool>) = (row.get(2), row.get(3));
    if recovering == Some(true) {
        return Err(SourceError::Setup(format!(
            "a recovery is under way (see {t}): its rows must stay until it completes; prune \
             after `outbox-relay recover` (or `run`) finished it"
        ))
        .into());
    }
    // This relay's own slot must have a row: without one (the relay never
    // wrote a checkpoint, or writes it elsewhere), the other slots' rows
    // say nothing of what this slot has confirmed.
    // Another slot's row without a commit time (its relay started and has
    // confirmed nothing yet) counts as no row: that slot has no window for
    // `recover` to re-publish.
    let (Some(commit_us), Some(true)) = (oldest, mine) else {
        return Err(SourceError::Setup(format!(
            "no confirmed position recorded for slot {:?} in {t}: nothing is known to be \
             confirmed there, so nothing is pruned (run the relay until it has confirmed \
             events)",
            cfg.postgres.slot
        ))
        .into());
    };
    let longest = longest.unwrap_or(0.0);
    let commit_us = commit_us as i64;
    // What `recover` would re-publish starts this long before the
    // checkpoint's commit time (the larger of its two rules).
    let overlap = (DEFAULT_OVERLAP_SECS as f64).max((longest + LONGEST_TX_MARGIN_SECS).ceil());
    // With commit timestamps, `recover` also takes rows that committed
    // after its window's start, whatever their created_at: keep them too.
    let commit_ts: bool = client
        .query_one(
            "SELECT current_setting('track_commit_timestamp') = 'on'",
            &[],
        )
        .await
        .map_err(sql_err(&cfg.postgres, "reading track_commit_timestamp"))?
        .get(0);
    let committed_before = if commit_ts {
        "AND NOT coalesce(pg_xact_commit_timestamp(xmin) >= cutoff, false)"
    } else {
        ""
    };
    let mut reports = Vec::new();
    for t in tables {
        let o = &cfg.outboxes[t];
        let table = o.table().expect("a table outbox");
        let cut = Cut {
            older_than,
            commit_us,
            overlap,
            committed_before,
        };
        let report = prune_table(&client, cfg, o, cut, batch, dry_run, stop).await?;
        reports.push((table.to_string(), report));
    }
    Ok(reports)
}

/// Which rows of a table may go.
struct Cut {
    older_than: Duration,
    /// The oldest checkpoint's commit time (µs since the Unix epoch).
    commit_us: i64,
    /// `recover`'s window before it, in seconds.
    overlap: f64,
    /// SQL keeping rows committed after the cutoff (commit timestamps).
    committed_before: &'static str,
}

async fn prune_table(
    client: &tokio_postgres::Client,
    cfg: &Config,
    o: &crate::config::OutboxConfig,
    cut: Cut,
    batch: i64,
    dry_run: bool,
    stop: &CancellationToken,
) -> Result<PruneReport, RelayError> {
    let Cut {
        older_than,
        commit_us,
        overlap,
        committed_before,
    } = cut;
    let table = o.table().expect("a table outbox").quoted();
    let created = quote_ident(&o.columns.created_at);
    let created_key = o.key_of("created_at");
    let keep_new = committed_before
        .replace("xmin", "o.xmin")
        .replace("cutoff", "c.cutoff");
    let row = client
        .query_one(
            &format!(
                "WITH c AS (SELECT now() - make_interval(secs => $1) AS aged, \
                        least(now() - make_interval(secs => $1), \
                              to_timestamp($2::float8 / 1e6) - make_interval(secs => $3)) AS cutoff) \
                 SELECT c.cutoff::text, \
                        count(*) FILTER (WHERE o.{created} < c.cutoff {keep_new}), \
                        count(*) FILTER (WHERE NOT (o.{created} < c.cutoff {keep_new})) \
                 FROM c LEFT JOIN {table} o ON o.{created} < c.aged GROUP BY c.cutoff"
            ),
            &[&older_than.as_secs_f64(), &(commit_us as f64), &overlap],
        )
        .await
        .map_err(sql_err(
            &cfg.postgres,
            format!("counting old rows of {table} by {created} ({created_key})"),
        ))?;
    let mut report = PruneReport {
        cutoff: row.get(0),
        deleted: row.get(1),
        kept: row.get(2),
    };
    if dry_run || report.deleted == 0 {
        return Ok(report);
    }
    // By ctid (a TID scan, whatever the indexes), and by age again: in a
    // partitioned table a ctid names a row in each partition, and only old
    // ones may go.
    let delete = format!(
        "WITH k AS (SELECT $1::text::timestamptz AS cutoff) \
         DELETE FROM {table} WHERE {created} < (SELECT cutoff FROM k) {keep_new_del} \
         AND ctid = ANY(ARRAY(SELECT ctid FROM {table}, k \
         WHERE {created} < k.cutoff {committed_before} LIMIT $2))",
        keep_new_del = committed_before.replace("cutoff", "(SELECT cutoff FROM k)"),
    );
    let mut deleted = 0i64;
    loop {
        if stop.is_cancelled() {
            return Err(RelayError::Interrupted(format!(
                "stopped after deleting {deleted} rows"
            )));
        }
        let n = client
            .execute(&delete, &[&report.cutoff, &batch])
            .await
            .map_err(sql_err(
                &cfg.postgres,
                format!("deleting old rows of {table}"),
            ))?;
        deleted += n as i64;
        if n == 0 {
            break;
        }
    }
    report.deleted = deleted;
    Ok(report)
}

/// Parses an age such as `30d`, `12h`, `90m`, `3600s` or `2w`.
pub fn parse_age(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (n, unit) = s.split_at(split);
    let n: u64 = n
        .parse()
        .map_err(|_| format!("{s:?}: expected a number and a unit, e.g. 30d or 12h"))?;
    let secs = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        "w" => 7 * 86_400,
        _ => return Err(format!("{s:?}: the unit must be s, m, h, d or w")),
    };
    Ok(Duration::from_secs(n.saturating_mul(secs)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages() {
        assert_eq!(parse_age("30d"), Ok(Duration::from_secs(30 * 86_400)));
        assert_eq!(parse_age("12h"), Ok(Duration::from_secs(12 * 3600)));
        assert_eq!(parse_age("90m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_age("2w"), Ok(Duration::from_secs(14 * 86_400)));
        for bad in ["", "d", "12", "1y", "-1d", "1.5d"] {
            assert!(parse_age(bad).is_err(), "{bad}");
        }
    }
}
