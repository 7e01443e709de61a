//! The PostgreSQL half of the TLS tests (`tests/it/tls.rs`): each sslmode on
//! both connections, a server without TLS, a certificate from another
//! trusted CA, and `hostaddr`. These need no broker: the relay's
//! `rabbitmq.url` points where nobody listens.

use outbox_relay::lsn::Lsn;
use outbox_relay::source::{connect_sql, start_replication};

use super::support::*;

/// Each sslmode against a server that accepts only TLS, on both the SQL
/// connection and the replication connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_sslmodes_against_a_tls_only_server() {
    let pki = Pki::new();
    let server = ScratchPg::start(Some(&pki));
    let pg = server.prepare().await;
    let ca = pki.ca().display().to_string();
    let cfg = published(&pg, &server.url("127.0.0.1", "")).await;

    let both = |url: String, pg_extra: String| both_connections(&cfg, &pg, url, pg_extra);

    // verify-full with the CA, by address and by name (URL parameters).
    let local = server.url("127.0.0.1", "");
    assert_eq!(
        both(
            local.clone(),
            format!("sslmode = \"verify-full\"\nca_file = \"{ca}\"")
        )
        .await,
        Ok(true)
    );
    let by_name = server.url(
        "localhost",
        &format!(
            "?sslmode=verify-full&sslrootcert={}",
            ca.replace('/', "%2F")
        ),
    );
    assert_eq!(both(by_name, String::new()).await, Ok(true));

    // verify-full with the system's CA bundle (sslrootcert=system): the
    // throwaway CA is not in it. Both connections fail, permanently, naming
    // what to set.
    let (sql, repl) = both(local.clone(), "ca_file = \"system\"".into())
        .await
        .unwrap_err();
    for (what, e) in [("SQL", sql), ("replication", repl)] {
        let (msg, transient) = e.unwrap_or_else(|| panic!("{what} connection succeeded"));
        assert!(
            msg.contains("certificate not trusted")
                && msg.contains("postgres.ca_file")
                && msg.contains("sslmode"),
            "{what}: {msg}"
        );
        assert!(!transient, "{what}: {msg}");
        assert!(
            !msg.contains(RELAY_PASSWORD),
            "{what}: password leaked: {msg}"
        );
    }
    // ... and so does the binary.
    cfg.write(
        &server.url("127.0.0.1", "?sslrootcert=system"),
        "",
        NO_BROKER,
        "",
    );
    let out = cfg.cmd("setup").output().unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("postgres.ca_file") && stderr(&out).contains("sslmode"),
        "{}",
        stderr(&out)
    );

    // 127.0.0.2 is not in the certificate: verify-full refuses it (and no
    // longer suggests verify-ca as the cure), verify-ca does not check the
    // name.
    let other = server.url("127.0.0.2", "");
    let (sql, repl) = both(
        other.clone(),
        format!("sslmode = \"verify-full\"\nca_file = \"{ca}\""),
    )
    .await
    .unwrap_err();
    for (what, e) in [("SQL", sql), ("replication", repl)] {
        let (msg, _) = e.unwrap_or_else(|| panic!("{what} connection succeeded"));
        assert!(
            msg.contains("not for this host")
                && msg.contains("hostaddr=")
                && !msg.contains("verify-ca"),
            "{what}: {msg}"
        );
    }
    assert_eq!(
        both(
            other.clone(),
            format!("sslmode = \"verify-ca\"\nca_file = \"{ca}\"")
        )
        .await,
        Ok(true)
    );

    // require: TLS without verification; prefer: TLS since it is offered.
    assert_eq!(
        both(local.clone(), "sslmode = \"require\"".into()).await,
        Ok(true)
    );
    assert_eq!(both(local.clone(), String::new()).await, Ok(true));

    // disable: the server takes no plaintext (hostssl only).
    let (sql, repl) = both(local, "sslmode = \"disable\"".into())
        .await
        .unwrap_err();
    for (what, e) in [("SQL", sql), ("replication", repl)] {
        let (msg, transient) = e.unwrap_or_else(|| panic!("{what} connection succeeded"));
        assert!(
            msg.contains("no encryption") && msg.contains("postgres.sslmode"),
            "{what}: {msg}"
        );
        assert!(!transient, "{what}: {msg}");
    }
}

