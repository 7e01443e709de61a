//! Opening and closing the connection: TCP (or TLS), the AMQP handshake
//! (start, PLAIN login, tune, open), channels, and `connection.close`.

use super::frames::is_close;
use super::frames::unexpected;
use super::{
    CONTROL_CHANNEL, DEFAULT_FRAME_MAX, Event, Found, Io, KEEPALIVE_IDLE, KEEPALIVE_INTERVAL,
    KEEPALIVE_RETRIES, PUBLISH_CHANNEL, Target, USER_TIMEOUT, Wire, WireError,
};
use amq_protocol::frame::AMQPFrame;
use amq_protocol::protocol::AMQPClass;
use amq_protocol::protocol::channel;
use amq_protocol::protocol::confirm;
use amq_protocol::protocol::connection;
use amq_protocol::types::AMQPValue;
use amq_protocol::types::FieldTable;
use amq_protocol::types::LongString;
use amq_protocol::uri::AMQPScheme;
use amq_protocol::uri::SASLMechanism;
use bytes::BytesMut;
use std::collections::VecDeque;
use std::io;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpStream;
use tokio::time::Instant;

/// How long each address of the broker's host name may take to accept a
/// connection, before the next is tried (the caller's deadline bounds
/// them all).
const ADDRESS_TIMEOUT: Duration = Duration::from_secs(5);

