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
//! lapin itself uses. lapin still serves `outbox-relay check` and the tests.
//!
//! What it does not do: consume, transactions, more than one publishing
//! channel, SASL mechanisms other than PLAIN. A failure ends the
//! connection; the relay starts a new session, as it did with lapin.

use std::fmt;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use amq_protocol::frame::{AMQPContentHeader, AMQPFrame, WriteContext, gen_frame, parse_frame};
use amq_protocol::protocol::{AMQPClass, basic, channel, confirm, connection, exchange};
use amq_protocol::types::{AMQPValue, FieldTable, LongString};
use amq_protocol::uri::{AMQPScheme, AMQPUri, SASLMechanism};
use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio::time::Instant;

use crate::message::{Envelope, MessageView};

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
/// Flush the write buffer once it holds this much, even mid-batch.
const WRITE_HIGH_WATER: usize = 64 * 1024;
/// TCP keepalive: probes after this much silence, this often, this many:
/// a dead peer is noticed within about a minute.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(30);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
const KEEPALIVE_RETRIES: u32 = 3;
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
    /// Connects, authenticates (PLAIN), opens the vhost and the publishing
    /// channel, and turns publisher confirms on. No deadline here: the
    /// caller sets one.
    pub async fn connect(target: &Target) -> Result<Wire, WireError> {
        let uri = &target.uri;
        if let Some(m) = uri.query.auth_mechanism {
            if m != SASLMechanism::Plain {
                return Err(WireError::Unsupported(format!(
                    "rabbitmq.url asks for the {} SASL mechanism; only PLAIN (user and password) is supported",
                    m.name()
                )));
            }
        }
        // An IPv6 literal comes in brackets (see `parse_amqp_url`).
        let host = uri.authority.host.as_str();
        let host = host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(host);
        let tcp = TcpStream::connect((host, uri.authority.port)).await?;
        tcp.set_nodelay(true)?;
        // A dead peer is noticed even with heartbeats off and nothing to
        // send (a broker that blocks publishing, then vanishes).
        socket2::SockRef::from(&tcp).set_tcp_keepalive(
            &socket2::TcpKeepalive::new()
                .with_time(KEEPALIVE_IDLE)
                .with_interval(KEEPALIVE_INTERVAL)
                .with_retries(KEEPALIVE_RETRIES),
        )?;
        let io: Box<dyn Io> = match (&uri.scheme, &target.tls) {
            (AMQPScheme::AMQPS, Some(tls)) => {
                let name = rustls::pki_types::ServerName::try_from(host.to_owned())
                    .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
                let stream = tokio_rustls::TlsConnector::from(tls.clone())
                    .connect(name, tcp)
                    .await?;
                Box::new(stream)
            }
            (AMQPScheme::AMQPS, None) => {
                return Err(WireError::Unsupported(
                    "amqps:// without TLS settings".into(),
                ));
            }
            (AMQPScheme::AMQP, _) => Box::new(tcp),
        };
        let mut w = Wire::over(io);
        match w.handshake(target).await {
            Ok(()) => Ok(w),
            Err(e) => {
                w.broken = true;
                Err(e)
            }
        }
    }

    async fn handshake(&mut self, target: &Target) -> Result<(), WireError> {
        let uri = &target.uri;
        self.wbuf.extend_from_slice(b"AMQP\x00\x00\x09\x01");
        let start = match self.method(0).await? {
            AMQPClass::Connection(connection::AMQPMethod::Start(s)) => s,
            other => return Err(unexpected("connection.start", &other)),
        };
        if !start
            .mechanisms
            .to_string()
            .split(' ')
            .any(|m| m == "PLAIN")
        {
            return Err(WireError::Unsupported(format!(
                "the broker does not offer PLAIN authentication (it offers {})",
                start.mechanisms
            )));
        }
        let user = &uri.authority.userinfo;
        let mut response = Vec::with_capacity(user.username.len() + user.password.len() + 2);
        response.push(0);
        response.extend_from_slice(user.username.as_bytes());
        response.push(0);
        response.extend_from_slice(user.password.as_bytes());
        self.send_method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::StartOk(connection::StartOk {
                client_properties: client_properties(&target.connection_name),
                mechanism: "PLAIN".into(),
                response: LongString::from(response),
                locale: "en_US".into(),
            })),
        )?;
        let tune = match self.method(0).await? {
            AMQPClass::Connection(connection::AMQPMethod::Tune(t)) => t,
            other => return Err(unexpected("connection.tune", &other)),
        };
        // Each limit: the smaller of the two, or the other where one side
        // says 0 (no limit), as RabbitMQ's own clients negotiate.
        let frame_max = negotiate(
            uri.query.frame_max.unwrap_or(DEFAULT_FRAME_MAX),
            tune.frame_max,
        )
        .max(4096);
        let heartbeat = negotiate(uri.query.heartbeat.unwrap_or(0), tune.heartbeat);
        let channel_max = negotiate(uri.query.channel_max.unwrap_or(0), tune.channel_max);
        if channel_max != 0 && channel_max < CONTROL_CHANNEL {
            return Err(WireError::Unsupported(format!(
                "the broker allows {channel_max} channel(s) per connection; the relay needs {CONTROL_CHANNEL} (rabbitmq.url channel_max, or the broker's channel_max)"
            )));
        }
        self.send_method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::TuneOk(connection::TuneOk {
                channel_max,
                frame_max,
                heartbeat,
            })),
        )?;
        self.frame_max = frame_max;
        self.heartbeat = (heartbeat > 0).then(|| Duration::from_secs(u64::from(heartbeat)));
        if let Some(hb) = self.heartbeat {
            self.heartbeat_timer.as_mut().reset(Instant::now() + hb / 2);
        }
        self.send_method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Open(connection::Open {
                virtual_host: uri.vhost.as_str().into(),
            })),
        )?;
        match self.method(0).await? {
            AMQPClass::Connection(connection::AMQPMethod::OpenOk(_)) => {}
            other => return Err(unexpected("connection.open-ok", &other)),
        }
        self.open_channel(PUBLISH_CHANNEL).await?;
        self.send_method(
            PUBLISH_CHANNEL,
            AMQPClass::Confirm(confirm::AMQPMethod::Select(confirm::Select {
                nowait: false,
            })),
        )?;
        match self.method(PUBLISH_CHANNEL).await? {
            AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(_)) => Ok(()),
            other => Err(unexpected("confirm.select-ok", &other)),
        }
    }

    async fn open_channel(&mut self, id: u16) -> Result<(), WireError> {
        self.send_method(
            id,
            AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
        )?;
        match self.method(id).await? {
            AMQPClass::Channel(channel::AMQPMethod::OpenOk(_)) => Ok(()),
            other => Err(unexpected("channel.open-ok", &other)),
        }
    }

    /// Whether `exchange` exists: a passive declare on a channel of its
    /// own. Only between publishes' answers: call it before publishing.
    pub async fn exchange_exists(&mut self, exchange: &str) -> Result<bool, WireError> {
        self.open_channel(CONTROL_CHANNEL).await?;
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
        match self.method(CONTROL_CHANNEL).await {
            Ok(AMQPClass::Exchange(exchange::AMQPMethod::DeclareOk(_))) => {}
            Ok(other) => return Err(unexpected("exchange.declare-ok", &other)),
            Err(WireError::ChannelClosed { code: 404, .. }) => return Ok(false),
            Err(e) => return Err(e),
        }
        self.send_method(
            CONTROL_CHANNEL,
            AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
                reply_code: 200,
                reply_text: "ok".into(),
                class_id: 0,
                method_id: 0,
            })),
        )?;
        match self.method(CONTROL_CHANNEL).await? {
            AMQPClass::Channel(channel::AMQPMethod::CloseOk(_)) => Ok(true),
            other => Err(unexpected("channel.close-ok", &other)),
        }
    }

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

    /// A connection over `io` as if the handshake was done (for tests that
    /// play the broker).
    #[cfg(test)]
    pub(super) fn after_handshake(
        io: impl AsyncRead + AsyncWrite + Send + Unpin + 'static,
    ) -> Wire {
        let mut w = Wire::over(Box::new(io));
        w.greeted = true;
        w
    }

    /// A connection over `io`, before the handshake.
    fn over(io: Box<dyn Io>) -> Wire {
        let now = Instant::now();
        Wire {
            io,
            rbuf: BytesMut::with_capacity(64 * 1024),
            wbuf: Vec::with_capacity(64 * 1024),
            written: 0,
            unflushed: false,
            frame_max: DEFAULT_FRAME_MAX,
            heartbeat: None,
            last_read: now,
            last_write: now,
            heartbeat_timer: Box::pin(tokio::time::sleep_until(now + Duration::from_secs(3600))),
            next_tag: 1,
            blocked: false,
            returning: None,
            broken: false,
            channel_closed: None,
            greeted: false,
            flow_paused: false,
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

    /// True while the broker blocks publishing (a resource alarm).
    pub fn is_blocked(&self) -> bool {
        self.blocked || self.flow_paused
    }

    /// Writes what is queued and waits for the broker's next answer.
    /// Cancel-safe: all state lives in `self`, so dropping the future
    /// (e.g. in `select!`) loses nothing.
    pub async fn event(&mut self) -> Result<Event, WireError> {
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

    /// Closes the connection politely and waits for the broker's answer.
    pub async fn close(mut self) -> Result<(), WireError> {
        if self.broken {
            return Ok(());
        }
        self.send_method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Close(connection::Close {
                reply_code: 200,
                reply_text: "shutdown".into(),
                class_id: 0,
                method_id: 0,
            })),
        )?;
        loop {
            match self.frame().await? {
                AMQPFrame::Method(0, AMQPClass::Connection(connection::AMQPMethod::CloseOk(_))) => {
                    break;
                }
                AMQPFrame::Method(0, AMQPClass::Connection(connection::AMQPMethod::Close(_))) => {
                    // Both sides closing at once: answer it too.
                    let _ = self.send_method(
                        0,
                        AMQPClass::Connection(connection::AMQPMethod::CloseOk(
                            connection::CloseOk {},
                        )),
                    );
                    self.try_write_now();
                    break;
                }
                _ => {}
            }
        }
        // TLS close_notify (or a plain FIN): the broker sees a clean close.
        tokio::io::AsyncWriteExt::shutdown(&mut self.io).await?;
        Ok(())
    }

    /// The next method on `channel`, handling the rest (heartbeats,
    /// blocked notices, closes) on the way.
    async fn method(&mut self, channel: u16) -> Result<AMQPClass, WireError> {
        loop {
            match self.frame().await? {
                AMQPFrame::Method(ch, class) if ch == channel && !is_close(&class) => {
                    return Ok(class);
                }
                frame => {
                    if let Some(Event::Blocked(b)) = self.on_frame(frame)? {
                        self.blocked = b;
                    }
                }
            }
        }
    }

    /// A frame for the loop's state; `Some` when it is news for the caller.
    fn on_frame(&mut self, frame: AMQPFrame) -> Result<Option<Event>, WireError> {
        match frame {
            AMQPFrame::Heartbeat | AMQPFrame::InvalidHeartbeat(_) => Ok(None),
            AMQPFrame::Method(_, AMQPClass::Connection(connection::AMQPMethod::Close(c))) => {
                let _ = self.send_method(
                    0,
                    AMQPClass::Connection(connection::AMQPMethod::CloseOk(connection::CloseOk {})),
                );
                self.try_write_now();
                self.broken = true;
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
            AMQPFrame::Method(PUBLISH_CHANNEL, AMQPClass::Basic(m)) => match m {
                basic::AMQPMethod::Ack(a) => Ok(Some(Event::Ack {
                    tag: a.delivery_tag,
                    multiple: a.multiple,
                })),
                basic::AMQPMethod::Nack(n) => Ok(Some(Event::Nack {
                    tag: n.delivery_tag,
                    multiple: n.multiple,
                })),
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
            AMQPFrame::Header(PUBLISH_CHANNEL, h) if self.returning.is_some() => {
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

    fn fail(&mut self, e: WireError) -> WireError {
        self.broken = true;
        e
    }

    fn send_method(&mut self, channel: u16, class: AMQPClass) -> Result<(), WireError> {
        self.put_frame(&AMQPFrame::Method(channel, class))
    }

    fn put_frame(&mut self, frame: &AMQPFrame) -> Result<(), WireError> {
        match encode_frame(std::mem::take(&mut self.wbuf), frame) {
            Ok(buf) => {
                self.wbuf = buf;
                Ok(())
            }
            Err(e) => Err(self.fail(e)),
        }
    }

    /// Best effort, without waiting: the broker is closing anyway.
    fn try_write_now(&mut self) {
        let waker = futures_util::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        let _ = self.poll_write(&mut cx);
    }

    /// The next frame, writing what is queued meanwhile.
    async fn frame(&mut self) -> Result<AMQPFrame, WireError> {
        if self.broken {
            return Err(WireError::Eof);
        }
        let res = std::future::poll_fn(|cx| self.poll_frame(cx)).await;
        if res.is_err() {
            self.broken = true;
        }
        res
    }

    fn poll_frame(&mut self, cx: &mut Context<'_>) -> Poll<Result<AMQPFrame, WireError>> {
        if let Some(hb) = self.heartbeat {
            while self.heartbeat_timer.as_mut().poll(cx).is_ready() {
                // What the broker sent while nobody read counts as heard.
                match tokio_util::io::poll_read_buf(Pin::new(&mut self.io), cx, &mut self.rbuf) {
                    Poll::Ready(Ok(0)) => return Poll::Ready(Err(WireError::Eof)),
                    Poll::Ready(Ok(_)) => self.last_read = Instant::now(),
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e.into())),
                    Poll::Pending => {}
                }
                self.tick()?;
                self.heartbeat_timer
                    .as_mut()
                    .reset(Instant::now() + (hb / 2).max(Duration::from_millis(100)));
            }
        }
        loop {
            self.poll_write(cx)?;
            if let Some(frame) = self.parse()? {
                return Poll::Ready(Ok(frame));
            }
            if self.rbuf.capacity() - self.rbuf.len() < 8192 {
                self.rbuf.reserve(64 * 1024);
            }
            match tokio_util::io::poll_read_buf(Pin::new(&mut self.io), cx, &mut self.rbuf) {
                Poll::Ready(Ok(0)) => return Poll::Ready(Err(WireError::Eof)),
                Poll::Ready(Ok(_)) => self.last_read = Instant::now(),
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e.into())),
                Poll::Pending => return Poll::Pending,
            }
        }
    }

    /// Writes as much of the buffer as the socket takes now.
    fn poll_write(&mut self, cx: &mut Context<'_>) -> Result<(), WireError> {
        while self.written < self.wbuf.len() {
            match Pin::new(&mut self.io).poll_write(cx, &self.wbuf[self.written..]) {
                Poll::Ready(Ok(0)) => return Err(io::Error::from(io::ErrorKind::WriteZero).into()),
                Poll::Ready(Ok(n)) => {
                    self.written += n;
                    self.unflushed = true;
                    self.last_write = Instant::now();
                }
                Poll::Ready(Err(e)) => return Err(e.into()),
                Poll::Pending => {
                    // The socket is full (the broker reads slowly, or
                    // applies flow control): drop what is written once it is
                    // the larger part, so the buffer holds at most twice
                    // what is unwritten, and each byte moves at most once.
                    if self.written >= self.wbuf.len() - self.written {
                        self.wbuf.drain(..self.written);
                        self.written = 0;
                    }
                    return Ok(());
                }
            }
        }
        self.wbuf.clear();
        self.written = 0;
        // One huge message must not pin its size for the connection's life.
        if self.wbuf.capacity() > WRITE_KEEP {
            self.wbuf.shrink_to(WRITE_HIGH_WATER);
        }
        if self.unflushed {
            match Pin::new(&mut self.io).poll_flush(cx) {
                Poll::Ready(Ok(())) => self.unflushed = false,
                Poll::Ready(Err(e)) => return Err(e.into()),
                Poll::Pending => {}
            }
        }
        Ok(())
    }

    /// A complete frame from the read buffer, if there is one.
    fn parse(&mut self) -> Result<Option<AMQPFrame>, WireError> {
        if self.rbuf.len() < 7 {
            return Ok(None);
        }
        if self.rbuf.starts_with(b"AMQP") {
            // The broker answers a protocol header it does not speak with
            // its own, then closes.
            return Err(WireError::Unsupported(
                "the broker does not speak AMQP 0-9-1 on this port (rabbitmq.url)".into(),
            ));
        }
        if !matches!(self.rbuf[0], 1 | 2 | 3 | 8) && !self.greeted {
            // Not an AMQP frame: another kind of server on this port.
            let what = match self.rbuf[0] {
                0x15 | 0x16 => "it speaks TLS: use amqps://".to_owned(),
                _ if self.rbuf.starts_with(b"HTTP") => "it speaks HTTP".to_owned(),
                _ => format!("it sent {:?}", String::from_utf8_lossy(&self.rbuf[..7])),
            };
            return Err(WireError::Unsupported(format!(
                "the server at rabbitmq.url is not an AMQP 0-9-1 broker ({what}); check the host, port and scheme"
            )));
        }
        self.greeted = true;
        let size = u32::from_be_bytes([self.rbuf[3], self.rbuf[4], self.rbuf[5], self.rbuf[6]]);
        if size > self.frame_max.max(DEFAULT_FRAME_MAX) {
            return Err(WireError::Protocol(format!(
                "frame of {size} bytes exceeds frame_max {}",
                self.frame_max
            )));
        }
        let total = size as usize + 8;
        if self.rbuf.len() < total {
            self.rbuf.reserve(total - self.rbuf.len());
            return Ok(None);
        }
        let raw = self.rbuf.split_to(total);
        match parse_frame(&raw[..]) {
            Ok((_, frame)) => Ok(Some(frame)),
            Err(e) => Err(WireError::Protocol(format!("unparsable frame: {e}"))),
        }
    }
}

/// The agreed value of a limit both sides propose; 0 means none.
fn negotiate<N: Ord + Default + Copy>(ours: N, theirs: N) -> N {
    let zero = N::default();
    match (ours == zero, theirs == zero) {
        (true, _) => theirs,
        (_, true) => ours,
        _ => ours.min(theirs),
    }
}

/// `basic.publish` (mandatory) of `env` with its header and body frames,
/// appended to `buf` through amq-protocol's encoder.
fn encode_envelope(buf: Vec<u8>, frame_max: u32, env: Envelope) -> Result<Vec<u8>, WireError> {
    let Envelope {
        exchange,
        routing_key,
        body,
        properties,
    } = env;
    let frames = [
        AMQPFrame::Method(
            PUBLISH_CHANNEL,
            AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
                exchange,
                routing_key,
                mandatory: true,
                immediate: false,
            })),
        ),
        AMQPFrame::Header(
            PUBLISH_CHANNEL,
            AMQPContentHeader {
                class_id: CLASS_BASIC,
                body_size: body.len() as u64,
                properties,
            },
        ),
    ];
    let mut buf = buf;
    for frame in &frames {
        buf = encode_frame(buf, frame)?;
    }
    put_body(&mut buf, frame_max, &body);
    Ok(buf)
}

