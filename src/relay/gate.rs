//! The position a session reports (to the server, in the checkpoint row,
//! to the next session): the sink's watermark, held back to what the
//! outbox tables' coverage vouches for (`source::coverage`).

use super::SQL_DEADLINE;
use crate::checkpoint::Progress;
use crate::config::Config;
use crate::lsn::Lsn;
use crate::source::SourceError;
use crate::source::coverage::{Coverage, Uncertain};
use crate::source::longest_tx::LongestTx;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::debug;
use tracing::warn;

/// How often the coverage is read while the watermark waits on it. Each
/// reading vouches for all WAL written before it, so a busy stream waits
/// at most this long (plus a round trip) for its position to be reported.
const COVERAGE_EVERY: Duration = Duration::from_millis(50);
/// The last reading, when the session ends.
const FINAL_DEADLINE: Duration = Duration::from_secs(2);
/// How often the SQL connection is looked at while the watermark does not
/// wait on the coverage (see [`Gate::run`]).
const CLOSED_EVERY: Duration = Duration::from_secs(1);

/// Readings may fail this long (the SQL connection lost while the stream
/// lives on) before the session ends, to reconnect: meanwhile nothing is
/// reported, and WAL is retained.
const UNREAD_LIMIT: Duration = Duration::from_secs(30);

/// The gate of one session: forwards `watermark` into `reported`, never
/// past the WAL position the last reading of the coverage vouched for,
/// until `sink_done` (after the sink's last confirm, a drain included). A
/// change in the coverage ends the session (`stop`) with the error that
/// explains it; so do readings failing for [`UNREAD_LIMIT`], and the SQL
/// connection closed (transient: the next session reconnects).
///
/// The SQL connection closed ends the session even while the watermark
/// stands still: a fast shutdown of PostgreSQL ends the SQL backend first,
/// then waits for the walsender, which waits until the client confirms all
/// it sent. While the broker withholds confirms (an alarm), only the end
/// of the session lets the server stop.
pub(super) struct Gate {
    pub cfg: Config,
    pub sql: Arc<tokio_postgres::Client>,
    /// The outbox tables' coverage the session started from.
    pub coverage: Coverage,
    /// The time its last good reading names, for the checkpoint row.
    pub since: watch::Sender<String>,
    /// Held while the checkpoint row is written (see [`record_since`]).
    pub row_writes: Arc<tokio::sync::Mutex<()>>,
    /// Widens the time a change names (see `source::coverage`).
    pub longest: Arc<tokio::sync::Mutex<LongestTx>>,
    /// The sink's watermark.
    pub watermark: watch::Receiver<Progress>,
    /// What is reported.
    pub reported: watch::Sender<Progress>,
    /// Cancelled to end the session.
    pub stop: CancellationToken,
    /// Cancelled once the sink confirmed its last.
    pub sink_done: CancellationToken,
}

