//! The AMQP side: one connection, one channel in confirm mode, publishes with
//! `mandatory` and persistent delivery.
//!
//! Why one channel: AMQP orders messages per channel, and confirms on a
//! channel are issued in publish order, so per-aggregate order is kept by
//! construction. Why `mandatory`: without it the broker silently drops a
//! message no queue is bound for, and still confirms it. With it, the message
//! comes back (`basic.return`) before the confirm, and we treat it as a
//! failure, never as delivered.
//!
//! The connection is [`wire::Wire`], a publishing-only AMQP client driven by
//! the publishing task itself (see there why not lapin).

pub mod budget;
#[cfg(test)]
mod conformance;
pub mod publisher;
pub mod replies;
pub mod wire;

use std::collections::VecDeque;
use std::time::Duration;

use crate::config::{RabbitmqConfig, redact_url};
use crate::message::{Envelope, MessageView};
use crate::tls::{self, TlsFailure};
use replies::Disposition;
use wire::{Event, Returned, Target, Wire, WireError};

/// What went wrong on the broker side.
#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    /// The connection failed (lost, closed or refused by the broker...).
    #[error("{what} ({url}): {source}")]
    Amqp {
        /// The call that failed.
        what: &'static str,
        /// The broker URL, password masked.
        url: String,
        /// What happened.
        source: WireError,
    },
    /// The exchange named in the config does not exist.
    #[error("exchange {0:?} does not exist on the broker; declare it, or fix rabbitmq.exchange")]
    NoExchange(String),
    /// The broker connection or channel went away while idle.
    #[error("connection to RabbitMQ lost")]
    Disconnected,
    /// A call took longer than its deadline.
    #[error("{0} timed out")]
    Timeout(&'static str),
    /// The broker refused responsibility for a message.
    #[error("broker nacked event {id}")]
    Nacked {
        /// Event id.
        id: String,
    },
    /// The message was unroutable: no queue is bound for its routing key.
    #[error(
        "event {id} is unroutable: exchange {exchange:?} has no queue bound for routing key {routing_key:?} ({reply})"
    )]
    Returned {
        /// Event id.
        id: String,
        /// Where it went.
        exchange: String,
        /// With which key.
        routing_key: String,
        /// The broker's reply text.
        reply: String,
    },
    /// The dead-letter exchange refused a dead letter.
    #[error(
        "dead-letter exchange {exchange:?} refused event {id} ({reason}); bind a queue to it, or fix rabbitmq.dead_letter_exchange"
    )]
    DeadLetterRefused {
        /// Event id.
        id: String,
        /// The dead-letter exchange.
        exchange: String,
        /// The broker's reply.
        reason: String,
    },
    /// TLS could not be set up or the handshake was refused (untrusted or
    /// wrong certificate): the message names the setting to fix.
    #[error("{0}")]
    Tls(String),
    /// A message waited `rabbitmq.confirm_timeout_secs` for its confirm,
    /// not counting time the broker blocked publishing.
    #[error(
        "no publisher confirm within {secs} s for the oldest of {in_flight} waiting message(s) (rabbitmq.confirm_timeout_secs); the broker is not answering"
    )]
    ConfirmTimeout {
        /// Messages awaiting a confirm.
        in_flight: u64,
        /// The timeout.
        secs: u64,
    },
}

impl SinkError {
    /// What this failure means, by the table in [`replies`].
    pub fn disposition(&self) -> Disposition {
        match self {
            SinkError::Amqp { source, .. } => source.disposition(),
            SinkError::NoExchange(_)
            | SinkError::Tls(_)
            | SinkError::Returned { .. }
            | SinkError::DeadLetterRefused { .. } => Disposition::Stop,
            SinkError::Disconnected
            | SinkError::Timeout(_)
            | SinkError::Nacked { .. }
            | SinkError::ConfirmTimeout { .. } => Disposition::Transient,
        }
    }

    /// The exchange the broker said does not exist, when a publish to it
    /// closed the channel (404 NOT_FOUND "no exchange 'X' in vhost 'V'"): a
    /// templated exchange that renders to a name nobody declared.
    pub fn missing_exchange(&self) -> Option<String> {
        match self.disposition() {
            Disposition::MissingExchange(x) => Some(x),
            _ => None,
        }
    }

