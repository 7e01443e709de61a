//! The hand-off between the pipeline's two halves: the items the source
//! reads from the replication stream, in WAL order (`source::stream`), and
//! the publisher takes (`sink::publisher`), over a queue bounded in items
//! and, for large rows, in bytes.
//!
//! The queue holds a fixed number of items; with 1 MiB rows that count
//! alone would be hundreds of MiB. Large rows therefore also take their size
//! from a byte budget before they are queued, and give it back when the
//! publisher takes them. Small rows (the common case) take nothing: the item
//! count bounds them, and the hot path does no bookkeeping for them.

use tokio::sync::Semaphore;

use crate::lsn::Lsn;
use crate::outbox::OutboxEvent;

/// One item from source to sink, in WAL order.
#[derive(Debug)]
// Rows keep their columns inline (no allocation per event), and rows
// are the common case: boxing them would add back the allocation.
#[allow(clippy::large_enum_variant)]
pub enum Item {
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

/// Rows smaller than this are bounded by the queue's item count alone.
pub const SMALL_ROW: usize = 16 * 1024;

/// Bytes of large rows waiting in the queue at most (one row is always let
/// through, however large).
pub const QUEUE_BYTES: usize = 16 * 1024 * 1024;

/// A byte budget shared by the two ends of one session's queue.
#[derive(Debug)]
pub struct ByteBudget {
    bytes: Semaphore,
}

impl Default for ByteBudget {
    fn default() -> Self {
        ByteBudget {
            bytes: Semaphore::new(QUEUE_BYTES),
        }
    }
}

impl ByteBudget {
    /// What queueing `item` costs: its row's size, capped at the whole
    /// budget (so any row can pass once the queue is empty); 0 for anything
    /// small.
    pub fn cost(item: &Item) -> u32 {
        match item {
            Item::Event(ev) => Self::cost_of(ev.bytes()),
            _ => 0,
        }
    }

    /// The cost of a row of `bytes` ([`crate::outbox::OutboxEvent::bytes`]).
    pub fn cost_of(bytes: usize) -> u32 {
        if bytes < SMALL_ROW {
            0
        } else {
            bytes.min(QUEUE_BYTES) as u32
        }
    }

    /// Waits until `cost` bytes are free, and takes them. Cancel-safe.
    pub async fn take(&self, cost: u32) {
        if cost == 0 {
            return;
        }
        if let Ok(permit) = self.bytes.acquire_many(cost).await {
            permit.forget();
        }
    }

    /// The publisher took an item that cost `cost`.
    pub fn give_back(&self, cost: u32) {
        if cost > 0 {
            self.bytes.add_permits(cost as usize);
        }
    }
}
