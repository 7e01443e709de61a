//! The one place that decides what the relay does next.
//!
//! ```text
//!             ┌──────────── slot lost (on_slot_lost = "recover") ───────────┐
//!             ▼                                                             │
//! start ─▶ Finishing ──done──▶ Streaming ──transient: back off, again──┐    │
//!             ▲  │                │  ▲                                 │    │
//!             │  └─slot lost─▶ Recovering ──done──▶ (Streaming)        └────┘
//!             │                   │
//!             └── another process is re-publishing (RecoveryPending)
//! ```
//!
//! - **Finishing**: a recovery recorded earlier (by `recover`, or a relay
//!   stopped half way through one) is finished before anything streams;
//!   with none recorded it is done at once. Entered at start and whenever a
//!   session finds another process re-publishing.
//! - **Recovering**: the slot was lost and `postgres.on_slot_lost =
//!   "recover"`: the slot is made again and the rows written since the last
//!   checkpoint re-published. A slot lost again soon after is a stop.
//! - **Streaming**: sessions, one after another ([`super::session`]): a
//!   transient failure backs off and starts another; while another process
//!   holds the slot, the relay stands by and polls for it.
//!
//! Whatever the phase, a stop asked for ends it cleanly (nothing in flight
//! is reported), and a failure that is not transient stops the relay with
//! the error that names what to fix. Each change of phase is logged with
//! its reason.

use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use super::session::{Memory, Session};
use super::{SLOT_BUSY_LOG_EVERY, SLOT_BUSY_RETRY, backoff};
use crate::config::{Config, OnSlotLost};
use crate::error::RelayError;
use crate::lsn::Lsn;
use crate::metrics::{Metrics, TargetLabel};
use crate::recover::{self, RecoverOutcome};
use crate::sink::refusals::learn;
use crate::source::{SQL_DEADLINE, SourceError};

/// How long after the relay recovered a lost slot losing it again stops
/// the relay instead.
const RECOVER_AGAIN_AFTER: Duration = Duration::from_secs(600);

/// What the relay is doing (see the module's picture).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Finishing,
    Recovering,
    Streaming,
}

/// What a step of a phase decided.
enum Next {
    /// The same phase again after `delay` (a transient failure); a stop
    /// asked for meanwhile ends the relay cleanly.
    Retry { delay: Duration, after: RelayError },
    /// Another phase, for this reason.
    Enter(Phase, &'static str),
    /// The relay ends with this.
    Stop(Result<Option<Lsn>, RelayError>),
}

/// Owns everything that outlives a session, and decides between finishing
/// or making a recovery, streaming, standing by and stopping.
pub(super) struct Supervisor<'a> {
    cfg: &'a Config,
    metrics: &'a Metrics,
    shutdown: CancellationToken,
    /// What sessions learn for the next (see [`Memory`]); made anew when
    /// streaming starts after a recovery, whose slot is a new one.
    memory: Memory,
    /// Failures in a row, for the backoff.
    attempt: u32,
    /// When "standing by" was last logged.
    busy_logged: Option<Instant>,
    /// When this process last recovered a lost slot: a slot lost again
    /// soon after means the recovery cannot keep up (e.g.
    /// `max_slot_wal_keep_size` below what re-publishing the window
    /// writes), and recovering again would only repeat the window.
    recovered_at: Option<Instant>,
}

impl<'a> Supervisor<'a> {
    pub(super) fn new(cfg: &'a Config, metrics: &'a Metrics, shutdown: CancellationToken) -> Self {
        Supervisor {
            cfg,
            metrics,
            shutdown,
            memory: Memory::new(cfg),
            attempt: 0,
            busy_logged: None,
            recovered_at: None,
        }
    }

