//! `CC` and `BCC` from a row's headers, when its outbox does not set
//! `routing_headers = true`: dropped (a row must not copy itself to routing
//! keys of its choosing), and said in the log at most once a minute, with
//! how many were dropped meanwhile.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// At most one log line per this long.
const EVERY: Duration = Duration::from_secs(60);

/// Dropped since the last line.
static DROPPED: AtomicU64 = AtomicU64::new(0);
/// When the last line was written.
static LAST: Mutex<Option<Instant>> = Mutex::new(None);

/// The row `id` had a `key` (`CC` or `BCC`) header, dropped.
pub(super) fn dropped(id: &str, key: &str) {
    let n = DROPPED.fetch_add(1, Ordering::Relaxed) + 1;
    let Ok(mut last) = LAST.try_lock() else {
        return;
    };
    if last.is_some_and(|t| t.elapsed() < EVERY) {
        return;
    }
    *last = Some(Instant::now());
    DROPPED.fetch_sub(n, Ordering::Relaxed);
    tracing::warn!(
        event_id = %crate::logtext::Shown(id),
        header = key,
        dropped = n,
        "dropped the row's routing header (CC/BCC routes a copy of the message to keys the \
         row chooses); set routing_headers = true on the outbox to send them (said at most \
         once a minute)"
    );
}
