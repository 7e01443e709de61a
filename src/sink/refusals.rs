//! What the broker refused in earlier sessions, and what the next session
//! (or a recovery's next pass) must route around: the policy of
//! [`super::replies`] applied across sessions.

use tracing::warn;

use super::SinkError;
use super::publisher::PublishError;
use super::refused::{Refusal, RefusedExchanges};
use super::replies::Disposition;
use crate::config::Config;

/// 404s for one exchange name before the relay stops instead of starting
/// another session that would dead-letter its events.
const MISSING_EXCHANGE_STRIKES: u32 = 3;
/// Sessions the broker ends while the same event is the oldest unconfirmed
/// one (published alone) before that event is dead-lettered.
const HEAD_STRIKES: u32 = 3;

/// What the broker refused in earlier sessions, for the next one to route
/// around (see [`super::replies`]).
#[derive(Debug, Default)]
pub struct Refusals {
    /// Templated exchanges the broker does not have, or lets the relay not
    /// write to: their events are dead-lettered. The publisher holds them
    /// while it runs (it learns more), and gives them back when it ends.
    pub missing: RefusedExchanges,
    /// The broker's `max_message_size`, once it said so.
    pub max_body: Option<usize>,
    /// Events the broker kept refusing while they were the oldest
    /// unconfirmed one, and why: they are dead-lettered.
    pub poison: std::collections::HashMap<String, String>,
    /// Publish one message at a time until this many were published, so
    /// that the next refusal is blamed on the right message.
    pub careful_for: u64,
    /// Sessions ended by each refusal (an exchange name, a body limit, an
    /// event blamed): the same one coming back must not loop sessions.
    pub strikes: std::collections::HashMap<String, u32>,
}

/// The oldest unconfirmed event of a session that failed.
#[derive(Debug, Clone)]
pub struct Head {
    /// Its id.
    pub id: String,
    /// It was published alone: surely the one the broker refused.
    pub alone: bool,
    /// Events the session had published.
    pub sent: u64,
}

