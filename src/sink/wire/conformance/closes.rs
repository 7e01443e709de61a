//! Closing cleanly, whoever closes first: close-ok answered at once, then
//! `connection.close`, then TLS `close_notify` or a FIN, so the broker logs
//! a clean close and not a dropped socket.

use std::sync::Arc;
use std::time::Duration;

use amq_protocol::protocol::{AMQPClass, channel, connection};
use tokio::net::TcpListener;

use super::super::Target;
use super::super::scripted::{Peer, broker, connect, message, next_event};
use crate::sink::replies::Disposition;

/// The broker closes the publishing channel (406): the client answers
/// close-ok at once, reports the close, and still closes the connection
/// cleanly (connection.close, then a FIN).
#[tokio::test]
async fn a_channel_close_is_answered_and_the_connection_closes_cleanly() {
    let (t, broker) = broker("127.0.0.1", |mut p| async move {
        p.handshake(131_072).await;
        p.publish().await;
        p.send_method(
            1,
            AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
                reply_code: 406,
                reply_text:
                    "PRECONDITION_FAILED - message size 9 is larger than configured max size 8"
                        .into(),
                class_id: 60,
                method_id: 40,
            })),
        )
        .await;
        let (ch, m) = p.method().await;
        assert_eq!(ch, 1);
        assert!(
            matches!(m, AMQPClass::Channel(channel::AMQPMethod::CloseOk(_))),
            "{m:?}"
        );
        answers_our_close_then_ends(&mut p).await;
    })
    .await;
    let mut w = connect(&t).await.unwrap();
    w.publish(message("a", 9)).unwrap();
    let e = next_event(&mut w).await.unwrap_err();
    assert_eq!(e.disposition(), Disposition::BodyLimit(8));
    assert!(
        w.publish(message("b", 1)).is_err(),
        "published on a closed channel"
    );
    close_within_10s(w).await;
    broker.await.unwrap();
}

/// Over TLS, `close` ends with a `close_notify`: the broker's TLS read
/// ends cleanly, not with "peer closed connection without sending TLS
/// close_notify" (what RabbitMQ sees from a client that drops the socket).
#[tokio::test]
async fn over_tls_the_connection_ends_with_close_notify() {
    let (t, broker) = tls_broker(|mut p| async move {
        p.handshake(131_072).await;
        answers_our_close_then_ends(&mut p).await;
    })
    .await;
    let w = connect(&t).await.unwrap();
    close_within_10s(w).await;
    broker.await.unwrap();
}

/// The broker closes the connection first (320, a node shutting down):
/// over TLS, close-ok, then `close_notify`.
#[tokio::test]
async fn over_tls_a_close_from_the_broker_is_answered_then_close_notify() {
    let (t, broker) = tls_broker(|mut p| async move {
        p.handshake(131_072).await;
        p.close_connection(320, "CONNECTION_FORCED - broker forced connection closure")
            .await;
        let (ch, m) = p.method().await;
        assert_eq!(ch, 0);
        assert!(
            matches!(m, AMQPClass::Connection(connection::AMQPMethod::CloseOk(_))),
            "{m:?}"
        );
        ends_with_close_notify(&mut p).await;
    })
    .await;
    let mut w = connect(&t).await.unwrap();
    let e = next_event(&mut w).await.unwrap_err();
    assert_eq!(e.disposition(), Disposition::Transient, "{e}");
    close_within_10s(w).await;
    broker.await.unwrap();
}

/// The client sends `connection.close`; the broker answers close-ok; the
/// client's side then ends cleanly.
async fn answers_our_close_then_ends(p: &mut Peer) {
    let (_, m) = p.method().await;
    assert!(
        matches!(m, AMQPClass::Connection(connection::AMQPMethod::Close(_))),
        "{m:?}"
    );
    p.send_method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::CloseOk(connection::CloseOk {})),
    )
    .await;
    ends_with_close_notify(p).await;
}

/// The client's side ended after close-ok, with a TLS `close_notify` (or
/// a FIN over TCP), not a dropped socket.
async fn ends_with_close_notify(p: &mut Peer) {
    assert!(p.frame().await.is_none(), "expected the end after close-ok");
    assert!(
        !p.unclean_eof,
        "the socket closed without a TLS close_notify"
    );
}

async fn close_within_10s(w: super::super::Wire) {
    tokio::time::timeout(Duration::from_secs(10), w.close())
        .await
        .expect("close hung")
        .unwrap();
}

/// A TLS broker on 127.0.0.1 running `script` for one connection, and the
/// client's target (`amqps://…@localhost`, trusting exactly its CA).
async fn tls_broker<F, Fut>(script: F) -> (Target, tokio::task::JoinHandle<()>)
where
    F: FnOnce(Peer) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send,
{
    let (server, roots) = tls_pair();
    let listener = TcpListener::bind(("127.0.0.1", 0)).await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let task = tokio::spawn(async move {
        let (tcp, _) = listener.accept().await.unwrap();
        let tls = tokio_rustls::TlsAcceptor::from(server)
            .accept(tcp)
            .await
            .unwrap();
        script(Peer::new(tls)).await;
    });
    let uri = crate::amqpurl::parse_amqp_url(&format!("amqps://u:p@localhost:{port}/v")).unwrap();
    let target = Target {
        uri,
        tls: Some(roots),
        connection_name: "conformance".into(),
    };
    (target, task)
}

/// A server config with a certificate for `localhost`, and a client
/// config that trusts exactly its CA.
fn tls_pair() -> (Arc<rustls::ServerConfig>, Arc<rustls::ClientConfig>) {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca, ca_key);
    let key = KeyPair::generate().unwrap();
    let cert = CertificateParams::new(vec!["localhost".to_owned()])
        .unwrap()
        .signed_by(&key, &issuer)
        .unwrap();
    let server = rustls::ServerConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(
            vec![cert.der().clone()],
            rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
        )
        .unwrap();
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca_cert.der().clone()).unwrap();
    let client = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    (Arc::new(server), Arc::new(client))
}
