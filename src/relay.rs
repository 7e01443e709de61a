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

use std::sync::Arc;
use std::time::Duration;

use pgwire_replication::{ReplicationClient, ReplicationEvent};
use tokio::sync::{Notify, mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::checkpoint::CheckpointError;
use crate::config::Config;
use crate::lsn::Lsn;
use crate::message::RenderError;
use crate::metrics::{Metrics, Target, TargetLabel};
use crate::outbox::{Decoded, OutboxDecoder, OutboxOids, PG_EPOCH_OFFSET_US};
use crate::sink::budget::ByteBudget;
use crate::sink::publisher::{self, Progress, SinkItem};
use crate::sink::publisher::{Head, Refusals};
use crate::sink::replies::Disposition;
use crate::sink::{AmqpSink, SinkError};
use crate::source::checkpoint_table;
use crate::source::longest_tx::LongestTx;
use crate::source::silence::{self, Silence, Silent};
use crate::source::{SourceError, connect_sql, slot, slot::usable_slot, start_replication};

/// Why the relay stopped, or why a session ended.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    /// PostgreSQL side.
    #[error(transparent)]
    Source(#[from] SourceError),
    /// Broker side.
    #[error(transparent)]
    Sink(#[from] SinkError),
    /// A row that cannot become a message, and no dead-letter exchange.
    #[error(
        "undeliverable event: {0}; set rabbitmq.dead_letter_exchange to dead-letter such events instead of stopping"
    )]
    Render(#[from] RenderError),
    /// An event the broker will never take, and no dead-letter exchange.
    #[error(
        "undeliverable event {id}: {reason}; set rabbitmq.dead_letter_exchange to dead-letter such events instead of stopping"
    )]
    Undeliverable {
        /// Event id.
        id: String,
        /// Why.
        reason: String,
    },
    /// A command was stopped (SIGINT/SIGTERM) before it finished.
    #[error("{0}")]
    Interrupted(String),
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
            RelayError::Render(_)
            | RelayError::Undeliverable { .. }
            | RelayError::Interrupted(_) => false,
            // A broken stream is re-read from the slot by a new session.
            RelayError::Order(_) => true,
        }
    }

    fn target(&self) -> Target {
        match self {
            RelayError::Sink(_) => Target::rabbitmq,
            _ => Target::postgres,
        }
    }
}

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
const CHECKPOINT_EVERY: Duration = Duration::from_secs(1);
/// 404s for one exchange name before the relay stops instead of starting
/// another session that would dead-letter its events.
const MISSING_EXCHANGE_STRIKES: u32 = 3;
/// Sessions the broker ends while the same event is the oldest unconfirmed
/// one (published alone) before that event is dead-lettered.
const HEAD_STRIKES: u32 = 3;
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
    let mut known: Option<OutboxOids> = None;
    // What the broker refused in earlier sessions (see sink::replies).
    let mut refusals = Refusals::default();
    // Sessions ended by each refusal (an exchange name, a body limit, an
    // event blamed): the same one coming back must not loop sessions.
    let mut strikes: std::collections::HashMap<String, u32> = Default::default();
    // Outlives sessions: an open transaction is timed from when it was
    // first seen, whatever reconnects happen meanwhile.
    let longest = Arc::new(tokio::sync::Mutex::new(LongestTx::default()));
    loop {
        let mut progressed = false;
        let r = session(
            cfg,
            &shutdown,
            metrics,
            &mut progressed,
            (&mut known, &mut refusals, &longest),
        )
        .await;
        let head = refusals.head.lock().expect("not poisoned").take();
        if progressed {
            refusals.careful_for = 0;
        }
        let r = match r {
            Err(RelayError::Sink(e)) => match learn(cfg, &e, head, &mut refusals, &mut strikes) {
                Some(stop) => Err(stop),
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

/// A session failed with `e`; `head` was its oldest unconfirmed event.
/// Learns what the next session must route around (see
/// [`crate::sink::replies`]), or returns the error that stops the relay.
pub(crate) fn learn(
    cfg: &Config,
    e: &SinkError,
    head: Option<Head>,
    refusals: &mut Refusals,
    strikes: &mut std::collections::HashMap<String, u32>,
) -> Option<RelayError> {
    let dlx = cfg.rabbitmq.dead_letter_exchange.as_deref();
    let mut strike = |key: String| {
        let n = strikes.entry(key).or_default();
        *n += 1;
        *n
    };
    match e.disposition() {
        Disposition::MissingExchange(exchange) => {
            let n = strike(format!("exchange {exchange}"));
            if dlx == Some(exchange.as_str())
                || cfg.rabbitmq.exchange.as_literal().is_some()
                || dlx.is_none()
                || n > MISSING_EXCHANGE_STRIKES
            {
                // Nothing to dead-letter to, or no template at all: the
                // operator must declare it.
                return Some(RelayError::Sink(SinkError::NoExchange(exchange)));
            }
            warn!(%exchange, "the broker has no such exchange; its events will be dead-lettered");
            refusals.missing.insert(exchange);
        }
        Disposition::BodyLimit(limit) => {
            let n = strike(format!("body limit {limit}"));
            if dlx.is_none() || n > MISSING_EXCHANGE_STRIKES {
                return Some(RelayError::Undeliverable {
                    id: head.map_or_else(|| "?".into(), |h| h.id),
                    reason: format!(
                        "the broker refuses bodies over {limit} bytes (its max_message_size); \
                         set rabbitmq.max_message_bytes to at most {limit}"
                    ),
                });
            }
            warn!(
                limit,
                "the broker refuses larger bodies; they will be dead-lettered without the body"
            );
            refusals.max_body = Some(limit);
        }
        Disposition::HeadOfWindow => {
            let head = head?;
            // Replay one message at a time past where this session got, so
            // the message that draws the refusal is alone when it comes
            // again (the replay starts at or before this session's start).
            refusals.careful_for = refusals
                .careful_for
                .max(head.sent + cfg.rabbitmq.window as u64);
            // Only a message published alone is surely the one.
            let Head {
                id, alone: true, ..
            } = head
            else {
                return None;
            };
            let n = strike(format!("event {id}"));
            if n > 2 * HEAD_STRIKES {
                // Its bare dead letter is refused too.
                return Some(RelayError::Undeliverable {
                    id,
                    reason: format!("the broker keeps refusing it, even as a dead letter: {e}"),
                });
            }
            if n >= HEAD_STRIKES {
                let reason = format!(
                    "the broker ended {n} sessions while this was the oldest unconfirmed \
                     message, last with: {e}"
                );
                warn!(event_id = %id, %reason, "giving up on the event");
                refusals.poison.insert(id, reason);
            }
        }
        Disposition::Transient | Disposition::Stop => {}
    }
    None
}

/// Capped exponential backoff with jitter (half fixed, half random), so a
/// fleet of relays does not reconnect in lockstep.
pub fn backoff(attempt: u32) -> Duration {
    let exp = BACKOFF_BASE.saturating_mul(1u32 << attempt.min(16));
    let ceiling = exp.min(BACKOFF_CAP);
    let half = ceiling / 2;
    half + half.mul_f64(rand::random_range(0.0..1.0))
}

async fn session(
    cfg: &Config,
    shutdown: &CancellationToken,
    metrics: &Metrics,
    progressed: &mut bool,
    (known, refusals, longest): (
        &mut Option<OutboxOids>,
        &mut Refusals,
        &Arc<tokio::sync::Mutex<LongestTx>>,
    ),
) -> Result<Option<Lsn>, RelayError> {
    // Connecting can take a while (each step has its deadline): a stop asked
    // for meanwhile ends it at once, with nothing in flight.
    let connect = async {
        let sql = Arc::new(connect_sql(&cfg.postgres).await?);
        let start = bounded("reading the slot", usable_slot(&sql, cfg)).await?;
        let oids = bounded(
            "looking up the outbox table",
            slot::outbox_oids(&sql, cfg, known.as_ref()),
        )
        .await?;
        bounded(
            "reading the publication",
            slot::require_publication(&sql, cfg, &oids),
        )
        .await?;
        *known = Some(oids.clone());
        let silence_limit = bounded(
            "reading wal_sender_timeout",
            silence::limit(&sql, &cfg.postgres),
        )
        .await?;
        let mut sink = AmqpSink::connect(&cfg.rabbitmq).await?;
        info!("connected to RabbitMQ");
        // An exchange declared since it was found missing is used again.
        for exchange in refusals.missing.clone() {
            match sink.check_exchange(&exchange).await {
                Ok(()) => {
                    info!(%exchange, "the exchange exists now");
                    refusals.missing.remove(&exchange);
                }
                Err(SinkError::NoExchange(_)) => {}
                Err(e) => return Err(e.into()),
            }
        }
        // Last, so that a broker that is down costs no walsender. (Its
        // connect has a deadline; an AMQP heartbeat interval above a few
        // seconds outlasts it.)
        let repl = start_replication(&cfg.postgres, start, REPLICATION_BUFFER).await?;
        Ok::<_, RelayError>((sql, start, oids, silence_limit, sink, repl))
    };
    let (sql, start, oids, silence_limit, mut sink, mut repl) = tokio::select! {
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
    let (wm_tx, mut wm_rx) = watch::channel(Progress {
        lsn: start,
        commit_time_us: None,
    });
    let mut decoder = OutboxDecoder::new(&cfg.outbox, &cfg.rabbitmq, oids);

    // Side tasks on the SQL connection; they end with the session.
    let (probe, alive) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let watch_liveness = tokio::spawn(liveness(
        cfg.clone(),
        sql.clone(),
        silence_limit,
        (probe.clone(), alive.clone()),
        stop.clone(),
    ));
    let side = tokio::spawn(side_tasks(
        cfg.clone(),
        (sql, longest.clone()),
        wm_rx.clone(),
        metrics.clone(),
        stop.clone(),
    ));

    let source = source_loop(
        &mut repl,
        &mut decoder,
        (items_tx, &budget),
        &mut wm_rx,
        (Silence::new(silence_limit), &probe, &alive),
        &stop,
        metrics,
    );
    let sink_loop = async {
        let r = publisher::run(
            &mut sink,
            items_rx,
            &wm_tx,
            (&cfg.rabbitmq, &*refusals, &budget),
            start,
            metrics,
            &stop,
        )
        .await;
        // Whatever ends the sink ends the session: stop reading WAL.
        stop.cancel();
        r
    };
    let (source_res, sink_res) = tokio::join!(source, sink_loop);
    metrics.streaming.set(0);

    let confirmed = wm_rx.borrow().lsn;
    *progressed = confirmed > start;
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

    let res = sink_res.and(source_res);
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

/// Work beside the stream that needs the SQL connection: the checkpoint
/// table, the optional heartbeat, and the retained-WAL gauge. Failures here
/// are logged, never fatal: the slot remains the source of truth.
async fn side_tasks(
    cfg: Config,
    (sql, longest): (
        Arc<tokio_postgres::Client>,
        Arc<tokio::sync::Mutex<LongestTx>>,
    ),
    mut progress: watch::Receiver<Progress>,
    metrics: Metrics,
    stop: CancellationToken,
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
    let mut written: Option<i64> = None;
    let mut checkpoint_warned = false;
    let mut longest_warned = false;
    loop {
        tokio::select! {
            biased;
            _ = stop.cancelled() => break,
            _ = tokio::time::sleep(CHECKPOINT_EVERY) => {
                // Only a new durable transaction is worth a write: writing
                // on keepalives would itself make WAL, forever.
                let p = *progress.borrow_and_update();
                if p.commit_time_us.is_some() && p.commit_time_us != written {
                    let write = tokio::time::timeout(SQL_DEADLINE, checkpoint_table::write(&sql, &cfg, p));
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
                    "SELECT (pg_current_wal_lsn() - restart_lsn)::bigint FROM pg_replication_slots WHERE slot_name = $1",
                    &params,
                );
                if let Ok(Ok(row)) = tokio::time::timeout(SQL_DEADLINE, call).await {
                    metrics.retained_wal_bytes.set(row.get::<_, Option<i64>>(0).unwrap_or(0));
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

/// Tells the source loop when the stream is alive though silent, on a task
/// of its own so that no other SQL work delays it (see `source::silence`):
/// sends the probe when asked, and signals `alive` whenever the slot's
/// walsender has read further.
async fn liveness(
    cfg: Config,
    sql: Arc<tokio_postgres::Client>,
    limit: Duration,
    (probe, alive): (Arc<Notify>, Arc<Notify>),
    stop: CancellationToken,
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
                match decoder.decode(data).map_err(SourceError::from)? {
                    Decoded::Event(ev) => SinkItem::Event(ev),
                    Decoded::Nothing => continue,
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
    use crate::sink::wire::WireError;

    fn config(dlx: bool) -> Config {
        let dlx = if dlx {
            "dead_letter_exchange = \"dlx\"\n"
        } else {
            ""
        };
        let text = format!(
            "[postgres]\nurl = \"postgres://u@h/db\"\n[outbox]\ntable = \"public.outbox\"\n\
             [rabbitmq]\nurl = \"amqp://h\"\nexchange = \"{{aggregate_type}}\"\nwindow = 100\n{dlx}"
        );
        Config::from_toml(&text, "test.toml", Vec::new()).unwrap()
    }

    fn closed(code: u16, text: &str) -> SinkError {
        SinkError::Amqp {
            what: "publishing",
            url: String::new(),
            source: WireError::ChannelClosed {
                code,
                text: text.into(),
            },
        }
    }

    fn head(id: &str, alone: bool, sent: u64) -> Option<Head> {
        Some(Head {
            id: id.into(),
            alone,
            sent,
        })
    }

    /// A refusal blamed on a message: first the replay goes one message at
    /// a time past where the session failed; the same message refused
    /// alone three times is dead-lettered; its dead letter refused as well
    /// stops the relay.
    #[test]
    fn a_message_the_broker_keeps_refusing_is_found_then_dead_lettered() {
        let cfg = config(true);
        let (mut r, mut strikes) = (Refusals::default(), Default::default());
        let e = closed(505, "UNEXPECTED_FRAME");
        assert!(learn(&cfg, &e, head("a", false, 700), &mut r, &mut strikes).is_none());
        assert_eq!(r.careful_for, 800);
        assert!(r.poison.is_empty(), "not alone: not blamed");
        for n in 1..=3 {
            assert!(learn(&cfg, &e, head("k", true, 5), &mut r, &mut strikes).is_none());
            assert_eq!(r.poison.contains_key("k"), n == 3, "after {n}");
        }
        assert!(r.poison["k"].contains("UNEXPECTED_FRAME"));
        assert_eq!(r.careful_for, 800, "never shrinks while failing");
        for _ in 4..=6 {
            assert!(learn(&cfg, &e, head("k", true, 1), &mut r, &mut strikes).is_none());
        }
        let stop = learn(&cfg, &e, head("k", true, 1), &mut r, &mut strikes).unwrap();
        assert!(stop.to_string().contains("even as a dead letter"), "{stop}");
        assert!(!stop.is_transient());
    }

    #[test]
    fn the_brokers_body_limit_is_learnt_or_stops_without_a_dead_letter_exchange() {
        let e = closed(
            406,
            "PRECONDITION_FAILED - message size 200000 is larger than configured max size 65536",
        );
        let (mut r, mut strikes) = (Refusals::default(), Default::default());
        assert!(learn(&config(true), &e, head("b", false, 1), &mut r, &mut strikes).is_none());
        assert_eq!(r.max_body, Some(65_536));
        let (mut r, mut strikes) = (Refusals::default(), Default::default());
        let stop = learn(
            &config(false),
            &e,
            head("b", false, 1),
            &mut r,
            &mut strikes,
        )
        .unwrap();
        let text = stop.to_string();
        assert!(
            text.contains("rabbitmq.max_message_bytes") && text.contains("65536"),
            "{text}"
        );
    }

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
