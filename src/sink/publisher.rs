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

use super::refusals::{Head, Refusals};
use super::refused::{self, Refusal, RefusedExchanges};
use super::replies::Disposition;
use super::unconfirmed::Unconfirmed;
use super::wire::{Event, Found};
use super::{Broker, SinkError};
use crate::checkpoint::{Checkpoint, CheckpointError, Progress};
use crate::config::RabbitmqConfig;
use crate::handoff::{ByteBudget, Item};
use crate::logtext::Shown;
use crate::lsn::Lsn;
use crate::message::{
    Envelope, MessageView, RenderError, dead_letter_unrenderable, event_id, view_within,
};
use prometheus_client::metrics::counter::Counter;

use crate::metrics::{ChannelLabel, Metrics, Outcome, OutcomeLabel};
use crate::outbox::OutboxEvent;

mod answers;
#[cfg(test)]
mod fake;
mod inflight;
mod settle;
use answers::Answers;
use inflight::{
    ConfirmClock, Content, InFlight, Sizes, after, fit_dead_letter, retry_delay, unix_now_us,
};

/// Why publishing stopped. The relay reports the broker's failures as its
/// own `Sink` errors, the others as they are (see `crate::error::RelayError`).
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
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
    /// The stream broke BEGIN/COMMIT order.
    #[error("replication stream out of order: {0}")]
    Order(#[from] CheckpointError),
}

impl PublishError {
    /// Worth a new session (as `RelayError::is_transient` decides for it).
    pub fn is_transient(&self) -> bool {
        match self {
            PublishError::Sink(e) => e.is_transient(),
            PublishError::Render(_) | PublishError::Undeliverable { .. } => false,
            PublishError::Order(_) => true,
        }
    }
}

/// The loop's state.
struct Publisher<'a> {
    /// Counter handles resolved once: a labelled lookup takes a lock.
    published: Counter,
    dead_lettered: Counter,
    cfg: &'a RabbitmqConfig,
    /// Each outbox's dead-letter exchange, by its index.
    dead_letters: &'a [Option<String>],
    metrics: &'a Metrics,
    cp: Checkpoint,
    watermark: &'a watch::Sender<Progress>,
    /// The publishing channels' own state, one per `rabbitmq.channels`
    /// (the connections themselves are passed in beside).
    lanes: Vec<Lane>,
    /// The channels due for a look for answers.
    answers: Answers,
    /// The channel whose answers are looked at first, in turn.
    turn: usize,
    /// The channel whose connection failed (an error from its answers).
    failed_lane: Option<usize>,
    /// Reused for the messages one answer settles.
    settled: Vec<(InFlight, Result<(), SinkError>)>,
    /// Re-publishes waiting for their delay.
    retries: FuturesUnordered<Retry>,
    clock: ConfirmClock,
    /// What earlier sessions learnt.
    refusals: &'a Refusals,
    /// Templated exchanges the broker refused (404, 403): events bound for
    /// them are dead-lettered instead of closing the channel. Taken from
    /// `refusals` for the session, given back when it ends.
    refused: RefusedExchanges,
    /// Templated exchanges the broker said exist this session (a passive
    /// declare before the first event to each): an event is never the
    /// first to find one missing, so a missing one closes no channel and
    /// sends nothing again. At most [`refused::CAP`] names, then forgotten
    /// all at once (each costs one more check).
    verified: HashSet<String>,
    /// Events published this session.
    sent: u64,
    /// Bytes held by messages not yet confirmed (waiting, or waiting for a
    /// retry), against `rabbitmq.window_bytes`.
    held: usize,
    /// The input queue's byte budget, given back as items are taken.
    budget: &'a ByteBudget,
    /// A stop asked for (a signal): what is outstanding gets the grace
    /// period.
    stop: &'a CancellationToken,
    /// Input is still taken.
    open: bool,
    /// When the grace period ends, once a stop started it.
    drain_deadline: Option<Instant>,
    /// The broker blocks publishing, as last said.
    blocked: bool,
    /// The gauges' and the confirm deadline's once a second.
    gauges: tokio::time::Interval,
}

