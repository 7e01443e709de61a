//! The AMQP side: one connection, one channel in confirm mode, publishes with
//! `mandatory` and persistent delivery.
//!
//! Why one channel: AMQP orders messages per channel, and confirms on a
//! channel are issued in publish order, so per-aggregate order is kept by
//! construction. Why `mandatory`: without it the broker silently drops a
//! message no queue is bound for, and still confirms it. With it, the message
//! comes back (`basic.return`) before the confirm; lapin hands it over inside
//! the `Ack`, and we treat that as a failure, never as delivered.

pub mod publisher;

use std::time::Duration;

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions};
use lapin::protocol::{AMQPErrorKind, AMQPHardError, AMQPSoftError};
use lapin::types::FieldTable;
use lapin::{Channel, Connection, ConnectionProperties, DefaultConnectionBuilder, ExchangeKind};
use lapin::{Confirmation, PublisherConfirm};

use crate::config::{RabbitmqConfig, redact_url};
use crate::message::Envelope;
use crate::tls::{self, TlsFailure};

/// What went wrong on the broker side.
#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    /// A lapin call failed (connection lost, channel closed, refused...).
    #[error("{what} ({url}): {source}")]
    Amqp {
        /// The call that failed.
        what: &'static str,
        /// The broker URL, password masked.
        url: String,
        /// lapin's error.
        source: lapin::Error,
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
    /// True when retrying later may succeed (connection trouble, a broker
    /// restart, a nack); false when the operator must change something.
    pub fn is_transient(&self) -> bool {
        match self {
            SinkError::Amqp { source, .. } => match source.kind() {
                lapin::ErrorKind::ProtocolError(e) => {
                    !matches!(
                        e.kind(),
                        AMQPErrorKind::Hard(AMQPHardError::NOTALLOWED)
                            | AMQPErrorKind::Soft(AMQPSoftError::ACCESSREFUSED)
                            | AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND)
                    ) && e.get_id() != 403
                }
                _ => source.can_be_recovered(),
            },
            SinkError::NoExchange(_)
            | SinkError::Tls(_)
            | SinkError::Returned { .. }
            | SinkError::DeadLetterRefused { .. } => false,
            SinkError::Disconnected
            | SinkError::Timeout(_)
            | SinkError::Nacked { .. }
            | SinkError::ConfirmTimeout { .. } => true,
        }
    }
}

/// Deadline for connecting, for each control call, and for a publish while
/// the broker is not blocking us.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(15);

async fn deadline<T>(
    what: &'static str,
    url: &str,
    fut: impl Future<Output = lapin::Result<T>>,
) -> Result<T, SinkError> {
    match tokio::time::timeout(CALL_TIMEOUT, fut).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(source)) => Err(SinkError::Amqp {
            what,
            url: redact_url(url),
            source,
        }),
        Err(_) => Err(SinkError::Timeout(what)),
    }
}

/// A connected publisher.
pub struct AmqpSink {
    conn: Connection,
    channel: Channel,
    url: String,
}

impl AmqpSink {
    /// Connects, opens the publishing channel in confirm mode, and checks
    /// that a fixed exchange exists.
    pub async fn connect(cfg: &RabbitmqConfig) -> Result<AmqpSink, SinkError> {
        let url = cfg.url.expose();
        let props = ConnectionProperties::default().with_connection_name("outbox-relay".into());
        // Used by amqps:// URLs only; lapin decides by the scheme.
        let tls_config = tls::rabbitmq_tls(cfg.ca_file.as_deref())
            .map_err(|e| SinkError::Tls(format!("rabbitmq.ca_file: {e}")))?;
        let builder = DefaultConnectionBuilder::new()
            .map_err(|source| SinkError::Amqp {
                what: "connecting to RabbitMQ",
                url: redact_url(url),
                source,
            })?
            .with_uri_str(url.to_owned())
            .with_properties(props)
            .with_tls_config(tls_config);
        let conn = match deadline("connecting to RabbitMQ", url, builder.connect()).await {
            Err(SinkError::Amqp { source, .. })
                if TlsFailure::find(&source).is_some_and(|f| f.is_permanent()) =>
            {
                let f = TlsFailure::find(&source).expect("just found");
                return Err(SinkError::Tls(tls::rabbitmq_failure(&f, &redact_url(url))));
            }
            other => other?,
        };
        let channel = deadline("opening a channel", url, conn.create_channel()).await?;
        deadline(
            "enabling publisher confirms",
            url,
            channel.confirm_select(ConfirmSelectOptions::default()),
        )
        .await?;
        let sink = AmqpSink {
            conn,
            channel,
            url: redact_url(url),
        };
        if let Some(exchange) = cfg.exchange.as_literal() {
            sink.check_exchange(exchange).await?;
        }
        Ok(sink)
    }

