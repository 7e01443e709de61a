//! Both PostgreSQL connections against a server that proved nothing and
//! asks for the password in a form it can read (cleartext, MD5), or lets
//! the relay in unauthenticated where `require_auth` wants SCRAM: the
//! request is refused, nothing is sent in answer, and the error names the
//! setting to change.

use super::scripted::{PASSWORD, PgPeer, pg_server};
use super::{SourceError, connect_sql, start_replication};
use crate::lsn::Lsn;

/// A server that answers every startup with the authentication request
/// `code` (and `data`), then records what the client sends.
async fn asks(
    query: &str,
    code: u32,
    data: &'static [u8],
) -> (String, String, Vec<Vec<(u8, Vec<u8>)>>) {
    let (cfg, server) = pg_server(query, move |mut p: PgPeer| async move {
        p.startup().await;
        p.auth(code, data).await;
        p.until_closed().await
    })
    .await;
    let sql = match connect_sql(&cfg).await {
        Ok(_) => panic!("the SQL connection opened"),
        Err(e) => e,
    };
    let replication = match start_replication(
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
    for e in [&sql, &replication] {
        assert!(matches!(e, SourceError::Setup(_)), "not a refusal: {e}");
    }
    let sent = server.await.unwrap();
    assert_eq!(sent.len(), 2, "one connection each");
    (sql.to_string(), replication.to_string(), sent)
}

fn assert_nothing_sent(sent: &[Vec<(u8, Vec<u8>)>]) {
    for messages in sent {
        assert!(
            messages.iter().all(
                |(tag, body)| *tag != b'p' && !String::from_utf8_lossy(body).contains(PASSWORD)
            ),
            "the client answered: {messages:?}"
        );
    }
}

#[tokio::test]
async fn a_cleartext_password_request_is_refused_by_both_connections() {
    for mode in ["disable", "prefer"] {
        let (sql, replication, sent) = asks(&format!("sslmode={mode}"), 3, b"").await;
        assert_nothing_sent(&sent);
        for e in [&sql, &replication] {
            assert!(
                e.contains("the password in the clear") && e.contains("postgres.sslmode"),
                "{mode}: {e}"
            );
        }
    }
}

#[tokio::test]
async fn an_md5_password_request_is_refused_by_both_connections() {
    let (sql, replication, sent) = asks("sslmode=prefer", 5, b"salt").await;
    assert_nothing_sent(&sent);
    for e in [&sql, &replication] {
        assert!(e.contains("MD5") && e.contains("postgres.sslmode"), "{e}");
    }
}

/// `require_auth=scram-sha-256`: a server that lets the relay in without
/// authenticating is refused too (it could be anyone).
#[tokio::test]
async fn require_auth_refuses_a_server_that_authenticates_nothing() {
    let (sql, replication, sent) = asks("sslmode=disable&require_auth=scram-sha-256", 0, b"").await;
    assert_nothing_sent(&sent);
    for e in [&sql, &replication] {
        assert!(e.contains("postgres.require_auth"), "{e}");
    }
}
