//! Noticing a dead replication connection: a walsender that stopped, a
//! failover, a network path that drops packets without a reset. The socket
//! stays open and says nothing, so the session must decide from silence.
//!
//! A quiet database may legitimately send nothing for a long time (the
//! relay reports its position as it moves, so the walsender need not ask
//! for one), and so may a busy walsender reading WAL that has nothing for
//! the relay. So the stream asks for a reply when quiet ([`ask_every`]),
//! the side of the session that holds the SQL connection
//! watches the walsender's `sent_lsn` (moving: alive), and silence is
//! answered with a probe: a non-transactional `pg_logical_emit_message`,
//! which a live walsender decodes and sends at once. Silence for half of
//! the limit sends the probe; silence for the whole limit, with `sent_lsn`
//! standing still, ends the session (transient: the next session
//! reconnects, and replays from the slot).
//!
//! The limit is the server's `wal_sender_timeout`, the time after which the
//! server itself gives up on a silent client (between 2 s and 10 min; 60 s
//! when the server disables its own timeout).

use std::time::Duration;

use tokio::time::Instant;
use tokio_postgres::Client;

use super::{SourceError, sql_err};
use crate::config::PostgresConfig;

/// The limit when the server disables `wal_sender_timeout` (0).
const DEFAULT_LIMIT: Duration = Duration::from_secs(60);
/// Bounds on the limit: a probe needs a moment to travel; an hour of
/// silence is not "noticed".
const MIN_LIMIT: Duration = Duration::from_secs(2);
const MAX_LIMIT: Duration = Duration::from_secs(600);

/// The probe: a non-transactional logical message (the relay ignores
/// messages), sent on by the walsender as soon as its WAL is flushed. A
/// non-transactional message does not flush WAL by itself, so the same
/// statement takes a transaction id: its commit flushes the probe with it
/// (pgoutput skips the empty transaction).
pub const PROBE_SQL: &str =
    "SELECT pg_logical_emit_message(false, 'outbox-relay-probe', ''), txid_current()";

/// How far the slot's walsender has read WAL (`pg_stat_replication.
/// sent_lsn`). It moves while the walsender works through WAL that produces
/// no output for the relay (other tables' transactions, catching up after a
/// downtime), during which the stream itself can be silent for longer than
/// the limit: a moving `sent_lsn` counts as hearing from the stream.
pub const SENT_LSN_SQL: &str = "SELECT r.sent_lsn::text FROM pg_replication_slots s \
     JOIN pg_stat_replication r ON r.pid = s.active_pid WHERE s.slot_name = $1";

/// How often `sent_lsn` is read: a quarter of the limit, within 1 to 5 s.
pub fn progress_every(limit: Duration) -> Duration {
    (limit / 4).clamp(Duration::from_secs(1), Duration::from_secs(5))
}

/// How long the replication stream may be quiet before the relay asks the
/// walsender for a reply (a standby status update with `reply_requested`):
/// a quarter of the limit, within 0.5 to 10 s. A walsender replaying a
/// large transaction that has nothing for the relay (another table's bulk
/// `UPDATE`, a `COPY`) reads the relay's updates only every half
/// `wal_sender_timeout`, and then pings only if none asked for a reply was
/// waiting; `sent_lsn` stands still meanwhile. So the relay asks: the
/// answer comes at the walsender's next read, at most three quarters of
/// the limit after the stream went quiet.
pub fn ask_every(limit: Duration) -> Duration {
    (limit / 4).clamp(Duration::from_millis(500), Duration::from_secs(10))
}

/// What to do when [`Silence::deadline`] passes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Silent {
    /// Send the probe.
    Probe,
    /// Give up on the stream.
    Stalled(Duration),
}

/// Time since the replication stream last said anything.
#[derive(Debug)]
pub struct Silence {
    limit: Duration,
    last_heard: Instant,
    probed: bool,
}

impl Silence {
    /// Starts counting now.
    pub fn new(limit: Duration) -> Silence {
        Silence {
            limit,
            last_heard: Instant::now(),
            probed: false,
        }
    }

    /// The stream said something (or the relay was busy elsewhere and not
    /// listening): start counting again.
    pub fn heard(&mut self) {
        self.last_heard = Instant::now();
        self.probed = false;
    }

    /// When to act next.
    pub fn deadline(&self) -> Instant {
        if self.probed {
            self.last_heard + self.limit
        } else {
            self.last_heard + self.limit / 2
        }
    }

    /// The deadline passed: probe first, then give up.
    pub fn expired(&mut self) -> Silent {
        if self.probed {
            Silent::Stalled(self.last_heard.elapsed())
        } else {
            self.probed = true;
            Silent::Probe
        }
    }
}

/// The silence limit for this server: its `wal_sender_timeout` (as the
/// relay's role sees it), bounded.
pub async fn limit(client: &Client, cfg: &PostgresConfig) -> Result<Duration, SourceError> {
    let ms: i32 = client
        .query_one(
            "SELECT setting::int FROM pg_settings WHERE name = 'wal_sender_timeout'",
            &[],
        )
        .await
        .map_err(sql_err(cfg, "reading wal_sender_timeout"))?
        .get(0);
    Ok(limit_from_ms(ms))
}

fn limit_from_ms(ms: i32) -> Duration {
    if ms <= 0 {
        return DEFAULT_LIMIT;
    }
    let timeout = Duration::from_millis(ms as u64);
    // A walsender busy replaying reads the relay's request for a reply
    // only every half of its timeout: above the cap, the limit still
    // outlasts that, the request's own wait, and a margin.
    let busy = timeout / 2 + ask_every(MAX_LIMIT) + Duration::from_secs(5);
    timeout.clamp(MIN_LIMIT, MAX_LIMIT).max(busy.min(timeout))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn silence_probes_at_half_the_limit_then_gives_up() {
        let mut s = Silence::new(Duration::from_secs(10));
        let start = Instant::now();
        assert_eq!(s.deadline(), start + Duration::from_secs(5));
        tokio::time::sleep_until(s.deadline()).await;
        assert_eq!(s.expired(), Silent::Probe);
        assert_eq!(s.deadline(), start + Duration::from_secs(10));
        // The probe's answer (anything at all) starts the count again.
        tokio::time::sleep(Duration::from_secs(2)).await;
        s.heard();
        assert_eq!(s.deadline(), start + Duration::from_secs(12));
        tokio::time::sleep_until(s.deadline()).await;
        assert_eq!(s.expired(), Silent::Probe);
        tokio::time::sleep_until(s.deadline()).await;
        assert_eq!(s.expired(), Silent::Stalled(Duration::from_secs(10)));
    }

    #[test]
    fn the_limit_follows_wal_sender_timeout_within_bounds() {
        assert_eq!(limit_from_ms(60_000), Duration::from_secs(60));
        assert_eq!(limit_from_ms(4_000), Duration::from_secs(4));
        assert_eq!(limit_from_ms(0), DEFAULT_LIMIT);
        assert_eq!(limit_from_ms(100), MIN_LIMIT);
        // Above the cap, still longer than a busy walsender's half timeout.
        assert_eq!(limit_from_ms(1_800_000), Duration::from_secs(915));
        assert_eq!(limit_from_ms(1_000_000), MAX_LIMIT);
    }
}
