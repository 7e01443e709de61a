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
//!   confirms per transaction in the
//!   [`Checkpoint`](crate::checkpoint::Checkpoint), and publishes the
//!   watermark.
//!
//! Any failure ends the session. Whatever was not confirmed was not reported,
//! so the next session replays it from the slot: recovery needs no state of
//! its own beyond the slot.

use std::sync::Arc;
use std::time::Duration;

use pgwire_replication::{ReplicationClient, ReplicationEvent};
use tokio::sync::{Notify, mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::checkpoint::Progress;
use crate::config::Config;
use crate::lsn::Lsn;
use crate::metrics::{Metrics, TargetLabel};
use crate::outbox::{Decoded, OutboxDecoder, OutboxOids, PG_EPOCH_OFFSET_US};
use crate::sink::budget::ByteBudget;
use crate::sink::nodes::Nodes;
use crate::sink::publisher::{self, SinkItem};
use crate::sink::refusals::{Refusals, learn};
use crate::sink::{AmqpSink, SinkError};
use crate::source::checkpoint_table;
use crate::source::coverage::{self, Coverage, Seen};
use crate::source::longest_tx::LongestTx;
use crate::source::resume;
use crate::source::silence::{self, Silence, Silent};
use crate::source::{SourceError, connect_sql, slot, slot::usable_slot, start_replication};

pub use crate::error::RelayError;

mod gate;
mod side;
use gate::gate;
use side::{Beside, liveness, side_tasks};

/// Items buffered between the loops; with their byte budget
/// ([`ByteBudget`]), the confirm window (count and bytes) and the
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
/// Deadline of each SQL call beside the stream.
const SQL_DEADLINE: Duration = Duration::from_secs(10);
/// Retained WAL is polled this often for the metric.
const RETAINED_WAL_EVERY: Duration = Duration::from_secs(5);

/// Runs sessions until `shutdown` is cancelled (returns the final confirmed
/// LSN, `None` when it came while connecting, between sessions or standing
/// by, with nothing in flight) or a fatal error.
pub async fn run(
    cfg: &Config,
    shutdown: CancellationToken,
    metrics: &Metrics,
) -> Result<Option<Lsn>, RelayError> {
    let mut attempt: u32 = 0;
    let mut busy_logged: Option<Instant> = None;
    // The outbox as this process has known it: a RENAME followed by its
    // relation id stays followed across reconnects.
    let mut known: Known = (vec![None; cfg.outboxes.len()], None);
    // What the broker refused in earlier sessions (see sink::replies).
    let mut refusals = Refusals::default();
    // Sessions ended by each refusal (an exchange name, a body limit, an
    // event blamed): the same one coming back must not loop sessions.
    let mut strikes: std::collections::HashMap<String, u32> = Default::default();
    // Outlives sessions: an open transaction is timed from when it was
    // first seen, whatever reconnects happen meanwhile.
    let longest = Arc::new(tokio::sync::Mutex::new(LongestTx::default()));
    // The last position confirmed, and on which server: the next session
    // starts there if the slot lags behind it (see source::resume).
    let mut last: Option<resume::Confirmed> = None;
    // The broker nodes, tried from after the one whose session failed.
    let mut nodes = Nodes::new(&cfg.rabbitmq);
    loop {
        let mut progressed = false;
        let r = session(
            cfg,
            &shutdown,
            metrics,
            &mut progressed,
            (&mut known, &mut refusals, &longest, &mut last),
            &mut nodes,
        )
        .await;
        let head = refusals.head.lock().expect("not poisoned").take();
        if progressed {
            refusals.careful_for = 0;
        }
        let r = match r {
            Err(RelayError::Sink(e)) => match learn(cfg, &e, head, &mut refusals, &mut strikes) {
                Some(stop) => Err(stop.into()),
                None => Err(RelayError::Sink(e)),
            },
            other => other,
        };
        match r {
            Ok(lsn) => return Ok(lsn),
            // A failure the stop itself caused (a connection cut short).
            Err(e) if e.is_transient() && shutdown.is_cancelled() => {
                info!(last_error = %e, "stopped while connecting");
                return Ok(None);
            }
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
                    metrics
                        .reconnects
                        .get_or_create(&TargetLabel { target: e.target() })
                        .inc();
                    let delay = backoff(attempt);
                    attempt = attempt.saturating_add(1);
                    warn!(reason = %e, retry_in_ms = delay.as_millis() as u64, attempt, "reconnecting");
                    delay
                };
                // A stop asked for while waiting is a clean stop: nothing
                // is in flight, and the slot keeps the position.
                tokio::select! {
                    _ = shutdown.cancelled() => {
                        info!(last_error = %e, "stopped while waiting to reconnect");
                        return Ok(None);
                    }
                    _ = tokio::time::sleep(delay) => {}
                }
            }
            Err(e) => return Err(e),
        }
    }
}