    /// True when retrying later may succeed (connection trouble, a broker
    /// restart, a nack, a refusal the next session handles); false when
    /// the operator must change something.
    pub fn is_transient(&self) -> bool {
        self.disposition() != Disposition::Stop
    }
}

/// Parses `rabbitmq.url`. amq-protocol-uri reads the host with
/// `Url::domain`, which is `None` for an IPv6 literal, and then puts
/// "localhost" in its place (`amqp://[2001:db8::7]/` would connect to this
/// machine): the host is taken from the URL here (an IPv6 address without
/// its brackets, as sockets and TLS server names want it).
pub fn parse_amqp_url(url: &str) -> Result<lapin::uri::AMQPUri, String> {
    let mut uri: lapin::uri::AMQPUri = url.parse()?;
    let parsed = url::Url::parse(url).map_err(|e| e.to_string())?;
    match parsed.host() {
        Some(url::Host::Domain(_)) | None => {}
        Some(url::Host::Ipv4(ip)) => uri.authority.host = ip.to_string(),
        Some(url::Host::Ipv6(ip)) => uri.authority.host = ip.to_string(),
    }
    Ok(uri)
}

/// Deadline for connecting and for each control call.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(15);

/// A connected publisher.
pub struct AmqpSink {
    wire: Wire,
    url: String,
}

impl AmqpSink {
    /// Connects, opens the publishing channel in confirm mode, and checks
    /// that a fixed exchange exists.
    pub async fn connect(cfg: &RabbitmqConfig) -> Result<AmqpSink, SinkError> {
        let url = redact_url(cfg.url.expose());
        let amqp = |what, source| SinkError::Amqp {
            what,
            url: url.clone(),
            source,
        };
        let uri = parse_amqp_url(cfg.url.expose())
            .map_err(|e: String| amqp("parsing rabbitmq.url", WireError::Unsupported(e)))?;
        // `ca_file` is set for every amqps:// URL (the configured CA, or
        // the system bundle), and trusted alone.
        let tls = match cfg.ca_file.as_deref() {
            Some(roots) => Some(
                tls::rabbitmq_client_config(roots)
                    .map_err(|e| SinkError::Tls(format!("rabbitmq.ca_file: {e}")))?,
            ),
            None => None,
        };
        let target = Target {
            uri,
            tls,
            connection_name: "outbox-relay".into(),
        };
        let what = "connecting to RabbitMQ";
        let wire = match tokio::time::timeout(CALL_TIMEOUT, Wire::connect(&target)).await {
            Err(_) => return Err(SinkError::Timeout(what)),
            Ok(Err(source)) => {
                if let Some(f) = TlsFailure::find(&source).filter(TlsFailure::is_permanent) {
                    return Err(SinkError::Tls(tls::rabbitmq_failure(&f, &url)));
                }
                return Err(amqp(what, source));
            }
            Ok(Ok(wire)) => wire,
        };
        let mut sink = AmqpSink { wire, url };
        if let Some(exchange) = cfg.exchange.as_literal() {
            sink.check_exchange(exchange).await?;
        }
        Ok(sink)
    }

    fn error(&self, what: &'static str, source: WireError) -> SinkError {
        SinkError::Amqp {
            what,
            url: self.url.clone(),
            source,
        }
    }

    /// Passive declare on a channel of its own: the broker closes a channel
    /// on which a passive declare fails. Call before publishing.
    pub async fn check_exchange(&mut self, exchange: &str) -> Result<(), SinkError> {
        if exchange.is_empty() {
            return Ok(()); // the default exchange always exists
        }
        let what = "checking the exchange";
        match tokio::time::timeout(CALL_TIMEOUT, self.wire.exchange_exists(exchange)).await {
            Err(_) => Err(SinkError::Timeout(what)),
            Ok(Err(e)) => Err(self.error(what, e)),
            Ok(Ok(true)) => Ok(()),
            Ok(Ok(false)) => Err(SinkError::NoExchange(exchange.to_owned())),
        }
    }

