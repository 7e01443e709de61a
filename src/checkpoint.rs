//! The confirmed-LSN watermark.
//!
//! Invariant: [`Checkpoint::confirmed`] is the end LSN of the newest
//! transaction such that it and every transaction before it (in commit order)
//! have had every one of their messages confirmed by the broker. Nothing else
//! is ever reported to PostgreSQL, so the slot's `confirmed_flush_lsn` never
//! passes a message the broker has not taken responsibility for.
//!
//! Transactions arrive in commit order (pgoutput sends whole transactions at
//! commit), so the pending ones form a queue. Confirms may come in any order;
//! each names the message's sequence number, which finds its transaction by
//! binary search over the queue.

use std::collections::VecDeque;

use crate::lsn::Lsn;

/// Sequence number of a published message, unique within a session.
pub type Seq = u64;

#[derive(Debug)]
struct Tx {
    /// Sequence number of the first message of this transaction (or of the
    /// next transaction's first, when this one has none).
    first_seq: Seq,
    /// Messages published and not yet confirmed.
    outstanding: u64,
    /// Set at COMMIT; an open transaction can never be durable.
    end_lsn: Option<Lsn>,
    /// Commit time, microseconds since the Unix epoch.
    commit_time_us: i64,
}

/// The watermark over transactions in commit order.
#[derive(Debug)]
pub struct Checkpoint {
    pending: VecDeque<Tx>,
    next_seq: Seq,
    confirmed: Lsn,
    confirmed_commit_time_us: Option<i64>,
    in_flight: u64,
}

/// Misuse of the watermark by its caller: a stream out of BEGIN/COMMIT order.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CheckpointError {
    /// BEGIN while a transaction is open.
    #[error("BEGIN while a transaction is still open")]
    NestedBegin,
    /// A message or COMMIT with no open transaction.
    #[error("{0} outside a transaction")]
    NoTransaction(&'static str),
    /// A confirm for a message that is not pending.
    #[error("confirm for unknown message {0}")]
    UnknownSeq(Seq),
}

impl Checkpoint {
    /// Starts at `start`, the position the slot already holds as confirmed.
    pub fn new(start: Lsn) -> Self {
        Checkpoint {
            pending: VecDeque::new(),
            next_seq: 0,
            confirmed: start,
            confirmed_commit_time_us: None,
            in_flight: 0,
        }
    }

    fn open_tx(&mut self) -> Option<&mut Tx> {
        self.pending.back_mut().filter(|t| t.end_lsn.is_none())
    }

    /// A transaction begins; `commit_time_us` is its commit time.
    pub fn begin(&mut self, commit_time_us: i64) -> Result<(), CheckpointError> {
        if self.open_tx().is_some() {
            return Err(CheckpointError::NestedBegin);
        }
        self.pending.push_back(Tx {
            first_seq: self.next_seq,
            outstanding: 0,
            end_lsn: None,
            commit_time_us,
        });
        Ok(())
    }

    /// A message of the open transaction is handed to the broker; returns its
    /// sequence number, to be passed to [`Checkpoint::confirm`].
    pub fn publish(&mut self) -> Result<Seq, CheckpointError> {
        let tx = self
            .open_tx()
            .ok_or(CheckpointError::NoTransaction("message"))?;
        tx.outstanding += 1;
        let seq = self.next_seq;
        self.next_seq += 1;
        self.in_flight += 1;
        Ok(seq)
    }

    /// The open transaction commits, ending at `end_lsn`. Returns the new
    /// watermark if it moved (an empty transaction with nothing before it).
    pub fn commit(&mut self, end_lsn: Lsn) -> Result<Option<Lsn>, CheckpointError> {
        let tx = self
            .open_tx()
            .ok_or(CheckpointError::NoTransaction("COMMIT"))?;
        tx.end_lsn = Some(end_lsn);
        Ok(self.advance())
    }

