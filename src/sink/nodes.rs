//! The broker nodes of `rabbitmq.url`, in the order they are tried: as
//! written (or shuffled once, with `rabbitmq.shuffle`), starting after the
//! node whose session last failed, so that a node that accepts connections
//! and then fails does not keep the relay from the healthy ones.
//!
//! With several publishing channels, each starts on a node of its own
//! turn; a node whose session failed in the last [`SHUN_FOR`] takes none
//! while another has not failed (else, as the channels outnumber the
//! nodes, one of them would land on it again at every session).

use std::time::Duration;
use tokio::time::Instant;

use crate::config::RabbitmqConfig;

/// How long a node whose session failed is passed over by the channels'
/// first choices: it is tried again after, when it may have recovered.
pub const SHUN_FOR: Duration = Duration::from_secs(300);

/// Which node to try first, and the order after it.
#[derive(Debug, Clone)]
pub struct Nodes {
    /// Indexes into `rabbitmq.urls`.
    order: Vec<usize>,
    /// Where in `order` the next attempt starts.
    next: usize,
    /// Nodes whose session failed, and when (never all of them).
    failures: Vec<(usize, Instant)>,
}

impl Nodes {
    /// The nodes of `cfg`, shuffled if it says so.
    pub fn new(cfg: &RabbitmqConfig) -> Nodes {
        let mut order: Vec<usize> = (0..cfg.urls.len()).collect();
        if cfg.shuffle {
            // Fisher-Yates.
            for i in (1..order.len()).rev() {
                order.swap(i, rand::random_range(0..=i));
            }
        }
        Nodes {
            order,
            next: 0,
            failures: Vec::new(),
        }
    }

