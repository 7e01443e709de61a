//! How long transactions stay open, for `recover`'s window.
//!
//! An outbox row's `created_at` is usually its transaction's start time, so
//! a row can commit long after the time it carries. When the slot is lost,
//! `recover` re-publishes rows created since the last checkpoint minus an
//! overlap; without `track_commit_timestamp` (which gives each row's commit
//! time) that overlap must exceed the longest transaction, so the relay
//! measures it while it runs, from two unprivileged sources:
//!
//! - `pg_stat_activity.xact_start` of every session it may see (all of
//!   them with `pg_read_all_stats`, else its own role's);
//! - the oldest open transaction id (of the sessions', the prepared
//!   transactions' and the snapshot's): the same id seen again means that
//!   transaction is still open since it was first seen.
//!
//! A transaction shorter than the sampling interval may go unseen; the
//! window adds the interval to what was seen.

use std::time::Duration;

use tokio::time::Instant;
use tokio_postgres::Client;

/// One query for both sources. The oldest open transaction id is the
/// oldest of the sessions' `backend_xid`, the prepared transactions', and
/// the snapshot's xmin when it is below the xmax (then it is one of the
/// running ones; equal to the xmax, it names none: an idle server must not
/// count as one long transaction, and an open transaction at or above the
/// xmax is in no snapshot's list, so the other two sources are needed).
pub const SAMPLE_SQL: &str = "SELECT coalesce(extract(epoch FROM now() - min(xact_start))::float8, 0), \
     (SELECT o.x::text FROM ( \
        SELECT backend_xid AS x FROM pg_stat_activity \
         WHERE backend_xid IS NOT NULL AND pid <> pg_backend_pid() \
        UNION ALL SELECT transaction FROM pg_prepared_xacts \
        UNION ALL SELECT (pg_snapshot_xmin(s)::text::numeric % 4294967296)::text::xid \
          FROM pg_current_snapshot() s WHERE pg_snapshot_xmin(s) < pg_snapshot_xmax(s) \
      ) o ORDER BY age(o.x) DESC LIMIT 1) \
     FROM pg_stat_activity WHERE xact_start IS NOT NULL AND pid <> pg_backend_pid() \
     AND backend_type = 'client backend'";

/// The longest transaction seen so far.
#[derive(Debug, Default)]
pub struct LongestTx {
    /// The oldest running xid last seen, and since when.
    oldest: Option<(String, Instant)>,
    /// The longest seen, in seconds.
    pub longest_secs: f64,
}

impl LongestTx {
    /// Takes one sample; returns the new longest when it grew.
    pub async fn sample(&mut self, sql: &Client, deadline: Duration) -> Option<f64> {
        let row = tokio::time::timeout(deadline, sql.query_one(SAMPLE_SQL, &[]))
            .await
            .ok()?
            .ok()?;
        let started: f64 = row.get(0);
        let xmin: Option<String> = row.get(1);
        Some(started).and_then(|s| self.observe(s, xmin, Instant::now()))
    }

    /// One sample: the oldest visible transaction start (seconds ago) and
    /// the oldest running xid.
    fn observe(&mut self, started_secs: f64, xmin: Option<String>, now: Instant) -> Option<f64> {
        let by_xid = match (&self.oldest, xmin) {
            (Some((seen, since)), Some(x)) if *seen == x => {
                now.duration_since(*since).as_secs_f64()
            }
            (_, Some(x)) => {
                self.oldest = Some((x, now));
                0.0
            }
            (_, None) => {
                self.oldest = None;
                0.0
            }
        };
        let longest = started_secs.max(by_xid);
        (longest > self.longest_secs).then(|| {
            self.longest_secs = longest;
            longest
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_grows_from_either_source() {
        let mut l = LongestTx::default();
        let t0 = Instant::now();
        assert_eq!(l.observe(0.0, Some("100".into()), t0), None);
        // The same oldest xid 20 s later: open for at least 20 s.
        let got = l.observe(1.0, Some("100".into()), t0 + Duration::from_secs(20));
        assert_eq!(got, Some(20.0));
        // It ended; a new oldest xid counts from now, and shorter is no news.
        assert_eq!(
            l.observe(2.0, Some("150".into()), t0 + Duration::from_secs(25)),
            None
        );
        // A visible session whose transaction started 90 s ago.
        assert_eq!(
            l.observe(90.0, Some("150".into()), t0 + Duration::from_secs(30)),
            Some(90.0)
        );
        assert_eq!(l.longest_secs, 90.0);
    }
}