/// One publishing channel (a connection of its own): what waits for its
/// answers, in its own delivery-tag order. An event's aggregate picks its
/// channel ([`lane_of`]), so one aggregate's events, their retries and
/// their dead letters all go out on one channel, in commit order.
#[derive(Default)]
struct Lane {
    /// Messages published and not yet answered, by delivery tag.
    unconfirmed: Unconfirmed<InFlight>,
    /// The event waiting for its templated exchange to be looked for; no
    /// new event is taken meanwhile (their order).
    held_back: Option<(InFlight, String)>,
    /// When the passive declare for the held-back event's exchange was
    /// sent (its answer is due like a confirm); `None`: none is out.
    looking_since: Option<Instant>,
    /// Its events not yet confirmed (waiting for an answer or for a
    /// retry): what its window counts.
    in_flight: u64,
}

/// The channel of `ev` among `lanes`: a stable hash (FNV-1a) of its
/// aggregate (the raw `aggregate_type` and `aggregate_id` values), the same
/// in every session and process. An event whose columns cannot be read
/// goes on the first (it is dead-lettered or stops the relay there).
fn lane_of(ev: &OutboxEvent, lanes: usize) -> usize {
    if lanes <= 1 {
        return 0;
    }
    let Ok(m) = &ev.mapping else { return 0 };
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for col in [m.aggregate_type, m.aggregate_id] {
        let bytes = ev.value(col).map_or(&[][..], |b| &b[..]);
        // The length first: ("ab", "c") and ("a", "bc") differ.
        for b in (bytes.len() as u64).to_le_bytes().iter().chain(bytes) {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    (h % lanes as u64) as usize
}

type Retry = std::pin::Pin<Box<dyn Future<Output = InFlight> + Send>>;

/// Whether an event's templated exchange is looked for before it is sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verify {
    /// Yes, unless the broker said it exists this session.
    First,
    /// No: the event was sent before (its exchange was looked for then).
    Skip,
}

/// Publishes of a message the broker keeps nacking before it is
/// dead-lettered: with the doubling backoff (capped at 30 s) about two
/// minutes at the default `retry_backoff_ms`, long enough for a queue to
/// drain, short enough that one message cannot hold the stream.
const NACK_ATTEMPTS: u32 = 10;

impl<'a> Publisher<'a> {
    /// The dead-letter exchange of events of `outbox` (`None`: they stop
    /// the relay instead).
    fn dlx(&self, outbox: usize) -> Option<&'a str> {
        match self.dead_letters.get(outbox) {
            Some(d) => d.as_deref(),
            None => self.cfg.dead_letter_exchange.as_deref(),
        }
    }

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
        f: &InFlight,
        env: Envelope,
        reason: &str,
    ) -> Result<InFlight, PublishError> {
        let attempts = f.attempts;
        let Some(dlx) = self.dlx(f.outbox()) else {
            error!(event_id = %Shown(env.id()), reason, "undeliverable event and no dead-letter exchange; stopping");
            return Err(PublishError::Undeliverable {
                id: env.id().to_owned(),
                reason: reason.to_owned(),
            });
        };
        error!(event_id = %Shown(env.id()), channel = f.lane, reason, attempts, dead_letter_exchange = %dlx, "dead-lettering event");
        let dl = env.dead_letter(dlx, reason, attempts);
        Ok(InFlight::dead_letter(f, dl))
    }

    /// A new event: check it, publish it (encoded straight from the row),
    /// or dead-letter it.
    /// `bytes`: the row's size ([`OutboxEvent::bytes`]), measured once.
    /// Returns the channel it went to.
    fn publish_event(
        &mut self,
        sinks: &mut [impl Broker],
        ev: OutboxEvent,
        bytes: usize,
    ) -> Result<usize, PublishError> {
        let seq = self.cp.publish()?;
        self.sent += 1;
        let commit_time_us = ev.commit_time_us;
        let lane = lane_of(&ev, self.lanes.len());
        self.lanes[lane].in_flight += 1;
        let mut f = InFlight::new(
            seq,
            Content::Event(ev),
            Sizes {
                body_bytes: 0,
                held: bytes,
            },
            commit_time_us,
        );
        f.lane = lane;
        let sink = self.answers.sink(sinks, lane);
        let sent = self.send_event(sink, f, Verify::First);
        self.blame(lane, sent).map(|()| lane)
    }

    /// `r`, and, if it failed, `lane` as the channel the session failed on
    /// (whose node the next session keeps off, whose oldest message is the
    /// head blamed).
    fn blame<T>(&mut self, lane: usize, r: Result<T, PublishError>) -> Result<T, PublishError> {
        if r.is_err() {
            self.failed_lane = Some(lane);
        }
        r
    }

    /// Publishes the event `f` holds, encoded straight from its row, or its
    /// dead letter in its place; or holds it back until its templated
    /// exchange has been looked for (`verify`).
    fn send_event(
        &mut self,
        sink: &mut impl Broker,
        mut f: InFlight,
        verify: Verify,
    ) -> Result<(), PublishError> {
        let Content::Event(ev) = &f.content else {
            let env = f.envelope()?;
            self.held += f.held;
            return self.launch(sink, f, env);
        };
        let sent = match self.message(ev, sink.frame_max())? {
            Ok(view) => match self.unverified(ev, &view, verify) {
                None => Ok((sink.publish_view(&view)?, view.body.len())),
                Some(exchange) => Err(exchange),
            },
            Err(dl) => {
                let d = InFlight::dead_letter(&f, dl);
                self.held += d.held;
                let env = d.envelope()?;
                return self.launch(sink, d, env);
            }
        };
        let (tag, body_bytes) = match sent {
            Ok(sent) => sent,
            Err(exchange) => {
                let lane = &mut self.lanes[f.lane];
                debug_assert!(lane.held_back.is_none(), "one event held back at a time");
                lane.held_back = Some((f, exchange));
                return Ok(());
            }
        };
        f.body_bytes = body_bytes;
        self.held += f.held;
        self.lanes[f.lane].unconfirmed.push(tag, f);
        Ok(())
    }

    /// The templated exchange `m` goes to when the broker has not yet said
    /// it exists this session, and an answer would matter: its events can
    /// be dead-lettered. (Without a dead-letter exchange a missing one
    /// stops the relay either way.)
    fn unverified(&self, ev: &OutboxEvent, m: &MessageView<'_>, verify: Verify) -> Option<String> {
        // A guard is what a templated exchange has, and only it.
        let templated = ev
            .mapping
            .as_ref()
            .is_ok_and(|m| m.exchange_guard.is_some());
        if verify == Verify::Skip || !templated || self.dlx(ev.outbox).is_none() {
            return None;
        }
        let exchange = m.exchange.parts().concat();
        (!self.answered(&exchange)).then_some(exchange)
    }

    /// Whether the broker has said this session what `exchange` is (it
    /// exists, or it refused it), or the config names it.
    fn answered(&self, exchange: &str) -> bool {
        self.verified.contains(exchange)
            || self.cfg.fixed_exchanges.iter().any(|x| x == exchange)
            || self.refused.refusal(exchange).is_some()
    }

    /// Moves the held-back event on: sends it (or its dead letter) once
    /// the broker has said whether its exchange exists, else asks (a
    /// passive declare on the control channel, answered among the
    /// confirms: nothing waits for it).
    fn release(&mut self, sink: &mut impl Broker, lane: usize) -> Result<(), PublishError> {
        let (f, exchange) = (self.lanes[lane].held_back.take()).expect("called when held back");
        if self.answered(&exchange) {
            return self.send_event(sink, f, Verify::First);
        }
        sink.look_for(&exchange)?;
        self.lanes[lane].looking_since = Some(Instant::now());
        self.lanes[lane].held_back = Some((f, exchange));
        Ok(())
    }

    /// The broker's answer to the passive declare for `name`: learnt, for
    /// [`Publisher::release`] to act on.
    fn on_found(&mut self, lane: usize, name: String, found: Found) {
        self.lanes[lane].looking_since = None;
        match found {
            Found::Exists => {
                if self.verified.len() >= refused::CAP {
                    self.verified.clear();
                }
                self.verified.insert(name);
            }
            Found::Missing => {
                warn!(exchange = %Shown(&name), "the broker has no such templated exchange; its events are dead-lettered (it is looked for again in a minute)");
                self.refused.insert(name, Refusal::Missing);
            }
            Found::Forbidden(reply) => {
                warn!(exchange = %Shown(&name), reply = %Shown(&reply), "the broker refuses this templated exchange; its events are dead-lettered (it is tried again in a minute)");
                self.refused.insert(name, Refusal::Forbidden);
            }
        }
    }

    /// The broker closed the publishing channel over `e`. When it refused
    /// a templated exchange (404: none such; 403: not ours to write), and
    /// the events bound there can be dead-lettered, the name is learnt,
    /// the channel opened again, and what waited for a confirm published
    /// again in order (those events now dead-lettered): no new session per
    /// name. Anything else ends the session.
    async fn route_around(
        &mut self,
        sink: &mut impl Broker,
        lane: usize,
        e: SinkError,
    ) -> Result<(), PublishError> {
        let (exchange, refusal) = match e.disposition() {
            Disposition::MissingExchange(x) => (x, Refusal::Missing),
            Disposition::RefusedExchange(x) => (x, Refusal::Forbidden),
            _ => return Err(e.into()),
        };
        let is = |d: &Option<String>| d.as_deref() == Some(exchange.as_str());
        let configured = self.cfg.fixed_exchanges.contains(&exchange)
            || self.dead_letters.iter().any(is)
            || is(&self.cfg.dead_letter_exchange);
        let any_dlx = self.dead_letters.iter().any(Option::is_some)
            || self.cfg.dead_letter_exchange.is_some();
        // Refused again while known refused: its events were not sent to
        // it since, so the reply named something else (cut short, or not
        // one of ours). End the session rather than reopen for ever. (With
        // several channels, one may learn the refusal while another still
        // waits on events it sent there before: its close is explained.)
        let sent_before =
            || (self.lanes[lane].unconfirmed.iter()).any(|f| f.destination().0 == exchange);
        let again = self.refused.refusal(&exchange).is_some() && !sent_before();
        if configured || !any_dlx || again {
            return Err(e.into());
        }
        if self.refused.refusal(&exchange).is_none() {
            warn!(exchange = %Shown(&exchange), reason = %e, "the broker refuses this templated exchange; its events are dead-lettered (it is tried again in a minute)");
        }
        self.verified.remove(&exchange);
        self.refused.insert(exchange, refusal);
        sink.reopen().await?;
        // Sent before: sent again as they were, none held back (their
        // order).
        for mut f in self.lanes[lane].unconfirmed.take_all() {
            self.held -= f.held;
            f.published_at = Instant::now();
            self.send_event(sink, f, Verify::Skip)?;
        }
        Ok(())
    }

    /// The message for `ev`, or (`Err`) its dead letter when it cannot be
    /// sent as it stands; without a dead-letter exchange, the error that
    /// stops the relay.
    fn message<'e>(
        &self,
        ev: &'e OutboxEvent,
        frame_max: u32,
    ) -> Result<Result<MessageView<'e>, Envelope>, PublishError> {
        // The broker would close the connection over a content header that
        // does not fit in a frame (and again on every replay): refuse it
        // here, and dead-letter it without its headers.
        let m = view_within(ev, frame_max).and_then(|m| match m.header_bytes() {
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
                let Some(dlx) = self.dlx(ev.outbox) else {
                    error!(error = %e, "undeliverable event and no dead-letter exchange; stopping");
                    return Err(PublishError::Render(e));
                };
                error!(event_id = %Shown(&event_id(ev)), reason = %e, dead_letter_exchange = %dlx, "dead-lettering event");
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
        if !self.refusals.poison.is_empty()
            && let Some(reason) = self.refusals.poison.get(m.message_id)
        {
            let Some(dlx) = self.dlx(ev.outbox) else {
                return Err(PublishError::Undeliverable {
                    id: m.message_id.to_owned(),
                    reason: reason.clone(),
                });
            };
            error!(event_id = %Shown(m.message_id), %reason, dead_letter_exchange = %dlx, "dead-lettering event");
            // Bare: whatever in its headers or body the broker refused
            // is not sent again.
            let dl = m.to_envelope().dead_letter(dlx, reason, 0);
            return Ok(Err(fit_dead_letter(dl, 0, 0)));
        }
        if !self.refused.is_empty() {
            let exchange = m.exchange.parts().concat();
            if let Some(refusal) = self.refused.refusal(&exchange) {
                let reason = refusal.reason(&exchange);
                let Some(dlx) = self.dlx(ev.outbox) else {
                    return Err(PublishError::Undeliverable {
                        id: m.message_id.to_owned(),
                        reason,
                    });
                };
                error!(event_id = %Shown(m.message_id), %reason, dead_letter_exchange = %dlx, "dead-lettering event");
                return Ok(Err(m.to_envelope().dead_letter(dlx, &reason, 0)));
            }
        }
        let limit = self.max_body();
        if m.body.len() > limit {
            let Some(dlx) = self.dlx(ev.outbox) else {
                return Err(PublishError::Undeliverable {
                    id: m.message_id.to_owned(),
                    reason: format!(
                        "body of {} bytes exceeds rabbitmq.max_message_bytes ({limit})",
                        m.body.len()
                    ),
                });
            };
            error!(event_id = %Shown(m.message_id), bytes = m.body.len(), limit, "dead-lettering oversized event");
            return Ok(Err(m.to_envelope().dead_letter_oversized(dlx, limit)));
        }
        Ok(Ok(m))
    }

    /// Hands a message to the broker (written with the next wait for an
    /// answer).
    fn launch(
        &mut self,
        sink: &mut impl Broker,
        mut f: InFlight,
        env: Envelope,
    ) -> Result<(), PublishError> {
        let env = if f.is_dead_letter() {
            fit_dead_letter(env, sink.frame_max(), self.max_body())
        } else {
            env
        };
        f.published_at = Instant::now();
        let tag = sink.publish(env)?;
        self.lanes[f.lane].unconfirmed.push(tag, f);
        Ok(())
    }

    /// A broker answer: settle what it answers, schedule retries.
    fn on_answer(&mut self, lane: usize, ev: Event) -> Result<(), PublishError> {
        let mut settled = std::mem::take(&mut self.settled);
        self.lanes[lane].unconfirmed.apply(
            ev,
            InFlight::message_id,
            InFlight::destination,
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

    /// A new item from the source, in WAL order; the channel it went to,
    /// if it is an event.
    fn on_item(
        &mut self,
        sinks: &mut [impl Broker],
        item: Item,
    ) -> Result<Option<usize>, PublishError> {
        let mut lane = None;
        match item {
            Item::Begin { commit_time_us } => self.cp.begin(commit_time_us)?,
            Item::Event(ev) => {
                let bytes = ev.bytes();
                self.budget.give_back(ByteBudget::cost_of(bytes));
                lane = Some(self.publish_event(sinks, ev, bytes)?);
            }
            Item::Commit { end_lsn } => {
                let moved = self.cp.commit(end_lsn)?;
                self.advance(moved);
            }
            Item::Keepalive { wal_end } => {
                let moved = self.cp.keepalive(wal_end);
                self.advance(moved);
            }
        }
        Ok(lane)
    }

    /// `queued`: items waiting in the queue from the source.
    fn update_gauges(&self, queued: usize) {
        let in_flight = self.cp.in_flight() as i64;
        self.metrics.in_flight.set(in_flight);
        (self.metrics.unconfirmed_events).set(in_flight.saturating_add(queued as i64));
        (self.metrics.unconfirmed_bytes).set(self.held as i64);
        for (channel, l) in self.lanes.iter().enumerate() {
            let label = ChannelLabel {
                channel: channel as u32,
            };
            let gauge = self.metrics.channel_in_flight.get_or_create(&label);
            gauge.set(l.in_flight.try_into().unwrap_or(i64::MAX));
        }
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

/// The tags between the oldest unanswered message and the newest stay
/// within this many windows.
const SPAN_WINDOWS: usize = 4;

/// What a run of the publisher works with, besides the connection and its
/// input.
pub struct Publishing<'a> {
    /// The broker's settings.
    pub cfg: &'a RabbitmqConfig,
    /// Each outbox's dead-letter exchange, by its index.
    pub dead_letters: &'a [Option<String>],
    /// What earlier runs learnt the broker refuses; what this run learns of
    /// missing exchanges is added to it.
    pub refusals: &'a mut Refusals,
    /// The input's byte budget, given back as items are taken.
    pub budget: &'a ByteBudget,
    /// The position the watermark starts from.
    pub start: Lsn,
    /// Where outcomes are counted.
    pub metrics: &'a Metrics,
}

/// Why a run of the publisher failed, and the message it was on.
#[derive(Debug)]
pub struct Failed {
    /// Why.
    pub error: PublishError,
    /// The oldest unconfirmed event, for the next run to blame if the same
    /// failure comes back (see [`super::refusals::learn`]).
    pub head: Option<Head>,
    /// The publishing channel whose connection failed, when one did (its
    /// node is tried last next time).
    pub lane: Option<usize>,
}

/// Runs until `items` closes and every message is settled (after a stop,
/// or until the shutdown grace period ends), or until a failure (a confirm
/// overdue among them).
///
/// One task drives the connections, one per publishing channel
/// (`sinks`, at least one): publishes are queued into their write buffers
/// a batch at a time (whatever the source has ready, up to `BATCH`) and
/// written in one go while the loop waits for answers. One watermark
/// covers them all: a transaction is reported once every message of it,
/// and of every transaction before it, is confirmed, on whichever channel.
pub async fn run<S: Broker>(
    sinks: &mut [S],
    mut items: mpsc::Receiver<Item>,
    watermark: &watch::Sender<Progress>,
    Publishing {
        cfg,
        dead_letters,
        refusals,
        budget,
        start,
        metrics,
    }: Publishing<'_>,
    stop: &CancellationToken,
) -> Result<(), Failed> {
    // Taken for the session, given back when it ends.
    let refused = std::mem::take(&mut refusals.missing);
    let outcome = |outcome| {
        metrics
            .events
            .get_or_create(&OutcomeLabel { outcome })
            .clone()
    };
    // A session starts unblocked (the broker says `connection.blocked` anew
    // on a connection that must wait), whatever the last one ended in: a
    // gauge left at 1 would keep `/readyz` at 503 and the alert firing.
    metrics.blocked.set(0);
    assert!(!sinks.is_empty(), "at least one publishing channel");
    let mut p = Publisher {
        published: outcome(Outcome::published),
        dead_lettered: outcome(Outcome::dead_lettered),
        cfg,
        dead_letters,
        metrics,
        cp: Checkpoint::new(start),
        watermark,
        lanes: (0..sinks.len()).map(|_| Lane::default()).collect(),
        answers: Answers::new(sinks.len()),
        turn: 0,
        failed_lane: None,
        settled: Vec::new(),
        retries: FuturesUnordered::new(),
        clock: ConfirmClock::new(),
        refusals,
        refused,
        verified: HashSet::new(),
        sent: 0,
        held: 0,
        budget,
        stop,
        open: true,
        drain_deadline: None,
        blocked: false,
        gauges: tokio::time::interval(Duration::from_secs(1)),
    };
    let r = p.run(sinks, &mut items).await;
    let lane = p.failed_lane.take();
    // Between sessions nothing is blocked: the next connection is asked anew.
    metrics.blocked.set(0);
    // Which message the session failed with, for the next one to blame
    // if this keeps happening (see `replies`).
    let head = r.is_err().then(|| {
        let alone = p.sent <= p.refusals.careful_for;
        // The failing channel's oldest (none: it had nothing in flight,
        // and no message is to blame), else the oldest of all.
        let oldest = match lane {
            Some(l) => p.lanes[l].unconfirmed.oldest(),
            None => (p.lanes.iter().filter_map(|l| l.unconfirmed.oldest())).min_by_key(|f| f.seq),
        };
        let id = oldest.and_then(InFlight::message_id)?;
        Some(Head {
            id,
            alone,
            sent: p.sent,
        })
    });
    let refused = std::mem::take(&mut p.refused);
    drop(p);
    refusals.missing = refused;
    r.map_err(|error| Failed {
        error,
        head: head.flatten(),
        lane,
    })
}

impl Publisher<'_> {
    /// The loop: one branch per source of work, by priority.
    async fn run<S: Broker>(
        &mut self,
        sinks: &mut [S],
        items: &mut mpsc::Receiver<Item>,
    ) -> Result<(), PublishError> {
        loop {
            if !self.open && self.cp.in_flight() == 0 {
                return Ok(());
            }
            let blocked = self.note_blocked(sinks.iter().any(Broker::is_blocked));
            let room = self.room(sinks);
            // A channel whose held-back event may move on. (Not while
            // blocked: the broker reads nothing from a blocked connection.
            // Not while its publishing channel is closed: its reopening
            // comes first.)
            let releasable = (!blocked)
                .then(|| {
                    (self.lanes.iter().zip(sinks.iter())).position(|(l, s)| {
                        l.held_back.is_some() && l.looking_since.is_none() && s.publishing_open()
                    })
                })
                .flatten();
            let flushing = sinks.iter().any(Broker::wants_flush);
            let first = self.turn;
            self.turn = (self.turn + 1) % sinks.len();
            tokio::select! {
                biased;
                // 1. Once a second, first: it must not starve behind a
                // stream of answers (the confirm deadline, the gauges).
                _ = self.gauges.tick() => self.on_tick(items.len())?,
                // 2. Broker answers: they free the window and move the
                // watermark (waiting for them writes what is queued).
                (lane, ev) = self.answers.next(sinks, first) => match ev {
                    Ok(ev) => {
                        let r = self.on_broker(lane, ev);
                        self.blame(lane, r)?;
                    }
                    // The publishing channel closed: routed around when it
                    // can be.
                    Err(e) => {
                        self.failed_lane = Some(lane);
                        let sink = self.answers.sink(sinks, lane);
                        self.route_around(sink, lane, e).await?;
                        self.failed_lane = None;
                    }
                },
                // 3. An event waits for its exchange to be looked for, or
                // has its answer.
                () = std::future::ready(()), if releasable.is_some() => {
                    let lane = releasable.expect("guarded");
                    let sink = self.answers.sink(sinks, lane);
                    let r = self.release(sink, lane);
                    self.blame(lane, r)?;
                }
                // 4. Retries whose delay is over.
                Some(f) = self.retries.next(), if !self.retries.is_empty() && !blocked && !flushing => {
                    let env = f.envelope()?;
                    let lane = f.lane;
                    let sink = self.answers.sink(sinks, lane);
                    let r = self.launch(sink, f, env);
                    self.blame(lane, r)?;
                }
                // 5. New WAL, while there is room.
                item = items.recv(), if room => self.on_items(sinks, item, items)?,
                // 6. A stop: no more WAL; outstanding confirms get the
                // grace period. (While the broker blocks us the item
                // channel is not read, so its closing cannot be what starts
                // the clock.)
                _ = self.stop.cancelled(), if self.drain_deadline.is_none() => self.close(),
                // 7. The grace period over.
                _ = tokio::time::sleep_until(self.drain_deadline.unwrap_or_else(Instant::now)), if self.drain_deadline.is_some() => {
                    warn!(in_flight = self.cp.in_flight(), "shutdown grace period over with unconfirmed messages; they were not reported and will be replayed");
                    return Ok(());
                }
            }
        }
    }

    /// Whether the broker blocks publishing (a resource alarm), said once
    /// per change.
    fn note_blocked(&mut self, blocked: bool) -> bool {
        if blocked != self.blocked {
            if blocked {
                warn!("broker blocked publishing (resource alarm); pausing WAL reading");
            } else {
                info!("broker unblocked publishing; resuming");
            }
            self.metrics.blocked.set(i64::from(blocked));
            self.blocked = blocked;
        }
        blocked
    }

    /// Room for more: within the window's count and bytes (one message
    /// always goes, however large), and the write buffer not backed up
    /// (the broker applying TCP flow control).
    ///
    /// The next event may go to any channel: every one must have room (a
    /// full one holds the others back, as it holds back the watermark).
    /// While the publisher is careful (a session after one failed on its
    /// head) one message at a time is in flight in all.
    fn room(&self, sinks: &[impl Broker]) -> bool {
        self.room_in_all() && (0..self.lanes.len()).all(|lane| self.room_in(lane, &sinks[lane]))
    }

    /// [`Publisher::room`] after an item given that there was room before
    /// it: only the channel the item went to (if any) can have filled up.
    fn room_after(&self, sinks: &[impl Broker], lane: Option<usize>) -> bool {
        self.room_in_all() && lane.is_none_or(|lane| self.room_in(lane, &sinks[lane]))
    }

    /// What [`Publisher::room`] asks of all channels together.
    fn room_in_all(&self) -> bool {
        let careful = self.sent < self.refusals.careful_for;
        self.open
            && !self.blocked
            && (!careful || self.cp.in_flight() == 0)
            && (self.held < self.cfg.window_bytes || self.cp.in_flight() == 0)
    }

    /// What [`Publisher::room`] asks of channel `lane`.
    fn room_in(&self, lane: usize, sink: &impl Broker) -> bool {
        let full_window = self.cfg.window as u64;
        let l = &self.lanes[lane];
        l.held_back.is_none()
            && l.in_flight < full_window
            // One message left unanswered while the rest are confirmed
            // must not grow the tag list without bound: publishing
            // pauses, and the confirm deadline ends it.
            && l.unconfirmed.span() < SPAN_WINDOWS * full_window as usize
            && !sink.wants_flush()
    }

    /// Once a second: the gauges, and the deadline of the oldest answer
    /// due (a passive declare's answer is due as a confirm is).
    fn on_tick(&mut self, queued: usize) -> Result<(), PublishError> {
        self.update_gauges(queued);
        // The answer due longest, and its channel (blamed if overdue).
        let due = (self.lanes.iter().enumerate())
            .filter_map(|(i, l)| {
                let confirm = l.unconfirmed.oldest().map(|f| f.published_at);
                let at = match (confirm, l.looking_since) {
                    (Some(c), Some(k)) => c.min(k),
                    (c, k) => c.or(k)?,
                };
                Some((at, i))
            })
            .min();
        let oldest = due.map(|(at, _)| at);
        if (self.clock).overdue(oldest, self.blocked, self.cfg.confirm_timeout) {
            let (at, lane) = due.expect("overdue only with an answer due");
            self.failed_lane = Some(lane);
            if self.lanes[lane].looking_since == Some(at) {
                return Err(SinkError::Timeout("checking a templated exchange").into());
            }
            return Err(SinkError::ConfirmTimeout {
                in_flight: self.lanes.iter().map(|l| l.unconfirmed.len() as u64).sum(),
                secs: self.cfg.confirm_timeout.as_secs(),
            }
            .into());
        }
        Ok(())
    }

    /// What the broker said: an exchange looked for, or confirms and
    /// returns.
    fn on_broker(&mut self, lane: usize, ev: Event) -> Result<(), PublishError> {
        match ev {
            Event::Exchange { name, found } => {
                self.on_found(lane, name, found);
                Ok(())
            }
            ev => self.on_answer(lane, ev),
        }
    }

    /// An item from the source (`None`: its end), and what else is ready,
    /// so that it goes out in one write.
    fn on_items(
        &mut self,
        sinks: &mut [impl Broker],
        item: Option<Item>,
        items: &mut mpsc::Receiver<Item>,
    ) -> Result<(), PublishError> {
        let Some(item) = item else {
            self.close();
            return Ok(());
        };
        // There was room for the first (the loop's guard): after each,
        // only the channel it went to can have filled up.
        let mut lane = self.on_item(sinks, item)?;
        for _ in 1..BATCH {
            let room = self.room_after(sinks, lane);
            debug_assert_eq!(room, self.room(sinks), "room after an item, on {lane:?}");
            if !room {
                break;
            }
            match items.try_recv() {
                Ok(item) => lane = self.on_item(sinks, item)?,
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    self.close();
                    break;
                }
            }
        }
        Ok(())
    }

    /// No more input. Ended by a stop (a signal), outstanding confirms get
    /// the shutdown grace period. Ended by itself (a recovery handed over
    /// its last row, the stream failed), they are waited for, as any
    /// confirm is, within `rabbitmq.confirm_timeout_secs` of the broker
    /// being free to answer; a stop asked for meanwhile starts the grace
    /// period.
    fn close(&mut self) {
        self.open = false;
        let in_flight = self.cp.in_flight();
        if !self.stop.is_cancelled() {
            if in_flight > 0 {
                info!(in_flight, "input ended; waiting for outstanding confirms");
            }
            return;
        }
        if in_flight > 0 {
            info!(
                in_flight,
                grace_secs = self.cfg.shutdown_grace.as_secs(),
                "waiting for outstanding confirms"
            );
        }
        self.drain_deadline = Some(Instant::now() + self.cfg.shutdown_grace);
    }
}

#[cfg(test)]
mod tests;