/// Against a server without TLS: prefer (the default) falls back to
/// plaintext on both connections; require fails naming postgres.sslmode.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_without_tls_prefer_falls_back_require_fails() {
    let server = ScratchPg::start(None);
    let pg = server.prepare().await;
    let cfg = published(&pg, &server.url("127.0.0.1", "")).await;

    let c = cfg.load();
    assert_eq!(c.postgres.sslmode, outbox_relay::tls::SslMode::Prefer);
    let sql = connect_sql(&c.postgres).await.unwrap();
    let repl = start_replication(
        &c.postgres,
        Lsn(0),
        None,
        outbox_relay::source::StreamLimits {
            buffer_events: 16,
            silence_limit: std::time::Duration::from_secs(60),
        },
    )
    .await
    .unwrap();
    assert!(!walsender_ssl(&pg, "prefer").await);
    assert_eq!(relay_backends(&pg).await, (2, false));
    drop(repl);
    drop(sql);
    wait_no_relay_backends(&pg).await;

    cfg.write(
        &server.url("127.0.0.1", "?sslmode=require"),
        "",
        NO_BROKER,
        "",
    );
    let c = cfg.load();
    for (what, e) in [
        ("SQL", connect_sql(&c.postgres).await.err()),
        (
            "replication",
            start_replication(
                &c.postgres,
                Lsn(0),
                None,
                outbox_relay::source::StreamLimits {
                    buffer_events: 16,
                    silence_limit: std::time::Duration::from_secs(60),
                },
            )
            .await
            .err(),
        ),
    ] {
        let e = e.unwrap_or_else(|| panic!("{what} connection succeeded"));
        let msg = e.to_string();
        assert!(
            msg.contains("does not accept TLS") && msg.contains("postgres.sslmode"),
            "{what}: {msg}"
        );
        assert!(!e.is_transient(), "{what}: {msg}");
    }
}

