//! The relay: one [`supervisor`] deciding between finishing or making a
//! recovery, streaming, standing by and stopping; and the [`session`]s it
//! runs, one after another.
//!
//! A session is: SQL connection (slot checks), AMQP connection, replication
//! stream from the slot's confirmed position, then the pipeline's two
//! halves joined by a bounded hand-off ([`crate::handoff`]):
//!
//! - the **source half** ([`crate::source::stream`]) reads the replication
//!   stream, decodes pgoutput and hands BEGIN / event / COMMIT / keepalive
//!   items over in WAL order, and reports the confirmed position back to
//!   the server;
//! - the **sink half** ([`crate::sink::publisher`]) publishes events within
//!   the confirm window, counts confirms per transaction in the
//!   [`Checkpoint`](crate::checkpoint::Checkpoint), and moves the watermark;
//!
//! and beside them, on the SQL connection: the coverage gate (the position
//! reported never passes what the outbox tables' publication vouches for),
//! the checkpoint row, heartbeats, the liveness probe.
//!
//! Any failure ends the session. Whatever was not confirmed was not reported,
//! so the next session replays it from the slot: recovery needs no state of
//! its own beyond the slot.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::lsn::Lsn;
use crate::metrics::Metrics;
use crate::source::{SQL_DEADLINE, SourceError};

pub use crate::error::RelayError;

mod gate;
mod session;
mod side;
mod supervisor;

/// Items buffered between the loops; with their byte budget
/// ([`crate::handoff::ByteBudget`]), the confirm window (count and bytes) and the
/// replication client's buffer this bounds memory, whatever the size of a
/// transaction or of a row.
const CHANNEL_CAPACITY: usize = 512;
/// Events buffered inside the replication client. It counts events, not
/// bytes: with 1 MiB rows this is 64 MiB.
const REPLICATION_BUFFER: usize = 64;
/// Backoff between sessions: from `BACKOFF_BASE`, doubling, capped.
const BACKOFF_BASE: Duration = Duration::from_millis(250);
const BACKOFF_CAP: Duration = Duration::from_secs(30);
/// Poll interval while another process holds the slot.
const SLOT_BUSY_RETRY: Duration = Duration::from_secs(2);
/// How often "waiting for the slot" is logged.
const SLOT_BUSY_LOG_EVERY: Duration = Duration::from_secs(60);
/// The checkpoint table is written at most this often.
const CHECKPOINT_EVERY: Duration = Duration::from_millis(200);
/// Retained WAL is polled this often for the metric.
const RETAINED_WAL_EVERY: Duration = Duration::from_secs(5);

/// Runs the relay until `shutdown` is cancelled (returns the final
/// confirmed LSN, `None` when it came while connecting, between sessions,
/// standing by or recovering, with nothing in flight) or a fatal error.
pub async fn run(
    cfg: &Config,
    shutdown: CancellationToken,
    metrics: &Metrics,
) -> Result<Option<Lsn>, RelayError> {
    supervisor::Supervisor::new(cfg, metrics, shutdown)
        .run()
        .await
}

/// Capped exponential backoff with jitter (half fixed, half random), so a
/// fleet of relays does not reconnect in lockstep.
pub fn backoff(attempt: u32) -> Duration {
    let exp = BACKOFF_BASE.saturating_mul(1u32 << attempt.min(16));
    let ceiling = exp.min(BACKOFF_CAP);
    let half = ceiling / 2;
    half + half.mul_f64(rand::random_range(0.0..1.0))
}

/// [`crate::source::bounded`], as the relay's error.
async fn bounded<T>(
    what: &str,
    fut: impl std::future::Future<Output = Result<T, SourceError>>,
) -> Result<T, RelayError> {
    Ok(crate::source::bounded(what, fut).await?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_is_capped_and_jittered() {
        for attempt in 0..40 {
            let d = backoff(attempt);
            let ceiling = BACKOFF_BASE
                .saturating_mul(1u32 << attempt.min(16))
                .min(BACKOFF_CAP);
            assert!(d >= ceiling / 2 && d <= ceiling, "{attempt}: {d:?}");
        }
        assert!(backoff(30) <= BACKOFF_CAP);
        let samples: std::collections::HashSet<_> = (0..20).map(|_| backoff(5)).collect();
        assert!(samples.len() > 1, "no jitter");
    }
}