/// Capped exponential backoff with jitter (half fixed, half random), so a
/// fleet of relays does not reconnect in lockstep.
pub fn backoff(attempt: u32) -> Duration {
    let exp = BACKOFF_BASE.saturating_mul(1u32 << attempt.min(16));
    let ceiling = exp.min(BACKOFF_CAP);
    let half = ceiling / 2;
    half + half.mul_f64(rand::random_range(0.0..1.0))
}

/// Each outbox's relation ids as this process has known them, and the
/// publication's hold on them that the last session started from.
type Known = (Vec<Option<OutboxOids>>, Option<Seen>);

async fn session(
    cfg: &Config,
    shutdown: &CancellationToken,
    metrics: &Metrics,
    progressed: &mut bool,
    (known, refusals, longest, last): (
        &mut Known,
        &mut Refusals,
        &Arc<tokio::sync::Mutex<LongestTx>>,
        &mut Option<resume::Confirmed>,
    ),
    nodes: &mut Nodes,
) -> Result<Option<Lsn>, RelayError> {
    // Connecting can take a while (each step has its deadline): a stop asked
    // for meanwhile ends it at once, with nothing in flight.
    let connect = async {
        let sql = Arc::new(connect_sql(&cfg.postgres).await?);
        // First: a standby (reached through an address that moved, while a
        // failover is under way) fails here, and is retried; its missing
        // slot is not taken for a lost one.
        let server = bounded(
            "identifying the server",
            resume::server(&sql, &cfg.postgres),
        )
        .await?;
        let slot_lsn = bounded("reading the slot", usable_slot(&sql, cfg)).await?;
        // A recovery under way (another relay re-publishing after a
        // failover): its rows first, then the stream.
        let pending = checkpoint_table::pending_recovery(&sql, cfg);
        if bounded("reading the checkpoint", pending).await?.is_some() {
            return Err(SourceError::RecoveryPending(cfg.postgres.slot.clone()).into());
        }
        // A checkpoint that cannot be read only costs replays.
        let checkpoint =
            match bounded("reading the checkpoint", checkpoint_table::read(&sql, cfg)).await {
                Ok(c) => c,
                Err(e) => {
                    debug!(error = %e, "cannot read the checkpoint");
                    None
                }
            };
        // What the outbox tables' coverage was when the last session (of
        // any process) started: a change since, while no relay streamed,
        // is found below.
        let recorded = bounded(
            "reading the recorded coverage",
            coverage::recorded(&sql, cfg),
        )
        .await?;
        // Rows of a table changed later may date from as long before as
        // the longest transaction seen (see coverage::read_position).
        let longest_secs = (checkpoint.as_ref())
            .and_then(|c| c.longest_tx_secs)
            .unwrap_or(0.0)
            .max(longest.lock().await.longest_secs);
        let widen_secs = longest_secs + coverage::WIDEN_MARGIN_SECS;
        let checkpoint = checkpoint.and_then(|c| {
            let lsn = c.confirmed_lsn.parse::<Lsn>().ok()?;
            Some((c.system_identifier, lsn))
        });
        let (start, origin) = resume::choose(
            slot_lsn,
            &server,
            checkpoint.as_ref().map(|(id, lsn)| (id.as_deref(), *lsn)),
            last.as_ref(),
        );
        // A position from another server or timeline, or past this end of
        // WAL (a disk rolled back), never applies again: forget it, so that
        // WAL written later cannot make it look plausible.
        if last
            .as_ref()
            .is_some_and(|c| !resume::still_applies(c, &server))
        {
            warn!(
                "forgetting the last session's position: the server is not the one it was confirmed on"
            );
            *last = None;
        }
        if origin != resume::Origin::Slot {
            info!(slot_lsn = %slot_lsn, lsn = %start, from = origin.as_str(), "resuming past the slot's confirmed position");
        }
        let mut oids = Vec::with_capacity(cfg.outboxes.len());
        for (outbox, known) in cfg.outboxes.iter().zip(known.0.iter()) {
            let found = slot::outbox_oids(&sql, cfg, outbox, known.as_ref());
            oids.push(bounded("looking up the outbox table", found).await?);
        }
        slot::check_overlap(cfg, &oids)?;
        // Before the publication's check: a table re-created since, and
        // added back by `setup`, needs `republish`, which this names.
        let previous = recorded.as_ref().or(known.1.as_ref());
        let baseline = Coverage::baseline(&sql, cfg, &oids, widen_secs, previous);
        let coverage = match bounded("reading the publication", baseline).await {
            Ok(c) => c,
            // A change: what the publication lacks now is said too (a row
            // filter, a table not added back), after the `republish` the
            // change needs.
            Err(RelayError::Source(change @ SourceError::Setup(_))) => {
                let publication = slot::require_publication(&sql, cfg, &oids);
                return Err(
                    match bounded("reading the publication", publication).await {
                        Err(RelayError::Source(SourceError::Setup(lacks))) => {
                            SourceError::Setup(format!("{change}; besides: {lacks}"))
                        }
                        _ => change,
                    }
                    .into(),
                );
            }
            Err(e) => return Err(e),
        };
        // Recorded before the publication is checked: a table the
        // publication does not hold yet is recorded so, and once `setup`
        // adds it, the next start names the `republish` its rows need.
        bounded(
            "recording the outbox tables' coverage",
            coverage.record(&sql, cfg, recorded.as_ref(), (start, &server.system_id)),
        )
        .await?;
        bounded(
            "reading the publication",
            slot::require_publication(&sql, cfg, &oids),
        )
        .await?;
        known.0.clone_from(&oids);
        known.1 = Some(coverage.seen());
        let silence_limit = bounded(
            "reading wal_sender_timeout",
            silence::limit(&sql, &cfg.postgres),
        )
        .await?;
        let name = format!("outbox-relay (slot {})", cfg.postgres.slot);
        let mut sink = AmqpSink::connect(&cfg.rabbitmq, &name, nodes).await?;
        nodes.reached(sink.node());
        // An exchange declared since it was found missing is used again.
        let refused = refusals.missing.get_mut().expect("not poisoned");
        for exchange in refused.names() {
            match sink.check_exchange(&exchange).await {
                Ok(()) => {
                    info!(exchange = %crate::logtext::Shown(&exchange), "the exchange exists now");
                    refused.remove(&exchange);
                }
                Err(SinkError::NoExchange(_)) => {}
                Err(e) => return Err(e.into()),
            }
        }
        // Last, so that a broker that is down costs no walsender. (Its
        // connect has a deadline; an AMQP heartbeat interval above a few
        // seconds outlasts it.)
        let repl = start_replication(
            &cfg.postgres,
            start,
            Some(&server),
            (REPLICATION_BUFFER, silence_limit),
        )
        .await?;
        Ok::<_, RelayError>((
            sql,
            start,
            server,
            (oids, coverage),
            silence_limit,
            sink,
            repl,
        ))
    };
    let (sql, start, server, (oids, coverage), silence_limit, mut sink, mut repl) = tokio::select! {
        biased;
        _ = shutdown.cancelled() => {
            info!("stopped while connecting");
            return Ok(None);
        }
        r = connect => r?,
    };
    info!(slot = %cfg.postgres.slot, lsn = %start, "streaming from LSN");
    metrics.streaming.set(1);
    metrics.confirmed_lsn.set(start.0);

    let stop = shutdown.child_token();
    let (items_tx, items_rx) = mpsc::channel(CHANNEL_CAPACITY);
    let budget = ByteBudget::default();
    let (wm_tx, wm_rx) = watch::channel(Progress {
        lsn: start,
        commit_time_us: None,
    });
    // What is reported: the watermark, held back to what the outbox
    // tables' coverage vouches for, until the sink has confirmed its last.
    let (reported_tx, mut reported) = watch::channel(*wm_rx.borrow());
    let sink_done = CancellationToken::new();
    let mut decoder = OutboxDecoder::new(&cfg.outboxes, oids);
    let dead_letters = cfg.dead_letters();

    // Side tasks on the SQL connection; they end with the session.
    let (probe, alive) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let watch_liveness = tokio::spawn(liveness(
        cfg.clone(),
        Arc::clone(&sql),
        silence_limit,
        (Arc::clone(&probe), Arc::clone(&alive)),
        stop.clone(),
    ));
    let (since_tx, since_rx) = watch::channel(coverage.last_good().to_owned());
    let gated = tokio::spawn(gate(
        cfg.clone(),
        Arc::clone(&sql),
        (coverage, since_tx),
        Arc::clone(longest),
        (wm_rx, reported_tx),
        (stop.clone(), sink_done.clone()),
    ));
    let side = tokio::spawn(side_tasks(
        cfg.clone(),
        Beside {
            sql,
            longest: Arc::clone(longest),
            system_id: server.system_id.clone(),
            coverage_since: since_rx,
        },
        reported.clone(),
        metrics.clone(),
        stop.clone(),
    ));

    let source = source_loop(
        &mut repl,
        &mut decoder,
        (items_tx, &budget),
        &mut reported,
        (Silence::new(silence_limit), &probe, &alive),
        &stop,
        metrics,
    );
    let sink_loop = async {
        let r = publisher::run(
            &mut sink,
            items_rx,
            &wm_tx,
            (&cfg.rabbitmq, &dead_letters, &*refusals, &budget),
            start,
            metrics,
            &stop,
        )
        .await
        .map_err(RelayError::from);
        // Whatever ends the sink ends the session: stop reading WAL.
        stop.cancel();
        r
    };
    let (source_res, sink_res) = tokio::join!(source, sink_loop);
    metrics.streaming.set(0);
    if sink_res.is_err() && !shutdown.is_cancelled() {
        nodes.failed(sink.node());
    }

    // The gate's last word: the position it vouches for, or why none.
    stop.cancel();
    sink_done.cancel();
    let gate_res = gated.await.unwrap_or_else(|e| {
        Err(SourceError::Timeout(format!(
            "the coverage gate failed ({e}); the position after its last report will be replayed"
        )))
    });
    let confirmed = reported.borrow().lsn;
    *progressed = confirmed > start;
    *last = Some(resume::Confirmed {
        system_id: server.system_id,
        timeline: server.timeline,
        lsn: confirmed,
    });
    report_final(&mut repl, confirmed, cfg.postgres.status_interval).await;
    // A broker that stopped answering would not answer a close either:
    // waiting for it would only delay the next session.
    if matches!(
        &sink_res,
        Err(RelayError::Sink(SinkError::ConfirmTimeout { .. }))
    ) {
        drop(sink);
    } else {
        sink.close().await;
    }
    stop.cancel();
    let _ = side.await;
    let _ = watch_liveness.await;

    let res = gate_res
        .map_err(RelayError::from)
        .and(sink_res)
        .and(source_res);
    match res {
        // A transient failure while shutting down ends the drain early; the
        // position reported is still only what was confirmed.
        Err(e) if shutdown.is_cancelled() && e.is_transient() => {
            warn!(error = %e, "failure while draining; unconfirmed messages will be replayed");
        }
        other => other?,
    }
    info!(lsn = %confirmed, "stopped; final confirmed LSN");
    Ok(Some(confirmed))
}