/// An attacker in the middle with a certificate from a CA the system trusts
/// (any public CA signs one for the attacker's own domain): the server here
/// presents a certificate from a second, "public" CA, which `SSL_CERT_FILE`
/// puts in the system's trust store. The relay is configured with its own
/// CA: verify-ca and verify-full refuse the server on both connections.
/// verify-ca without a CA file, and sslrootcert=system with a mode weaker
/// than verify-full, are refused at start-up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_from_another_trusted_ca_is_refused_on_both_connections() {
    let own = Pki::new();
    let public = Pki::new();
    let server = ScratchPg::start(Some(&public));
    let pg = server.prepare().await;
    let cfg = published(&pg, &server.url("127.0.0.1", "")).await;
    let system = public.ca().display().to_string();
    let env = [("SSL_CERT_FILE", system.as_str())];
    let own_ca = own.ca().display().to_string();
    let local = server.url("127.0.0.1", "");

    // The public CA is in the trust store: verify-full against the system
    // bundle accepts the server, on both connections.
    let both = |url: String, extra: String| both_connections_with(&cfg, &pg, url, extra, &env);
    assert_eq!(
        both(
            server.url("localhost", "?sslrootcert=system"),
            String::new()
        )
        .await,
        Ok(true)
    );

    // sslrootcert=system means verify-full (it used to mean prefer): the
    // public certificate does not name 127.0.0.2, so both connections
    // refuse it.
    let (sql, repl) = both(
        server.url("127.0.0.2", "?sslrootcert=system"),
        String::new(),
    )
    .await
    .unwrap_err();
    for (what, e) in [("SQL", sql), ("replication", repl)] {
        let (msg, _) =
            e.unwrap_or_else(|| panic!("system roots: the {what} connection was accepted"));
        assert!(msg.contains("not for this host"), "{what}: {msg}");
    }

    // With the relay's own CA configured, that certificate is refused.
    for mode in ["verify-ca", "verify-full"] {
        let (sql, repl) = both(
            local.clone(),
            format!("sslmode = \"{mode}\"\nca_file = \"{own_ca}\""),
        )
        .await
        .unwrap_err();
        for (what, e) in [("SQL", sql), ("replication", repl)] {
            let (msg, transient) =
                e.unwrap_or_else(|| panic!("{mode}: the {what} connection was accepted"));
            assert!(
                msg.contains("certificate not trusted"),
                "{mode} {what}: {msg}"
            );
            assert!(!transient, "{mode} {what}: {msg}");
        }
    }

    // No CA file: verify-ca and verify-full do not start (they trusted every
    // public CA before), whether the mode comes from the file or the URL.
    for (url, extra) in [
        (local.clone(), "sslmode = \"verify-ca\"".to_owned()),
        (local.clone(), "sslmode = \"verify-full\"".to_owned()),
        (server.url("127.0.0.1", "?sslmode=verify-ca"), String::new()),
    ] {
        cfg.write(&url, &extra, NO_BROKER, "");
        let err = cfg.load_with(&env).unwrap_err();
        assert!(err.contains("postgres.ca_file"), "{extra} {url}: {err}");
        refused_naming(
            cfg.cmd("run").env("SSL_CERT_FILE", &system),
            "postgres.ca_file",
        );
    }

    // sslrootcert=system with require would encrypt to anyone: refused.
    cfg.write(
        &server.url("localhost", "?sslrootcert=system&sslmode=require"),
        "",
        NO_BROKER,
        "",
    );
    let err = cfg.load_with(&env).unwrap_err();
    assert!(
        err.contains("postgres.sslmode") && err.contains("verify-full"),
        "{err}"
    );
    refused_naming(
        cfg.cmd("run").env("SSL_CERT_FILE", &system),
        "postgres.sslmode",
    );
}

/// `hostaddr` says where to connect, the host name what the certificate
/// must name: both connections go to the hostaddr. The server listens on
/// 127.0.0.2 only, and a decoy that never answers listens where `localhost`
/// leads (127.0.0.1, same port): nothing may reach it. A URL that could
/// send the two connections to different servers is refused at start-up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostaddr_reaches_the_same_server_on_both_connections() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    let pki = Pki::new();
    let server = ScratchPg::start_on(Some(&pki), "127.0.0.2");
    let pg = server.prepare().await;
    let decoy = tokio::net::TcpListener::bind(("127.0.0.1", server.port))
        .await
        .unwrap();
    let reached = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&reached);
    let decoy_task = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = decoy.accept().await {
            counter.fetch_add(1, Ordering::SeqCst);
            held.push(socket);
        }
    });
    let url = server.url("localhost", "?hostaddr=127.0.0.2");
    let cfg = published(&pg, &url).await;
    let ca = pki.ca().display().to_string();
    assert_eq!(
        both_connections(
            &cfg,
            &pg,
            url.clone(),
            format!("sslmode = \"verify-full\"\nca_file = \"{ca}\"")
        )
        .await,
        Ok(true)
    );
    // verify-ca: the probe that reads the certificate's names goes to the
    // hostaddr too.
    assert_eq!(
        both_connections(
            &cfg,
            &pg,
            url.clone(),
            format!("sslmode = \"verify-ca\"\nca_file = \"{ca}\"")
        )
        .await,
        Ok(true)
    );
    assert_eq!(
        reached.load(Ordering::SeqCst),
        0,
        "a connection went to the decoy at localhost"
    );
    decoy_task.abort();

    for (bad, why) in [
        (
            format!(
                "postgres://relay:{RELAY_PASSWORD}@127.0.0.2:{0},localhost:{0}/postgres",
                server.port
            ),
            "hosts",
        ),
        (
            format!(
                "postgres://relay:{RELAY_PASSWORD}@:{}/postgres",
                server.port
            ),
            "no host",
        ),
    ] {
        cfg.write(&bad, "", NO_BROKER, "");
        let out = cfg.cmd("run").output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{bad}: {}", stderr(&out));
        let err = stderr(&out);
        assert!(
            err.contains("postgres.url") && err.contains(why),
            "{bad}: {err}"
        );
        assert!(!err.contains(RELAY_PASSWORD), "password leaked: {err}");
    }
}

