//! Wires the stages of one replication session, and restarts sessions after
//! transient failures.
//!
//! A session is: SQL connection (slot checks), AMQP connection, replication
//! stream from the slot's confirmed position, then two loops joined by a
//! bounded channel:
//!
//! - the **source loop** reads the replication stream, decodes pgoutput and
//!   forwards BEGIN / event / COMMIT / keepalive items in WAL order, and
//!   forwards the sink's watermark to the replication client;
//! - the **sink loop** publishes events within the confirm window, counts
//!   confirms per transaction in the [`Checkpoint`], and publishes the
//!   watermark.
//!
//! Any failure ends the session. Whatever was not confirmed was not reported,
//! so the next session replays it from the slot: recovery needs no state of
//! its own beyond the slot.

use std::time::Duration;

use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use lapin::PublisherConfirm;
use lapin::types::ShortString;
use pgwire_replication::{ReplicationClient, ReplicationEvent};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use crate::checkpoint::{Checkpoint, CheckpointError, Seq};
use crate::config::Config;
use crate::lsn::Lsn;
use crate::message::{RenderError, render};
use crate::outbox::{Decoded, OutboxDecoder, OutboxEvent, PG_EPOCH_OFFSET_US};
use crate::sink::{AmqpSink, SinkError, check_confirmation};
use crate::source::{SourceError, connect_sql, slot::usable_slot, start_replication};