    /// Runs until a stop (the final confirmed LSN; `None` when it came with
    /// nothing in flight) or a failure that is not transient.
    pub(super) async fn run(mut self) -> Result<Option<Lsn>, RelayError> {
        let mut phase = Phase::Finishing;
        loop {
            let next = match phase {
                Phase::Finishing | Phase::Recovering => self.recover(phase).await,
                Phase::Streaming => self.stream().await,
            };
            match next {
                Next::Stop(r) => return r,
                Next::Retry { delay, after } => {
                    tokio::select! {
                        _ = self.shutdown.cancelled() => {
                            info!(last_error = %after, "stopped while waiting to reconnect");
                            return Ok(None);
                        }
                        _ = tokio::time::sleep(delay) => {}
                    }
                }
                Next::Enter(to, why) => {
                    info!(from = ?phase, to = ?to, reason = why, "relay phase");
                    if phase == Phase::Streaming || to == Phase::Streaming {
                        self.attempt = 0;
                    }
                    // Timed from its end: a recovery that re-published
                    // for longer than the guard still guards the loop.
                    if phase == Phase::Recovering && to == Phase::Streaming {
                        self.recovered_at = Some(Instant::now());
                    }
                    if to == Phase::Streaming {
                        self.memory = Memory::new(self.cfg);
                        self.busy_logged = None;
                    }
                    phase = to;
                }
            }
        }
    }

    /// One step of finishing a recorded recovery, or of recovering a lost
    /// slot.
    async fn recover(&mut self, phase: Phase) -> Next {
        let (cfg, shutdown) = (self.cfg, &self.shutdown);
        let step = async {
            if phase == Phase::Recovering {
                // Counted by the relay that re-published: another that saw
                // the same loss finds the slot healthy once it has the lock.
                recover::recover_lost_slot(cfg, shutdown)
                    .await
                    .map(|outcome| match outcome {
                        RecoverOutcome::Republished { published, .. } => {
                            self.metrics.slot_recoveries.inc();
                            published.is_none_or(|p| p.complete)
                        }
                        RecoverOutcome::Healthy(_) => true,
                    })
            } else {
                recover::finish_pending(cfg, shutdown).await
            }
        };
        // A stop is honoured even where a step does not look at it (a query
        // the server never answers): the step has the grace period to drain
        // its confirms, and two SQL deadlines more to close the broker
        // (5 s at most) and save its progress, then it is cut. Whatever it
        // recorded stays, as after a kill; whether it had found a recovery
        // to finish is not known, so the exit says only what to do.
        let cut = async {
            shutdown.cancelled().await;
            tokio::time::sleep(cfg.rabbitmq.shutdown_grace + 2 * SQL_DEADLINE).await;
        };
        let step = tokio::select! {
            r = step => r,
            () = cut => {
                return Next::Stop(Err(RelayError::Interrupted(format!(
                    "stopped while a recovery step of slot {:?} did not answer within the \
                     shutdown grace period (rabbitmq.shutdown_grace_secs) and {} s more; start \
                     `outbox-relay run` again: a recovery it recorded is finished then",
                    cfg.postgres.slot,
                    (2 * SQL_DEADLINE).as_secs()
                ))));
            }
        };
        match step {
            Ok(true) => Next::Enter(Phase::Streaming, "no recovery left to finish"),
            // Stopped by a signal half way: the record stays, and the exit
            // says the recovery is not finished (a service manager that
            // restarts on failure restarts it).
            Ok(false) => Next::Stop(Err(RelayError::Interrupted(format!(
                "stopped before the recovery of slot {:?} was finished; it is recorded: start \
                 `outbox-relay run` (or `outbox-relay recover`) again to finish it",
                cfg.postgres.slot
            )))),
            // The recovery recorded earlier lost its slot too (killed
            // mid-recovery, then another failover): with `recover`, the
            // lost slot is recovered, which resumes that record's window
            // from its start, not a stop forever.
            Err(RelayError::Source(SourceError::SlotLost(why)))
                if phase == Phase::Finishing && self.recovers_lost_slots() =>
            {
                self.slot_lost(
                    &why,
                    "replication slot lost during a recovery: recreating it and re-publishing \
                     the recorded window (postgres.on_slot_lost = \"recover\")",
                )
            }
            Err(e) if e.is_transient() && !self.shutdown.is_cancelled() => {
                let delay = backoff(self.attempt);
                self.attempt += 1;
                warn!(reason = %e, retry_in_ms = delay.as_millis() as u64, "finishing the recovery");
                Next::Retry { delay, after: e }
            }
            Err(e) if e.is_transient() => Next::Stop(Ok(None)),
            Err(e) => Next::Stop(Err(e)),
        }
    }

