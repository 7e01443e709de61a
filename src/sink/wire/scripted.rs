//! The scripted broker the client's tests run against: an in-process TCP
//! listener that speaks amq-protocol frames, one script per test, and the
//! helpers those tests share.

use std::time::Duration;

use amq_protocol::frame::{AMQPFrame, parse_frame};
use amq_protocol::protocol::{AMQPClass, basic, channel, confirm, connection};
use amq_protocol::types::FieldTable;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpListener;

use super::{Event, Target, Wire, WireError, encode_frame};
use crate::message::Envelope;

/// The broker's side of a socket: TCP, or TLS over it.
pub(super) trait PeerIo: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> PeerIo for T {}

/// The broker's end of one connection.
pub(super) struct Peer {
    pub(super) s: Box<dyn PeerIo>,
    pub(super) buf: Vec<u8>,
    /// The read that ended the stream failed (over TLS: the socket closed
    /// without a `close_notify`).
    pub(super) unclean_eof: bool,
}

impl Peer {
    pub(super) fn new(s: impl PeerIo + 'static) -> Peer {
        Peer {
            s: Box::new(s),
            buf: Vec::new(),
            unclean_eof: false,
        }
    }

    pub(super) async fn read_more(&mut self) -> bool {
        // On the heap: a 64 KiB array would sit in every future that reads.
        let mut chunk = vec![0u8; 65536];
        match tokio::time::timeout(Duration::from_secs(10), self.s.read(&mut chunk)).await {
            Ok(Ok(0)) => false,
            Ok(Err(_)) => {
                self.unclean_eof = true;
                false
            }
            Ok(Ok(n)) => {
                self.buf.extend_from_slice(&chunk[..n]);
                true
            }
            Err(_) => panic!("the client sent nothing for 10 s"),
        }
    }

    /// The next frame from the client, `None` at EOF.
    pub(super) async fn frame(&mut self) -> Option<AMQPFrame> {
        loop {
            if let Ok((rest, f)) = parse_frame(&self.buf[..]) {
                let used = self.buf.len() - rest.len();
                self.buf.drain(..used);
                return Some(f);
            }
            if !self.read_more().await {
                return None;
            }
        }
    }

    /// The next method from the client (heartbeats skipped).
    pub(super) async fn method(&mut self) -> (u16, AMQPClass) {
        loop {
            match self.frame().await.expect("a method, not EOF") {
                AMQPFrame::Method(ch, m) => return (ch, m),
                AMQPFrame::Heartbeat => {}
                other => panic!("expected a method, got {other:?}"),
            }
        }
    }

    pub(super) async fn send(&mut self, frame: AMQPFrame) {
        let bytes = encode_frame(Vec::new(), &frame).unwrap();
        self.s.write_all(&bytes).await.unwrap();
    }

    pub(super) async fn send_method(&mut self, ch: u16, m: AMQPClass) {
        self.send(AMQPFrame::Method(ch, m)).await;
    }

    /// Up to the `connection.tune` answer: header, start, start-ok, tune.
    pub(super) async fn start(&mut self, frame_max: u32, heartbeat: u16) {
        self.greet().await;
        self.tune(2047, frame_max, heartbeat).await;
        let (_, m) = self.method().await;
        assert!(
            matches!(m, AMQPClass::Connection(connection::AMQPMethod::TuneOk(_))),
            "{m:?}"
        );
    }