    /// The broker confirmed message `seq`. Returns the new watermark if it
    /// moved.
    pub fn confirm(&mut self, seq: Seq) -> Result<Option<Lsn>, CheckpointError> {
        let idx = self.pending.partition_point(|t| t.first_seq <= seq);
        let tx = idx
            .checked_sub(1)
            .and_then(|i| self.pending.get_mut(i))
            .filter(|t| t.outstanding > 0 && seq < self.next_seq)
            .ok_or(CheckpointError::UnknownSeq(seq))?;
        tx.outstanding -= 1;
        self.in_flight -= 1;
        Ok(self.advance())
    }

    /// The server says it has sent everything up to `wal_end`. When nothing
    /// is pending, nothing before `wal_end` still needs the broker, so the
    /// watermark may move there: this is what keeps an idle outbox from
    /// holding WAL back in a busy database. Returns the new watermark if it
    /// moved.
    pub fn keepalive(&mut self, wal_end: Lsn) -> Option<Lsn> {
        if self.is_idle() && wal_end > self.confirmed {
            self.confirmed = wal_end;
            return Some(wal_end);
        }
        None
    }

    fn advance(&mut self) -> Option<Lsn> {
        let before = self.confirmed;
        while let Some(front) = self.pending.front() {
            match front.end_lsn {
                Some(end) if front.outstanding == 0 => {
                    self.confirmed = self.confirmed.max(end);
                    self.confirmed_commit_time_us = Some(front.commit_time_us);
                    self.pending.pop_front();
                }
                _ => break,
            }
        }
        (self.confirmed > before).then_some(self.confirmed)
    }

    /// The watermark: safe to report as flushed.
    #[cfg(test)]
    pub fn confirmed(&self) -> Lsn {
        self.confirmed
    }

    /// Commit time (µs since the Unix epoch) of the newest durable transaction.
    pub fn confirmed_commit_time_us(&self) -> Option<i64> {
        self.confirmed_commit_time_us
    }

    /// Commit time of the oldest transaction not yet durable.
    pub fn oldest_pending_commit_time_us(&self) -> Option<i64> {
        self.pending.front().map(|t| t.commit_time_us)
    }

    /// Messages published and not yet confirmed.
    pub fn in_flight(&self) -> u64 {
        self.in_flight
    }

