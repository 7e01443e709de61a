//! The publishing loop: takes BEGIN / event / COMMIT / keepalive items in WAL
//! order, publishes within the confirm window, retries returns and nacks,
//! dead-letters what can never be delivered, and moves the watermark.
//!
//! Every message keeps its checkpoint sequence number through retries and
//! dead-lettering, so its transaction becomes durable only once the broker
//! took *some* copy of it: on its exchange, or on the dead-letter exchange.

use std::collections::HashSet;
use std::time::Duration;

use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use tokio::sync::mpsc::error::TryRecvError;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tracing::{error, info, warn};

use tokio_util::sync::CancellationToken;

use super::budget::ByteBudget;
use super::{AmqpSink, SinkError, Unconfirmed};
use crate::checkpoint::{Checkpoint, Seq};
use crate::config::RabbitmqConfig;
use crate::lsn::Lsn;
use crate::message::{
    Envelope, MessageView, RenderError, dead_letter_unrenderable, event_id, render, view,
};
use prometheus_client::metrics::counter::Counter;

use crate::metrics::{Metrics, Outcome, OutcomeLabel, ReasonLabel, RetryReason};
use crate::outbox::OutboxEvent;
use crate::relay::RelayError;

/// One item from source to sink, in WAL order.
#[derive(Debug)]
// Rows keep their columns inline (no allocation per event), and rows
// are the common case: boxing them would add back the allocation.
#[allow(clippy::large_enum_variant)]
pub enum SinkItem {
    /// A transaction begins (commit time, µs since the Unix epoch).
    Begin {
        /// Commit time.
        commit_time_us: i64,
    },
    /// An outbox INSERT of the open transaction.
    Event(OutboxEvent),
    /// The open transaction committed, ending at `end_lsn`.
    Commit {
        /// End of the commit record.
        end_lsn: Lsn,
    },
    /// The server has sent everything up to `wal_end`.
    Keepalive {
        /// Server's WAL position.
        wal_end: Lsn,
    },
}

/// The durable position and the commit time of the transaction that made it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    /// Safe to report as flushed.
    pub lsn: Lsn,
    /// Commit time (µs since the Unix epoch) of the newest durable
    /// transaction, if any in this session.
    pub commit_time_us: Option<i64>,
}

/// What a message is published from.
// Rows keep their columns inline (no allocation per event), and rows
// are the common case: boxing them would add back the allocation.
#[allow(clippy::large_enum_variant)]
enum Content {
    /// A decoded row. The first publish encodes it straight from the row
    /// into the connection's write buffer; only a retry renders it into an
    /// owned message.
    Event(OutboxEvent),
    /// A dead letter, fixed once built (cloned for each publish: rare).
    DeadLetter(Box<Envelope>),
}

/// A message on its way: what to re-publish if it comes back.
struct InFlight {
    seq: Seq,
    content: Content,
    /// Publishes so far, this one included.
    attempts: u32,
    /// Body size, for the published-bytes counter.
    body_bytes: usize,
    /// Bytes it holds, counted against `rabbitmq.window_bytes`.
    held: usize,
    /// Commit time of its transaction (µs since the Unix epoch).
    commit_time_us: i64,
    published_at: Instant,
}

impl InFlight {
    fn new(
        seq: Seq,
        content: Content,
        (body_bytes, held): (usize, usize),
        commit_time_us: i64,
    ) -> InFlight {
        InFlight {
            held,
            commit_time_us,
            seq,
            content,
            attempts: 0,
            body_bytes,
            published_at: Instant::now(),
        }
    }

    fn dead_letter(seq: Seq, commit_time_us: i64, dl: Envelope) -> InFlight {
        let bytes = dl.body.len();
        InFlight::new(
            seq,
            Content::DeadLetter(Box::new(dl)),
            (bytes, bytes),
            commit_time_us,
        )
    }

    fn is_dead_letter(&self) -> bool {
        matches!(self.content, Content::DeadLetter(_))
    }