/// A client certificate (`postgres.cert_file`/`key_file`, or `sslcert=`
/// and `sslkey=` in the URL) logs both connections in where pg_hba.conf
/// says `cert`; without one, or with another user's, both are refused for
/// good, naming what to fix. A half-given pair or a key of another
/// certificate is refused when the configuration is loaded. An expired
/// one is told as the relay's certificate, not the server's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_certificate_logs_in_both_connections() {
    let pki = Pki::new();
    // The role the helpers watch (`relay`) logs in by certificate only.
    let server = ScratchPg::start_with_client_certs(&pki, "relay");
    let pg = server.prepare().await;
    let ca = pki.ca().display().to_string();
    let (cert, key) = pki.client("relay");
    let (other_cert, other_key) = pki.client("intruder");
    let (cert, key) = (cert.display().to_string(), key.display().to_string());
    let url = format!("postgres://relay@localhost:{}/postgres", server.port);
    let cfg = published(&pg, &url).await;
    let verified = format!("sslmode = \"verify-full\"\nca_file = \"{ca}\"\n");

    let keys = format!("{verified}cert_file = \"{cert}\"\nkey_file = \"{key}\"");
    assert_eq!(
        both_connections(&cfg, &pg, url.clone(), keys).await,
        Ok(true)
    );
    let in_url = format!(
        "{url}?sslcert={}&sslkey={}",
        cert.replace('/', "%2F"),
        key.replace('/', "%2F")
    );
    assert_eq!(
        both_connections(&cfg, &pg, in_url, verified.clone()).await,
        Ok(true)
    );
    wait_no_relay_backends(&pg).await;

    let pair = |c: &std::path::Path, k: &std::path::Path| {
        format!(
            "{verified}cert_file = \"{}\"\nkey_file = \"{}\"",
            c.display(),
            k.display()
        )
    };
    let (old_cert, old_key) = pki.expired_client("relay");
    // The expired one's refusal is told as the relay's certificate.
    for (case, extra, ours) in [
        ("no certificate", verified.clone(), false),
        ("another user's", pair(&other_cert, &other_key), false),
        ("expired", pair(&old_cert, &old_key), true),
    ] {
        let (sql, repl) = both_connections(&cfg, &pg, url.clone(), extra)
            .await
            .unwrap_err();
        for (what, e) in [("SQL", sql), ("replication", repl)] {
            let (msg, transient) =
                e.unwrap_or_else(|| panic!("{case}: {what} connection succeeded"));
            assert!(msg.contains("certificate"), "{case}: {what}: {msg}");
            assert!(!transient, "{case}: {what}: {msg}");
            if ours {
                assert!(
                    msg.contains("client certificate") && msg.contains("postgres.cert_file"),
                    "{case}: {what}: {msg}"
                );
                assert!(!msg.contains("server certificate"), "{case}: {what}: {msg}");
            }
        }
    }

    cfg.write(
        &url,
        &format!("{verified}cert_file = \"{cert}\""),
        NO_BROKER,
        "",
    );
    let e = cfg.load_with(&[]).unwrap_err();
    assert!(e.contains("postgres.key_file"), "{e}");
    cfg.write(
        &url,
        &format!(
            "{verified}cert_file = \"{cert}\"\nkey_file = \"{}\"",
            other_key.display()
        ),
        NO_BROKER,
        "",
    );
    let e = cfg.load_with(&[]).unwrap_err();
    assert!(e.contains("postgres.cert_file"), "{e}");
}