    /// Passive declare on a throwaway channel: the broker closes a channel on
    /// which a passive declare fails.
    pub async fn check_exchange(&self, exchange: &str) -> Result<(), SinkError> {
        if exchange.is_empty() {
            return Ok(()); // the default exchange always exists
        }
        let ch = deadline("opening a channel", &self.url, self.conn.create_channel()).await?;
        let res = deadline(
            "checking the exchange",
            &self.url,
            ch.exchange_declare(
                exchange.into(),
                ExchangeKind::Topic,
                ExchangeDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            ),
        )
        .await;
        match res {
            Ok(()) => {
                let _ = ch.close(200, "ok".into()).await;
                Ok(())
            }
            Err(SinkError::Amqp { source, .. })
                if matches!(source.kind(), lapin::ErrorKind::ProtocolError(e)
                    if matches!(e.kind(), AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND))) =>
            {
                Err(SinkError::NoExchange(exchange.to_owned()))
            }
            Err(e) => Err(e),
        }
    }

    /// Hands one message to the broker; see [`PublishHandle::publish`]. No
    /// deadline here: the caller decides how long a blocked broker may hold
    /// it.
    pub async fn publish(&self, env: Envelope) -> Result<PublisherConfirm, SinkError> {
        self.handle().publish(env).await
    }

    /// An owned handle for publishing, so a publish can be started now and
    /// finished later, without borrowing the sink.
    pub fn handle(&self) -> PublishHandle {
        PublishHandle {
            channel: self.channel.clone(),
            status: self.conn.status().clone(),
        }
    }

    /// False once the connection or the publishing channel is gone (closed
    /// by the broker, network lost): the session must start over.
    pub fn is_connected(&self) -> bool {
        self.conn.status().connected() && self.channel.status().connected()
    }

    /// True while the broker has blocked publishing (resource alarm).
    pub fn is_blocked(&self) -> bool {
        self.conn.status().blocked()
    }

    /// Closes channel and connection politely (a blocked broker would not
    /// answer: then the connection is just dropped).
    pub async fn close(self) {
        if self.is_blocked() {
            return;
        }
        let _ = tokio::time::timeout(Duration::from_secs(5), async {
            let _ = self.channel.close(200, "shutdown".into()).await;
            let _ = self.conn.close(200, "shutdown".into()).await;
        })
        .await;
    }
}

/// See [`AmqpSink::handle`].
#[derive(Clone)]
pub struct PublishHandle {
    channel: Channel,
    status: lapin::ConnectionStatus,
}

impl PublishHandle {
    /// `basic.publish`, mandatory. lapin queues the frames synchronously on
    /// the returned future's first poll; the future then resolves once they
    /// are written, to the confirm's future. The message is moved into
    /// lapin's frames, not copied (lapin takes its strings and properties by
    /// value).
    pub async fn publish(&self, env: Envelope) -> Result<PublisherConfirm, SinkError> {
        self.channel
            .basic_publish(
                env.exchange,
                env.routing_key,
                BasicPublishOptions {
                    mandatory: true,
                    immediate: false,
                },
                &env.body,
                env.properties,
            )
            .await
            .map_err(|source| SinkError::Amqp {
                what: "publishing",
                url: String::from("broker connection"),
                source,
            })
    }

    /// True while the broker blocks publishing.
    pub fn is_blocked(&self) -> bool {
        self.status.blocked()
    }
}

/// The outcome of one publish, once the broker answered. `id` names the
/// event in an error; it is only called on the (rare) failure path.
pub fn check_confirmation(c: Confirmation, id: impl FnOnce() -> String) -> Result<(), SinkError> {
    match c {
        Confirmation::Ack(None) => Ok(()),
        Confirmation::Ack(Some(ret)) | Confirmation::Nack(Some(ret)) => Err(SinkError::Returned {
            id: id(),
            exchange: ret.delivery.exchange.to_string(),
            routing_key: ret.delivery.routing_key.to_string(),
            reply: ret.reply_text.to_string(),
        }),
        // confirm_select is always on; treat the impossible as a failure
        // rather than as delivered.
        Confirmation::Nack(None) | Confirmation::NotRequested => {
            Err(SinkError::Nacked { id: id() })
        }
    }
}
