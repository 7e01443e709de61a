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

pub(crate) mod nodes;
pub(crate) mod publisher;
pub(crate) mod refusals;
pub(crate) mod refused;
pub(crate) mod replies;
mod unconfirmed;
pub mod wire;
pub use unconfirmed::Unconfirmed;

use std::time::Duration;

use crate::amqpurl::parse_amqp_url;
use crate::config::{Login, RabbitmqConfig, shown_url};
use crate::message::{Envelope, MessageView};
use crate::redact::NOT_A_URL;
use crate::tls::{self, TlsFailure};
use nodes::Nodes;
use replies::Disposition;
use tracing::{info, warn};
use wire::{Event, Target, Wire, WireError};

/// What a connect that the broker ended unsaid was, when the relay
/// presented a client certificate (`check` tells it by this text).
pub const CLOSED_WITH_CERT: &str = "connecting to RabbitMQ with the client certificate \
     (if the broker refuses it, expired or signed by a CA it does not trust, it may just close \
     the connection: check rabbitmq.cert_file)";

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
    #[error(
        "exchange {0:?} does not exist on the broker; declare it, or fix rabbitmq.exchange (or the exchange of the [[outbox]] naming it)"
    )]
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
    /// The server refused the password of a `password_file` within
    /// `ROTATION_GRACE` of the first refusal: the next connect reads the
    /// file again.
    #[error(transparent)]
    PasswordRotating(crate::config::Rotating<SinkError>),
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
            | SinkError::PasswordRotating(_)
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

    /// The refusal itself, without the retry a rotating password file
    /// earns (`check` reports it, it does not retry).
    pub fn without_rotation(self) -> SinkError {
        match self {
            SinkError::PasswordRotating(r) => *r.source,
            other => other,
        }
    }

    /// True when retrying later may succeed (connection trouble, a broker
    /// restart, a nack, a refusal the next session handles); false when
    /// the operator must change something.
    pub fn is_transient(&self) -> bool {
        // A refused exchange the publisher did not route around (a
        // configured one, the dead-letter exchange) is the operator's.
        !matches!(
            self.disposition(),
            Disposition::Stop | Disposition::RefusedExchange(_)
        )
    }
}

/// Deadline for connecting and for each control call.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(15);

/// A connected publisher.
pub struct AmqpSink {
    wire: Wire,
    url: String,
    node: usize,
}

/// What the publishing policy ([`publisher`]: the window, retries, dead
/// letters, refusals) needs of a connection to the broker: the seam between
/// the policy and the wire. [`AmqpSink`] is the real one; the publisher's
/// tests drive the policy against a recording fake that scripts answers
/// and faults (`publisher/fake.rs`). The scripted TCP broker
/// (`wire/scripted.rs`) stays for what only the wire can show.
pub trait Broker {
    /// Queues a message on the publishing channel; its delivery tag.
    fn publish(&mut self, env: Envelope) -> Result<u64, SinkError>;
    /// Queues a message encoded straight from a row; its delivery tag.
    fn publish_view(&mut self, m: &MessageView<'_>) -> Result<u64, SinkError>;
    /// Queues a passive declare of `exchange`; the answer comes from
    /// [`Broker::answer`] as [`Event::Exchange`].
    fn look_for(&mut self, exchange: &str) -> Result<(), SinkError>;
    /// The next answer, writing what is queued meanwhile. Cancel-safe,
    /// and what it registers stays registered when it is dropped (the
    /// socket's and the heartbeat timer's wakers, held by the connection,
    /// not by the future): once polled `Pending` it is ready again only
    /// after waking the waker it was polled with, or after a call on the
    /// connection (a publish, a passive declare, a reopen). The publisher
    /// looks only at the connections woken or called since
    /// (`publisher/answers.rs`).
    fn answer(&mut self) -> impl Future<Output = Result<Event, SinkError>> + Send;
    /// Opens the publishing channel again after the broker closed it.
    fn reopen(&mut self) -> impl Future<Output = Result<(), SinkError>> + Send;
    /// The broker blocked publishing (a resource alarm).
    fn is_blocked(&self) -> bool;
    /// The publishing channel is open.
    fn publishing_open(&self) -> bool;
    /// The write buffer is backed up: publish no more until it drains.
    fn wants_flush(&self) -> bool;
    /// The largest frame the broker takes.
    fn frame_max(&self) -> u32;
}

impl Broker for AmqpSink {
    fn publish(&mut self, env: Envelope) -> Result<u64, SinkError> {
        AmqpSink::publish(self, env)
    }
    fn publish_view(&mut self, m: &MessageView<'_>) -> Result<u64, SinkError> {
        AmqpSink::publish_view(self, m)
    }
    fn look_for(&mut self, exchange: &str) -> Result<(), SinkError> {
        AmqpSink::look_for(self, exchange)
    }
    fn answer(&mut self) -> impl Future<Output = Result<Event, SinkError>> + Send {
        AmqpSink::answer(self)
    }
    fn reopen(&mut self) -> impl Future<Output = Result<(), SinkError>> + Send {
        AmqpSink::reopen(self)
    }
    fn is_blocked(&self) -> bool {
        AmqpSink::is_blocked(self)
    }
    fn publishing_open(&self) -> bool {
        AmqpSink::publishing_open(self)
    }
    fn wants_flush(&self) -> bool {
        AmqpSink::wants_flush(self)
    }
    fn frame_max(&self) -> u32 {
        AmqpSink::frame_max(self)
    }
}

impl AmqpSink {
    /// Connects to the first node of `rabbitmq.url` that answers, in the
    /// order `nodes` gives, opens the publishing channel in confirm mode,
    /// and checks that a fixed exchange exists. `name` is the connection's
    /// name in the broker's logs and management UI. When every node fails,
    /// the error of a node that refused for good (credentials, TLS, a
    /// missing exchange) comes first: retrying does not fix it.
    pub async fn connect(
        cfg: &RabbitmqConfig,
        name: &str,
        nodes: &Nodes,
    ) -> Result<AmqpSink, SinkError> {
        let several = cfg.urls.len() > 1;
        let mut failed: Option<SinkError> = None;
        for node in nodes.attempts() {
            let url = shown_url(cfg.urls[node].expose());
            match Self::connect_node(cfg, node, name).await {
                Ok(sink) => {
                    info!(node = %url, connection = name, "connected to RabbitMQ");
                    return Ok(sink);
                }
                Err(e) => {
                    if several {
                        warn!(node = %url, error = %e, "RabbitMQ node failed; trying the next");
                    }
                    if failed.as_ref().is_none_or(SinkError::is_transient) {
                        failed = Some(e);
                    }
                }
            }
        }
        Err(failed.expect("rabbitmq.url holds at least one URL"))
    }

