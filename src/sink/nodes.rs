//! The broker nodes of `rabbitmq.url`, in the order they are tried: as
//! written (or shuffled once, with `rabbitmq.shuffle`), starting after the
//! node whose session last failed, so that a node that accepts connections
//! and then fails does not keep the relay from the healthy ones.

use crate::config::RabbitmqConfig;

/// Which node to try first, and the order after it.
#[derive(Debug, Clone)]
pub struct Nodes {
    /// Indexes into `rabbitmq.urls`.
    order: Vec<usize>,
    /// Where in `order` the next attempt starts.
    next: usize,
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
        Nodes { order, next: 0 }
    }

    /// The nodes to try, in order (each once).
    pub fn attempts(&self) -> impl Iterator<Item = usize> + '_ {
        let n = self.order.len();
        (0..n).map(move |k| self.order[(self.next + k) % n])
    }

    /// The order for publishing channel `lane` of several: starting
    /// `lane` nodes further on, so that the channels spread over the
    /// cluster's nodes.
    pub fn for_lane(&self, lane: usize) -> Nodes {
        let n = self.order.len();
        Nodes {
            order: self.order.clone(),
            next: (self.next + lane) % n.max(1),
        }
    }

    /// `node` was reached: the next attempt starts with it again.
    pub fn reached(&mut self, node: usize) {
        if let Some(at) = self.order.iter().position(|&i| i == node) {
            self.next = at;
        }
    }

    /// The session on `node` failed: the next attempt starts after it.
    pub fn failed(&mut self, node: usize) {
        if let Some(at) = self.order.iter().position(|&i| i == node) {
            self.next = (at + 1) % self.order.len();
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
