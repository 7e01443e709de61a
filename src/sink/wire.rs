//! The AMQP 0-9-1 connection the relay publishes on: one socket, owned by
//! the task that publishes, with no I/O thread, promise or lock per message.
//!
//! Why not lapin here: lapin turns each `basic_publish` into a vector of
//! frames (the body copied into it), two promises, a queue push under a
//! mutex and a wake-up of its I/O thread, which copies the body again when
//! it serializes. Profiles put that at most of the relay's CPU per event.
//! This client appends a publish's three frames straight into the write
//! buffer (the body's only copy), writes the buffer in one call when the
//! caller next waits for the broker, and hands back the broker's answers
//! (`basic.ack`, `basic.nack`, `basic.return`, `connection.blocked`) as
//! plain values. Frames are encoded and parsed by amq-protocol, the codec
//! lapin itself uses. lapin serves only the tests and the example consumer.
//!
//! What it does not do: consume, transactions, more than one publishing
//! channel, SASL mechanisms other than PLAIN. A failure ends the
//! connection; the relay starts a new session, as it did with lapin.

use std::collections::VecDeque;
use std::fmt;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use amq_protocol::frame::AMQPFrame;
use amq_protocol::protocol::{AMQPClass, basic, channel, connection, exchange};
use amq_protocol::types::FieldTable;
use amq_protocol::uri::AMQPUri;
use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::time::Instant;

use crate::message::{Envelope, MessageView};

#[cfg(test)]
mod conformance;
mod connect;
mod frames;
#[cfg(test)]
mod fuzz;
#[cfg(test)]
mod hostile;
#[cfg(test)]
mod scripted;
#[cfg(test)]
mod tests;

#[cfg(test)]
pub(super) use connect::watch_peer;
#[cfg(test)]
pub(super) use frames::encode_frame;
pub use frames::header_frame_len;
#[cfg(test)]
pub(super) use frames::nesting;
use frames::{encode_envelope, encode_view, unexpected};

/// The socket, plain or TLS.
trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

/// The channel messages are published on.
const PUBLISH_CHANNEL: u16 = 1;
/// A channel for passive declares: the broker closes a channel on which
/// one fails, and the publishing channel must survive that.
const CONTROL_CHANNEL: u16 = 2;
/// Largest frame we accept before `connection.tune`, and the frame size we
/// ask for unless `rabbitmq.url` says (RabbitMQ's default).
const DEFAULT_FRAME_MAX: u32 = 131_072;
/// Answers kept while waiting for a reply, beyond two per publish (see
/// [`Wire::keep`]).
const PENDING_SLACK: u64 = 64;
/// Flush the write buffer once it holds this much, even mid-batch.
const WRITE_HIGH_WATER: usize = 64 * 1024;
/// TCP keepalive: probes after this much silence, this often, this many:
/// a dead peer is noticed within about a minute.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(30);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
const KEEPALIVE_RETRIES: u32 = 3;
/// Unacknowledged data older than this ends the connection (the same
/// minute keepalive takes).
const USER_TIMEOUT: Duration = Duration::from_secs(60);
/// An empty write buffer larger than this is shrunk back.
const WRITE_KEEP: usize = 1024 * 1024;

/// What went wrong on the connection.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// The socket failed (TLS errors arrive here too, inside the
    /// `io::Error`).
    #[error("{0}")]
    Io(#[from] io::Error),
    /// The broker closed the connection (`connection.close`).
    #[error("the broker closed the connection: {code} {text}")]
    ConnectionClosed {
        /// AMQP reply code.
        code: u16,
        /// The broker's reply text.
        text: String,
    },
    /// The broker closed a channel (`channel.close`), e.g. publishing to an
    /// exchange that does not exist.
    #[error("the broker closed the channel: {code} {text}")]
    ChannelClosed {
        /// AMQP reply code.
        code: u16,
        /// The broker's reply text.
        text: String,
    },
    /// The socket closed without a `connection.close`.
    #[error("the broker closed the connection")]
    Eof,
    /// Nothing came from the broker for two heartbeat intervals.
    #[error("no heartbeat from the broker for {0} s")]
    HeartbeatMissed(u64),
    /// The broker sent something this client does not expect.
    #[error("AMQP protocol error: {0}")]
    Protocol(String),
    /// The URL asks for something this client does not do.
    #[error("{0}")]
    Unsupported(String),
}

