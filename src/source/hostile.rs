//! The replication client against a PostgreSQL server that breaks the
//! client's resources: a SCRAM iteration count that would take hours of
//! PBKDF2, a message length announced far beyond what follows.

use pgwire_replication::protocol::framing::{
    MAX_MESSAGE_SIZE, MessageReader, STARTUP_MAX_MESSAGE_SIZE,
};

use super::scripted::{PgPeer, pg_server};
use super::{SourceError, start_replication};
use crate::lsn::Lsn;

/// The client's error for a server that runs `script`.
async fn replication_error<F, Fut>(script: F) -> String
where
    F: Fn(PgPeer) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let (cfg, server) = pg_server("sslmode=disable", script).await;
    let e = match start_replication(
        &cfg,
        Lsn(0),
        None,
        super::StreamLimits {
            buffer_events: 16,
            silence_limit: std::time::Duration::from_secs(60),
        },
    )
    .await
    {
        Ok(_) => panic!("the replication connection opened"),
        Err(e) => e,
    };
    server.abort();
    assert!(!matches!(e, SourceError::Timeout(_)), "{e}");
    e.to_string()
}

/// A server-first message with an iteration count above postgres-protocol's
/// cap (100,000) is refused before any PBKDF2 round, and no proof is sent.
#[tokio::test]
async fn a_huge_scram_iteration_count_is_refused() {
    let e = replication_error(|mut p: PgPeer| async move {
        p.startup().await;
        p.auth(10, b"SCRAM-SHA-256\0\0").await;
        let (tag, init) = p.message().await.expect("a SASLInitialResponse");
        assert_eq!(tag, b'p');
        let text = String::from_utf8_lossy(&init).into_owned();
        let nonce = text.split("r=").nth(1).expect("a client nonce").to_owned();
        let first = format!("r={nonce}srv,s=c2FsdHNhbHQ=,i=100001");
        p.auth(11, first.as_bytes()).await;
        let sent = p.until_closed().await;
        assert!(sent.len() == 1, "the client answered: {sent:?}");
    })
    .await;
    assert!(e.contains("iteration count 100001"), "{e}");
}

/// A 5-byte header announcing 512 MiB before streaming is refused from the
/// header: nothing is allocated for it.
#[tokio::test]
async fn a_huge_startup_message_is_refused_from_its_header() {
    let e = replication_error(|mut p: PgPeer| async move {
        p.startup().await;
        let mut header = vec![b'R'];
        header.extend_from_slice(&(512u32 << 20).to_be_bytes());
        p.send_raw(&header).await;
        p.until_closed().await;
    })
    .await;
    assert!(
        e.contains(&STARTUP_MAX_MESSAGE_SIZE.to_string()) && e.contains("too large"),
        "{e}"
    );
}

/// While streaming, a message may be up to 1 GiB; a header announcing
/// that much takes memory only for the bytes that follow it.
#[tokio::test]
async fn an_announced_length_is_not_allocated_before_it_arrives() {
    let mut data = vec![b'd'];
    data.extend_from_slice(&(MAX_MESSAGE_SIZE as u32 - 1).to_be_bytes());
    data.extend_from_slice(&[7u8; 100]);
    let mut reader = MessageReader::new();
    let e = reader.read(&mut &data[..]).await.unwrap_err();
    assert!(e.to_string().contains("EOF"), "{e}");
    assert!(
        reader.buffered_capacity() < 1 << 20,
        "{} bytes held for 100 received",
        reader.buffered_capacity()
    );
}