    /// The connection's negotiated frame_max.
    pub fn frame_max(&self) -> u32 {
        self.wire.frame_max()
    }

    /// Queues `basic.publish` (mandatory) for `env`, moving the message in;
    /// returns its delivery tag. Written when the caller next waits for an
    /// answer ([`AmqpSink::answer`]).
    pub fn publish(&mut self, env: Envelope) -> Result<u64, SinkError> {
        self.wire
            .publish(env)
            .map_err(|e| self.error("publishing", e))
    }

    /// As [`AmqpSink::publish`], encoding straight from the row's pieces.
    pub fn publish_view(&mut self, m: &MessageView<'_>) -> Result<u64, SinkError> {
        self.wire
            .publish_view(m)
            .map_err(|e| self.error("publishing", e))
    }

    /// Enough is queued: wait for an answer (which writes it) before
    /// queueing more.
    pub fn wants_flush(&self) -> bool {
        self.wire.wants_flush()
    }

    /// Writes what is queued and waits for the broker's next answer.
    /// Cancel-safe.
    pub async fn answer(&mut self) -> Result<Event, SinkError> {
        match self.wire.event().await {
            Ok(ev) => Ok(ev),
            Err(e) => Err(self.error("waiting for the broker", e)),
        }
    }

    /// True while the broker has blocked publishing (resource alarm).
    pub fn is_blocked(&self) -> bool {
        self.wire.is_blocked()
    }

    /// Closes the connection politely (a blocked broker would not answer:
    /// then the connection is just dropped).
    pub async fn close(self) {
        if self.is_blocked() {
            return;
        }
        let _ = tokio::time::timeout(Duration::from_secs(5), self.wire.close()).await;
    }
}

/// Messages published and not yet answered, by delivery tag, oldest first.
/// Tags are consecutive from 1 on a new connection; the broker may answer
/// out of order (e.g. messages routed to different queues), singly or for
/// every tag up to one (`multiple`).
#[derive(Debug)]
pub struct Unconfirmed<T> {
    first_tag: u64,
    slots: VecDeque<Option<Slot<T>>>,
    live: usize,
}

#[derive(Debug)]
struct Slot<T> {
    item: T,
    returned: Option<Box<Returned>>,
}

impl<T> Default for Unconfirmed<T> {
    fn default() -> Self {
        Unconfirmed {
            first_tag: 1,
            slots: VecDeque::new(),
            live: 0,
        }
    }
}

impl<T> Unconfirmed<T> {
    /// `item` was published as `tag` (tags come in increasing order).
    pub fn push(&mut self, tag: u64, item: T) {
        while self.first_tag + (self.slots.len() as u64) < tag {
            self.slots.push_back(None);
        }
        self.slots.push_back(Some(Slot {
            item,
            returned: None,
        }));
        self.live += 1;
    }

    /// Messages waiting for an answer.
    pub fn len(&self) -> usize {
        self.live
    }

    /// True when nothing waits.
    pub fn is_empty(&self) -> bool {
        self.live == 0
    }

    /// The message that has waited longest.
    pub fn oldest(&self) -> Option<&T> {
        self.slots.iter().flatten().next().map(|s| &s.item)
    }

