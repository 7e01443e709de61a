//! Which publishing channels to look at for an answer.
//!
//! Looking at a channel (polling its [`Broker::answer`]) registers a waker
//! with its socket and its heartbeat timer: with N channels, looking at all
//! of them for each answer costs N registrations (each a lock) where one
//! would do. So each channel gets a waker of its own, which marks it due
//! and wakes the loop; a look goes only to the channels that are due:
//!
//! - woken since they were last looked at (bytes to read, room to write,
//!   a heartbeat due);
//! - touched by the loop since ([`Answers::sink`]: a publish queued bytes
//!   to write, a passive declare, a channel reopened with another waker);
//! - answered at their last look (more may be buffered).
//!
//! Every channel starts due. A channel is let go (no longer due) only
//! after a look that found nothing, made with its own waker, so whatever
//! would make it ready wakes it again.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::task::{Context, Poll, Wake, Waker};

use futures_util::task::AtomicWaker;

use super::super::wire::Event;
use super::super::{Broker, SinkError};

/// The channels woken, and the loop's waker to pass it on to.
#[derive(Default)]
struct Woken {
    /// Bit `i`: channel `i` was woken since the loop last took the bits.
    bits: AtomicU32,
    /// The loop's task.
    task: AtomicWaker,
}

/// One channel's waker.
struct LaneWaker {
    bit: u32,
    woken: Arc<Woken>,
}

impl Wake for LaneWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.bits.fetch_or(self.bit, Ordering::AcqRel);
        self.woken.task.wake();
    }
}

/// The channels due for a look, and their wakers.
pub(super) struct Answers {
    woken: Arc<Woken>,
    wakers: Vec<Waker>,
    /// Bit `i`: channel `i` is due for a look.
    due: u32,
}

impl Answers {
    /// For `lanes` channels (at most 32), every one due.
    pub(super) fn new(lanes: usize) -> Answers {
        assert!(
            (1..=32).contains(&lanes),
            "1 to 32 publishing channels (rabbitmq.channels is at most 16)"
        );
        let woken = Arc::new(Woken::default());
        let wakers = (0..lanes)
            .map(|i| {
                Waker::from(Arc::new(LaneWaker {
                    bit: 1 << i,
                    woken: Arc::clone(&woken),
                }))
            })
            .collect();
        Answers {
            woken,
            wakers,
            due: all(lanes),
        }
    }

    /// Channel `lane`, for the loop to do something to (queue bytes, ask
    /// a question, reopen it): it is due for a look from now on. Outside a
    /// look the loop reaches a channel mutably only through here: one
    /// changed behind its back could hold an answer no waker announces,
    /// unread until the confirm deadline ends the session.
    pub(super) fn sink<'s, S>(&mut self, sinks: &'s mut [S], lane: usize) -> &'s mut S {
        self.due |= 1 << lane;
        &mut sinks[lane]
    }

    /// The next answer from any of `sinks` that is due, and whose, starting
    /// with `first` (in turn, so that no channel's answers wait behind a
    /// busy one's). Each channel's [`Broker::answer`] future is made and
    /// dropped per look: it is cancel-safe, and the waker it registered
    /// stays.
    pub(super) fn next<'s, S: Broker>(
        &'s mut self,
        sinks: &'s mut [S],
        first: usize,
    ) -> impl Future<Output = (usize, Result<Event, SinkError>)> + 's {
        debug_assert_eq!(sinks.len(), self.wakers.len());
        std::future::poll_fn(move |cx| self.poll_next(sinks, first, cx))
    }

    fn poll_next<S: Broker>(
        &mut self,
        sinks: &mut [S],
        first: usize,
        cx: &mut Context<'_>,
    ) -> Poll<(usize, Result<Event, SinkError>)> {
        // Registered before the bits are taken: a wake after the taking
        // finds this waker.
        self.woken.task.register(cx.waker());
        self.due |= self.woken.bits.swap(0, Ordering::AcqRel);
        let n = sinks.len();
        for k in 0..n {
            let i = (first + k) % n;
            let bit = 1 << i;
            if self.due & bit == 0 {
                continue;
            }
            let mut own = Context::from_waker(&self.wakers[i]);
            let answer = std::pin::pin!(sinks[i].answer());
            match answer.poll(&mut own) {
                // Still due: more may be buffered.
                Poll::Ready(r) => return Poll::Ready((i, r)),
                Poll::Pending => self.due &= !bit,
            }
        }
        Poll::Pending
    }
}

/// The bits of channels `0..lanes`.
fn all(lanes: usize) -> u32 {
    u32::MAX >> (32 - lanes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_channel_starts_due() {
        assert_eq!(all(1), 0b1);
        assert_eq!(all(3), 0b111);
        assert_eq!(all(32), u32::MAX);
        assert_eq!(Answers::new(5).due, 0b1_1111);
    }

    #[test]
    fn a_channel_woken_is_due_and_wakes_the_loop() {
        let a = Answers::new(3);
        let flag = Arc::new(Flag::default());
        a.woken.task.register(&Waker::from(Arc::clone(&flag)));
        a.wakers[2].wake_by_ref();
        assert_eq!(a.woken.bits.load(Ordering::Acquire), 0b100);
        assert!(flag.0.load(Ordering::Acquire), "the loop's task is woken");
    }

    #[derive(Default)]
    struct Flag(std::sync::atomic::AtomicBool);
    impl Wake for Flag {
        fn wake(self: Arc<Self>) {
            self.0.store(true, Ordering::Release);
        }
    }
}