impl WireError {
    /// The connection ended without a word from the broker (a reset, a
    /// close): what a broker that refuses a client certificate after a
    /// TLS 1.3 handshake may do instead of sending its alert.
    pub fn ended_unsaid(&self) -> bool {
        use io::ErrorKind as K;
        match self {
            WireError::Io(e) => matches!(
                e.kind(),
                K::ConnectionReset | K::UnexpectedEof | K::BrokenPipe | K::ConnectionAborted
            ),
            WireError::Eof => true,
            _ => false,
        }
    }

    /// The AMQP reply code, when the broker closed something.
    pub fn code(&self) -> Option<u16> {
        match self {
            WireError::ConnectionClosed { code, .. } | WireError::ChannelClosed { code, .. } => {
                Some(*code)
            }
            _ => None,
        }
    }

    /// What it means for the relay (see [`super::replies`]).
    pub fn disposition(&self) -> super::replies::Disposition {
        use super::replies::{Disposition, disposition};
        match self {
            WireError::Unsupported(_) => Disposition::Stop,
            WireError::ChannelClosed { code, text } => disposition(true, *code, text),
            WireError::ConnectionClosed { code, text } => disposition(false, *code, text),
            _ => Disposition::Transient,
        }
    }

    /// False when the operator must change something (credentials,
    /// permissions, a missing exchange or vhost).
    pub fn is_transient(&self) -> bool {
        self.disposition() != super::replies::Disposition::Stop
    }
}

/// A message the broker could not route (`basic.return`). Its confirm
/// follows; the message is not delivered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Returned {
    /// AMQP reply code (312 NO_ROUTE).
    pub reply_code: u16,
    /// The broker's reply text.
    pub reply_text: String,
    /// The exchange it was published to.
    pub exchange: String,
    /// Its routing key.
    pub routing_key: String,
    /// Its `message_id` property: which message it is.
    pub message_id: Option<String>,
}

/// What the broker said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// `basic.ack`: the broker took responsibility for message `tag`, and
    /// with `multiple` for every earlier one too.
    Ack {
        /// Delivery tag.
        tag: u64,
        /// Also every tag before it.
        multiple: bool,
    },
    /// `basic.nack`: the broker refused them.
    Nack {
        /// Delivery tag.
        tag: u64,
        /// Also every tag before it.
        multiple: bool,
    },
    /// `basic.return` with its content header.
    Returned(Returned),
    /// `connection.blocked` (true) or `connection.unblocked` (false).
    Blocked(bool),
    /// The write buffer, full when the wait began, has drained: there is
    /// room for more publishes.
    Drained,
    /// The answer to [`Wire::look_for`]: whether exchange `name` exists.
    Exchange {
        /// The exchange looked for.
        name: String,
        /// What the broker said.
        found: Found,
    },
}

/// What a passive `exchange.declare` found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Found {
    /// `exchange.declare-ok`.
    Exists,
    /// 404 NOT_FOUND (the control channel closed).
    Missing,
    /// 403 ACCESS_REFUSED, with the broker's text (the control channel
    /// closed).
    Forbidden(String),
}

/// A `basic.return` whose content has not all arrived.
struct Returning {
    ret: Returned,
    body_left: Option<u64>,
}

/// Where to connect and how.
pub struct Target {
    /// The parsed `rabbitmq.url`.
    pub uri: AMQPUri,
    /// TLS settings for `amqps://`.
    pub tls: Option<Arc<rustls::ClientConfig>>,
    /// Shown to operators in the management UI.
    pub connection_name: String,
}

/// An open connection with a publishing channel in confirm mode.
pub struct Wire {
    io: Box<dyn Io>,
    rbuf: BytesMut,
    wbuf: Vec<u8>,
    /// Bytes at the front of `wbuf` already written.
    written: usize,
    /// Written but not yet flushed (TLS keeps records back until flushed).
    unflushed: bool,
    frame_max: u32,
    heartbeat: Option<Duration>,
    last_read: Instant,
    last_write: Instant,
    /// Next heartbeat check (send one when idle, fail when the broker is
    /// silent), polled wherever the connection is read.
    heartbeat_timer: Pin<Box<tokio::time::Sleep>>,
    /// Delivery tag of the next publish.
    next_tag: u64,
    blocked: bool,
    returning: Option<Returning>,
    /// Set once the connection failed: every later call fails alike.
    broken: bool,
    /// The broker closed the publishing channel (answered with close-ok):
    /// publishing fails alike, but the connection can still close cleanly.
    channel_closed: Option<(u16, String)>,
    /// A first frame came: the peer speaks AMQP.
    greeted: bool,
    /// The broker paused the publishing channel (`channel.flow`).
    flow_paused: bool,
    /// The broker closed the connection and close-ok is queued.
    answered_close: bool,
    /// Answers read while waiting for a reply on another channel (the
    /// publishing channel reopened while a passive declare is out, or a
    /// declare's own wait), handed out first by [`Wire::event`].
    pending: VecDeque<Event>,
    /// The control channel is open (or its `channel.open` is sent).
    control_open: bool,
    /// The exchange a passive declare on the control channel is out for.
    looking_for: Option<String>,
}

