//! What runs beside a session on its SQL connection: the checkpoint row,
//! heartbeats, retained WAL and the longest transaction, and the liveness
//! probe of a silent stream.

use super::{CHECKPOINT_EVERY, RETAINED_WAL_EVERY, SQL_DEADLINE};
use crate::checkpoint::Progress;
use crate::config::Config;
use crate::metrics::Metrics;
use crate::source::SourceError;
use crate::source::checkpoint_table;
use crate::source::longest_tx::LongestTx;
use crate::source::silence;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Notify;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::debug;
use tracing::warn;

/// Work beside the stream that needs the SQL connection: the checkpoint
/// table, the optional heartbeat, and the retained-WAL gauge. Failures here
/// are logged, never fatal: the slot remains the source of truth.
pub(super) struct Beside {
    pub cfg: Config,
    /// The session's SQL connection.
    pub sql: Arc<tokio_postgres::Client>,
    /// The longest transaction sampled.
    pub longest: Arc<tokio::sync::Mutex<LongestTx>>,
    /// The cluster's system identifier, for the checkpoint row.
    pub system_id: String,
    /// The time the coverage's last good reading names (see
    /// `source::coverage`), for the checkpoint row.
    pub coverage_since: watch::Receiver<String>,
    /// Held while the checkpoint row is written: the gate's last write
    /// after a change comes after every one of these.
    pub row_writes: Arc<tokio::sync::Mutex<()>>,
    /// The position reported.
    pub progress: watch::Receiver<Progress>,
    pub metrics: Metrics,
    pub stop: CancellationToken,
}