    /// One session, and what its end means.
    async fn stream(&mut self) -> Next {
        let ended = Session::run(self.cfg, &mut self.memory, &self.shutdown, self.metrics).await;
        if ended.progressed {
            self.memory.refusals.careful_for = 0;
        }
        let r = match ended.result {
            Err(RelayError::Sink(e)) => {
                match learn(self.cfg, &e, ended.head, &mut self.memory.refusals) {
                    Some(stop) => Err(stop.into()),
                    None => Err(RelayError::Sink(e)),
                }
            }
            other => other,
        };
        let e = match r {
            Ok(lsn) => return Next::Stop(Ok(lsn)),
            Err(e) => e,
        };
        if self.shutdown.is_cancelled() && e.is_transient() {
            // A failure the stop itself caused (a connection cut short).
            info!(last_error = %e, "stopped while connecting");
            return Next::Stop(Ok(None));
        }
        if e.is_transient() {
            if ended.progressed {
                self.attempt = 0;
            }
            return Next::Retry {
                delay: self.reconnect_delay(&e),
                after: e,
            };
        }
        match e {
            RelayError::Source(SourceError::SlotLost(why)) if self.recovers_lost_slots() => self
                .slot_lost(
                    &why,
                    "replication slot lost: recreating it and re-publishing the outbox rows \
                     written since the last checkpoint (postgres.on_slot_lost = \"recover\"); \
                     consumers will see duplicates",
                ),
            // Another relay (or `recover`) is re-publishing: back to
            // finishing the recovery, which waits for its lock.
            RelayError::Source(SourceError::RecoveryPending(slot))
                if !self.shutdown.is_cancelled() =>
            {
                info!(%slot, "a recovery is under way: waiting for it before streaming");
                Next::Enter(Phase::Finishing, "another process is re-publishing")
            }
            // Stopped while connecting found it: nothing to wait for.
            RelayError::Source(SourceError::RecoveryPending(_)) => {
                info!("stopped while connecting");
                Next::Stop(Ok(None))
            }
            e => Next::Stop(Err(e)),
        }
    }

    /// How long to wait before the next session after `e`.
    fn reconnect_delay(&mut self, e: &RelayError) -> Duration {
        if matches!(e, RelayError::Source(SourceError::SlotBusy { .. })) {
            // Another relay holds the slot: poll often so a standby takes
            // over soon after it dies, but log rarely.
            if (self.busy_logged).is_none_or(|t| t.elapsed() >= SLOT_BUSY_LOG_EVERY) {
                warn!(reason = %e, "standing by: waiting for the slot");
                self.busy_logged = Some(Instant::now());
            }
            return SLOT_BUSY_RETRY.mul_f64(rand::random_range(0.5..1.0));
        }
        (self.metrics.reconnects)
            .get_or_create(&TargetLabel { target: e.target() })
            .inc();
        let delay = backoff(self.attempt);
        self.attempt = self.attempt.saturating_add(1);
        warn!(reason = %e, retry_in_ms = delay.as_millis() as u64, attempt = self.attempt, "reconnecting");
        delay
    }

    fn recovers_lost_slots(&self) -> bool {
        self.cfg.postgres.on_slot_lost == OnSlotLost::Recover && !self.shutdown.is_cancelled()
    }

    /// The slot is lost and the relay recovers lost slots: recover it,
    /// unless it was lost again within [`RECOVER_AGAIN_AFTER`] of the last
    /// recovery (then re-publishing the window in a loop is no answer).
    fn slot_lost(&mut self, why: &str, message: &'static str) -> Next {
        if (self.recovered_at).is_some_and(|t| t.elapsed() < RECOVER_AGAIN_AFTER) {
            return Next::Stop(Err(RelayError::Source(SourceError::Setup(format!(
                "{why}; the slot was lost again within {} minutes of its recovery: not \
                 recovering in a loop. Find out why (max_slot_wal_keep_size, a failover under \
                 way, someone dropping it), then run `outbox-relay recover`",
                RECOVER_AGAIN_AFTER.as_secs() / 60
            )))));
        }
        error!(reason = %why, "{message}");
        Next::Enter(Phase::Recovering, "the replication slot was lost")
    }
}