/// Why the relay stopped, or why a session ended.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    /// PostgreSQL side.
    #[error(transparent)]
    Source(#[from] SourceError),
    /// Broker side.
    #[error(transparent)]
    Sink(#[from] SinkError),
    /// A row that cannot become a message.
    #[error("undeliverable event: {0}")]
    Render(#[from] RenderError),
    /// The stream broke BEGIN/COMMIT order.
    #[error("replication stream out of order: {0}")]
    Order(#[from] CheckpointError),
}

impl RelayError {
    /// The one place that decides: retry with backoff, or stop and tell the
    /// operator.
    pub fn is_transient(&self) -> bool {
        match self {
            RelayError::Source(e) => e.is_transient(),
            RelayError::Sink(e) => e.is_transient(),
            RelayError::Render(_) => false,
            // A broken stream is re-read from the slot by a new session.
            RelayError::Order(_) => true,
        }
    }
}

/// One item from source to sink, in WAL order.
#[derive(Debug)]
enum Item {
    Begin { commit_time_us: i64 },
    Event(OutboxEvent),
    Commit { end_lsn: Lsn },
    Keepalive { wal_end: Lsn },
}

/// Items buffered between the loops; with the confirm window and the
/// replication client's buffer this bounds memory, whatever the size of a
/// transaction.
const CHANNEL_CAPACITY: usize = 512;
/// Events buffered inside the replication client.
const REPLICATION_BUFFER: usize = 1024;
/// How long shutdown waits for outstanding confirms.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);
/// Backoff between sessions: from `BACKOFF_BASE`, doubling, capped.
const BACKOFF_BASE: Duration = Duration::from_millis(250);
const BACKOFF_CAP: Duration = Duration::from_secs(30);
/// Poll interval while another process holds the slot.
const SLOT_BUSY_RETRY: Duration = Duration::from_secs(2);
/// How often "waiting for the slot" is logged.
const SLOT_BUSY_LOG_EVERY: Duration = Duration::from_secs(60);

/// Runs sessions until `shutdown` is cancelled (returns the final confirmed
/// LSN) or a fatal error.
pub async fn run(cfg: &Config, shutdown: CancellationToken) -> Result<Lsn, RelayError> {
    let mut attempt: u32 = 0;
    let mut busy_logged: Option<Instant> = None;
    loop {
        let mut progressed = false;
        match session(cfg, &shutdown, &mut progressed).await {
            Ok(lsn) => return Ok(lsn),
            Err(e) if e.is_transient() && !shutdown.is_cancelled() => {
                if progressed {
                    attempt = 0;
                }
                let delay = if matches!(e, RelayError::Source(SourceError::SlotBusy { .. })) {
                    // Another relay holds the slot: poll often so a standby
                    // takes over soon after it dies, but log rarely.
                    if busy_logged.is_none_or(|t| t.elapsed() >= SLOT_BUSY_LOG_EVERY) {
                        warn!(reason = %e, "standing by: waiting for the slot");
                        busy_logged = Some(Instant::now());
                    }
                    SLOT_BUSY_RETRY.mul_f64(rand::random_range(0.5..1.0))
                } else {
                    let delay = backoff(attempt);
                    attempt = attempt.saturating_add(1);
                    warn!(reason = %e, retry_in_ms = delay.as_millis() as u64, attempt, "reconnecting");
                    delay
                };
                tokio::select! {
                    _ = shutdown.cancelled() => return Err(e),
                    _ = tokio::time::sleep(delay) => {}
                }
            }
            Err(e) => return Err(e),
        }
    }
}

/// Capped exponential backoff with jitter (half fixed, half random), so a
/// fleet of relays does not reconnect in lockstep.
fn backoff(attempt: u32) -> Duration {
    let exp = BACKOFF_BASE.saturating_mul(1u32 << attempt.min(16));
    let ceiling = exp.min(BACKOFF_CAP);
    let half = ceiling / 2;
    half + half.mul_f64(rand::random_range(0.0..1.0))
}

async fn session(
    cfg: &Config,
    shutdown: &CancellationToken,
    progressed: &mut bool,
) -> Result<Lsn, RelayError> {
    let sql = connect_sql(&cfg.postgres).await?;
    let start = usable_slot(&sql, cfg).await?;
    drop(sql);
    let sink = AmqpSink::connect(&cfg.rabbitmq).await?;
    info!("connected to RabbitMQ");
    let mut repl = start_replication(&cfg.postgres, start, REPLICATION_BUFFER).await?;
    info!(slot = %cfg.postgres.slot, lsn = %start, "streaming from LSN");

    let stop = shutdown.child_token();
    let (items_tx, items_rx) = mpsc::channel(CHANNEL_CAPACITY);
    let (wm_tx, mut wm_rx) = watch::channel(start);
    let mut decoder = OutboxDecoder::new(&cfg.outbox, &cfg.rabbitmq);

    let source = source_loop(&mut repl, &mut decoder, items_tx, &mut wm_rx, &stop);
    let sink_loop = async {
        let r = sink_loop(&sink, items_rx, &wm_tx, cfg, start).await;
        // Whatever ends the sink ends the session: stop reading WAL.
        stop.cancel();
        r
    };
    let (source_res, sink_res) = tokio::join!(source, sink_loop);

    let confirmed = *wm_rx.borrow();
    *progressed = confirmed > start;
    report_final(&mut repl, confirmed, cfg.postgres.status_interval).await;
    sink.close().await;

    sink_res?;
    source_res?;
    info!(lsn = %confirmed, "stopped; final confirmed LSN");
    Ok(confirmed)
}

/// Hands the final watermark to the server before ending the stream: waits
/// (bounded) until a status update carrying it has been sent.
async fn report_final(repl: &mut ReplicationClient, confirmed: Lsn, interval: Duration) {
    repl.update_applied_lsn(confirmed.into());
    let metrics = repl.metrics();
    let deadline = Instant::now() + interval * 2 + Duration::from_secs(1);
    while repl.is_running()
        && Lsn::from(metrics.last_applied_lsn()) < confirmed
        && Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    if Lsn::from(metrics.last_applied_lsn()) < confirmed {
        debug!(lsn = %confirmed, "final position not acknowledged in time; it will be replayed");
    }
    if tokio::time::timeout(Duration::from_secs(5), repl.shutdown())
        .await
        .is_err()
    {
        repl.abort();
    }
}

async fn source_loop(
    repl: &mut ReplicationClient,
    decoder: &mut OutboxDecoder,
    items: mpsc::Sender<Item>,
    watermark: &mut watch::Receiver<Lsn>,
    stop: &CancellationToken,
) -> Result<(), RelayError> {
    loop {
        // Priorities: stop first, then progress back to the server, then WAL.
        let ev = tokio::select! {
            biased;
            _ = stop.cancelled() => return Ok(()),
            Ok(()) = watermark.changed() => {
                repl.update_applied_lsn((*watermark.borrow_and_update()).into());
                continue;
            }
            ev = repl.recv() => ev,
        };
        let item = match ev {
            Ok(Some(ReplicationEvent::Begin {
                commit_time_micros, ..
            })) => {
                decoder.begin(commit_time_micros);
                Item::Begin {
                    commit_time_us: commit_time_micros.saturating_add(PG_EPOCH_OFFSET_US),
                }
            }
            Ok(Some(ReplicationEvent::XLogData { data, .. })) => {
                match decoder.decode(data).map_err(SourceError::from)? {
                    Decoded::Event(ev) => Item::Event(ev),
                    Decoded::Nothing => continue,
                }
            }
            Ok(Some(ReplicationEvent::Commit { end_lsn, .. })) => {
                decoder.commit();
                Item::Commit {
                    end_lsn: end_lsn.into(),
                }
            }
            Ok(Some(ReplicationEvent::KeepAlive { wal_end, .. })) => Item::Keepalive {
                wal_end: wal_end.into(),
            },
            Ok(Some(ReplicationEvent::Message { .. } | ReplicationEvent::StoppedAt { .. })) => {
                continue;
            }
            Ok(None) => return Err(SourceError::Ended.into()),
            Err(source) => {
                return Err(SourceError::Replication {
                    url: String::from("replication connection"),
                    source,
                }
                .into());
            }
        };
        // Wait for room in the channel while still forwarding progress.
        loop {
            tokio::select! {
                biased;
                _ = stop.cancelled() => return Ok(()),
                Ok(()) = watermark.changed() => {
                    repl.update_applied_lsn((*watermark.borrow_and_update()).into());
                }
                permit = items.reserve() => match permit {
                    Ok(p) => { p.send(item); break; }
                    Err(_) => return Ok(()), // the sink ended; its result is the session's
                },
            }
        }
    }
}

async fn wait_confirm(
    seq: Seq,
    id: String,
    exchange: ShortString,
    routing_key: ShortString,
    confirm: PublisherConfirm,
    timeout: Duration,
) -> (Seq, Result<(), SinkError>) {
    let res = match tokio::time::timeout(timeout, confirm).await {
        Err(_) => Err(SinkError::ConfirmTimeout {
            id,
            secs: timeout.as_secs(),
        }),
        Ok(Err(source)) => Err(SinkError::Amqp {
            what: "waiting for a publisher confirm",
            url: String::from("broker connection"),
            source,
        }),
        Ok(Ok(c)) => check_confirmation(&id, exchange.as_str(), routing_key.as_str(), c),
    };
    (seq, res)
}

async fn sink_loop(
    sink: &AmqpSink,
    mut items: mpsc::Receiver<Item>,
    watermark: &watch::Sender<Lsn>,
    cfg: &Config,
    start: Lsn,
) -> Result<(), RelayError> {
    let mut cp = Checkpoint::new(start);
    let mut confirms = FuturesUnordered::new();
    let window = cfg.rabbitmq.window as u64;
    let confirm_timeout = cfg.rabbitmq.confirm_timeout;
    let mut open = true;
    let mut drain_deadline: Option<Instant> = None;
    let mut blocked_logged = false;
    let advance = |lsn: Option<Lsn>| {
        if let Some(lsn) = lsn {
            watermark.send_replace(lsn);
        }
    };
    loop {
        if !open && cp.in_flight() == 0 {
            return Ok(());
        }
        let blocked = sink.is_blocked();
        if blocked != blocked_logged {
            if blocked {
                warn!("broker blocked publishing (resource alarm); pausing");
            } else {
                info!("broker unblocked publishing; resuming");
            }
            blocked_logged = blocked;
        }
        tokio::select! {
            biased;
            Some((seq, res)) = confirms.next(), if !confirms.is_empty() => {
                res?;
                advance(cp.confirm(seq)?);
            }
            item = items.recv(), if open && !blocked && cp.in_flight() < window => match item {
                None => {
                    open = false;
                    drain_deadline = Some(Instant::now() + SHUTDOWN_GRACE);
                    if cp.in_flight() > 0 {
                        info!(in_flight = cp.in_flight(), "waiting for outstanding confirms");
                    }
                }
                Some(Item::Begin { commit_time_us }) => cp.begin(commit_time_us)?,
                Some(Item::Event(ev)) => {
                    let env = render(&ev).inspect_err(|e| error!(error = %e, "undeliverable event"))?;
                    let confirm = sink.publish(&env).await?;
                    let seq = cp.publish()?;
                    confirms.push(wait_confirm(
                        seq,
                        env.id,
                        env.exchange,
                        env.routing_key,
                        confirm,
                        confirm_timeout,
                    ));
                }
                Some(Item::Commit { end_lsn }) => advance(cp.commit(end_lsn)?),
                Some(Item::Keepalive { wal_end }) => advance(cp.keepalive(wal_end)),
            },
            _ = tokio::time::sleep_until(drain_deadline.unwrap_or_else(Instant::now)), if drain_deadline.is_some() => {
                warn!(in_flight = cp.in_flight(), "grace period over with unconfirmed messages; they will be replayed on restart");
                return Ok(());
            }
            _ = tokio::time::sleep(Duration::from_millis(50)), if blocked => {}
        }
    }
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
