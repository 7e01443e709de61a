//! What the publisher does with the broker's answer to one message: a
//! confirm moves the checkpoint; a return or a nack publishes it again
//! after a backoff, until its attempts run out and it is dead-lettered.

use std::time::Duration;

use tracing::warn;

use super::inflight::InFlight;
use super::{NACK_ATTEMPTS, PublishError, Publisher, retry_delay, unix_now_us};
use crate::logtext::Shown;
use crate::metrics::{ReasonLabel, RetryReason};
use crate::sink::SinkError;

impl Publisher<'_> {
    /// The broker answered `f`. Returns what to publish again, and when.
    pub(super) fn settle(
        &mut self,
        f: InFlight,
        res: Result<(), SinkError>,
    ) -> Result<Option<(Duration, InFlight)>, PublishError> {
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
                self.lanes[f.lane].in_flight -= 1;
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
                let reason = |n| {
                    format!(
                        "unroutable: exchange {exchange:?} has no queue bound for routing key {routing_key:?} ({reply}) after {n} attempts"
                    )
                };
                let limit = self.cfg.unroutable_attempts;
                let channel = f.lane;
                self.again_or_dead_letter(f, id, limit, RetryReason::returned, reason, |id, n, delay| {
                    warn!(event_id = %Shown(id), channel, attempt = n, retry_in_ms = delay.as_millis() as u64, exchange = %Shown(&exchange), routing_key = %Shown(&routing_key), "unroutable; will publish again");
                })
            }
            Err(SinkError::Nacked { id }) => {
                let reason = |n| {
                    format!(
                        "nacked by the broker {n} times (e.g. a full queue with x-overflow = \
                         reject-publish)"
                    )
                };
                let channel = f.lane;
                self.again_or_dead_letter(f, id, NACK_ATTEMPTS, RetryReason::nacked, reason, |id, n, delay| {
                    warn!(event_id = %Shown(id), channel, attempt = n, retry_in_ms = delay.as_millis() as u64, "broker nacked; will publish again");
                })
            }
            Err(e) => Err(e.into()),
        }
    }

    /// `f` refused once more (returned, or nacked): published again after
    /// a backoff, counted and logged (`log`), until `limit` attempts; then
    /// dead-lettered, saying `reason`. A dead letter has nowhere further
    /// to go: returned that often (the dead-letter exchange routes it
    /// nowhere), it stops the relay; nacked (its queue full, with
    /// `x-overflow = reject-publish`), it is published again for as long
    /// as it takes, at the longest backoff, holding the confirmed position
    /// as any message the broker holds back: a full dead-letter queue is
    /// the broker's back-pressure, not a reason to stop.
    fn again_or_dead_letter(
        &mut self,
        mut f: InFlight,
        id: String,
        limit: u32,
        why: RetryReason,
        reason: impl FnOnce(u32) -> String,
        log: impl FnOnce(&str, u32, Duration),
    ) -> Result<Option<(Duration, InFlight)>, PublishError> {
        f.attempts += 1;
        // A nacked dead letter waits for its queue, however long.
        let waits = f.is_dead_letter() && why == RetryReason::nacked;
        if waits && f.attempts == limit {
            warn!(event_id = %Shown(&id), channel = f.lane, attempts = f.attempts, exchange = %Shown(&f.destination().0), "dead letter nacked again and again (its queue full?); it is published again until the broker takes it, and the confirmed position waits for it");
        }
        if f.attempts >= limit && !waits {
            let reason = reason(f.attempts);
            if f.is_dead_letter() {
                let exchange = f.destination().0;
                return Err(SinkError::DeadLetterRefused {
                    id,
                    exchange,
                    reason,
                }
                .into());
            }
            let env = f.envelope()?;
            let dl = self.dead_letter(&f, env, &reason)?;
            self.held = self.held - f.held + dl.held;
            return Ok(Some((Duration::ZERO, dl)));
        }
        self.metrics
            .retries
            .get_or_create(&ReasonLabel { reason: why })
            .inc();
        let delay = retry_delay(self.cfg.retry_backoff, f.attempts);
        log(&id, f.attempts, delay);
        Ok(Some((delay, f)))
    }
}
