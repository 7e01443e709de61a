//! Frames: reading and parsing them off the socket, writing the buffer,
//! and encoding (amq-protocol's encoder, or by hand for a row's publish).

use super::{DEFAULT_FRAME_MAX, PUBLISH_CHANNEL, WRITE_HIGH_WATER, WRITE_KEEP, Wire, WireError};
use crate::message::Envelope;
use crate::message::MessageView;
use amq_protocol::frame::AMQPContentHeader;
use amq_protocol::frame::AMQPFrame;
use amq_protocol::frame::WriteContext;
use amq_protocol::frame::gen_frame;
use amq_protocol::frame::parse_frame;
use amq_protocol::protocol::AMQPClass;
use amq_protocol::protocol::basic;
use amq_protocol::protocol::channel;
use amq_protocol::protocol::connection;
use amq_protocol::types::FieldTable;
use std::io;
use std::pin::Pin;
use std::task::Context;
use std::task::Poll;
use std::time::Duration;
use tokio::io::AsyncWrite;
use tokio::time::Instant;

impl Wire {
    pub(super) fn fail(&mut self, e: WireError) -> WireError {
        self.broken = true;
        e
    }

    pub(super) fn send_method(&mut self, channel: u16, class: AMQPClass) -> Result<(), WireError> {
        self.put_frame(&AMQPFrame::Method(channel, class))
    }

    pub(super) fn put_frame(&mut self, frame: &AMQPFrame) -> Result<(), WireError> {
        match encode_frame(std::mem::take(&mut self.wbuf), frame) {
            Ok(buf) => {
                self.wbuf = buf;
                Ok(())
            }
            Err(e) => Err(self.fail(e)),
        }
    }

    /// Best effort, without waiting: the broker is closing anyway.
    pub(super) fn try_write_now(&mut self) {
        let waker = futures_util::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        let _ = self.poll_write(&mut cx);
    }

    /// The next frame, writing what is queued meanwhile.
    pub(super) async fn frame(&mut self) -> Result<AMQPFrame, WireError> {
        if self.broken {
            return Err(WireError::Eof);
        }
        let res = std::future::poll_fn(|cx| self.poll_frame(cx)).await;
        if res.is_err() {
            self.broken = true;
        }
        res
    }

    pub(super) fn poll_frame(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Result<AMQPFrame, WireError>> {
        if let Some(hb) = self.heartbeat {
            while self.heartbeat_timer.as_mut().poll(cx).is_ready() {
                // What the broker sent while nobody read counts as heard.
                match tokio_util::io::poll_read_buf(Pin::new(&mut self.io), cx, &mut self.rbuf) {
                    Poll::Ready(Ok(0)) => return Poll::Ready(Err(self.eof())),
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
                Poll::Ready(Ok(0)) => return Poll::Ready(Err(self.eof())),
                Poll::Ready(Ok(_)) => self.last_read = Instant::now(),
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e.into())),
                Poll::Pending => return Poll::Pending,
            }
        }
    }