    /// Applies a broker answer: the messages it settles go to `out` in tag
    /// order, with their outcome. `message_id` gives a message's
    /// `message_id` property as published and `destination` its exchange
    /// and routing key: a returned message is known by them (errors name
    /// it).
    pub fn apply(
        &mut self,
        ev: Event,
        (message_id, destination): (
            impl Fn(&T) -> Option<String>,
            impl Fn(&T) -> (String, String),
        ),
        out: &mut Vec<(T, Result<(), SinkError>)>,
    ) -> Result<(), SinkError> {
        let protocol = |what: String| SinkError::Amqp {
            what: "reading the broker's answers",
            url: String::from("broker connection"),
            source: WireError::Protocol(what),
        };
        match ev {
            Event::Blocked(_) | Event::Drained => Ok(()),
            Event::Returned(ret) => {
                // A return carries no delivery tag: its message is known by
                // message_id (and, among copies, by destination). Ids are
                // meant to be unique, but nothing enforces it, and copies
                // to the same destination may be routed differently
                // (headers exchanges, CC/BCC, a binding removed between
                // them): so the return marks the one candidate when there
                // is one, else every candidate with its destination, else
                // every one with its id. A copy that was routed is then
                // published again (a duplicate), never one that was
                // returned counted as delivered.
                let dest = (ret.exchange.clone(), ret.routing_key.clone());
                let mut candidates = Vec::new();
                let mut seen = false;
                for (i, s) in self.slots.iter().enumerate() {
                    let Some(s) = s else { continue };
                    if message_id(&s.item) != ret.message_id {
                        continue;
                    }
                    seen = true;
                    if s.returned.is_none() {
                        candidates.push(i);
                    }
                }
                if candidates.len() > 1 {
                    let same_dest: Vec<usize> = candidates
                        .iter()
                        .copied()
                        .filter(|&i| {
                            self.slots[i]
                                .as_ref()
                                .is_some_and(|s| destination(&s.item) == dest)
                        })
                        .collect();
                    if !same_dest.is_empty() {
                        candidates = same_dest;
                    }
                }
                for &i in &candidates {
                    if let Some(s) = self.slots[i].as_mut() {
                        s.returned = Some(Box::new(ret.clone()));
                    }
                }
                if candidates.is_empty() && !seen {
                    return Err(protocol(format!(
                        "basic.return for a message not waiting for a confirm (message_id {:?})",
                        ret.message_id
                    )));
                }
                Ok(())
            }
            Event::Ack { tag, multiple } | Event::Nack { tag, multiple } => {
                let acked = matches!(ev, Event::Ack { .. });
                let end = self.first_tag + self.slots.len() as u64;
                let last = if tag == 0 && multiple { end - 1 } else { tag };
                if last >= end {
                    return Err(protocol(format!(
                        "basic.ack/nack for delivery tag {tag}, but only {} were published",
                        end - 1
                    )));
                }
                if last < self.first_tag {
                    return Ok(()); // already answered
                }
                let upto = (last - self.first_tag) as usize + 1;
                let from = if multiple { 0 } else { upto.saturating_sub(1) };
                for slot in self.slots.range_mut(from..upto) {
                    if let Some(Slot { item, returned }) = slot.take() {
                        self.live -= 1;
                        let res = match returned {
                            Some(r) => Err(SinkError::Returned {
                                id: r.message_id.unwrap_or_else(|| "?".into()),
                                exchange: r.exchange,
                                routing_key: r.routing_key,
                                reply: r.reply_text,
                            }),
                            None if acked => Ok(()),
                            None => Err(SinkError::Nacked {
                                id: message_id(&item).unwrap_or_else(|| "?".into()),
                            }),
                        };
                        out.push((item, res));
                    }
                }
                while matches!(self.slots.front(), Some(None)) {
                    self.slots.pop_front();
                    self.first_tag += 1;
                }
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_ip_address_in_the_url_is_the_host_connected_to() {
        let host = |u: &str| parse_amqp_url(u).unwrap().authority.host;
        assert_eq!(host("amqp://u:p@10.0.0.5:5673/v"), "10.0.0.5");
        assert_eq!(host("amqp://[::1]/"), "::1");
        assert_eq!(host("amqps://[2001:db8::7]:5671/%2f"), "2001:db8::7");
        assert_eq!(host("amqp://rabbit.example/"), "rabbit.example");
        assert_eq!(host("amqp://rabbit%2dx.example/"), "rabbit-x.example");
        let uri = parse_amqp_url("amqp://u:p@127.0.0.2:5999/v?frame_max=4096").unwrap();
        assert_eq!(uri.authority.port, 5999);
        assert_eq!(uri.vhost, "v");
        assert_eq!(uri.query.frame_max, Some(4096));
    }

    #[test]
    fn the_missing_exchange_is_read_from_the_404() {
        let closed = |code, text: &str| SinkError::Amqp {
            what: "publishing",
            url: String::new(),
            source: WireError::ChannelClosed {
                code,
                text: text.to_owned(),
            },
        };
        let e = closed(404, "NOT_FOUND - no exchange 'ex_it's' in vhost '/'");
        assert_eq!(e.missing_exchange().as_deref(), Some("ex_it's"));
        assert!(e.is_transient());
        // Cut short by the broker (255 bytes): not guessed at, so permanent.
        let e = closed(404, "NOT_FOUND - no exchange 'a-very-long-na...");
        assert_eq!(e.missing_exchange(), None);
        assert!(!e.is_transient());
        let e = closed(404, "NOT_FOUND - no queue 'q' in vhost '/'");
        assert_eq!(e.missing_exchange(), None);
        assert_eq!(
            closed(406, "no exchange 'x' in vhost '/'").missing_exchange(),
            None
        );
    }

    use super::*;

    #[allow(clippy::ptr_arg)] // the item type is String
    fn some(m: &String) -> Option<String> {
        Some(m.clone())
    }

    fn ack(tag: u64, multiple: bool) -> Event {
        Event::Ack { tag, multiple }
    }

    fn returned(id: &str) -> Event {
        Event::Returned(Returned {
            reply_code: 312,
            reply_text: "NO_ROUTE".into(),
            exchange: "ex".into(),
            routing_key: "rk".into(),
            message_id: Some(id.into()),
        })
    }

    /// Messages "m1".."mN" published as tags 1..N.
    fn published(n: u64) -> Unconfirmed<String> {
        let mut u = Unconfirmed::default();
        for tag in 1..=n {
            u.push(tag, format!("m{tag}"));
        }
        u
    }

    fn dest(_: &String) -> (String, String) {
        ("ex".into(), "rk".into())
    }

    fn apply(u: &mut Unconfirmed<String>, ev: Event) -> Vec<(String, Result<(), String>)> {
        let mut out = Vec::new();
        u.apply(ev, (some, dest), &mut out).unwrap();
        out.into_iter()
            .map(|(m, r)| (m, r.map_err(|e| e.to_string())))
            .collect()
    }

    fn names(v: &[(String, Result<(), String>)]) -> Vec<&str> {
        v.iter().map(|(m, _)| m.as_str()).collect()
    }

    #[test]
    fn single_and_multiple_acks_settle_in_tag_order_out_of_order_too() {
        let mut u = published(5);
        let got = apply(&mut u, ack(3, false));
        assert_eq!(names(&got), ["m3"]);
        assert!(got[0].1.is_ok());
        assert_eq!(u.oldest().map(String::as_str), Some("m1"));
        assert_eq!(u.len(), 4);
        let got = apply(&mut u, ack(4, true));
        assert_eq!(names(&got), ["m1", "m2", "m4"]);
        assert_eq!(u.oldest().map(String::as_str), Some("m5"));
        // A repeated or stale answer settles nothing twice.
        assert!(apply(&mut u, ack(4, true)).is_empty());
        assert!(apply(&mut u, ack(2, false)).is_empty());
        assert_eq!(names(&apply(&mut u, ack(5, false))), ["m5"]);
        assert!(u.is_empty());
        assert_eq!(u.oldest(), None);
        // Tags go on from where they were.
        u.push(6, "m6".into());
        assert_eq!(names(&apply(&mut u, ack(6, false))), ["m6"]);
    }

    #[test]
    fn a_nack_is_never_delivered() {
        let mut u = published(3);
        let got = apply(
            &mut u,
            Event::Nack {
                tag: 2,
                multiple: true,
            },
        );
        assert_eq!(names(&got), ["m1", "m2"]);
        for (m, r) in &got {
            assert_eq!(r.as_ref().unwrap_err(), &format!("broker nacked event {m}"));
        }
        assert_eq!(u.len(), 1);
    }

    #[test]
    fn a_returned_message_is_matched_by_id_and_its_ack_is_a_failure() {
        let mut u = published(3);
        assert!(apply(&mut u, returned("m2")).is_empty());
        let got = apply(&mut u, ack(3, true));
        assert_eq!(names(&got), ["m1", "m2", "m3"]);
        assert!(got[0].1.is_ok() && got[2].1.is_ok());
        let err = got[1].1.as_ref().unwrap_err();
        assert!(err.contains("event m2 is unroutable"), "{err}");
        assert!(err.contains("NO_ROUTE"), "{err}");
    }

    #[test]
    fn a_return_for_no_waiting_message_ends_the_session() {
        let mut u = published(2);
        let mut out = Vec::new();
        let e = u.apply(returned("m9"), (some, dest), &mut out).unwrap_err();
        assert!(e.is_transient(), "{e}");
        assert!(e.to_string().contains("m9"), "{e}");
    }

    #[test]
    fn a_return_marks_every_copy_it_may_be_for() {
        // Two copies of one message to the same place, one returned: which
        // one is unknown, so both count as returned (the routed one is
        // published again: a duplicate, never a loss).
        let mut u = Unconfirmed::default();
        for (tag, m) in [(1, "a"), (2, "dup"), (3, "dup")] {
            u.push(tag, m.to_owned());
        }
        assert!(apply(&mut u, returned("dup")).is_empty());
        let got = apply(&mut u, ack(3, true));
        assert_eq!(names(&got), ["a", "dup", "dup"]);
        assert!(
            got[0].1.is_ok() && got[1].1.is_err() && got[2].1.is_err(),
            "{got:?}"
        );
        // A return for an id whose messages are all returned: nothing new.
        let mut u = published(1);
        assert!(apply(&mut u, returned("m1")).is_empty());
        assert!(apply(&mut u, returned("m1")).is_empty());
    }

    /// A routable message sharing its id with an unroutable one (another
    /// routing key) is not taken for the returned one.
    #[test]
    fn a_routable_copy_with_the_same_id_is_not_returned() {
        let mut u: Unconfirmed<(String, String)> = Unconfirmed::default();
        u.push(1, ("dup".into(), "ok.key".into()));
        u.push(2, ("dup".into(), "lost.key".into()));
        let mut ret = returned("dup");
        if let Event::Returned(r) = &mut ret {
            r.routing_key = "lost.key".into();
        }
        let id = |m: &(String, String)| Some(m.0.clone());
        let to = |m: &(String, String)| ("ex".to_owned(), m.1.clone());
        let mut out = Vec::new();
        u.apply(ret, (id, to), &mut out).unwrap();
        u.apply(ack(2, true), (id, to), &mut out).unwrap();
        assert!(out[0].1.is_ok(), "the routable copy: {:?}", out[0].1);
        assert!(
            matches!(out[1].1, Err(SinkError::Returned { .. })),
            "{:?}",
            out[1].1
        );
    }

    #[test]
    fn a_return_without_message_id_matches_messages_without_one() {
        let mut u: Unconfirmed<Option<String>> = Unconfirmed::default();
        u.push(1, Some("a".into()));
        u.push(2, None);
        let mut ret = returned("x");
        if let Event::Returned(r) = &mut ret {
            r.message_id = None;
        }
        let mut out = Vec::new();
        let to = |_: &Option<String>| ("ex".to_owned(), "rk".to_owned());
        u.apply(ret, (Option::clone, to), &mut out).unwrap();
        u.apply(ack(2, true), (Option::clone, to), &mut out)
            .unwrap();
        assert!(out[0].1.is_ok());
        assert!(
            matches!(out[1].1, Err(SinkError::Returned { .. })),
            "{:?}",
            out[1].1
        );
    }

    #[test]
    fn an_answer_for_a_tag_never_published_ends_the_session() {
        for multiple in [false, true] {
            let mut u = published(3);
            let mut out = Vec::new();
            let e = u
                .apply(ack(9, multiple), (some, dest), &mut out)
                .unwrap_err();
            assert!(e.to_string().contains("delivery tag 9"), "{e}");
            assert!(out.is_empty(), "nothing settled");
            assert_eq!(u.len(), 3);
        }
        // tag 0 with `multiple`: everything published so far.
        let mut u = published(3);
        assert_eq!(names(&apply(&mut u, ack(0, true))), ["m1", "m2", "m3"]);
    }
}
