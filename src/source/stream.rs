//! The source half of a session: reads the replication stream, decodes
//! pgoutput, and hands BEGIN / event / COMMIT / keepalive items to the sink
//! half (`sink::publisher`) in WAL order, while it reports back to the
//! server the position the sink half confirmed.

use pgwire_replication::{ReplicationClient, ReplicationEvent};
use tokio::sync::{Notify, mpsc, watch};
use tokio_util::sync::CancellationToken;

use super::SourceError;
use super::silence::{Silence, Silent};
use crate::checkpoint::Progress;
use crate::handoff::{ByteBudget, Item};
use crate::metrics::Metrics;
use crate::outbox::{Decoded, OutboxDecoder, PG_EPOCH_OFFSET_US};

/// The source half's state for one session.
pub struct Stream<'a> {
    /// The replication stream.
    pub repl: &'a mut ReplicationClient,
    /// pgoutput to events, with the relation cache.
    pub decoder: &'a mut OutboxDecoder,
    /// The hand-off to the sink half.
    pub items: mpsc::Sender<Item>,
    /// Its byte budget (large rows).
    pub budget: &'a ByteBudget,
    /// The position to report to the server, as it moves.
    pub reported: &'a mut watch::Receiver<Progress>,
    /// How long the stream may be silent (see `source::silence`).
    pub silence: Silence,
    /// Notified to probe a silent stream.
    pub probe: &'a Notify,
    /// Notified when the walsender read further though it sent nothing.
    pub alive: &'a Notify,
    /// Counts transactions, positions, skipped messages.
    pub metrics: &'a Metrics,
}

impl Stream<'_> {
    /// Runs until `stop` (or the sink half ending: its result is the
    /// session's), or a failure of the stream.
    pub async fn run(mut self, stop: &CancellationToken) -> Result<(), SourceError> {
        loop {
            // Priorities, highest first.
            let ev = tokio::select! {
                biased;
                // 1. A stop.
                _ = stop.cancelled() => return Ok(()),
                // 2. Progress back to the server.
                Ok(()) = self.reported.changed() => {
                    report(self.repl, self.reported);
                    continue;
                }
                // 3. WAL.
                ev = self.repl.recv() => ev,
                // 4. The walsender alive though silent.
                _ = self.alive.notified() => {
                    self.silence.heard();
                    continue;
                }
                // 5. Silence: probe, then give up on the stream.
                _ = tokio::time::sleep_until(self.silence.deadline()) => {
                    self.on_silence()?;
                    continue;
                }
            };
            self.silence.heard();
            let Some(item) = self.on_wal(ev)? else {
                continue;
            };
            if !self.hand_off(item, stop).await {
                return Ok(());
            }
            // Time spent waiting for the sink is not the stream's silence.
            self.silence.heard();
        }
    }

    /// Silence past its deadline: probe first, then the stream is stalled.
    fn on_silence(&mut self) -> Result<(), SourceError> {
        match self.silence.expired() {
            Silent::Probe => {
                self.probe.notify_one();
                Ok(())
            }
            Silent::Stalled(for_) => Err(SourceError::Stalled(for_)),
        }
    }

    /// What a message of the stream hands to the sink half, if anything.
    fn on_wal(
        &mut self,
        ev: Result<Option<ReplicationEvent>, pgwire_replication::PgWireError>,
    ) -> Result<Option<Item>, SourceError> {
        let item = match ev {
            Ok(Some(ReplicationEvent::Begin {
                commit_time_micros,
                xid,
                final_lsn,
            })) => {
                (self.decoder).begin_tx(commit_time_micros, xid, final_lsn.into());
                Item::Begin {
                    commit_time_us: commit_time_micros.saturating_add(PG_EPOCH_OFFSET_US),
                }
            }
            Ok(Some(ReplicationEvent::XLogData { data, .. })) => {
                let decoded = self.decoder.decode(data)?;
                return Ok(self.item(decoded));
            }
            Ok(Some(ReplicationEvent::Commit { end_lsn, .. })) => {
                self.decoder.commit();
                self.metrics.transactions.inc();
                self.metrics.received_lsn.set(end_lsn.as_u64());
                Item::Commit {
                    end_lsn: end_lsn.into(),
                }
            }
            Ok(Some(ReplicationEvent::KeepAlive { wal_end, .. })) => {
                self.metrics.received_lsn.set(wal_end.as_u64());
                Item::Keepalive {
                    wal_end: wal_end.into(),
                }
            }
            Ok(Some(ReplicationEvent::Message {
                transactional,
                lsn,
                prefix,
                content,
            })) => {
                let decoded = (self.decoder).message(transactional, &prefix, content, lsn.into());
                return Ok(self.item(decoded?));
            }
            Ok(Some(ReplicationEvent::StoppedAt { .. })) => return Ok(None),
            Ok(None) => return Err(SourceError::Ended),
            Err(source) => {
                return Err(SourceError::Replication {
                    url: String::from("replication connection"),
                    source,
                });
            }
        };
        Ok(Some(item))
    }

    /// What a decoded WAL message sends the publisher, if anything; counts
    /// a skipped non-transactional outbox message.
    fn item(&self, decoded: Decoded) -> Option<Item> {
        match decoded {
            Decoded::Event(ev) => Some(Item::Event(ev)),
            Decoded::Nothing => None,
            Decoded::Skipped => {
                self.metrics.skipped_messages.inc();
                None
            }
        }
    }

    /// Waits for room in the hand-off (a large row: for its bytes too)
    /// while still reporting progress; false when the session ends first.
    async fn hand_off(&mut self, item: Item, stop: &CancellationToken) -> bool {
        let cost = ByteBudget::cost(&item);
        let mut taken = cost == 0;
        loop {
            tokio::select! {
                biased;
                // 1. A stop.
                _ = stop.cancelled() => return false,
                // 2. Progress back to the server.
                Ok(()) = self.reported.changed() => report(self.repl, self.reported),
                // 3. The row's bytes, then its place in the queue.
                _ = self.budget.take(cost), if !taken => taken = true,
                permit = self.items.reserve(), if taken => match permit {
                    Ok(p) => {
                        p.send(item);
                        return true;
                    }
                    // The sink ended; its result is the session's.
                    Err(_) => return false,
                },
            }
        }
    }
}

/// The position confirmed moved: the server may free WAL up to it.
fn report(repl: &mut ReplicationClient, reported: &mut watch::Receiver<Progress>) {
    repl.update_applied_lsn(reported.borrow_and_update().lsn.into());
}