    /// Writes as much of the buffer as the socket takes now.
    pub(super) fn poll_write(&mut self, cx: &mut Context<'_>) -> Result<(), WireError> {
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
    pub(super) fn parse(&mut self) -> Result<Option<AMQPFrame>, WireError> {
        // Before the first frame, one octet tells another kind of server
        // (the first frame is a method, or the broker's protocol header).
        if !self.greeted && !self.rbuf.is_empty() && !matches!(self.rbuf[0], 1 | 2 | 3 | 8 | b'A') {
            return Err(self.not_amqp());
        }
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
        if self.rbuf[0] == b'A' && !self.greeted {
            return Err(self.not_amqp());
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
        parse_nested(&raw).map(Some)
    }
}

impl Wire {
    /// What a server that sent `rbuf` before any AMQP frame is: named for
    /// the operator (TLS, HTTP, or the bytes), with the setting to check.
    fn not_amqp(&self) -> WireError {
        let shown = &self.rbuf[..self.rbuf.len().min(7)];
        let what = match self.rbuf[0] {
            0x15 | 0x16 => "it speaks TLS: use amqps://".to_owned(),
            _ if self.rbuf.starts_with(b"HTTP") => "it speaks HTTP".to_owned(),
            _ => format!("it sent {:?}", String::from_utf8_lossy(shown)),
        };
        WireError::Unsupported(format!(
            "the server at rabbitmq.url is not an AMQP 0-9-1 broker ({what}); check the host, port and scheme"
        ))
    }

    /// The error for a socket that closed: EOF, or, if what came before
    /// it cannot begin an AMQP frame ("AMQ" cut short), what kind of
    /// server this is. A broker that dies inside its first frame is EOF.
    pub(super) fn eof(&self) -> WireError {
        if !self.greeted && !self.rbuf.is_empty() && !matches!(self.rbuf[0], 1 | 2 | 3 | 8) {
            self.not_amqp()
        } else {
            WireError::Eof
        }
    }
}

/// Frames with at most this many table or array type bytes parse on the
/// caller's stack.
pub(super) const SHALLOW: usize = 64;

/// The most table or array levels a frame could hold: its `F` and `A`
/// bytes. Only method and content-header frames (types 1 and 2) hold
/// tables; a body frame's payload is opaque bytes, however many `F`s it has.
pub(in crate::sink) fn nesting(raw: &[u8]) -> usize {
    match raw.first() {
        Some(1 | 2) => raw.iter().filter(|&&b| b == b'F' || b == b'A').count(),
        _ => 0,
    }
}

/// Parses one frame. amq-protocol parses nested tables and arrays
/// recursively, a stack frame or more per level, and each level takes a
/// type byte (`F` or `A`): a frame with few of them parses here; one that
/// could nest deeper (a broker's `connection.start` or a return's headers,
/// hostile or not, or any other method that holds a table) parses on a
/// thread whose stack holds its worst case. No deep value leaves that
/// thread (dropping or printing it recurses too): the tables a broker may
/// send are emptied there, and a method only a client sends, which is all
/// the other methods with tables, is refused there.
pub(super) fn parse_nested(raw: &[u8]) -> Result<AMQPFrame, WireError> {
    let parse = |raw: &[u8]| match parse_frame(raw) {
        Ok((_, frame)) => Ok(frame),
        Err(e) => Err(WireError::Protocol(format!("unparsable frame: {e}"))),
    };
    let levels = nesting(raw);
    if levels <= SHALLOW {
        return parse(raw);
    }
    let raw = raw.to_vec();
    let stack = levels.saturating_mul(8 * 1024).clamp(8 << 20, 2 << 30);
    std::thread::Builder::new()
        .name("amqp-frame".into())
        .stack_size(stack)
        .spawn(move || {
            // Dropping (or printing) nested values recurses too: the tables
            // a broker sends the client, which it never reads, are dropped
            // here. What is left is shallow.
            parse(&raw).map(|frame| match frame {
                AMQPFrame::Method(
                    ch,
                    AMQPClass::Connection(connection::AMQPMethod::Start(mut start)),
                ) => {
                    start.server_properties = FieldTable::default();
                    AMQPFrame::Method(
                        ch,
                        AMQPClass::Connection(connection::AMQPMethod::Start(start)),
                    )
                }
                AMQPFrame::Header(ch, mut h) => {
                    h.properties = h.properties.with_headers(FieldTable::default());
                    AMQPFrame::Header(ch, h)
                }
                other => other,
            })
            .and_then(|frame| match frame {
                AMQPFrame::Method(_, class) if holds_table(&class) => Err(WireError::Protocol(
                    format!(
                        "the broker sent a client's method whose field tables may nest {levels} \
                         levels deep; an AMQP 0-9-1 broker never sends it"
                    ),
                )),
                other => Ok(other),
            })
        })
        .map_err(|e| WireError::Protocol(format!("cannot parse a deeply nested frame: {e}")))?
        .join()
        .map_err(|_| WireError::Protocol("the frame parser failed".into()))?
}

/// The methods other than `connection.start` whose arguments hold a field
/// table: all of them are a client's (AMQP 0-9-1 and RabbitMQ's
/// extensions).
fn holds_table(class: &AMQPClass) -> bool {
    use amq_protocol::protocol::{exchange, queue};
    matches!(
        class,
        AMQPClass::Connection(connection::AMQPMethod::StartOk(_))
            | AMQPClass::Exchange(
                exchange::AMQPMethod::Declare(_)
                    | exchange::AMQPMethod::Bind(_)
                    | exchange::AMQPMethod::Unbind(_)
            )
            | AMQPClass::Queue(
                queue::AMQPMethod::Declare(_)
                    | queue::AMQPMethod::Bind(_)
                    | queue::AMQPMethod::Unbind(_)
            )
            | AMQPClass::Basic(basic::AMQPMethod::Consume(_))
    )
}

/// `basic.publish` (mandatory) of `env` with its header and body frames,
/// appended to `buf` through amq-protocol's encoder.
pub(super) fn encode_envelope(
    buf: Vec<u8>,
    frame_max: u32,
    env: Envelope,
) -> Result<Vec<u8>, WireError> {
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

/// The encoded size of the content-header frame `properties` make (frame
/// overhead included): what must fit in `frame_max`.
pub fn header_frame_len(properties: &amq_protocol::protocol::BasicProperties) -> usize {
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

/// `frame` appended to `buf` by amq-protocol's encoder.
pub(in crate::sink) fn encode_frame(buf: Vec<u8>, frame: &AMQPFrame) -> Result<Vec<u8>, WireError> {
    gen_frame(frame)(WriteContext::from(buf))
        .map(|ctx| ctx.write)
        .map_err(|e| WireError::Protocol(format!("cannot encode a frame: {e}")))
}

pub(super) const CLASS_BASIC: u16 = 60;
pub(super) const FRAME_METHOD: u8 = 1;
pub(super) const FRAME_HEADER: u8 = 2;
pub(super) const FRAME_BODY: u8 = 3;
pub(super) const FRAME_END: u8 = 0xCE;

/// Body frames: the payload in pieces of at most `frame_max` less the 8
/// bytes of frame overhead. The body's only copy.
pub(super) fn put_body(buf: &mut Vec<u8>, frame_max: u32, body: &[u8]) {
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
pub(super) fn begin_frame(buf: &mut Vec<u8>, kind: u8) -> usize {
    buf.push(kind);
    buf.extend_from_slice(&PUBLISH_CHANNEL.to_be_bytes());
    buf.extend_from_slice(&[0; 4]);
    buf.len()
}

pub(super) fn end_frame(buf: &mut Vec<u8>, payload_at: usize) {
    let size = (buf.len() - payload_at) as u32;
    buf[payload_at - 4..payload_at].copy_from_slice(&size.to_be_bytes());
    buf.push(FRAME_END);
}

/// A short string: length octet, bytes (the caller checked the length).
pub(super) fn put_short(buf: &mut Vec<u8>, parts: &[&str]) {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    debug_assert!(len <= 255);
    buf.push(len as u8);
    for p in parts {
        buf.extend_from_slice(p.as_bytes());
    }
}

/// A table entry holding a long string (`S`).
pub(super) fn put_long_string_entry(buf: &mut Vec<u8>, key: &str, value: &str) {
    put_short(buf, &[key]);
    buf.push(b'S');
    buf.extend_from_slice(&(value.len() as u32).to_be_bytes());
    buf.extend_from_slice(value.as_bytes());
}

/// What [`encode_envelope`] writes for `m.to_envelope()`, written from the
/// row's pieces directly (a row without a headers column; the proptest in
/// this module holds the two to the same bytes).
pub(super) fn encode_view(buf: &mut Vec<u8>, frame_max: u32, m: &MessageView<'_>) {
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

pub(super) fn is_close(class: &AMQPClass) -> bool {
    matches!(
        class,
        AMQPClass::Channel(channel::AMQPMethod::Close(_))
            | AMQPClass::Connection(connection::AMQPMethod::Close(_))
    )
}

pub(super) fn unexpected(wanted: &str, got: &AMQPClass) -> WireError {
    WireError::Protocol(format!(
        "expected {wanted}, got class {} method {}",
        got.get_amqp_class_id(),
        got.get_amqp_method_id()
    ))
}
