//! The position a session reports (to the server, in the checkpoint row,
//! to the next session): the sink's watermark, held back to what the
//! outbox tables' coverage vouches for (`source::coverage`).

use super::*;
use crate::source::coverage::{Coverage, Uncertain};

/// How often the coverage is read while the watermark waits on it. Each
/// reading vouches for all WAL written before it, so a busy stream waits
/// at most this long (plus a round trip) for its position to be reported.
const COVERAGE_EVERY: Duration = Duration::from_millis(50);
/// The last reading, when the session ends.
const FINAL_DEADLINE: Duration = Duration::from_secs(2);

/// Forwards `watermark` into `reported`, never past the WAL position the
/// last reading of the coverage vouched for. A change in the coverage ends
/// the session (`stop`) with the error that explains it.
pub(super) async fn gate(
    cfg: Config,
    sql: Arc<tokio_postgres::Client>,
    mut coverage: Coverage,
    (mut watermark, reported): (watch::Receiver<Progress>, watch::Sender<Progress>),
    stop: CancellationToken,
) -> Result<(), SourceError> {
    let pg = &cfg.postgres;
    let mut vouched = reported.borrow().lsn;
    let mut tick = tokio::time::interval(COVERAGE_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut unread_warned = false;
    loop {
        let wm = *watermark.borrow_and_update();
        forward(&reported, wm, vouched);
        let behind = wm.lsn > vouched;
        tokio::select! {
            biased;
            _ = stop.cancelled() => break,
            Ok(()) = watermark.changed() => {}
            _ = tick.tick(), if behind => {
                let read = tokio::time::timeout(SQL_DEADLINE, coverage.verify(&sql, pg)).await;
                match read {
                    Ok(Ok(at)) => {
                        vouched = vouched.max(at);
                        unread_warned = false;
                    }
                    Ok(Err(Uncertain::Changed(e))) => {
                        stop.cancel();
                        return Err(e);
                    }
                    Ok(Err(Uncertain::Unread(e))) if !unread_warned => {
                        warn!(error = %e, "cannot read the outbox tables' publication; the confirmed position waits");
                        unread_warned = true;
                    }
                    Ok(Err(Uncertain::Unread(e))) => debug!(error = %e, "coverage reading failed"),
                    Err(_) => debug!("coverage reading got no answer in time"),
                }
            }
        }
    }
    // The session ends: vouch once more, so that all the sink confirmed
    // is reported.
    let wm = *watermark.borrow();
    if wm.lsn > vouched {
        match tokio::time::timeout(FINAL_DEADLINE, coverage.verify(&sql, pg)).await {
            Ok(Ok(at)) => vouched = vouched.max(at),
            Ok(Err(Uncertain::Changed(e))) => return Err(e),
            _ => debug!("the last coverage reading failed; the position after it will be replayed"),
        }
    }
    forward(&reported, wm, vouched);
    Ok(())
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
