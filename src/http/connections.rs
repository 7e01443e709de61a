//! The connections the endpoint serves, at most a fixed number at once.
//!
//! When all places are taken, a new connection takes that of the
//! connection that has waited longest without a request in progress (one
//! that sent nothing yet, a half-sent request, an idle keep-alive), which is
//! closed. A flood of idle or slow connections therefore cannot keep a probe
//! out: each new connection, the probe's included, pushes out the oldest of
//! them, and the probe's request is answered as soon as it has arrived.
//! Only connections in the middle of a request keep their place; when every
//! one is, the new connection is refused.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tokio_util::sync::CancellationToken;

/// The connections being served.
pub(super) struct Connections {
    max: usize,
    open: Mutex<Open>,
}

#[derive(Default)]
struct Open {
    next: u64,
    by_id: HashMap<u64, Entry>,
}

struct Entry {
    /// Since when it has had no request in progress; `None` while it has.
    idle_since: Option<Instant>,
    /// Cancelled when another connection takes its place.
    evicted: CancellationToken,
}

impl Connections {
    /// Room for `max` connections.
    pub(super) fn new(max: usize) -> Arc<Connections> {
        Arc::new(Connections {
            max,
            open: Mutex::new(Open::default()),
        })
    }

    /// A place for a new connection: a free one, else that of the
    /// connection idle longest, which is told to close (`evicted`). `None`
    /// when every connection has a request in progress.
    pub(super) fn admit(self: &Arc<Self>) -> Option<Place> {
        let mut open = self.open.lock().expect("connections lock");
        if open.by_id.len() >= self.max {
            let oldest = (open.by_id.iter())
                .filter_map(|(id, e)| Some((e.idle_since?, *id)))
                .min()?
                .1;
            let gone = open.by_id.remove(&oldest).expect("listed");
            gone.evicted.cancel();
        }
        let id = open.next;
        open.next += 1;
        let evicted = CancellationToken::new();
        open.by_id.insert(
            id,
            Entry {
                idle_since: Some(Instant::now()),
                evicted: evicted.clone(),
            },
        );
        Some(Place {
            connections: Arc::clone(self),
            id,
            evicted,
        })
    }

    fn set_idle(&self, id: u64, idle: bool) {
        let mut open = self.open.lock().expect("connections lock");
        if let Some(e) = open.by_id.get_mut(&id) {
            e.idle_since = idle.then(Instant::now);
        }
    }
}

/// One connection's place; freed when dropped.
pub(super) struct Place {
    connections: Arc<Connections>,
    id: u64,
    /// Cancelled when another connection took this place: close at once.
    pub(super) evicted: CancellationToken,
}

impl Place {
    /// A request is in progress until the guard is dropped: the connection
    /// keeps its place meanwhile.
    pub(super) fn busy(self: &Arc<Self>) -> Busy {
        self.connections.set_idle(self.id, false);
        Busy(Arc::clone(self))
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        let mut open = self.connections.open.lock().expect("connections lock");
        open.by_id.remove(&self.id);
    }
}

/// See [`Place::busy`].
pub(super) struct Busy(Arc<Place>);

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.connections.set_idle(self.0.id, true);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_house_makes_room_by_closing_the_longest_idle() {
        let c = Connections::new(2);
        let first = Arc::new(c.admit().unwrap());
        let second = Arc::new(c.admit().unwrap());
        let busy_second = second.busy();
        let third = Arc::new(c.admit().expect("room made"));
        assert!(first.evicted.is_cancelled(), "the idle one goes");
        assert!(
            !second.evicted.is_cancelled(),
            "a request in progress stays"
        );
        drop(first);
        let busy_third = third.busy();
        assert!(c.admit().is_none(), "no idle connection left to close");
        drop(busy_second);
        let fourth = c.admit().expect("idle again");
        assert!(second.evicted.is_cancelled());
        assert!(!third.evicted.is_cancelled() && !fourth.evicted.is_cancelled());
        drop(busy_third);
    }
}