    async fn connect_node(
        cfg: &RabbitmqConfig,
        node: usize,
        name: &str,
    ) -> Result<AmqpSink, SinkError> {
        let mut sink = Self::open_node(cfg, node, name).await?;
        for exchange in &cfg.fixed_exchanges {
            sink.check_exchange(exchange).await?;
        }
        Ok(sink)
    }

    /// Connects to node `node` of `rabbitmq.url` and opens the publishing
    /// channel in confirm mode, as a session does, without looking for any
    /// exchange (`check` looks for each, and reports each).
    pub async fn open_node(
        cfg: &RabbitmqConfig,
        node: usize,
        name: &str,
    ) -> Result<AmqpSink, SinkError> {
        // The password as the password file holds it now (see `Secret`).
        let current = cfg.urls[node].current();
        let secret = current.expose();
        let url = shown_url(secret);
        let amqp = |what, source| SinkError::Amqp {
            what,
            url: url.clone(),
            source,
        };
        let uri = parse_amqp_url(secret).map_err(|_| {
            amqp(
                "parsing rabbitmq.url",
                WireError::Unsupported(NOT_A_URL.into()),
            )
        })?;
        // `ca_file` is set when any URL is amqps:// (the configured CA, or
        // the system bundle), and trusted alone.
        let tls = match (&uri.scheme, cfg.ca_file.as_deref()) {
            (amq_protocol::uri::AMQPScheme::AMQPS, Some(roots)) => Some(
                tls::rabbitmq_client_config(roots, cfg.client_cert.as_ref()).map_err(|e| {
                    SinkError::Tls(format!(
                        "TLS for RabbitMQ (rabbitmq.ca_file, rabbitmq.cert_file, \
                         rabbitmq.key_file): {e}"
                    ))
                })?,
            ),
            _ => None,
        };
        let with_cert = tls.is_some() && cfg.client_cert.is_some();
        let target = Target {
            uri,
            tls,
            connection_name: name.to_owned(),
        };
        let what = "connecting to RabbitMQ";
        let wire = match tokio::time::timeout(CALL_TIMEOUT, Wire::connect(&target)).await {
            Err(_) => return Err(SinkError::Timeout(what)),
            Ok(Err(source)) => {
                if let Some(f) = TlsFailure::find(&source).filter(TlsFailure::is_permanent) {
                    return Err(SinkError::Tls(tls::rabbitmq_failure(&f, &url)));
                }
                let login_refused = matches!(&source, WireError::ConnectionClosed { code: 403, text }
                    if text.contains("Login was refused"));
                let refusal = if with_cert && source.ended_unsaid() {
                    amqp(CLOSED_WITH_CERT, source)
                } else {
                    amqp(what, source)
                };
                return Err(match login_refused {
                    true => {
                        cfg.urls[node].refusal(Login::Sql, refusal, SinkError::PasswordRotating)
                    }
                    false => refusal,
                });
            }
            Ok(Ok(wire)) => wire,
        };
        cfg.urls[node].login_accepted(Login::Sql);
        Ok(AmqpSink { wire, url, node })
    }

    /// Which node of `rabbitmq.url` this is (an index into it).
    pub fn node(&self) -> usize {
        self.node
    }

    /// The node's URL, password masked.
    pub fn url(&self) -> &str {
        &self.url
    }

    fn error(&self, what: &'static str, source: WireError) -> SinkError {
        SinkError::Amqp {
            what,
            url: self.url.clone(),
            source,
        }
    }

    /// Passive declare on a channel of its own (the broker closes a channel
    /// on which a passive declare fails), waited for. Call before
    /// publishing; mid-session, [`AmqpSink::look_for`].
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

    /// Queues a passive declare for `exchange` on the control channel; the
    /// answer comes from [`AmqpSink::answer`] ([`Event::Exchange`]), among
    /// the answers to publishes.
    pub fn look_for(&mut self, exchange: &str) -> Result<(), SinkError> {
        self.wire
            .look_for(exchange)
            .map_err(|e| self.error("checking the exchange", e))
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

    /// Opens the publishing channel again after the broker closed it:
    /// delivery tags start from 1 again.
    pub async fn reopen(&mut self) -> Result<(), SinkError> {
        let what = "opening the publishing channel again";
        match tokio::time::timeout(CALL_TIMEOUT, self.wire.reopen_publishing()).await {
            Err(_) => Err(SinkError::Timeout(what)),
            Ok(Err(e)) => Err(self.error(what, e)),
            Ok(Ok(())) => Ok(()),
        }
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

    /// Whether the publishing channel is open; when not, the next
    /// [`AmqpSink::answer`] says why.
    pub fn publishing_open(&self) -> bool {
        self.wire.publishing_open()
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

#[cfg(test)]
mod tests;