/// `fut` within [`SQL_DEADLINE`]: a server that accepted the connection and
/// then hangs ends the attempt (transient), not the relay.
async fn bounded<T>(
    what: &str,
    fut: impl std::future::Future<Output = Result<T, SourceError>>,
) -> Result<T, RelayError> {
    match tokio::time::timeout(SQL_DEADLINE, fut).await {
        Ok(r) => Ok(r?),
        Err(_) => Err(SourceError::Timeout(what.to_owned()).into()),
    }
}

/// Hands the final watermark to the server before ending the stream: waits
/// (bounded) until a status update carrying it has been sent.
async fn report_final(repl: &mut ReplicationClient, confirmed: Lsn, interval: Duration) {
    repl.update_applied_lsn(confirmed.into());
    let sent = repl.metrics();
    let deadline = Instant::now() + interval * 2 + Duration::from_secs(1);
    while repl.is_running()
        && Lsn::from(sent.last_applied_lsn()) < confirmed
        && Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    if Lsn::from(sent.last_applied_lsn()) < confirmed {
        debug!(lsn = %confirmed, "final position not acknowledged in time; it will be replayed");
    }
    if tokio::time::timeout(Duration::from_secs(5), repl.shutdown())
        .await
        .is_err()
    {
        repl.abort();
    }
}