/// `frame` appended to `buf` by amq-protocol's encoder.
/// The encoded size of the content-header frame `properties` make (frame
/// overhead included): what must fit in `frame_max`.
pub fn header_frame_len(properties: &lapin::BasicProperties) -> usize {
    let frame = AMQPFrame::Header(
        PUBLISH_CHANNEL,
        AMQPContentHeader {
            class_id: CLASS_BASIC,
            body_size: 0,
            properties: properties.clone(),
        },
    );
    encode_frame(Vec::new(), &frame).map_or(usize::MAX, |b| b.len())
}

pub(super) fn encode_frame(buf: Vec<u8>, frame: &AMQPFrame) -> Result<Vec<u8>, WireError> {
    gen_frame(frame)(WriteContext::from(buf))
        .map(|ctx| ctx.write)
        .map_err(|e| WireError::Protocol(format!("cannot encode a frame: {e}")))
}

const CLASS_BASIC: u16 = 60;
const FRAME_METHOD: u8 = 1;
const FRAME_HEADER: u8 = 2;
const FRAME_BODY: u8 = 3;
const FRAME_END: u8 = 0xCE;

/// Body frames: the payload in pieces of at most `frame_max` less the 8
/// bytes of frame overhead. The body's only copy.
fn put_body(buf: &mut Vec<u8>, frame_max: u32, body: &[u8]) {
    let chunk = (frame_max as usize).saturating_sub(8).max(1);
    for part in body.chunks(chunk) {
        buf.push(FRAME_BODY);
        buf.extend_from_slice(&PUBLISH_CHANNEL.to_be_bytes());
        buf.extend_from_slice(&(part.len() as u32).to_be_bytes());
        buf.extend_from_slice(part);
        buf.push(FRAME_END);
    }
}