    /// The `message_id` it is published with: the event id (a rendered
    /// event always has one), or a dead letter's, which may have none.
    fn message_id(&self) -> Option<String> {
        match &self.content {
            Content::Event(ev) => Some(event_id(ev)),
            Content::DeadLetter(env) => env.properties.message_id().as_ref().map(|m| m.to_string()),
        }
    }

    /// Where it is published: exchange and routing key (to tell which
    /// message a return is for; only then, so it may allocate).
    fn destination(&self) -> (String, String) {
        match &self.content {
            Content::Event(ev) => match view(ev) {
                Ok(m) => (m.exchange.parts().concat(), m.routing_key.parts().concat()),
                Err(_) => Default::default(),
            },
            Content::DeadLetter(env) => (env.exchange.to_string(), env.routing_key.to_string()),
        }
    }

    /// The message, to publish it again.
    fn envelope(&self) -> Result<Envelope, RelayError> {
        match &self.content {
            Content::Event(ev) => render(ev).map_err(RelayError::Render),
            Content::DeadLetter(env) => Ok(Envelope::clone(env)),
        }
    }
}

/// How long the oldest unanswered message has waited, for the confirm
/// timeout. Checked once a second; no timer per message. The oldest is
/// watched, not the newest answer, so one stuck message is noticed even
/// while the broker confirms others around it (confirms may come out of
/// order, e.g. from different queues).
struct ConfirmClock {
    /// Waiting before this does not count: the broker blocked publishing
    /// (a resource alarm), or this process did not run for a while (then
    /// answers may be queued, unread).
    counted_from: Instant,
    last_check: Instant,
}

impl ConfirmClock {
    /// A check comes every second; a longer gap means the process stalled.
    const STALL: Duration = Duration::from_secs(3);

    fn new() -> ConfirmClock {
        let now = Instant::now();
        ConfirmClock {
            counted_from: now,
            last_check: now,
        }
    }

    /// Whether the oldest waiting message, published at `oldest`, has
    /// waited `timeout` or more, counting only time the broker was free to
    /// answer.
    fn overdue(&mut self, oldest: Option<Instant>, blocked: bool, timeout: Duration) -> bool {
        let now = Instant::now();
        if blocked || now.duration_since(self.last_check) > Self::STALL {
            self.counted_from = now;
        }
        self.last_check = now;
        oldest.is_some_and(|at| now.duration_since(at.max(self.counted_from)) >= timeout)
    }
}

/// Wall clock, µs since the Unix epoch (commit times are in these units).
fn unix_now_us() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64)
}

async fn after(delay: Duration, f: InFlight) -> InFlight {
    tokio::time::sleep(delay).await;
    f
}

/// Delay before publish number `attempts + 1` of a message: doubling from
/// the configured base, capped at 30 s.
fn retry_delay(base: Duration, attempts: u32) -> Duration {
    base.saturating_mul(1u32 << attempts.saturating_sub(1).min(16))
        .min(Duration::from_secs(30))
}

/// The loop's state.
struct Publisher<'a> {
    /// Counter handles resolved once: a labelled lookup takes a lock.
    published: Counter,
    dead_lettered: Counter,
    cfg: &'a RabbitmqConfig,
    metrics: &'a Metrics,
    cp: Checkpoint,
    watermark: &'a watch::Sender<Progress>,
    /// Messages published and not yet answered, by delivery tag.
    unconfirmed: Unconfirmed<InFlight>,
    /// Reused for the messages one answer settles.
    settled: Vec<(InFlight, Result<(), SinkError>)>,
    /// Re-publishes waiting for their delay.
    retries: FuturesUnordered<Retry>,
    clock: ConfirmClock,
    /// Exchanges the broker said do not exist (templated exchanges): events
    /// bound for them are dead-lettered instead of closing the channel.
    refusals: &'a Refusals,
    /// Events published this session.
    sent: u64,
    /// Bytes held by messages not yet confirmed (waiting, or waiting for a
    /// retry), against `rabbitmq.window_bytes`.
    held: usize,
    /// The input queue's byte budget, given back as items are taken.
    budget: &'a ByteBudget,
}