/// A session failed with `e`; `head` was its oldest unconfirmed event.
/// Learns what the next session must route around (see
/// [`crate::sink::replies`]), or returns the error that stops the relay.
pub fn learn(
    cfg: &Config,
    e: &SinkError,
    head: Option<Head>,
    refusals: &mut Refusals,
) -> Option<PublishError> {
    // Each outbox dead-letters to its own exchange, if it has one.
    let dlxs: Vec<&str> = (cfg.outboxes.iter())
        .filter_map(|o| o.dead_letter_exchange.as_deref())
        .collect();
    let mut strike = |key: String| {
        let n = refusals.strikes.entry(key).or_default();
        *n += 1;
        *n
    };
    match e.disposition() {
        Disposition::MissingExchange(exchange) => {
            let n = strike(format!("exchange {exchange}"));
            // Only a templated exchange's name may be routed around: a
            // configured (literal) one missing is the operator's to declare.
            let literal =
                (cfg.outboxes.iter()).any(|o| o.exchange.as_literal() == Some(exchange.as_str()));
            if dlxs.contains(&exchange.as_str())
                || literal
                || (cfg.outboxes.iter()).all(|o| o.exchange.as_literal().is_some())
                || dlxs.is_empty()
                || n > MISSING_EXCHANGE_STRIKES
            {
                // Nothing to dead-letter to, or no template at all: the
                // operator must declare it.
                return Some(PublishError::Sink(SinkError::NoExchange(exchange)));
            }
            warn!(exchange = %crate::logtext::Shown(&exchange), "the broker has no such exchange; its events will be dead-lettered");
            refusals.missing.insert(exchange, Refusal::Missing);
        }
        Disposition::BodyLimit(limit) => {
            let n = strike(format!("body limit {limit}"));
            if dlxs.is_empty() || n > MISSING_EXCHANGE_STRIKES {
                return Some(PublishError::Undeliverable {
                    id: head.map_or_else(|| "?".into(), |h| h.id),
                    reason: format!(
                        "the broker refuses bodies over {limit} bytes (its max_message_size); \
                         set rabbitmq.max_message_bytes to at most {limit}"
                    ),
                });
            }
            warn!(
                limit,
                "the broker refuses larger bodies; they will be dead-lettered without the body"
            );
            refusals.max_body = Some(limit);
        }
        Disposition::HeadOfWindow => {
            let head = head?;
            // Replay one message at a time past where this session got, so
            // the message that draws the refusal is alone when it comes
            // again (the replay starts at or before this session's start).
            refusals.careful_for = refusals
                .careful_for
                .max(head.sent + cfg.rabbitmq.window as u64);
            // Only a message published alone is surely the one.
            let Head {
                id, alone: true, ..
            } = head
            else {
                return None;
            };
            let n = strike(format!("event {id}"));
            if n > 2 * HEAD_STRIKES {
                // Its bare dead letter is refused too.
                return Some(PublishError::Undeliverable {
                    id,
                    reason: format!("the broker keeps refusing it, even as a dead letter: {e}"),
                });
            }
            if n >= HEAD_STRIKES {
                let reason = format!(
                    "the broker ended {n} sessions while this was the oldest unconfirmed \
                     message, last with: {e}"
                );
                warn!(event_id = %crate::logtext::Shown(&id), %reason, "giving up on the event");
                refusals.poison.insert(id, reason);
            }
        }
        Disposition::RefusedExchange(_) | Disposition::Transient | Disposition::Stop => {}
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sink::wire::WireError;

    fn config(dlx: bool) -> Config {
        let dlx = if dlx {
            "dead_letter_exchange = \"dlx\"\n"
        } else {
            ""
        };
        let text = format!(
            "[postgres]\nurl = \"postgres://u@h/db\"\n[outbox]\ntable = \"public.outbox\"\n\
             [rabbitmq]\nurl = \"amqp://h\"\nexchange = \"{{aggregate_type}}\"\nwindow = 100\n{dlx}"
        );
        Config::from_toml(&text, "test.toml", Vec::new()).unwrap()
    }

    fn closed(code: u16, text: &str) -> SinkError {
        SinkError::Amqp {
            what: "publishing",
            url: String::new(),
            source: WireError::ChannelClosed {
                code,
                text: text.into(),
            },
        }
    }

    fn head(id: &str, alone: bool, sent: u64) -> Option<Head> {
        Some(Head {
            id: id.into(),
            alone,
            sent,
        })
    }

    /// A refusal blamed on a message: first the replay goes one message at
    /// a time past where the session failed; the same message refused
    /// alone three times is dead-lettered; its dead letter refused as well
    /// stops the relay.
    #[test]
    fn a_message_the_broker_keeps_refusing_is_found_then_dead_lettered() {
        let cfg = config(true);
        let mut r = Refusals::default();
        let e = closed(505, "UNEXPECTED_FRAME");
        assert!(learn(&cfg, &e, head("a", false, 700), &mut r).is_none());
        assert_eq!(r.careful_for, 800);
        assert!(r.poison.is_empty(), "not alone: not blamed");
        for n in 1..=3 {
            assert!(learn(&cfg, &e, head("k", true, 5), &mut r).is_none());
            assert_eq!(r.poison.contains_key("k"), n == 3, "after {n}");
        }
        assert!(r.poison["k"].contains("UNEXPECTED_FRAME"));
        assert_eq!(r.careful_for, 800, "never shrinks while failing");
        for _ in 4..=6 {
            assert!(learn(&cfg, &e, head("k", true, 1), &mut r).is_none());
        }
        let stop = learn(&cfg, &e, head("k", true, 1), &mut r).unwrap();
        assert!(stop.to_string().contains("even as a dead letter"), "{stop}");
        assert!(!stop.is_transient());
    }

    #[test]
    fn the_brokers_body_limit_is_learnt_or_stops_without_a_dead_letter_exchange() {
        let e = closed(
            406,
            "PRECONDITION_FAILED - message size 200000 is larger than configured max size 65536",
        );
        let mut r = Refusals::default();
        assert!(learn(&config(true), &e, head("b", false, 1), &mut r).is_none());
        assert_eq!(r.max_body, Some(65_536));
        let mut r = Refusals::default();
        let stop = learn(&config(false), &e, head("b", false, 1), &mut r).unwrap();
        let text = stop.to_string();
        assert!(
            text.contains("rabbitmq.max_message_bytes") && text.contains("65536"),
            "{text}"
        );
    }

    /// With several outboxes, a missing exchange some outbox names
    /// literally stops the relay; one only a template can have made is
    /// routed around (its events dead-lettered).
    #[test]
    fn a_missing_configured_exchange_stops_even_beside_templates() {
        let text = "[postgres]\nurl = \"postgres://u@h/db\"\n\
                    [[outbox]]\ntable = \"a\"\nexchange = \"orders\"\n\
                    [[outbox]]\ntable = \"b\"\nexchange = \"{aggregate_type}\"\n\
                    [rabbitmq]\nurl = \"amqp://h\"\nexchange = \"x\"\ndead_letter_exchange = \"dlx\"\n";
        let cfg = Config::from_toml(text, "test.toml", Vec::new()).unwrap();
        let missing = |name: &str| {
            closed(
                404,
                &format!("NOT_FOUND - no exchange '{name}' in vhost '/'"),
            )
        };
        let mut r = Refusals::default();
        let stop = learn(&cfg, &missing("orders"), None, &mut r);
        assert!(stop.is_some(), "a configured exchange is the operator's");
        assert!(r.missing.is_empty());
        let learnt = learn(&cfg, &missing("cart"), None, &mut r);
        assert!(learnt.is_none());
        assert!(r.missing.refusal("cart").is_some());
    }
}