/// Starts a frame; returns where its size goes (see [`end_frame`]).
fn begin_frame(buf: &mut Vec<u8>, kind: u8) -> usize {
    buf.push(kind);
    buf.extend_from_slice(&PUBLISH_CHANNEL.to_be_bytes());
    buf.extend_from_slice(&[0; 4]);
    buf.len()
}

fn end_frame(buf: &mut Vec<u8>, payload_at: usize) {
    let size = (buf.len() - payload_at) as u32;
    buf[payload_at - 4..payload_at].copy_from_slice(&size.to_be_bytes());
    buf.push(FRAME_END);
}

/// A short string: length octet, bytes (the caller checked the length).
fn put_short(buf: &mut Vec<u8>, parts: &[&str]) {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    debug_assert!(len <= 255);
    buf.push(len as u8);
    for p in parts {
        buf.extend_from_slice(p.as_bytes());
    }
}

/// A table entry holding a long string (`S`).
fn put_long_string_entry(buf: &mut Vec<u8>, key: &str, value: &str) {
    put_short(buf, &[key]);
    buf.push(b'S');
    buf.extend_from_slice(&(value.len() as u32).to_be_bytes());
    buf.extend_from_slice(value.as_bytes());
}

/// What [`encode_envelope`] writes for `m.to_envelope()`, written from the
/// row's pieces directly (a row without a headers column; the proptest in
/// this module holds the two to the same bytes).
fn encode_view(buf: &mut Vec<u8>, frame_max: u32, m: &MessageView<'_>) {
    // basic.publish: class, method, reserved short, exchange, routing key,
    // bits (mandatory).
    let at = begin_frame(buf, FRAME_METHOD);
    buf.extend_from_slice(&CLASS_BASIC.to_be_bytes());
    buf.extend_from_slice(&40u16.to_be_bytes());
    buf.extend_from_slice(&0u16.to_be_bytes());
    put_short(buf, m.exchange.parts());
    put_short(buf, m.routing_key.parts());
    buf.push(1);
    end_frame(buf, at);

    // Content header: class, weight, body size, property flags, then the
    // properties in flag order: content-type, headers, delivery-mode,
    // message-id, timestamp, type.
    const CONTENT_TYPE: u16 = 1 << 15;
    const HEADERS: u16 = 1 << 13;
    const DELIVERY_MODE: u16 = 1 << 12;
    const MESSAGE_ID: u16 = 1 << 7;
    const TIMESTAMP: u16 = 1 << 6;
    const TYPE: u16 = 1 << 5;
    let at = begin_frame(buf, FRAME_HEADER);
    buf.extend_from_slice(&CLASS_BASIC.to_be_bytes());
    buf.extend_from_slice(&0u16.to_be_bytes());
    buf.extend_from_slice(&(m.body.len() as u64).to_be_bytes());
    let flags = CONTENT_TYPE | HEADERS | DELIVERY_MODE | MESSAGE_ID | TIMESTAMP | TYPE;
    buf.extend_from_slice(&flags.to_be_bytes());
    put_short(buf, &[m.content_type]);
    // The table, keys in order (a FieldTable is sorted): aggregate_id,
    // aggregate_type.
    buf.extend_from_slice(&[0; 4]);
    let table_at = buf.len();
    put_long_string_entry(buf, "aggregate_id", m.aggregate_id);
    put_long_string_entry(buf, "aggregate_type", m.aggregate_type);
    let table_len = (buf.len() - table_at) as u32;
    buf[table_at - 4..table_at].copy_from_slice(&table_len.to_be_bytes());
    buf.push(2);
    put_short(buf, &[m.message_id]);
    buf.extend_from_slice(&m.timestamp.to_be_bytes());
    put_short(buf, &[m.event_type]);
    end_frame(buf, at);

    put_body(buf, frame_max, &m.body);
}