impl fmt::Debug for Wire {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Wire")
            .field("next_tag", &self.next_tag)
            .field("blocked", &self.blocked)
            .finish_non_exhaustive()
    }
}

impl Wire {
    /// Fails as the broker closed the publishing channel, if it did.
    fn channel_open(&self) -> Result<(), WireError> {
        match &self.channel_closed {
            Some((code, text)) => Err(WireError::ChannelClosed {
                code: *code,
                text: text.clone(),
            }),
            None => Ok(()),
        }
    }

    /// Queues `basic.publish` (mandatory) with the message's header and
    /// body; returns its delivery tag. Nothing is written until the next
    /// [`Wire::event`] (or a full buffer): publish a batch, then wait.
    pub fn publish(&mut self, env: Envelope) -> Result<u64, WireError> {
        self.channel_open()?;
        let buf = std::mem::take(&mut self.wbuf);
        match encode_envelope(buf, self.frame_max, env) {
            Ok(buf) => self.wbuf = buf,
            Err(e) => return Err(self.fail(e)),
        }
        Ok(self.next_tag())
    }

    /// As [`Wire::publish`], encoding the message straight from the row's
    /// pieces: no allocation (unless the row has headers to merge).
    pub fn publish_view(&mut self, m: &MessageView<'_>) -> Result<u64, WireError> {
        if m.headers.is_some() {
            return self.publish(m.to_envelope());
        }
        self.channel_open()?;
        encode_view(&mut self.wbuf, self.frame_max, m);
        Ok(self.next_tag())
    }

    /// The negotiated frame_max: a content header must fit in one frame.
    pub fn frame_max(&self) -> u32 {
        self.frame_max
    }

    /// The negotiated heartbeat interval (`None`: off).
    #[cfg(test)]
    pub(in crate::sink) fn heartbeat(&self) -> Option<Duration> {
        self.heartbeat
    }

    fn next_tag(&mut self) -> u64 {
        let tag = self.next_tag;
        self.next_tag += 1;
        tag
    }

    /// Bytes waiting to be written: flush (by waiting for an event) before
    /// this grows past a batch.
    pub fn wants_flush(&self) -> bool {
        self.wbuf.len() - self.written >= WRITE_HIGH_WATER
    }

    /// Queues a passive `exchange.declare` for `exchange` on the control
    /// channel (opened first if it is not): the answer comes as an
    /// [`Event::Exchange`] from [`Wire::event`], among the answers to
    /// publishes, so nothing waits for it. One at a time. The channel
    /// stays open after an answer that does not close it.
    pub fn look_for(&mut self, exchange: &str) -> Result<(), WireError> {
        if self.looking_for.is_some() {
            return Err(WireError::Protocol(
                "a passive exchange.declare is already out".into(),
            ));
        }
        if !self.control_open {
            self.send_method(
                CONTROL_CHANNEL,
                AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
            )?;
            self.control_open = true;
        }
        self.send_method(
            CONTROL_CHANNEL,
            AMQPClass::Exchange(exchange::AMQPMethod::Declare(exchange::Declare {
                exchange: exchange.into(),
                kind: "topic".into(),
                passive: true,
                durable: false,
                auto_delete: false,
                internal: false,
                nowait: false,
                arguments: FieldTable::default(),
            })),
        )?;
        self.looking_for = Some(exchange.to_owned());
        Ok(())
    }

    /// Whether the publishing channel is open (a close the broker sent
    /// while another channel was waited on is reported by [`Wire::event`]).
    pub fn publishing_open(&self) -> bool {
        self.channel_closed.is_none()
    }

    /// True while the broker blocks publishing (a resource alarm).
    pub fn is_blocked(&self) -> bool {
        self.blocked || self.flow_paused
    }

