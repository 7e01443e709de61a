//! The handshake against the scripted broker: refusals (fatal or
//! retried), servers that are not AMQP brokers, a broker that dies inside
//! its first frame, and an IPv6 host.

use amq_protocol::frame::AMQPFrame;
use amq_protocol::protocol::{AMQPClass, connection};
use tokio::io::AsyncWriteExt;

use super::super::scripted::{broker, connect};
use super::super::{WireError, encode_frame};
use crate::sink::replies::Disposition;

#[tokio::test]
async fn wrong_credentials_stop_and_the_close_is_answered() {
    let (t, broker) = broker("127.0.0.1", |mut p| async move {
        // RabbitMQ refuses a login right after start-ok.
        p.greet().await;
        p.close_connection(403, "ACCESS_REFUSED - Login was refused")
            .await;
        let (_, m) = p.method().await;
        assert!(
            matches!(m, AMQPClass::Connection(connection::AMQPMethod::CloseOk(_))),
            "{m:?}"
        );
    })
    .await;
    let e = connect(&t).await.unwrap_err();
    assert!(
        matches!(e, WireError::ConnectionClosed { code: 403, .. }),
        "{e}"
    );
    assert_eq!(e.disposition(), Disposition::Stop);
    broker.await.unwrap();
}

#[tokio::test]
async fn a_vhost_that_is_down_is_retried() {
    let (t, broker) = broker("127.0.0.1", |mut p| async move {
        p.start(131_072, 0).await;
        let _open = p.method().await;
        p.close_connection(530, "NOT_ALLOWED - vhost v is down")
            .await;
        let _ = p.frame().await;
    })
    .await;
    let e = connect(&t).await.unwrap_err();
    assert!(
        matches!(e, WireError::ConnectionClosed { code: 530, .. }),
        "{e}"
    );
    assert!(e.is_transient());
    broker.await.unwrap();
}

/// Another kind of server on the port is named, and stops the relay:
/// from the first octet, however few it sends (then waits, or closes).
#[tokio::test]
async fn a_server_that_does_not_speak_amqp_is_named() {
    for (answer, says, then_close) in [
        (&b"HTTP/1.1 400 Bad Request\r\n\r\n"[..], "HTTP", false),
        (&b"\x15\x03\x03\x00\x02\x02\x46"[..], "amqps://", false),
        (&b"-ERR\r\n"[..], "it sent \"-ERR", false),
        (&b"\x15\x03"[..], "amqps://", true),
        (&b"AMQ"[..], "it sent \"AMQ\"", true),
    ] {
        let (t, broker) = broker("127.0.0.1", move |mut p| async move {
            let _ = p.read_more().await;
            p.s.write_all(answer).await.unwrap();
            if !then_close {
                let _ = p.read_more().await;
            }
        })
        .await;
        let e = connect(&t).await.unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("not an AMQP 0-9-1 broker") && text.contains(says),
            "{text}"
        );
        assert_eq!(e.disposition(), Disposition::Stop);
        broker.abort();
    }
}

/// A broker that dies inside its first frame (`connection.start` cut
/// short, before or after the frame header) is a lost connection, retried:
/// never taken for another kind of server, which would stop the relay.
#[tokio::test]
async fn a_broker_that_dies_inside_its_first_frame_is_retried() {
    let start = encode_frame(
        Vec::new(),
        &AMQPFrame::Method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Start(connection::Start {
                version_major: 0,
                version_minor: 9,
                server_properties: Default::default(),
                mechanisms: "PLAIN".into(),
                locales: "en_US".into(),
            })),
        ),
    )
    .unwrap();
    for cut in [1, 2, 6, 7, 12, start.len() - 1] {
        let sent = start[..cut].to_vec();
        let (t, broker) = broker("127.0.0.1", move |mut p| async move {
            let _ = p.read_more().await;
            p.s.write_all(&sent).await.unwrap();
        })
        .await;
        let e = connect(&t).await.unwrap_err();
        assert!(matches!(e, WireError::Eof), "cut at {cut}: {e}");
        assert_eq!(e.disposition(), Disposition::Transient, "cut at {cut}");
        broker.await.unwrap();
    }
}

/// amq-protocol-uri reads an IPv6 host as "localhost": the client must
/// connect to the address in the URL (this broker listens on ::1 only).
#[tokio::test]
async fn an_ipv6_host_is_the_one_connected_to() {
    let (t, broker) = broker("::1", |mut p| async move {
        p.handshake(131_072).await;
    })
    .await;
    connect(&t).await.expect("connected to [::1]");
    broker.await.unwrap();
}