fn is_close(class: &AMQPClass) -> bool {
    matches!(
        class,
        AMQPClass::Channel(channel::AMQPMethod::Close(_))
            | AMQPClass::Connection(connection::AMQPMethod::Close(_))
    )
}

fn unexpected(wanted: &str, got: &AMQPClass) -> WireError {
    WireError::Protocol(format!(
        "expected {wanted}, got class {} method {}",
        got.get_amqp_class_id(),
        got.get_amqp_method_id()
    ))
}

/// What the management UI shows, and the capabilities the broker needs to
/// know about: confirms, `basic.nack`, `connection.blocked`, and a
/// `connection.close` (rather than a dropped socket) when login fails.
fn client_properties(name: &str) -> FieldTable {
    let mut caps = FieldTable::default();
    for cap in [
        "publisher_confirms",
        "basic.nack",
        "connection.blocked",
        "authentication_failure_close",
    ] {
        caps.insert(cap.into(), AMQPValue::Boolean(true));
    }
    let mut props = FieldTable::default();
    props.insert(
        "product".into(),
        AMQPValue::LongString("outbox-relay".into()),
    );
    props.insert(
        "version".into(),
        AMQPValue::LongString(env!("CARGO_PKG_VERSION").into()),
    );
    props.insert("platform".into(), AMQPValue::LongString("Rust".into()));
    props.insert("capabilities".into(), AMQPValue::FieldTable(caps));
    props.insert("connection_name".into(), AMQPValue::LongString(name.into()));
    props
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::Name;
    use proptest::prelude::*;

    /// A broker that reads more slowly than the relay publishes: the
    /// written front of the buffer is dropped as it goes, so the buffer
    /// stays within twice what is unwritten, and the bytes that arrive are
    /// exactly the messages, in order.
    #[test]
    fn the_write_buffer_is_compacted_after_partial_writes() {
        use tokio::io::AsyncRead;
        // A runtime for the connection's timer; polled by hand, outside any
        // task (inside one, tokio's cooperative budget would make the pipe
        // pend after a while).
        let rt = tokio::runtime::Runtime::new().unwrap();
        let _in_runtime = rt.enter();
        let (client, mut broker) = tokio::io::duplex(8 * 1024);
        let mut w = Wire::over(Box::new(client));
        let waker = futures_util::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        let env = |i: usize| Envelope {
            exchange: "ex".into(),
            routing_key: format!("rk{i}").into(),
            body: bytes::Bytes::from(vec![(i % 251) as u8; 10_000]),
            properties: lapin::BasicProperties::default(),
        };
        let mut expected = Vec::new();
        let mut got = Vec::new();
        let mut chunk = vec![0u8; 8 * 1024];
        let read = |broker: &mut tokio::io::DuplexStream, got: &mut Vec<u8>, chunk: &mut [u8]| {
            let mut cx = Context::from_waker(&waker);
            let mut rb = tokio::io::ReadBuf::new(chunk);
            if let Poll::Ready(Ok(())) = Pin::new(broker).poll_read(&mut cx, &mut rb) {
                got.extend_from_slice(rb.filled());
            }
        };
        for i in 0..200 {
            expected = encode_envelope(expected, w.frame_max, env(i)).unwrap();
            w.publish(env(i)).unwrap();
            w.poll_write(&mut cx).unwrap();
            let unwritten = w.wbuf.len() - w.written;
            assert!(
                w.wbuf.len() <= 2 * unwritten,
                "round {i}: {} bytes buffered for {unwritten} unwritten",
                w.wbuf.len()
            );
            read(&mut broker, &mut got, &mut chunk);
        }
        while w.written < w.wbuf.len() || got.len() < expected.len() {
            w.poll_write(&mut cx).unwrap();
            read(&mut broker, &mut got, &mut chunk);
        }
        assert_eq!(got.len(), expected.len());
        assert!(got == expected, "the bytes on the wire differ");
        // One huge message does not pin its size once it is written.
        let huge = Envelope {
            body: bytes::Bytes::from(vec![1u8; 3 << 20]),
            ..env(0)
        };
        w.publish(huge).unwrap();
        assert!(w.wbuf.capacity() > WRITE_KEEP);
        got.clear();
        while w.written < w.wbuf.len() || !w.wbuf.is_empty() {
            w.poll_write(&mut cx).unwrap();
            read(&mut broker, &mut got, &mut chunk);
        }
        assert!(w.wbuf.capacity() <= WRITE_KEEP, "{}", w.wbuf.capacity());
    }

    fn name(parts: &[String]) -> Name<'_> {
        parts.iter().fold(Name::literal(""), |n, p| n.join(p))
    }

    fn parts_within(max: usize) -> impl Strategy<Value = Vec<String>> {
        proptest::collection::vec("\\PC{0,20}", 0..4).prop_filter("short", move |p| {
            p.iter().map(String::len).sum::<usize>() <= max
        })
    }

    proptest! {
        /// The direct encoder writes exactly what amq-protocol writes for
        /// the same message: frames, properties, header table, body chunks.
        #[test]
        fn encode_view_matches_amq_protocol(
            exchange in parts_within(255),
            routing_key in parts_within(255),
            message_id in "\\PC{0,60}",
            event_type in "\\PC{0,60}",
            aggregate_type in "\\PC{0,80}",
            aggregate_id in "\\PC{0,300}",
            timestamp in any::<u64>(),
            body in proptest::collection::vec(any::<u8>(), 0..9000),
            content_type in prop::sample::select(vec![
                "application/json",
                "text/plain; charset=utf-8",
                "application/octet-stream",
            ]),
            frame_max in prop::sample::select(vec![4096u32, 131_072]),
        ) {
            prop_assume!(message_id.len() <= 255 && event_type.len() <= 255);
            let m = MessageView {
                exchange: name(&exchange),
                routing_key: name(&routing_key),
                body: body.into(),
                message_id: &message_id,
                event_type: &event_type,
                content_type,
                timestamp,
                aggregate_type: &aggregate_type,
                aggregate_id: &aggregate_id,
                headers: None,
            };
            let mut direct = b"before".to_vec();
            encode_view(&mut direct, frame_max, &m);
            let reference = encode_envelope(b"before".to_vec(), frame_max, m.to_envelope()).unwrap();
            prop_assert_eq!(direct, reference);
            // The bound the publisher checks against frame_max is one.
            prop_assert!(m.header_bytes() >= header_frame_len(&m.to_envelope().properties));
        }

        /// With a headers column (strings, numbers, nested values, CC), the
        /// bound still holds.
        #[test]
        fn header_bytes_bounds_the_header_frame(
            keys in proptest::collection::vec("[a-zA-Z_-]{1,40}", 0..12),
            texts in proptest::collection::vec("\\PC{0,200}", 12),
            aggregate_id in "\\PC{0,300}",
        ) {
            let mut headers = FieldTable::default();
            for (i, k) in keys.iter().enumerate() {
                let v = match i % 5 {
                    0 => AMQPValue::LongString(texts[i].as_str().into()),
                    1 => AMQPValue::LongLongInt(i as i64),
                    2 => AMQPValue::Double(i as f64 / 3.0),
                    3 => AMQPValue::Boolean(i % 2 == 0),
                    _ => AMQPValue::FieldArray(vec![AMQPValue::LongString(texts[i].as_str().into())].into()),
                };
                headers.insert(k.as_str().into(), v);
            }
            let m = MessageView {
                exchange: Name::literal("ex"),
                routing_key: Name::literal("rk"),
                body: bytes::Bytes::new(),
                message_id: "id",
                event_type: "type",
                content_type: "application/json",
                timestamp: 1,
                aggregate_type: "order",
                aggregate_id: &aggregate_id,
                headers: Some(headers),
            };
            prop_assert!(m.header_bytes() >= header_frame_len(&m.to_envelope().properties));
        }
    }

    #[test]
    fn limits_are_the_smaller_unless_one_side_has_none() {
        assert_eq!(negotiate(131_072u32, 65_536), 65_536);
        assert_eq!(negotiate(4_096u32, 131_072), 4_096);
        assert_eq!(negotiate(0u16, 60), 60, "no heartbeat asked: the broker's");
        assert_eq!(negotiate(10u16, 60), 10);
        assert_eq!(negotiate(10u16, 0), 10, "the broker has none: ours");
        assert_eq!(negotiate(0u16, 0), 0);
    }
}