    /// Writes what is queued and waits for the broker's next answer.
    /// Cancel-safe: all state lives in `self`, so dropping the future
    /// (e.g. in `select!`) loses nothing.
    pub async fn event(&mut self) -> Result<Event, WireError> {
        if let Some(ev) = self.pending.pop_front() {
            return Ok(ev);
        }
        self.channel_open()?;
        // The caller held new work back because the buffer was full: tell
        // it as soon as the buffer drains, not at the next answer.
        let gated = self.wants_flush();
        loop {
            if self.broken {
                return Err(WireError::Eof);
            }
            let next = std::future::poll_fn(|cx| match self.poll_frame(cx) {
                Poll::Pending if gated && !self.wants_flush() => Poll::Ready(Ok(None)),
                other => other.map(|r| r.map(Some)),
            })
            .await;
            match next {
                Err(e) => {
                    self.broken = true;
                    return Err(e);
                }
                Ok(None) => return Ok(Event::Drained),
                Ok(Some(frame)) => {
                    if let Some(ev) = self.on_frame(frame)? {
                        return Ok(ev);
                    }
                }
            }
        }
    }

    /// Run by the heartbeat timer (every half interval): sends a heartbeat
    /// when nothing was written for half the interval, fails when nothing
    /// was read for two.
    fn tick(&mut self) -> Result<(), WireError> {
        let Some(hb) = self.heartbeat else {
            return Ok(());
        };
        if self.last_read.elapsed() > hb * 2 {
            self.broken = true;
            return Err(WireError::HeartbeatMissed((hb * 2).as_secs()));
        }
        if self.last_write.elapsed() >= hb / 2 && self.written == self.wbuf.len() {
            self.wbuf.extend_from_slice(&[8, 0, 0, 0, 0, 0, 0, 0xCE]);
        }
        Ok(())
    }

    /// A frame for the loop's state; `Some` when it is news for the caller.
    fn on_frame(&mut self, frame: AMQPFrame) -> Result<Option<Event>, WireError> {
        match frame {
            AMQPFrame::Heartbeat | AMQPFrame::InvalidHeartbeat(_) => Ok(None),
            AMQPFrame::Method(CONTROL_CHANNEL, class) => self.on_control(class),
            AMQPFrame::Method(_, AMQPClass::Connection(connection::AMQPMethod::Close(c))) => {
                let _ = self.send_method(
                    0,
                    AMQPClass::Connection(connection::AMQPMethod::CloseOk(connection::CloseOk {})),
                );
                self.try_write_now();
                self.broken = true;
                self.answered_close = true;
                Err(WireError::ConnectionClosed {
                    code: c.reply_code,
                    text: c.reply_text.to_string(),
                })
            }
            AMQPFrame::Method(ch, AMQPClass::Channel(channel::AMQPMethod::Close(c))) => {
                let _ = self.send_method(
                    ch,
                    AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
                );
                self.try_write_now();
                if ch == PUBLISH_CHANNEL {
                    self.channel_closed = Some((c.reply_code, c.reply_text.to_string()));
                }
                Err(WireError::ChannelClosed {
                    code: c.reply_code,
                    text: c.reply_text.to_string(),
                })
            }
            AMQPFrame::Method(0, AMQPClass::Connection(connection::AMQPMethod::Blocked(_))) => {
                self.blocked = true;
                Ok(Some(Event::Blocked(true)))
            }
            AMQPFrame::Method(0, AMQPClass::Connection(connection::AMQPMethod::Unblocked(_))) => {
                self.blocked = false;
                Ok(Some(Event::Blocked(self.is_blocked())))
            }
            AMQPFrame::Method(
                PUBLISH_CHANNEL,
                AMQPClass::Channel(channel::AMQPMethod::Flow(f)),
            ) => {
                // The broker asks the channel to pause (or resume): answer,
                // and hold publishing as for a blocked connection.
                self.send_method(
                    PUBLISH_CHANNEL,
                    AMQPClass::Channel(channel::AMQPMethod::FlowOk(channel::FlowOk {
                        active: f.active,
                    })),
                )?;
                self.try_write_now();
                self.flow_paused = !f.active;
                Ok(Some(Event::Blocked(self.is_blocked())))
            }
            // A return's header and body come next, nothing else: an ack
            // or another return in between would settle the wrong message.
            AMQPFrame::Method(PUBLISH_CHANNEL, class) if self.returning.is_some() => Err(self
                .fail(WireError::Protocol(format!(
                    "class {} method {} in the middle of a returned message",
                    class.get_amqp_class_id(),
                    class.get_amqp_method_id()
                )))),
            AMQPFrame::Method(PUBLISH_CHANNEL, AMQPClass::Basic(m)) => match m {
                basic::AMQPMethod::Ack(a) => {
                    self.published(a.delivery_tag, "ack")?;
                    Ok(Some(Event::Ack {
                        tag: a.delivery_tag,
                        multiple: a.multiple,
                    }))
                }
                basic::AMQPMethod::Nack(n) => {
                    self.published(n.delivery_tag, "nack")?;
                    Ok(Some(Event::Nack {
                        tag: n.delivery_tag,
                        multiple: n.multiple,
                    }))
                }
                basic::AMQPMethod::Return(r) => {
                    self.returning = Some(Returning {
                        ret: Returned {
                            reply_code: r.reply_code,
                            reply_text: r.reply_text.to_string(),
                            exchange: r.exchange.to_string(),
                            routing_key: r.routing_key.to_string(),
                            message_id: None,
                        },
                        body_left: None,
                    });
                    Ok(None)
                }
                other => Err(self.fail(unexpected(
                    "an answer to a publish",
                    &AMQPClass::Basic(other),
                ))),
            },
            AMQPFrame::Header(PUBLISH_CHANNEL, h)
                if self
                    .returning
                    .as_ref()
                    .is_some_and(|r| r.body_left.is_none()) =>
            {
                let r = self.returning.as_mut().expect("checked");
                r.ret.message_id = h.properties.message_id().as_ref().map(|s| s.to_string());
                r.body_left = Some(h.body_size);
                self.returned_if_complete()
            }
            AMQPFrame::Body(PUBLISH_CHANNEL, b) if self.returning.is_some() => {
                let r = self.returning.as_mut().expect("checked");
                if let Some(left) = r.body_left.as_mut() {
                    *left = left.saturating_sub(b.len() as u64);
                }
                self.returned_if_complete()
            }
            other => Err(self.fail(WireError::Protocol(format!("unexpected frame {other:?}")))),
        }
    }

