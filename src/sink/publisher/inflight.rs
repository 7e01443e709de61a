//! A message between publish and confirm: what it was published from, its
//! retries, the confirm deadline, and dead letters made to fit.

use super::PublishError;
use crate::checkpoint::Seq;
use crate::message::Envelope;
use crate::message::event_id;
use crate::message::render;
use crate::message::view;
use crate::outbox::OutboxEvent;
use std::time::Duration;
use tokio::time::Instant;

/// What a message is published from.
// Rows keep their columns inline (no allocation per event), and rows
// are the common case: boxing them would add back the allocation.
#[allow(clippy::large_enum_variant)]
pub(super) enum Content {
    /// A decoded row. The first publish encodes it straight from the row
    /// into the connection's write buffer; only a retry renders it into an
    /// owned message.
    Event(OutboxEvent),
    /// A dead letter, fixed once built (cloned for each publish: rare).
    DeadLetter(Box<Envelope>),
}

/// A new message's sizes.
pub(super) struct Sizes {
    /// Its body, for the published-bytes counter (0 for an event: counted
    /// as it is encoded).
    pub(super) body_bytes: usize,
    /// What it holds, counted against `rabbitmq.window_bytes`.
    pub(super) held: usize,
}

/// A message on its way: what to re-publish if it comes back.
pub(super) struct InFlight {
    pub(super) seq: Seq,
    /// The publishing channel it goes out on (its aggregate's), retries
    /// and its dead letter too.
    pub(super) lane: usize,
    pub(super) content: Content,
    /// Publishes so far, this one included.
    pub(super) attempts: u32,
    /// Body size, for the published-bytes counter.
    pub(super) body_bytes: usize,
    /// Bytes it holds, counted against `rabbitmq.window_bytes`.
    pub(super) held: usize,
    /// Commit time of its transaction (µs since the Unix epoch).
    pub(super) commit_time_us: i64,
    pub(super) published_at: Instant,
}

impl InFlight {
    pub(super) fn new(
        seq: Seq,
        content: Content,
        Sizes { body_bytes, held }: Sizes,
        commit_time_us: i64,
    ) -> InFlight {
        InFlight {
            held,
            commit_time_us,
            seq,
            lane: 0,
            content,
            attempts: 0,
            body_bytes,
            published_at: Instant::now(),
        }
    }

    /// The dead letter `dl` in place of `of`: its sequence number, its
    /// transaction's commit time, its channel.
    pub(super) fn dead_letter(of: &InFlight, dl: Envelope) -> InFlight {
        let bytes = dl.body.len();
        let mut d = InFlight::new(
            of.seq,
            Content::DeadLetter(Box::new(dl)),
            Sizes {
                body_bytes: bytes,
                held: bytes,
            },
            of.commit_time_us,
        );
        d.lane = of.lane;
        d
    }

    pub(super) fn is_dead_letter(&self) -> bool {
        matches!(self.content, Content::DeadLetter(_))
    }

    /// The outbox its event came from (0 for a dead letter, which is past
    /// needing one).
    pub(super) fn outbox(&self) -> usize {
        match &self.content {
            Content::Event(ev) => ev.outbox,
            Content::DeadLetter(_) => 0,
        }
    }

    /// The `message_id` it is published with: the event id (a rendered
    /// event always has one), or a dead letter's, which may have none.
    pub(super) fn message_id(&self) -> Option<String> {
        match &self.content {
            Content::Event(ev) => Some(event_id(ev)),
            Content::DeadLetter(env) => env.properties.message_id().as_ref().map(|m| m.to_string()),
        }
    }

    /// Where it is published: exchange and routing key (to tell which
    /// message a return is for; only then, so it may allocate).
    pub(super) fn destination(&self) -> (String, String) {
        match &self.content {
            Content::Event(ev) => match view(ev) {
                Ok(m) => (m.exchange.parts().concat(), m.routing_key.parts().concat()),
                Err(_) => Default::default(),
            },
            Content::DeadLetter(env) => (env.exchange.to_string(), env.routing_key.to_string()),
        }
    }

    /// The message, to publish it again.
    pub(super) fn envelope(&self) -> Result<Envelope, PublishError> {
        match &self.content {
            Content::Event(ev) => render(ev).map_err(PublishError::Render),
            Content::DeadLetter(env) => Ok(Envelope::clone(env)),
        }
    }
}

/// How long the oldest unanswered message has waited, for the confirm
/// timeout. Checked once a second; no timer per message. The oldest is
/// watched, not the newest answer, so one stuck message is noticed even
/// while the broker confirms others around it (confirms may come out of
/// order, e.g. from different queues).
pub(super) struct ConfirmClock {
    /// Waiting before this does not count: the broker blocked publishing
    /// (a resource alarm), or this process did not run for a while (then
    /// answers may be queued, unread).
    pub(super) counted_from: Instant,
    pub(super) last_check: Instant,
}

impl ConfirmClock {
    /// A check comes every second; a longer gap means the process stalled.
    const STALL: Duration = Duration::from_secs(3);

    pub(super) fn new() -> ConfirmClock {
        let now = Instant::now();
        ConfirmClock {
            counted_from: now,
            last_check: now,
        }
    }

    /// Whether the oldest waiting message, published at `oldest`, has
    /// waited `timeout` or more, counting only time the broker was free to
    /// answer.
    pub(super) fn overdue(
        &mut self,
        oldest: Option<Instant>,
        blocked: bool,
        timeout: Duration,
    ) -> bool {
        let now = Instant::now();
        if blocked || now.duration_since(self.last_check) > Self::STALL {
            self.counted_from = now;
        }
        self.last_check = now;
        oldest.is_some_and(|at| now.duration_since(at.max(self.counted_from)) >= timeout)
    }
}

/// Wall clock, µs since the Unix epoch (commit times are in these units).
pub(super) fn unix_now_us() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64)
}

pub(super) async fn after(delay: Duration, f: InFlight) -> InFlight {
    tokio::time::sleep(delay).await;
    f
}

/// Delay before publish number `attempts + 1` of a message: doubling from
/// the configured base, capped at 30 s.
pub(super) fn retry_delay(base: Duration, attempts: u32) -> Duration {
    base.saturating_mul(1u32 << attempts.saturating_sub(1).min(16))
        .min(Duration::from_secs(30))
}

/// Longest `x-outbox-*` header text kept when a dead letter must shrink.
pub(super) const DEAD_LETTER_TEXT_MAX: usize = 1024;

/// A dead letter the broker will take: its body within `max_body` (else
/// dropped, its size kept in `x-outbox-body-bytes`), its properties within
/// one frame (else only the `x-outbox-*` headers are kept, each cut to
/// [`DEAD_LETTER_TEXT_MAX`]). A dead letter the broker refused would be
/// replayed forever.
pub(super) fn fit_dead_letter(mut env: Envelope, frame_max: u32, max_body: usize) -> Envelope {
    use amq_protocol::types::{AMQPValue, FieldTable};
    if env.body.len() > max_body {
        env = env.without_body();
    }
    let fits =
        |e: &Envelope| crate::sink::wire::header_frame_len(&e.properties) <= frame_max as usize;
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
