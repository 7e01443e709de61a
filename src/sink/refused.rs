//! Templated exchanges the broker refused (404: it has no such exchange;
//! 403: the relay's user may not write to it), learnt while publishing:
//! events bound for them are dead-lettered, with no new session per name.
//! Bounded: at most [`CAP`] names, the oldest forgotten first; each is
//! tried again [`RECHECK`] after it was refused (it may have been declared
//! or granted since), at the cost of one more refusal if not.

use std::collections::HashMap;
use std::time::Duration;

use tokio::time::Instant;

/// Names remembered at most.
pub const CAP: usize = 1024;
/// A refused name is tried again after this long.
pub const RECHECK: Duration = Duration::from_secs(60);

/// What the broker said about an exchange.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// 404 NOT_FOUND: no such exchange.
    Missing,
    /// 403 ACCESS_REFUSED: no write permission on it.
    Forbidden,
}

impl Refusal {
    /// Why its events are dead-lettered.
    pub fn reason(self, exchange: &str) -> String {
        match self {
            Refusal::Missing => format!(
                "exchange {exchange:?} does not exist on the broker (404 NOT_FOUND); declare it, \
                 or fix the exchange template (rabbitmq.exchange)"
            ),
            Refusal::Forbidden => format!(
                "the broker refuses the relay's user writes to exchange {exchange:?} (403 \
                 ACCESS_REFUSED); grant them, or fix the exchange template (rabbitmq.exchange)"
            ),
        }
    }
}

/// The refused names, when each was refused.
#[derive(Debug, Default)]
pub struct RefusedExchanges {
    names: HashMap<String, (Instant, Refusal)>,
}

impl RefusedExchanges {
    /// Nothing refused: no lookup needed.
    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    /// Whether `name` was refused less than [`RECHECK`] ago, and how.
    pub fn refusal(&self, name: &str) -> Option<Refusal> {
        self.names
            .get(name)
            .filter(|(at, _)| at.elapsed() < RECHECK)
            .map(|(_, r)| *r)
    }

    /// The broker refused `name` just now; the oldest is forgotten when
    /// [`CAP`] names are held.
    pub fn insert(&mut self, name: String, refusal: Refusal) {
        if self.names.len() >= CAP && !self.names.contains_key(&name) {
            let oldest = (self.names.iter())
                .min_by_key(|(_, (at, _))| *at)
                .map(|(n, _)| n.clone());
            if let Some(oldest) = oldest {
                self.names.remove(&oldest);
            }
        }
        self.names.insert(name, (Instant::now(), refusal));
    }

    /// Forgets `name` (it exists now).
    pub fn remove(&mut self, name: &str) {
        self.names.remove(name);
    }

    /// The names held.
    pub fn names(&self) -> Vec<String> {
        self.names.keys().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn bounded_and_tried_again_after_a_while() {
        let mut r = RefusedExchanges::default();
        for i in 0..CAP + 10 {
            r.insert(format!("x{i}"), Refusal::Missing);
            tokio::time::advance(Duration::from_millis(1)).await;
        }
        assert_eq!(r.names().len(), CAP);
        assert_eq!(r.refusal("x0"), None, "the oldest forgotten");
        assert_eq!(r.refusal(&format!("x{}", CAP + 9)), Some(Refusal::Missing));
        r.insert("f".into(), Refusal::Forbidden);
        assert_eq!(r.names().len(), CAP);
        tokio::time::advance(RECHECK).await;
        assert_eq!(r.refusal("f"), None, "tried again");
    }
}