impl Wire {
    /// Connects, authenticates (PLAIN, or EXTERNAL: the TLS client
    /// certificate), opens the vhost and the publishing channel, and turns
    /// publisher confirms on. No deadline here: the caller sets one.
    pub async fn connect(target: &Target) -> Result<Wire, WireError> {
        let uri = &target.uri;
        mechanism(uri)?;
        // An IPv6 literal comes in brackets (see `parse_amqp_url`).
        let host = uri.authority.host.as_str();
        let host = host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(host);
        let tcp = crate::dial::connect(host, uri.authority.port, ADDRESS_TIMEOUT).await?;
        tcp.set_nodelay(true)?;
        // A dead peer is noticed even with heartbeats off and nothing to
        // send (a broker that blocks publishing, then vanishes).
        watch_peer(&tcp)?;
        let io: Box<dyn Io> = match (&uri.scheme, &target.tls) {
            (AMQPScheme::AMQPS, Some(tls)) => {
                let name = rustls::pki_types::ServerName::try_from(host.to_owned())
                    .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
                let stream = tokio_rustls::TlsConnector::from(Arc::clone(tls))
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

    pub(super) async fn handshake(&mut self, target: &Target) -> Result<(), WireError> {
        let uri = &target.uri;
        self.wbuf.extend_from_slice(b"AMQP\x00\x00\x09\x01");
        let start = match self.method(0).await? {
            AMQPClass::Connection(connection::AMQPMethod::Start(s)) => s,
            other => return Err(unexpected("connection.start", &other)),
        };
        let mechanism = mechanism(uri)?;
        if !start
            .mechanisms
            .to_string()
            .split(' ')
            .any(|m| m == mechanism)
        {
            let hint = if mechanism == "EXTERNAL" {
                " (enable the rabbitmq_auth_mechanism_ssl plugin and list EXTERNAL in the \
                 broker's auth_mechanisms)"
            } else {
                ""
            };
            return Err(WireError::Unsupported(format!(
                "the broker does not offer {mechanism} authentication (it offers {}){hint}",
                start.mechanisms
            )));
        }
        // EXTERNAL: who the client is comes from its certificate; the
        // response is empty (RabbitMQ's rabbit_auth_mechanism_ssl).
        let mut response = Vec::new();
        if mechanism == "PLAIN" {
            let user = &uri.authority.userinfo;
            response.reserve(user.username.len() + user.password.len() + 2);
            response.push(0);
            response.extend_from_slice(user.username.as_bytes());
            response.push(0);
            response.extend_from_slice(user.password.as_bytes());
        }
        self.send_method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::StartOk(connection::StartOk {
                client_properties: client_properties(&target.connection_name),
                mechanism: mechanism.into(),
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
        // Ours never 0 ("no limit"): the broker would choose, up to 4 GiB,
        // what the reader must hold of one frame.
        let frame_max = negotiate(
            (uri.query.frame_max)
                .filter(|&f| f != 0)
                .unwrap_or(DEFAULT_FRAME_MAX),
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
        self.open_publishing().await
    }

    /// Opens the publishing channel in confirm mode.
    async fn open_publishing(&mut self) -> Result<(), WireError> {
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

    /// Opens the publishing channel again after the broker closed it (its
    /// close-ok was sent after whatever was queued, which the broker
    /// discards): confirm mode, delivery tags from 1. Nothing published
    /// before is answered any more: publish again what waited.
    pub async fn reopen_publishing(&mut self) -> Result<(), WireError> {
        if self.channel_closed.is_none() {
            return Err(WireError::Protocol(
                "the publishing channel is open; nothing to reopen".into(),
            ));
        }
        self.returning = None;
        self.flow_paused = false;
        self.open_publishing().await?;
        self.channel_closed = None;
        self.next_tag = 1;
        Ok(())
    }

    pub(super) async fn open_channel(&mut self, id: u16) -> Result<(), WireError> {
        self.send_method(
            id,
            AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
        )?;
        match self.method(id).await? {
            AMQPClass::Channel(channel::AMQPMethod::OpenOk(_)) => Ok(()),
            other => Err(unexpected("channel.open-ok", &other)),
        }
    }

    /// Whether `exchange` exists: [`Wire::look_for`], waited for. Before
    /// publishing (answers to publishes read meanwhile would be kept for
    /// [`Wire::event`], in order, but the publishing channel's closing
    /// ends the wait).
    pub async fn exchange_exists(&mut self, exchange: &str) -> Result<bool, WireError> {
        self.look_for(exchange)?;
        loop {
            let frame = self.frame().await?;
            match self.on_frame(frame)? {
                Some(Event::Exchange { found, .. }) => {
                    return match found {
                        Found::Exists => Ok(true),
                        Found::Missing => Ok(false),
                        Found::Forbidden(text) => Err(WireError::ChannelClosed { code: 403, text }),
                    };
                }
                Some(ev) => self.keep(ev)?,
                None => {}
            }
        }
    }

    /// A connection over `io` as if the handshake was done (for tests that
    /// play the broker).
    #[cfg(test)]
    pub(in crate::sink) fn after_handshake(
        io: impl tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
    ) -> Wire {
        let mut w = Wire::over(Box::new(io));
        w.greeted = true;
        w
    }

    /// A connection over `io` after a handshake as [`Wire::connect`]'s
    /// (for tests that play the broker byte by byte).
    #[cfg(test)]
    pub(in crate::sink) async fn handshake_over(
        io: impl tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
        target: &Target,
    ) -> Result<Wire, WireError> {
        let mut w = Wire::over(Box::new(io));
        w.handshake(target).await?;
        Ok(w)
    }

    /// A connection over `io`, before the handshake.
    pub(super) fn over(io: Box<dyn Io>) -> Wire {
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
            answered_close: false,
            pending: VecDeque::new(),
            control_open: false,
            looking_for: None,
        }
    }

    /// Closes the connection politely and waits for the broker's answer.
    pub async fn close(mut self) -> Result<(), WireError> {
        if self.answered_close {
            // The broker closed first: our close-ok may still sit behind
            // unwritten publishes (which the broker discards until it).
            use tokio::io::AsyncWriteExt;
            let (written, wbuf) = (self.written, std::mem::take(&mut self.wbuf));
            self.io.write_all(&wbuf[written..]).await?;
            self.io.flush().await?;
            self.io.shutdown().await?;
            return Ok(());
        }
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
    pub(super) async fn method(&mut self, channel: u16) -> Result<AMQPClass, WireError> {
        loop {
            match self.frame().await? {
                AMQPFrame::Method(ch, class) if ch == channel && !is_close(&class) => {
                    return Ok(class);
                }
                // Answers read meanwhile (to publishes, or to a passive
                // declare, while the publishing channel is reopened) are
                // kept for `event`.
                frame => {
                    if let Some(ev) = self.on_frame(frame)? {
                        self.keep(ev)?;
                    }
                }
            }
        }
    }
}

/// A dead peer is noticed even with heartbeats off: TCP keepalive when
/// nothing is unacknowledged (an idle or blocked connection), and a user
/// timeout when something is (a blocked broker that vanished with our
/// publishes unread; a live one still answers the kernel's window probes).
pub(in crate::sink) fn watch_peer(tcp: &TcpStream) -> io::Result<()> {
    let sock = socket2::SockRef::from(tcp);
    sock.set_tcp_keepalive(
        &socket2::TcpKeepalive::new()
            .with_time(KEEPALIVE_IDLE)
            .with_interval(KEEPALIVE_INTERVAL)
            .with_retries(KEEPALIVE_RETRIES),
    )?;
    #[cfg(any(target_os = "linux", target_os = "android"))]
    sock.set_tcp_user_timeout(Some(USER_TIMEOUT))?;
    Ok(())
}

/// The agreed value of a limit both sides propose; 0 means none.
pub(super) fn negotiate<N: Ord + Default + Copy>(ours: N, theirs: N) -> N {
    let zero = N::default();
    match (ours == zero, theirs == zero) {
        (true, _) => theirs,
        (_, true) => ours,
        _ => ours.min(theirs),
    }
}

/// The SASL mechanism `rabbitmq.url` asks for (`auth_mechanism=`): PLAIN
/// (the default), or EXTERNAL (the client certificate says who logs in).
fn mechanism(uri: &amq_protocol::uri::AMQPUri) -> Result<&'static str, WireError> {
    match uri.query.auth_mechanism.unwrap_or_default() {
        SASLMechanism::Plain => Ok("PLAIN"),
        SASLMechanism::External => Ok("EXTERNAL"),
        m => Err(WireError::Unsupported(format!(
            "rabbitmq.url asks for the {} SASL mechanism; only PLAIN (user and password) and \
             EXTERNAL (a client certificate: rabbitmq.cert_file) are supported",
            m.name()
        ))),
    }
}

/// What the management UI shows, and the capabilities the broker needs to
/// know about: confirms, `basic.nack`, `connection.blocked`, and a
/// `connection.close` (rather than a dropped socket) when login fails.
pub(super) fn client_properties(name: &str) -> FieldTable {
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
mod mechanism_tests {
    use super::mechanism;

    /// PLAIN unless the URL asks for EXTERNAL; any other is refused,
    /// naming the two there are.
    #[test]
    fn the_url_chooses_plain_or_external() {
        let of = |url: &str| mechanism(&crate::amqpurl::parse_amqp_url(url).unwrap());
        assert_eq!(of("amqps://mq/%2f").unwrap(), "PLAIN");
        assert_eq!(of("amqps://mq/%2f?auth_mechanism=plain").unwrap(), "PLAIN");
        assert_eq!(
            of("amqps://mq/%2f?auth_mechanism=external").unwrap(),
            "EXTERNAL"
        );
        let e = of("amqps://mq/%2f?auth_mechanism=amqplain")
            .unwrap_err()
            .to_string();
        assert!(e.contains("PLAIN") && e.contains("EXTERNAL"), "{e}");
    }
}