    /// An answer for `tag` (0: every tag, with `multiple`) may come only
    /// once it was published: a broker acking ahead is broken, or hostile.
    fn published(&mut self, tag: u64, what: &str) -> Result<(), WireError> {
        if tag >= self.next_tag {
            return Err(self.fail(WireError::Protocol(format!(
                "a basic.{what} for delivery tag {tag}, never published"
            ))));
        }
        Ok(())
    }

    /// Keeps an answer read while waiting for another (see `pending`),
    /// bounded: a broker can owe at most an ack or a nack and a return
    /// for each publish, and blocked notices in a row say only the last.
    fn keep(&mut self, ev: Event) -> Result<(), WireError> {
        if let Event::Blocked(now) = ev
            && let Some(Event::Blocked(last)) = self.pending.back_mut()
        {
            *last = now;
            return Ok(());
        }
        let owed = self
            .next_tag
            .saturating_mul(2)
            .saturating_add(PENDING_SLACK);
        if self.pending.len() as u64 >= owed {
            return Err(self.fail(WireError::Protocol(format!(
                "{} answers kept while waiting for a reply, more than {} publishes can be owed",
                self.pending.len(),
                self.next_tag - 1
            ))));
        }
        self.pending.push_back(ev);
        Ok(())
    }

    /// A method on the control channel: the answers to `look_for`.
    fn on_control(&mut self, class: AMQPClass) -> Result<Option<Event>, WireError> {
        match class {
            AMQPClass::Channel(channel::AMQPMethod::OpenOk(_)) if self.control_open => Ok(None),
            AMQPClass::Exchange(exchange::AMQPMethod::DeclareOk(_))
                if self.looking_for.is_some() =>
            {
                let name = self.looking_for.take().expect("checked");
                Ok(Some(Event::Exchange {
                    name,
                    found: Found::Exists,
                }))
            }
            AMQPClass::Channel(channel::AMQPMethod::Close(c)) => {
                let _ = self.send_method(
                    CONTROL_CHANNEL,
                    AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
                );
                self.try_write_now();
                self.control_open = false;
                let found = match (c.reply_code, self.looking_for.take()) {
                    (404, Some(name)) => (name, Found::Missing),
                    (403, Some(name)) => (name, Found::Forbidden(c.reply_text.to_string())),
                    // Not an answer to a passive declare: nothing this
                    // client asked for, so nothing it can go on with (a
                    // new session; no event is to blame).
                    (code, _) => {
                        return Err(self.fail(WireError::Protocol(format!(
                            "the broker closed the control channel ({code}: {})",
                            c.reply_text
                        ))));
                    }
                };
                Ok(Some(Event::Exchange {
                    name: found.0,
                    found: found.1,
                }))
            }
            other => Err(self.fail(unexpected(
                "an answer to a passive exchange.declare",
                &other,
            ))),
        }
    }

    fn returned_if_complete(&mut self) -> Result<Option<Event>, WireError> {
        if self
            .returning
            .as_ref()
            .is_some_and(|r| r.body_left == Some(0))
        {
            let r = self.returning.take().expect("checked");
            return Ok(Some(Event::Returned(r.ret)));
        }
        Ok(None)
    }
}