/// What the broker refused in earlier sessions, for the next one to route
/// around (see [`super::replies`]).
#[derive(Debug, Default)]
pub struct Refusals {
    /// Templated exchanges the broker does not have: their events are
    /// dead-lettered.
    pub missing: HashSet<String>,
    /// The broker's `max_message_size`, once it said so.
    pub max_body: Option<usize>,
    /// Events the broker kept refusing while they were the oldest
    /// unconfirmed one, and why: they are dead-lettered.
    pub poison: std::collections::HashMap<String, String>,
    /// Publish one message at a time until this many were published, so
    /// that the next refusal is blamed on the right message.
    pub careful_for: u64,
    /// Set when a session fails: what it was publishing.
    pub head: std::sync::Mutex<Option<Head>>,
}

/// The oldest unconfirmed event of a session that failed.
#[derive(Debug, Clone)]
pub struct Head {
    /// Its id.
    pub id: String,
    /// It was published alone: surely the one the broker refused.
    pub alone: bool,
    /// Events the session had published.
    pub sent: u64,
}

type Retry = std::pin::Pin<Box<dyn Future<Output = InFlight> + Send>>;

/// Publishes of a message the broker keeps nacking before it is
/// dead-lettered: with the doubling backoff (capped at 30 s) about two
/// minutes at the default `retry_backoff_ms`, long enough for a queue to
/// drain, short enough that one message cannot hold the stream.
const NACK_ATTEMPTS: u32 = 10;

/// Longest `x-outbox-*` header text kept when a dead letter must shrink.
const DEAD_LETTER_TEXT_MAX: usize = 1024;

/// A dead letter the broker will take: its body within `max_body` (else
/// dropped, its size kept in `x-outbox-body-bytes`), its properties within
/// one frame (else only the `x-outbox-*` headers are kept, each cut to
/// [`DEAD_LETTER_TEXT_MAX`]). A dead letter the broker refused would be
/// replayed forever.
fn fit_dead_letter(mut env: Envelope, frame_max: u32, max_body: usize) -> Envelope {
    use lapin::types::{AMQPValue, FieldTable};
    if env.body.len() > max_body {
        env = env.without_body();
    }
    let fits = |e: &Envelope| super::wire::header_frame_len(&e.properties) <= frame_max as usize;
    if fits(&env) {
        return env;
    }
    let mut kept = FieldTable::default();
    if let Some(headers) = env.properties.headers() {
        for (k, v) in headers.inner() {
            if !k.as_str().starts_with("x-outbox-") {
                continue;
            }
            let v = match v {
                AMQPValue::LongString(s) if s.as_bytes().len() > DEAD_LETTER_TEXT_MAX => {
                    let text = String::from_utf8_lossy(&s.as_bytes()[..DEAD_LETTER_TEXT_MAX]);
                    AMQPValue::LongString(format!("{text}...").into())
                }
                other => other.clone(),
            };
            kept.insert(k.clone(), v);
        }
    }
    kept.insert("x-outbox-headers-dropped".into(), AMQPValue::Boolean(true));
    env.properties = env.properties.with_headers(kept);
    env
}