/// What a decoded WAL message sends the publisher, if anything; counts a
/// skipped non-transactional outbox message.
fn sink_item(decoded: Decoded, metrics: &Metrics) -> Option<SinkItem> {
    match decoded {
        Decoded::Event(ev) => Some(SinkItem::Event(ev)),
        Decoded::Nothing => None,
        Decoded::Skipped => {
            metrics.skipped_messages.inc();
            None
        }
    }
}

async fn source_loop(
    repl: &mut ReplicationClient,
    decoder: &mut OutboxDecoder,
    (items, budget): (mpsc::Sender<SinkItem>, &ByteBudget),
    watermark: &mut watch::Receiver<Progress>,
    (mut silence, probe, alive): (Silence, &Notify, &Notify),
    stop: &CancellationToken,
    metrics: &Metrics,
) -> Result<(), RelayError> {
    loop {
        // Priorities: stop first, then progress back to the server, then
        // WAL, then silence (probe, then give up on the stream).
        let ev = tokio::select! {
            biased;
            _ = stop.cancelled() => return Ok(()),
            Ok(()) = watermark.changed() => {
                repl.update_applied_lsn(watermark.borrow_and_update().lsn.into());
                continue;
            }
            ev = repl.recv() => ev,
            _ = alive.notified() => {
                silence.heard();
                continue;
            }
            _ = tokio::time::sleep_until(silence.deadline()) => match silence.expired() {
                Silent::Probe => {
                    probe.notify_one();
                    continue;
                }
                Silent::Stalled(for_) => return Err(SourceError::Stalled(for_).into()),
            },
        };
        silence.heard();
        let item = match ev {
            Ok(Some(ReplicationEvent::Begin {
                commit_time_micros,
                xid,
                final_lsn,
            })) => {
                decoder.begin_tx(commit_time_micros, xid, final_lsn.into());
                SinkItem::Begin {
                    commit_time_us: commit_time_micros.saturating_add(PG_EPOCH_OFFSET_US),
                }
            }
            Ok(Some(ReplicationEvent::XLogData { data, .. })) => {
                match sink_item(decoder.decode(data).map_err(SourceError::from)?, metrics) {
                    Some(item) => item,
                    None => continue,
                }
            }
            Ok(Some(ReplicationEvent::Commit { end_lsn, .. })) => {
                decoder.commit();
                metrics.transactions.inc();
                metrics.received_lsn.set(end_lsn.as_u64());
                SinkItem::Commit {
                    end_lsn: end_lsn.into(),
                }
            }
            Ok(Some(ReplicationEvent::KeepAlive { wal_end, .. })) => {
                metrics.received_lsn.set(wal_end.as_u64());
                SinkItem::Keepalive {
                    wal_end: wal_end.into(),
                }
            }
            Ok(Some(ReplicationEvent::Message {
                transactional,
                lsn,
                prefix,
                content,
            })) => {
                let decoded = decoder.message(transactional, &prefix, content, lsn.into());
                match sink_item(decoded.map_err(SourceError::from)?, metrics) {
                    Some(item) => item,
                    None => continue,
                }
            }
            Ok(Some(ReplicationEvent::StoppedAt { .. })) => continue,
            Ok(None) => return Err(SourceError::Ended.into()),
            Err(source) => {
                return Err(SourceError::Replication {
                    url: String::from("replication connection"),
                    source,
                }
                .into());
            }
        };
        // Wait for room in the channel (a large row: for its bytes too)
        // while still forwarding progress.
        let cost = ByteBudget::cost(&item);
        let mut taken = cost == 0;
        loop {
            tokio::select! {
                biased;
                _ = stop.cancelled() => return Ok(()),
                Ok(()) = watermark.changed() => {
                    repl.update_applied_lsn(watermark.borrow_and_update().lsn.into());
                }
                _ = budget.take(cost), if !taken => taken = true,
                permit = items.reserve(), if taken => match permit {
                    Ok(p) => { p.send(item); break; }
                    Err(_) => return Ok(()), // the sink ended; its result is the session's
                },
            }
        }
        // Time spent waiting for the sink is not the stream's silence.
        silence.heard();
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