    /// The protocol header, then start and start-ok.
    pub(super) async fn greet(&mut self) {
        while self.buf.len() < 8 {
            assert!(self.read_more().await, "no protocol header");
        }
        assert_eq!(&self.buf[..8], b"AMQP\x00\x00\x09\x01");
        self.buf.drain(..8);
        self.send_method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Start(connection::Start {
                version_major: 0,
                version_minor: 9,
                server_properties: FieldTable::default(),
                mechanisms: "PLAIN AMQPLAIN".into(),
                locales: "en_US".into(),
            })),
        )
        .await;
        let (_, m) = self.method().await;
        assert!(
            matches!(m, AMQPClass::Connection(connection::AMQPMethod::StartOk(_))),
            "{m:?}"
        );
    }

    pub(super) async fn tune(&mut self, channel_max: u16, frame_max: u32, heartbeat: u16) {
        self.send_method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Tune(connection::Tune {
                channel_max,
                frame_max,
                heartbeat,
            })),
        )
        .await;
    }

    /// A whole handshake: connection, channel 1, confirm mode.
    pub(super) async fn handshake(&mut self, frame_max: u32) {
        self.handshake_with(frame_max, 0).await;
    }

    /// As [`Peer::handshake`], proposing `heartbeat` seconds.
    pub(super) async fn handshake_with(&mut self, frame_max: u32, heartbeat: u16) {
        self.start(frame_max, heartbeat).await;
        let (_, m) = self.method().await;
        assert!(
            matches!(m, AMQPClass::Connection(connection::AMQPMethod::Open(_))),
            "{m:?}"
        );
        self.send_method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::OpenOk(connection::OpenOk {})),
        )
        .await;
        let (ch, m) = self.method().await;
        assert!(
            matches!(m, AMQPClass::Channel(channel::AMQPMethod::Open(_))),
            "{m:?}"
        );
        self.send_method(
            ch,
            AMQPClass::Channel(channel::AMQPMethod::OpenOk(channel::OpenOk {})),
        )
        .await;
        let (ch, m) = self.method().await;
        assert!(
            matches!(m, AMQPClass::Confirm(confirm::AMQPMethod::Select(_))),
            "{m:?}"
        );
        self.send_method(
            ch,
            AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(confirm::SelectOk {})),
        )
        .await;
    }

    /// One publish from the client: its routing key and body.
    pub(super) async fn publish(&mut self) -> (String, Vec<u8>) {
        let (_, m) = self.method().await;
        let AMQPClass::Basic(basic::AMQPMethod::Publish(p)) = m else {
            panic!("expected basic.publish, got {m:?}");
        };
        let Some(AMQPFrame::Header(_, h)) = self.frame().await else {
            panic!("expected a content header");
        };
        let mut body = Vec::new();
        while (body.len() as u64) < h.body_size {
            match self.frame().await {
                Some(AMQPFrame::Body(_, b)) => body.extend_from_slice(&b),
                other => panic!("expected a body frame, got {other:?}"),
            }
        }
        (p.routing_key.to_string(), body)
    }

    pub(super) async fn close_connection(&mut self, code: u16, text: &str) {
        self.send_method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Close(connection::Close {
                reply_code: code,
                reply_text: text.into(),
                class_id: 0,
                method_id: 0,
            })),
        )
        .await;
    }
}

/// A broker on `host` running `script` for one connection; the client's
/// target.
pub(super) async fn broker<F, Fut>(host: &str, script: F) -> (Target, tokio::task::JoinHandle<()>)
where
    F: FnOnce(Peer) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send,
{
    let listener = TcpListener::bind((host, 0)).await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let task = tokio::spawn(async move {
        let (s, _) = listener.accept().await.unwrap();
        script(Peer::new(s)).await;
    });
    let in_url = if host.contains(':') {
        format!("[{host}]")
    } else {
        host.to_owned()
    };
    let uri = crate::amqpurl::parse_amqp_url(&format!("amqp://u:p@{in_url}:{port}/v")).unwrap();
    let target = Target {
        uri,
        tls: None,
        connection_name: "conformance".into(),
    };
    (target, task)
}

pub(super) async fn connect(t: &Target) -> Result<Wire, WireError> {
    tokio::time::timeout(Duration::from_secs(10), Wire::connect(t))
        .await
        .expect("connect hung")
}

pub(super) fn message(key: &str, body: usize) -> Envelope {
    Envelope {
        exchange: "ex".into(),
        routing_key: key.into(),
        body: bytes::Bytes::from(vec![7u8; body]),
        properties: amq_protocol::protocol::BasicProperties::default().with_message_id(key.into()),
    }
}

pub(super) async fn next_event(w: &mut Wire) -> Result<Event, WireError> {
    tokio::time::timeout(Duration::from_secs(10), w.event())
        .await
        .expect("no event within 10 s")
}