impl Gate {
    /// Runs until `sink_done`, then vouches once more.
    pub(super) async fn run(self) -> Result<(), SourceError> {
        let Gate {
            cfg,
            sql,
            mut coverage,
            since,
            row_writes,
            longest,
            mut watermark,
            reported,
            stop,
            sink_done,
        } = self;
        let pg = &cfg.postgres;
        let mut vouched = reported.borrow().lsn;
        let mut tick = tokio::time::interval(COVERAGE_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut unread_since: Option<Instant> = None;
        let mut closed = tokio::time::interval(CLOSED_EVERY);
        closed.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let wm = *watermark.borrow_and_update();
            forward(&reported, wm, vouched);
            let behind = wm.lsn > vouched;
            tokio::select! {
                biased;
                _ = sink_done.cancelled() => break,
                Ok(()) = watermark.changed() => {}
                _ = closed.tick(), if !behind => {
                    if sql.is_closed() {
                        stop.cancel();
                        return Err(SourceError::Timeout(
                            "postgres.url's SQL connection closed (the server shutting down or \
                             restarting, or the backend ended); the session ends so that the \
                             server can stop, and the next one reconnects"
                                .into(),
                        ));
                    }
                }
                _ = tick.tick(), if behind => {
                    // Busy only while the side task samples it.
                    if let Ok(l) = longest.try_lock() {
                        coverage.widen(l.longest_secs);
                    }
                    let read = tokio::time::timeout(SQL_DEADLINE, coverage.verify(&sql, pg)).await;
                    let failed = match read {
                        Ok(Ok(at)) => {
                            vouched = vouched.max(at);
                            unread_since = None;
                            since.send_if_modified(|s| {
                                let newer = s != coverage.last_good();
                                if newer {
                                    coverage.last_good().clone_into(s);
                                }
                                newer
                            });
                            continue;
                        }
                        Ok(Err(Uncertain::Changed(change))) => {
                            record_since(&sql, &cfg, &coverage, &stop, &row_writes).await;
                            return Err(change.error(coverage.last_good()));
                        }
                        Ok(Err(Uncertain::Unread(e))) => e.to_string(),
                        Err(_) => format!("no answer within {SQL_DEADLINE:?}"),
                    };
                    let since = *unread_since.get_or_insert_with(Instant::now);
                    if since.elapsed() >= UNREAD_LIMIT || sql.is_closed() {
                        stop.cancel();
                        return Err(SourceError::Timeout(format!(
                            "reading the outbox tables' publication (the confirmed position waits on \
                             it; postgres.url's SQL connection): {failed}"
                        )));
                    }
                    debug!(error = %failed, "coverage reading failed; the confirmed position waits");
                }
            }
        }
        // The session ends: vouch once more, so that all the sink confirmed
        // is reported.
        let wm = *watermark.borrow();
        if wm.lsn > vouched {
            match tokio::time::timeout(FINAL_DEADLINE, coverage.verify(&sql, pg)).await {
                Ok(Ok(at)) => vouched = vouched.max(at),
                Ok(Err(Uncertain::Changed(change))) => {
                    record_since(&sql, &cfg, &coverage, &stop, &row_writes).await;
                    return Err(change.error(coverage.last_good()));
                }
                _ => debug!(
                    "the last coverage reading failed; the position after it will be replayed"
                ),
            }
        }
        forward(&reported, wm, vouched);
        Ok(())
    }
}

/// After a change: ends the session, and the time the stop names
/// (`republish --since`) goes to the checkpoint row, where `republish`
/// finds it covers the change and lets the next start through (see
/// `source::coverage`). Not recorded, the next start names the row's time.
///
/// The side task's checkpoint writes hold `row_writes` too and look at
/// `stop` under it, so none lands after this one: a write it began with
/// an older reading's time would otherwise replace the time the stop
/// names, and that time can be the later one (a long transaction seen
/// since moves it earlier), so that the next start would name a time
/// after rows the change let through.
async fn record_since(
    sql: &tokio_postgres::Client,
    cfg: &Config,
    coverage: &Coverage,
    stop: &CancellationToken,
    row_writes: &tokio::sync::Mutex<()>,
) {
    stop.cancel();
    let _row = row_writes.lock().await;
    match tokio::time::timeout(SQL_DEADLINE, coverage.record_since(sql, cfg)).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => warn!(error = %e, "cannot record the time the stop names"),
        Err(_) => warn!("cannot record the time the stop names: no answer"),
    }
}

/// `wm` when vouched for, else the vouched position with the commit time
/// last reported (the checkpoint row records a commit time no later than
/// its position).
fn forward(reported: &watch::Sender<Progress>, wm: Progress, vouched: Lsn) {
    reported.send_if_modified(|p| {
        let next = if wm.lsn <= vouched {
            wm
        } else {
            Progress {
                lsn: vouched,
                commit_time_us: p.commit_time_us,
            }
        };
        let moved = next.lsn > p.lsn || (next.lsn == p.lsn && next != *p);
        if moved {
            *p = next;
        }
        moved
    });
}