/// Runs the work beside the stream until `stop`.
pub(super) async fn side_tasks(
    Beside {
        cfg,
        sql,
        longest,
        system_id,
        coverage_since,
        row_writes,
        mut progress,
        metrics,
        stop,
    }: Beside,
) {
    // Every call has a deadline: a hung server must not keep the session
    // (which waits for these tasks) from ending.
    let bounded = |what: &'static str| {
        move |r: Result<Result<_, _>, tokio::time::error::Elapsed>| match r {
            Ok(r) => r.map_err(|e: tokio_postgres::Error| e.to_string()),
            Err(_) => Err(format!("{what} got no answer within {SQL_DEADLINE:?}")),
        }
    };
    let mut heartbeat = cfg.postgres.heartbeat.map(tokio::time::interval);
    let mut retained = tokio::time::interval(RETAINED_WAL_EVERY);
    // An interval, not a sleep made anew each turn of the loop: another
    // branch firing as often (a heartbeat every second) would restart a
    // sleep for ever, and the checkpoint would never be written.
    let mut checkpoint = tokio::time::interval(CHECKPOINT_EVERY);
    checkpoint.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut written: Option<i64> = None;
    let mut checkpoint_warned = false;
    let mut longest_warned = false;
    loop {
        tokio::select! {
            biased;
            _ = stop.cancelled() => break,
            _ = checkpoint.tick() => {
                // Only a new durable transaction is worth a write: writing
                // on keepalives would itself make WAL, forever.
                let p = *progress.borrow_and_update();
                if p.commit_time_us.is_some() && p.commit_time_us != written {
                    let _row = row_writes.lock().await;
                    if stop.is_cancelled() {
                        break;
                    }
                    // The coverage's reading vouched for the position
                    // reported; its time, read now, is no older.
                    let since = coverage_since.borrow().clone();
                    let write = tokio::time::timeout(SQL_DEADLINE, checkpoint_table::write(&sql, &cfg, p, checkpoint_table::Stamp { system_id: &system_id, coverage_since: &since }));
                    match write.await.unwrap_or_else(|_| Err(SourceError::Timeout("writing the checkpoint".into()))) {
                        Ok(()) => written = p.commit_time_us,
                        Err(e) if !checkpoint_warned => {
                            warn!(error = %e, "cannot record the checkpoint (run `outbox-relay setup` to create its table); continuing");
                            checkpoint_warned = true;
                        }
                        Err(e) => debug!(error = %e, "checkpoint write failed"),
                    }
                }
            }
            _ = async { heartbeat.as_mut().expect("guarded").tick().await }, if heartbeat.is_some() => {
                // A transactional message travels the slot like a tiny
                // transaction, so the watermark moves even when this
                // database writes nothing at all.
                let call = sql.execute("SELECT pg_logical_emit_message(true, 'outbox-relay-heartbeat', '')", &[]);
                if let Err(e) = bounded("the heartbeat")(tokio::time::timeout(SQL_DEADLINE, call).await) {
                    warn!(error = %e, "heartbeat failed");
                }
            }

            _ = retained.tick() => {
                let params: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&cfg.postgres.slot];
                let call = sql.query_one(
                    "SELECT (pg_current_wal_lsn() - restart_lsn)::bigint, safe_wal_size FROM pg_replication_slots WHERE slot_name = $1",
                    &params,
                );
                if let Ok(Ok(row)) = tokio::time::timeout(SQL_DEADLINE, call).await {
                    metrics.retained_wal_bytes.set(row.get::<_, Option<i64>>(0).unwrap_or(0));
                    // NULL when max_slot_wal_keep_size is -1 (unlimited).
                    metrics.safe_wal_bytes.set(row.get::<_, Option<i64>>(1).unwrap_or(-1));
                }
                // For `recover`'s window: see source::longest_tx.
                let mut longest = longest.lock().await;
                if let Some(secs) = longest.sample(&sql, SQL_DEADLINE).await {
                    let call = checkpoint_table::record_longest_tx(&sql, &cfg, secs);
                    match tokio::time::timeout(SQL_DEADLINE, call).await {
                        Ok(Ok(())) => debug!(secs, "longest transaction seen"),
                        other => {
                            longest.longest_secs = 0.0; // try again next time
                            if !longest_warned {
                                let e = other.map_or_else(|_| "no answer".to_owned(), |r| r.err().map(|e| e.to_string()).unwrap_or_default());
                                warn!(error = %e, "cannot record the longest transaction (run `outbox-relay setup` to update the checkpoint table); `recover` may choose too short a window");
                                longest_warned = true;
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Tells the source half when the stream is alive though silent, on a task
/// of its own so that no other SQL work delays it (see `source::silence`):
/// sends the probe when asked, and signals `alive` whenever the slot's
/// walsender has read further.
pub(super) struct Liveness {
    pub cfg: Config,
    pub sql: Arc<tokio_postgres::Client>,
    /// How long the stream may be silent.
    pub limit: Duration,
    /// Notified by the source half to send the probe.
    pub probe: Arc<Notify>,
    /// Notified by this task when the walsender read further.
    pub alive: Arc<Notify>,
    pub stop: CancellationToken,
}

/// Runs the liveness probe until `stop`.
pub(super) async fn liveness(
    Liveness {
        cfg,
        sql,
        limit,
        probe,
        alive,
        stop,
    }: Liveness,
) {
    let mut every = tokio::time::interval(silence::progress_every(limit));
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut sent: Option<String> = None;
    loop {
        tokio::select! {
            biased;
            _ = stop.cancelled() => break,
            _ = probe.notified() => {
                let call = tokio::time::timeout(SQL_DEADLINE, sql.execute(silence::PROBE_SQL, &[]));
                match call.await {
                    Ok(Ok(_)) => debug!("replication stream silent; probe message sent"),
                    Ok(Err(e)) => warn!(error = %e, "replication stream silent, and the probe message failed"),
                    Err(_) => warn!("replication stream silent, and the probe message got no answer"),
                }
            }
            _ = every.tick() => {
                let params: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&cfg.postgres.slot];
                let call = sql.query_opt(silence::SENT_LSN_SQL, &params);
                if let Ok(Ok(Some(row))) = tokio::time::timeout(SQL_DEADLINE, call).await {
                    let now: Option<String> = row.get(0);
                    if now.is_some() && sent.is_some() && now != sent {
                        alive.notify_one();
                    }
                    sent = now;
                }
            }
        }
    }
}