    /// No transaction open or waiting for confirms.
    pub fn is_idle(&self) -> bool {
        self.pending.is_empty()
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn waits_for_every_message_of_a_transaction() {
        let mut c = Checkpoint::new(Lsn(10));
        c.begin(0).unwrap();
        let a = c.publish().unwrap();
        let b = c.publish().unwrap();
        assert_eq!(c.commit(Lsn(100)).unwrap(), None);
        assert_eq!(c.confirm(b).unwrap(), None);
        assert_eq!(c.confirmed(), Lsn(10));
        assert_eq!(c.confirm(a).unwrap(), Some(Lsn(100)));
        assert!(c.is_idle());
        assert_eq!(c.in_flight(), 0);
    }

    #[test]
    fn a_later_transaction_confirmed_first_does_not_move_the_watermark() {
        let mut c = Checkpoint::new(Lsn(0));
        c.begin(1).unwrap();
        let t1 = c.publish().unwrap();
        c.commit(Lsn(100)).unwrap();
        c.begin(2).unwrap();
        let t2 = c.publish().unwrap();
        c.commit(Lsn(200)).unwrap();
        assert_eq!(c.confirm(t2).unwrap(), None);
        assert_eq!(c.confirmed(), Lsn(0));
        assert_eq!(c.oldest_pending_commit_time_us(), Some(1));
        assert_eq!(c.confirm(t1).unwrap(), Some(Lsn(200)));
        assert_eq!(c.confirmed_commit_time_us(), Some(2));
    }

    #[test]
    fn an_open_transaction_is_never_durable() {
        let mut c = Checkpoint::new(Lsn(0));
        c.begin(0).unwrap();
        let a = c.publish().unwrap();
        assert_eq!(c.confirm(a).unwrap(), None);
        assert_eq!(c.confirmed(), Lsn(0));
        assert_eq!(c.commit(Lsn(50)).unwrap(), Some(Lsn(50)));
    }

    #[test]
    fn empty_transactions_advance_only_behind_durable_ones() {
        let mut c = Checkpoint::new(Lsn(0));
        c.begin(0).unwrap();
        assert_eq!(c.commit(Lsn(10)).unwrap(), Some(Lsn(10)));
        c.begin(0).unwrap();
        let a = c.publish().unwrap();
        c.commit(Lsn(20)).unwrap();
        c.begin(0).unwrap();
        assert_eq!(
            c.commit(Lsn(30)).unwrap(),
            None,
            "empty tx behind an unconfirmed one"
        );
        c.begin(0).unwrap();
        c.commit(Lsn(40)).unwrap();
        assert_eq!(c.confirm(a).unwrap(), Some(Lsn(40)));
    }

    #[test]
    fn keepalive_moves_the_watermark_only_when_idle() {
        let mut c = Checkpoint::new(Lsn(5));
        assert_eq!(c.keepalive(Lsn(50)), Some(Lsn(50)));
        assert_eq!(c.keepalive(Lsn(40)), None, "never backwards");
        c.begin(0).unwrap();
        assert_eq!(c.keepalive(Lsn(60)), None, "open transaction");
        let a = c.publish().unwrap();
        c.commit(Lsn(70)).unwrap();
        assert_eq!(c.keepalive(Lsn(80)), None, "unconfirmed message");
        assert_eq!(c.confirm(a).unwrap(), Some(Lsn(70)));
        assert_eq!(c.keepalive(Lsn(80)), Some(Lsn(80)));
    }

    #[test]
    fn misuse_is_an_error() {
        let mut c = Checkpoint::new(Lsn(0));
        assert_eq!(c.publish(), Err(CheckpointError::NoTransaction("message")));
        assert_eq!(
            c.commit(Lsn(1)),
            Err(CheckpointError::NoTransaction("COMMIT"))
        );
        c.begin(0).unwrap();
        assert_eq!(c.begin(0), Err(CheckpointError::NestedBegin));
        let a = c.publish().unwrap();
        c.confirm(a).unwrap();
        assert_eq!(c.confirm(a), Err(CheckpointError::UnknownSeq(a)));
        assert_eq!(c.confirm(99), Err(CheckpointError::UnknownSeq(99)));
    }

    proptest! {
        /// Any interleaving of confirms: the watermark only ever equals the end
        /// of a transaction whose prefix is fully confirmed, and ends at the last.
        #[test]
        fn watermark_is_the_durable_prefix(
            sizes in proptest::collection::vec(0usize..5, 1..20),
            order_seed in any::<u64>(),
        ) {
            let mut c = Checkpoint::new(Lsn(0));
            let mut seqs = Vec::new(); // (seq, tx index)
            for (i, n) in sizes.iter().enumerate() {
                c.begin(i as i64).unwrap();
                for _ in 0..*n { seqs.push((c.publish().unwrap(), i)); }
                c.commit(Lsn((i as u64 + 1) * 10)).unwrap();
            }
            // Deterministic shuffle from the seed.
            let mut state = order_seed | 1;
            for i in (1..seqs.len()).rev() {
                state ^= state << 13; state ^= state >> 7; state ^= state << 17;
                seqs.swap(i, (state % (i as u64 + 1)) as usize);
            }
            let mut confirmed = vec![0usize; sizes.len()];
            for (seq, tx) in seqs {
                c.confirm(seq).unwrap();
                confirmed[tx] += 1;
                // Expected: end of the longest fully-confirmed prefix.
                let prefix = sizes.iter().zip(&confirmed).take_while(|(n, k)| *n == *k).count();
                let expected = if prefix == 0 { 0 } else { prefix as u64 * 10 };
                prop_assert_eq!(c.confirmed(), Lsn(expected));
            }
            prop_assert_eq!(c.confirmed(), Lsn(sizes.len() as u64 * 10));
            prop_assert!(c.is_idle());
        }
    }
}