impl Publisher<'_> {
    /// Largest body sent: `rabbitmq.max_message_bytes`, or the broker's own
    /// limit when it said it is lower.
    fn max_body(&self) -> usize {
        self.refusals
            .max_body
            .map_or(self.cfg.max_message_bytes, |b| {
                b.min(self.cfg.max_message_bytes)
            })
    }

    fn advance(&self, lsn: Option<Lsn>) {
        if let Some(lsn) = lsn {
            self.metrics.confirmed_lsn.set(lsn.0);
            self.watermark.send_replace(Progress {
                lsn,
                commit_time_us: self.cp.confirmed_commit_time_us(),
            });
        }
    }

    /// The copy for the dead-letter exchange, or the error that stops the
    /// relay when there is none.
    fn dead_letter(
        &self,
        seq: Seq,
        commit_time_us: i64,
        env: Envelope,
        reason: &str,
        attempts: u32,
    ) -> Result<InFlight, RelayError> {
        let Some(dlx) = &self.cfg.dead_letter_exchange else {
            error!(event_id = %env.id(), reason, "undeliverable event and no dead-letter exchange; stopping");
            return Err(RelayError::Undeliverable {
                id: env.id().to_owned(),
                reason: reason.to_owned(),
            });
        };
        error!(event_id = %env.id(), reason, attempts, dead_letter_exchange = %dlx, "dead-lettering event");
        let dl = env.dead_letter(dlx, reason, attempts);
        Ok(InFlight::dead_letter(seq, commit_time_us, dl))
    }

    /// A new event: check it, publish it (encoded straight from the row),
    /// or dead-letter it.
    /// `bytes`: the row's size ([`OutboxEvent::bytes`]), measured once.
    fn publish_event(
        &mut self,
        sink: &mut AmqpSink,
        ev: OutboxEvent,
        bytes: usize,
    ) -> Result<(), RelayError> {
        let seq = self.cp.publish()?;
        self.sent += 1;
        let commit_time_us = ev.commit_time_us;
        let (tag, body_bytes) = match self.message(&ev, sink.frame_max())? {
            Ok(view) => (sink.publish_view(&view)?, view.body.len()),
            Err(dl) => {
                let f = InFlight::dead_letter(seq, commit_time_us, dl);
                self.held += f.held;
                let env = f.envelope()?;
                return self.launch(sink, f, env);
            }
        };
        let f = InFlight::new(seq, Content::Event(ev), (body_bytes, bytes), commit_time_us);
        self.held += f.held;
        self.unconfirmed.push(tag, f);
        Ok(())
    }

    /// The message for `ev`, or (`Err`) its dead letter when it cannot be
    /// sent as it stands; without a dead-letter exchange, the error that
    /// stops the relay.
    fn message<'e>(
        &self,
        ev: &'e OutboxEvent,
        frame_max: u32,
    ) -> Result<Result<MessageView<'e>, Envelope>, RelayError> {
        // The broker would close the connection over a content header that
        // does not fit in a frame (and again on every replay): refuse it
        // here, and dead-letter it without its headers.
        let m = view(ev).and_then(|m| match m.header_bytes() {
            bytes if bytes > frame_max as usize => Err(RenderError::HeaderTooLarge {
                id: m.message_id.to_owned(),
                bytes,
                frame_max,
            }),
            _ => Ok(m),
        });
        let m = match m {
            Ok(m) => m,
            Err(e) => {
                let Some(dlx) = &self.cfg.dead_letter_exchange else {
                    error!(error = %e, "undeliverable event and no dead-letter exchange; stopping");
                    return Err(RelayError::Render(e));
                };
                error!(event_id = %event_id(ev), reason = %e, dead_letter_exchange = %dlx, "dead-lettering event");
                let dl = dead_letter_unrenderable(ev, &e, dlx);
                // The dead letter carries the row's body: it must fit too.
                let limit = self.max_body();
                return Ok(Err(if dl.body.len() > limit {
                    dl.without_body()
                } else {
                    dl
                }));
            }
        };
        if !self.refusals.poison.is_empty() {
            if let Some(reason) = self.refusals.poison.get(m.message_id) {
                let Some(dlx) = &self.cfg.dead_letter_exchange else {
                    return Err(RelayError::Undeliverable {
                        id: m.message_id.to_owned(),
                        reason: reason.clone(),
                    });
                };
                error!(event_id = %m.message_id, %reason, dead_letter_exchange = %dlx, "dead-lettering event");
                // Bare: whatever in its headers or body the broker refused
                // is not sent again.
                let dl = m.to_envelope().dead_letter(dlx, reason, 0);
                return Ok(Err(fit_dead_letter(dl, 0, 0)));
            }
        }
        if !self.refusals.missing.is_empty() {
            let exchange = m.exchange.parts().concat();
            if self.refusals.missing.contains(&exchange) {
                let reason = format!(
                    "exchange {exchange:?} does not exist on the broker (404 NOT_FOUND); declare \
                     it, or fix rabbitmq.exchange"
                );
                let Some(dlx) = &self.cfg.dead_letter_exchange else {
                    return Err(RelayError::Undeliverable {
                        id: m.message_id.to_owned(),
                        reason,
                    });
                };
                error!(event_id = %m.message_id, %reason, dead_letter_exchange = %dlx, "dead-lettering event");
                return Ok(Err(m.to_envelope().dead_letter(dlx, &reason, 0)));
            }
        }
        let limit = self.max_body();
        if m.body.len() > limit {
            let Some(dlx) = &self.cfg.dead_letter_exchange else {
                return Err(RelayError::Undeliverable {
                    id: m.message_id.to_owned(),
                    reason: format!(
                        "body of {} bytes exceeds rabbitmq.max_message_bytes ({limit})",
                        m.body.len()
                    ),
                });
            };
            error!(event_id = %m.message_id, bytes = m.body.len(), limit, "dead-lettering oversized event");
            return Ok(Err(m.to_envelope().dead_letter_oversized(dlx, limit)));
        }
        Ok(Ok(m))
    }

    /// The broker answered `f`. Returns what to publish again, and when.
    fn settle(
        &mut self,
        mut f: InFlight,
        res: Result<(), SinkError>,
    ) -> Result<Option<(Duration, InFlight)>, RelayError> {
        match res {
            Ok(()) => {
                self.metrics
                    .confirm_latency
                    .observe(f.published_at.elapsed().as_secs_f64());
                self.metrics
                    .commit_to_confirm
                    .observe(((unix_now_us() - f.commit_time_us) as f64 / 1e6).max(0.0));
                if f.is_dead_letter() {
                    self.dead_lettered.inc();
                } else {
                    self.published.inc();
                    self.metrics.published_bytes.inc_by(f.body_bytes as u64);
                }
                self.held -= f.held;
                let moved = self.cp.confirm(f.seq)?;
                self.advance(moved);
                Ok(None)
            }
            Err(SinkError::Returned {
                id,
                exchange,
                reply,
                ..
            }) if f.is_dead_letter() => Err(SinkError::DeadLetterRefused {
                id,
                exchange,
                reason: reply,
            }
            .into()),
            Err(SinkError::Returned {
                id,
                reply,
                exchange,
                routing_key,
            }) => {
                f.attempts += 1;
                if f.attempts >= self.cfg.unroutable_attempts {
                    let reason = format!(
                        "unroutable: exchange {exchange:?} has no queue bound for routing key {routing_key:?} ({reply}) after {} attempts",
                        f.attempts
                    );
                    let env = f.envelope()?;
                    let dl = self.dead_letter(f.seq, f.commit_time_us, env, &reason, f.attempts)?;
                    self.held = self.held - f.held + dl.held;
                    return Ok(Some((Duration::ZERO, dl)));
                }
                self.metrics
                    .retries
                    .get_or_create(&ReasonLabel {
                        reason: RetryReason::returned,
                    })
                    .inc();
                let delay = retry_delay(self.cfg.retry_backoff, f.attempts);
                warn!(event_id = %id, attempt = f.attempts, retry_in_ms = delay.as_millis() as u64, %exchange, %routing_key, "unroutable; will publish again");
                Ok(Some((delay, f)))
            }
            Err(SinkError::Nacked { id }) => {
                f.attempts += 1;
                if f.attempts >= NACK_ATTEMPTS {
                    let reason = format!(
                        "nacked by the broker {} times (e.g. a full queue with x-overflow = \
                         reject-publish)",
                        f.attempts
                    );
                    if f.is_dead_letter() {
                        return Err(SinkError::DeadLetterRefused {
                            id,
                            exchange: self.cfg.dead_letter_exchange.clone().unwrap_or_default(),
                            reason,
                        }
                        .into());
                    }
                    let env = f.envelope()?;
                    let dl = self.dead_letter(f.seq, f.commit_time_us, env, &reason, f.attempts)?;
                    self.held = self.held - f.held + dl.held;
                    return Ok(Some((Duration::ZERO, dl)));
                }
                self.metrics
                    .retries
                    .get_or_create(&ReasonLabel {
                        reason: RetryReason::nacked,
                    })
                    .inc();
                let delay = retry_delay(self.cfg.retry_backoff, f.attempts);
                warn!(event_id = %id, attempt = f.attempts, retry_in_ms = delay.as_millis() as u64, "broker nacked; will publish again");
                Ok(Some((delay, f)))
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Hands a message to the broker (written with the next wait for an
    /// answer).
    fn launch(
        &mut self,
        sink: &mut AmqpSink,
        mut f: InFlight,
        env: Envelope,
    ) -> Result<(), RelayError> {
        let env = if f.is_dead_letter() {
            fit_dead_letter(env, sink.frame_max(), self.max_body())
        } else {
            env
        };
        f.published_at = Instant::now();
        let tag = sink.publish(env)?;
        self.unconfirmed.push(tag, f);
        Ok(())
    }

    /// A broker answer: settle what it answers, schedule retries.
    fn on_answer(&mut self, ev: super::wire::Event) -> Result<(), RelayError> {
        let mut settled = std::mem::take(&mut self.settled);
        self.unconfirmed.apply(
            ev,
            (InFlight::message_id, InFlight::destination),
            &mut settled,
        )?;
        for (f, res) in settled.drain(..) {
            if let Some((delay, f)) = self.settle(f, res)? {
                self.retries.push(Box::pin(after(delay, f)));
            }
        }
        self.settled = settled;
        Ok(())
    }

    /// A new item from the source, in WAL order.
    fn on_item(&mut self, sink: &mut AmqpSink, item: SinkItem) -> Result<(), RelayError> {
        match item {
            SinkItem::Begin { commit_time_us } => self.cp.begin(commit_time_us)?,
            SinkItem::Event(ev) => {
                let bytes = ev.bytes();
                self.budget.give_back(ByteBudget::cost_of(bytes));
                self.publish_event(sink, ev, bytes)?
            }
            SinkItem::Commit { end_lsn } => {
                let moved = self.cp.commit(end_lsn)?;
                self.advance(moved);
            }
            SinkItem::Keepalive { wal_end } => {
                let moved = self.cp.keepalive(wal_end);
                self.advance(moved);
            }
        }
        Ok(())
    }

    fn update_gauges(&self) {
        self.metrics.in_flight.set(self.cp.in_flight() as i64);
        let lag = self
            .cp
            .oldest_pending_commit_time_us()
            .map_or(0.0, |t| ((unix_now_us() - t) as f64 / 1e6).max(0.0));
        self.metrics.lag_seconds.set(lag);
    }
}

/// Items taken from the source per turn at most, before the loop writes
/// them and looks at the broker's answers.
const BATCH: usize = 256;

/// Runs until `items` closes and every message is settled (or the shutdown
/// grace period ends), or until a failure.
///
/// One task drives the connection: publishes are queued into its write
/// buffer a batch at a time (whatever the source has ready, up to
/// [`BATCH`]) and written in one go while the loop waits for answers.
pub async fn run(
    sink: &mut AmqpSink,
    mut items: mpsc::Receiver<SinkItem>,
    watermark: &watch::Sender<Progress>,
    (cfg, refusals, budget): (&RabbitmqConfig, &Refusals, &ByteBudget),
    start: Lsn,
    metrics: &Metrics,
    stop: &CancellationToken,
) -> Result<(), RelayError> {
    let outcome = |outcome| {
        metrics
            .events
            .get_or_create(&OutcomeLabel { outcome })
            .clone()
    };
    let mut p = Publisher {
        published: outcome(Outcome::published),
        dead_lettered: outcome(Outcome::dead_lettered),
        cfg,
        metrics,
        cp: Checkpoint::new(start),
        watermark,
        unconfirmed: Unconfirmed::default(),
        settled: Vec::new(),
        retries: FuturesUnordered::new(),
        clock: ConfirmClock::new(),
        refusals,
        sent: 0,
        held: 0,
        budget,
    };
    let full_window = cfg.window as u64;
    let mut open = true;
    let mut drain_deadline: Option<Instant> = None;
    let mut blocked_logged = false;
    let mut gauges = tokio::time::interval(Duration::from_secs(1));
    let closing = |p: &Publisher<'_>| {
        if p.cp.in_flight() > 0 {
            info!(
                in_flight = p.cp.in_flight(),
                grace_secs = cfg.shutdown_grace.as_secs(),
                "waiting for outstanding confirms"
            );
        }
        Some(Instant::now() + cfg.shutdown_grace)
    };
    let r: Result<(), RelayError> = async {
        loop {
            if !open && p.cp.in_flight() == 0 {
                return Ok(());
            }
            let blocked = sink.is_blocked();
            if blocked != blocked_logged {
                if blocked {
                    warn!("broker blocked publishing (resource alarm); pausing WAL reading");
                } else {
                    info!("broker unblocked publishing; resuming");
                }
                metrics.blocked.set(i64::from(blocked));
                blocked_logged = blocked;
            }
            // Room for more: within the window's count and bytes (one message
            // always goes, however large), and the write buffer not backed up
            // (the broker applying TCP flow control).
            let room = |p: &Publisher<'_>, sink: &AmqpSink, open: bool| {
                let window = if p.sent < refusals.careful_for {
                    1
                } else {
                    full_window
                };
                open && !blocked
                    && p.cp.in_flight() < window
                    && (p.held < cfg.window_bytes || p.cp.in_flight() == 0)
                    && !sink.wants_flush()
            };
            // Priorities: broker answers first (they free the window and move
            // the watermark; waiting for them writes what is queued), then due
            // retries, then new WAL.
            tokio::select! {
                biased;
                // Once a second, first: it must not starve behind a
                // stream of answers (the confirm deadline, the gauges).
                _ = gauges.tick() => {
                    p.update_gauges();
                    let oldest = p.unconfirmed.oldest().map(|f| f.published_at);
                    if p.clock.overdue(oldest, blocked, cfg.confirm_timeout) {
                        return Err(SinkError::ConfirmTimeout {
                            in_flight: p.unconfirmed.len() as u64,
                            secs: cfg.confirm_timeout.as_secs(),
                        }
                        .into());
                    }
                }
                ev = sink.answer() => p.on_answer(ev?)?,
                Some(f) = p.retries.next(), if !p.retries.is_empty() && !blocked && !sink.wants_flush() => {
                    let env = f.envelope()?;
                    p.launch(sink, f, env)?;
                }
                item = items.recv(), if room(&p, sink, open) => match item {
                    None => {
                        open = false;
                        drain_deadline = closing(&p);
                    }
                    Some(item) => {
                        p.on_item(sink, item)?;
                        // Take what else is ready, so it goes out in one write.
                        for _ in 1..BATCH {
                            if !room(&p, sink, open) {
                                break;
                            }
                            match items.try_recv() {
                                Ok(item) => p.on_item(sink, item)?,
                                Err(TryRecvError::Empty) => break,
                                Err(TryRecvError::Disconnected) => {
                                    open = false;
                                    drain_deadline = closing(&p);
                                    break;
                                }
                            }
                        }
                    }
                },
                // Shutdown: take no more WAL, give outstanding confirms the grace
                // period. (While the broker blocks us the item channel is not
                // read, so its closing cannot be what starts the clock.)
                _ = stop.cancelled(), if drain_deadline.is_none() => {
                    open = false;
                    drain_deadline = closing(&p);
                }
                _ = tokio::time::sleep_until(drain_deadline.unwrap_or_else(Instant::now)), if drain_deadline.is_some() => {
                    warn!(in_flight = p.cp.in_flight(), "shutdown grace period over with unconfirmed messages; they were not reported and will be replayed");
                    return Ok(());
                }
            }
        }
    }
    .await;
    if r.is_err() {
        // Which message the session failed with, for the next one to blame
        // if this keeps happening (see `replies`).
        let (alone, sent) = (p.sent <= refusals.careful_for, p.sent);
        *refusals.head.lock().expect("not poisoned") = p
            .unconfirmed
            .oldest()
            .and_then(InFlight::message_id)
            .map(|id| Head { id, alone, sent });
    }
    r
}

#[cfg(test)]
mod tests {

    /// A dead letter too big for a frame keeps only its x-outbox-* headers,
    /// cut short; one with a body over the limit goes without it.
    #[test]
    fn dead_letters_are_made_to_fit() {
        use lapin::BasicProperties;
        use lapin::types::{AMQPValue, FieldTable};
        let mut headers = FieldTable::default();
        headers.insert(
            "pad".into(),
            AMQPValue::LongString("p".repeat(200_000).into()),
        );
        let env = Envelope {
            exchange: "ex".into(),
            routing_key: "rk".into(),
            body: bytes::Bytes::from(vec![b'x'; 5000]),
            properties: BasicProperties::default()
                .with_message_id("id".into())
                .with_headers(headers),
        };
        let dl = env.dead_letter("dlx", &"why ".repeat(1000), 1);
        let fitted = fit_dead_letter(dl, 131_072, 4096);
        assert!(super::super::wire::header_frame_len(&fitted.properties) <= 131_072);
        assert!(fitted.body.is_empty());
        let h = fitted.properties.headers().clone().unwrap();
        assert!(h.inner().get("pad").is_none());
        assert!(matches!(
            h.inner().get("x-outbox-headers-dropped"),
            Some(AMQPValue::Boolean(true))
        ));
        assert!(matches!(
            h.inner().get("x-outbox-body-bytes"),
            Some(AMQPValue::LongLongInt(5000))
        ));
        match h.inner().get("x-outbox-error") {
            Some(AMQPValue::LongString(s)) => {
                assert!(s.as_bytes().len() <= DEAD_LETTER_TEXT_MAX + 3)
            }
            other => panic!("{other:?}"),
        }
        // A small one is left as it is.
        let small = Envelope {
            exchange: "ex".into(),
            routing_key: "rk".into(),
            body: bytes::Bytes::from_static(b"{}"),
            properties: BasicProperties::default(),
        }
        .dead_letter("dlx", "why", 1);
        let same = fit_dead_letter(small.clone(), 131_072, 4096);
        assert_eq!(same.properties, small.properties);
        assert_eq!(same.body, small.body);
    }
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn the_oldest_waiting_message_times_out() {
        let timeout = Duration::from_secs(5);
        let mut c = ConfirmClock::new();
        let first = Instant::now();
        for _ in 0..5 {
            tokio::time::advance(Duration::from_millis(900)).await;
            assert!(!c.overdue(Some(first), false, timeout));
        }
        // It has waited 4.5 s; at 5.4 s it is overdue.
        tokio::time::advance(Duration::from_millis(900)).await;
        assert!(c.overdue(Some(first), false, timeout));
        assert!(!c.overdue(None, false, timeout), "nothing waits");
    }

    #[tokio::test(start_paused = true)]
    async fn alarm_and_stall_time_do_not_count() {
        let timeout = Duration::from_secs(5);
        let mut c = ConfirmClock::new();
        let first = Instant::now();
        for _ in 0..10 {
            tokio::time::advance(Duration::from_secs(1)).await;
            assert!(!c.overdue(Some(first), true, timeout), "blocked");
        }
        for _ in 0..4 {
            tokio::time::advance(Duration::from_secs(1)).await;
            assert!(!c.overdue(Some(first), false, timeout));
        }
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(c.overdue(Some(first), false, timeout), "5 s unblocked");

        // A process stall longer than a few checks restarts the count.
        let mut c = ConfirmClock::new();
        let first = Instant::now();
        tokio::time::advance(Duration::from_secs(60)).await;
        assert!(
            !c.overdue(Some(first), false, timeout),
            "first check after a stall"
        );
        for _ in 0..4 {
            tokio::time::advance(Duration::from_secs(1)).await;
            assert!(!c.overdue(Some(first), false, timeout));
        }
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(
            c.overdue(Some(first), false, timeout),
            "5 s counted since the stall"
        );
    }

    #[test]
    fn retry_delay_doubles_and_caps() {
        let b = Duration::from_millis(100);
        assert_eq!(retry_delay(b, 1), Duration::from_millis(100));
        assert_eq!(retry_delay(b, 2), Duration::from_millis(200));
        assert_eq!(retry_delay(b, 4), Duration::from_millis(800));
        assert_eq!(retry_delay(b, 40), Duration::from_secs(30));
    }
}