    /// The nodes to try, in order (each once).
    pub fn attempts(&self) -> impl Iterator<Item = usize> + '_ {
        let n = self.order.len();
        (0..n).map(move |k| self.order[(self.next + k) % n])
    }

    /// The order for publishing channel `lane` of several. Channel 0's is
    /// the relay's own (one channel: as ever). Channel `lane` starts on the
    /// `lane`-th node counting from where channel 0 starts, over the nodes
    /// whose session did not fail in the last [`SHUN_FOR`] while there are
    /// any, and tries those that did last: the channels spread over the
    /// cluster's healthy nodes.
    pub fn for_lane(&self, lane: usize) -> Nodes {
        let n = self.order.len().max(1);
        let plain = |next: usize| Nodes {
            order: self.order.clone(),
            next,
            failures: Vec::new(),
        };
        if lane == 0 {
            return plain(self.next);
        }
        let now = Instant::now();
        let failed = |node: &usize| {
            (self.failures.iter()).any(|&(f, at)| f == *node && now.duration_since(at) < SHUN_FOR)
        };
        let rotation = (0..self.order.len()).map(|k| self.order[(self.next + k) % n]);
        let (shunned, healthy): (Vec<usize>, Vec<usize>) = rotation.partition(failed);
        if healthy.is_empty() {
            return plain((self.next + lane) % n);
        }
        let start = lane % healthy.len();
        let order = (healthy[start..].iter())
            .chain(&healthy[..start])
            .chain(&shunned)
            .copied()
            .collect();
        Nodes {
            order,
            next: 0,
            failures: Vec::new(),
        }
    }

    /// `node` was reached: the next attempt starts with it again.
    pub fn reached(&mut self, node: usize) {
        if let Some(at) = self.order.iter().position(|&i| i == node) {
            self.next = at;
        }
    }

    /// The session on `node` failed: the next attempt starts after it,
    /// and the channels pass it over for a while.
    pub fn failed(&mut self, node: usize) {
        if let Some(at) = self.order.iter().position(|&i| i == node) {
            self.next = (at + 1) % self.order.len();
        }
        let now = Instant::now();
        self.failures
            .retain(|&(f, at)| f != node && now.duration_since(at) < SHUN_FOR);
        self.failures.push((node, now));
        // Never all: the oldest failures are forgotten first.
        while self.failures.len() >= self.order.len() && self.failures.len() > 1 {
            self.failures.remove(0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nodes(n: usize) -> Nodes {
        Nodes {
            order: (0..n).collect(),
            next: 0,
            failures: Vec::new(),
        }
    }

    #[test]
    fn nodes_are_tried_in_order_from_after_the_last_failure() {
        let mut n = nodes(3);
        assert_eq!(n.attempts().collect::<Vec<_>>(), [0, 1, 2]);
        n.failed(0);
        assert_eq!(n.attempts().collect::<Vec<_>>(), [1, 2, 0]);
        n.failed(2);
        assert_eq!(n.attempts().collect::<Vec<_>>(), [0, 1, 2]);
        n.reached(1);
        assert_eq!(n.attempts().collect::<Vec<_>>(), [1, 2, 0]);
        let mut one = nodes(1);
        one.failed(0);
        assert_eq!(one.attempts().collect::<Vec<_>>(), [0]);
    }

    /// The first node of each of `lanes` channels.
    fn firsts(n: &Nodes, lanes: usize) -> Vec<usize> {
        (0..lanes)
            .map(|l| n.for_lane(l).attempts().next().unwrap())
            .collect()
    }

    #[test]
    fn channels_spread_over_the_nodes_and_pass_over_one_that_failed() {
        let mut n = nodes(3);
        assert_eq!(firsts(&n, 4), [0, 1, 2, 0]);
        // More channels than nodes: without passing it over, one channel
        // would land on the failed node at every session.
        n.failed(1);
        assert_eq!(firsts(&n, 4), [2, 0, 2, 0]);
        n.failed(2);
        assert_eq!(firsts(&n, 4), [0, 0, 0, 0]);
        // Never all: the oldest failure is forgotten.
        n.failed(0);
        assert_eq!(firsts(&n, 2), [1, 1]);
        // A channel tries every node, those passed over last.
        let mut n = nodes(3);
        n.failed(0);
        assert_eq!(n.for_lane(1).attempts().collect::<Vec<_>>(), [2, 1, 0]);
        // Channel 0 keeps the one-channel order (after the failed node).
        assert_eq!(n.for_lane(0).attempts().collect::<Vec<_>>(), [1, 2, 0]);
        let mut one = nodes(1);
        one.failed(0);
        assert_eq!(firsts(&one, 3), [0, 0, 0]);
    }

    #[test]
    fn a_failure_is_passed_over_only_for_a_while() {
        let mut n = nodes(2);
        let Some(long_ago) = Instant::now().checked_sub(SHUN_FOR + Duration::from_secs(1)) else {
            return;
        };
        n.failed(1);
        assert_eq!(firsts(&n, 2), [0, 0]);
        n.failures = vec![(1, long_ago)];
        assert_eq!(firsts(&n, 2), [0, 1]);
    }

    #[test]
    fn a_shuffled_order_holds_every_node_once() {
        let cfg = crate::config::Config::from_toml(
            "[postgres]\nurl = \"postgres://u@h/db\"\n[outbox]\ntable = \"public.outbox\"\n\
             [rabbitmq]\nurl = [\"amqp://u:p@a/v\", \"amqp://u:p@b/v\", \"amqp://u:p@c/v\", \"amqp://u:p@d/v\"]\n\
             shuffle = true\nexchange = \"x\"\n",
            "test.toml",
            Vec::new(),
        )
        .unwrap();
        let mut seen = std::collections::HashSet::new();
        for _ in 0..50 {
            let n = Nodes::new(&cfg.rabbitmq);
            let mut order: Vec<usize> = n.attempts().collect();
            seen.insert(order.clone());
            order.sort();
            assert_eq!(order, [0, 1, 2, 3]);
        }
        assert!(seen.len() > 1, "never shuffled in 50 tries");
    }
}
