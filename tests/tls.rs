//! TLS end to end, against private servers that trust a throwaway CA made by
//! the test itself (rcgen): a scratch PostgreSQL with `ssl = on` that takes
//! only `hostssl` connections, and a private RabbitMQ node with an AMQPS
//! listener (`integration/servers.sh up` with `OUTBOX_IT_RABBITMQ_TLS_DIR`).
//! What the servers saw is checked on their side: `pg_stat_ssl` for the
//! relay's backends and walsender, `rabbitmqctl list_connections ssl`.
//!
//! Needs root and the PostgreSQL and RabbitMQ server packages
//! (`integration/servers.sh install`), as the rest of the suite; it starts
//! its own servers, so TEST_PG_URL / TEST_AMQP_URL are not used.

mod common;
#[path = "tls/support.rs"]
mod support;

use std::time::Duration;

use futures_util::StreamExt;
use lapin::options::BasicConsumeOptions;
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties};
use outbox_relay::lsn::Lsn;
use outbox_relay::source::{connect_sql, start_replication};
use support::*;

/// `outbox-relay setup`, then `run` with sslmode=verify-full and the CA on
/// both sides: an outbox row arrives over amqps, and PostgreSQL reports the
/// relay's SQL connections and its walsender as TLS. Without
/// `rabbitmq.ca_file`, amqps stops the relay with an error naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_streams_over_tls_with_verify_full() {
    let pki = Pki::new();
    let pg_server = ScratchPg::start(Some(&pki));
    let rabbit = TlsRabbit::start(&pki);
    let pg = pg_server.prepare().await;
    let ca = pki.ca().display().to_string();
    let amqps = rabbit.var("TEST_AMQPS_URL").to_owned();
    assert!(amqps.starts_with("amqps://"), "{amqps}");

    let cfg = RelayConfig::new(
        &pg_server.url("127.0.0.1", ""),
        &format!("sslmode = \"verify-full\"\nca_file = \"{ca}\""),
        &amqps,
        &format!("ca_file = \"{ca}\""),
    );

    // The consumer uses the node's plain listener; the relay must use TLS.
    let amqp = Connection::connect(rabbit.var("TEST_AMQP_URL"), ConnectionProperties::default())
        .await
        .unwrap();
    common::declare_bound_on(
        &amqp,
        &cfg.exchange,
        Some(("tls_q", FieldTable::default())),
        "#",
    )
    .await;
    let ch = amqp.create_channel().await.unwrap();
    let mut consumer = ch
        .basic_consume(
            "tls_q".into(),
            "tls_c".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();

    let out = cfg.cmd("setup").output().unwrap();
    assert!(out.status.success(), "setup: {}", stderr(&out));

    let (relay, log) = cfg.spawn();
    assert!(
        walsender_ssl(&pg, "verify-full").await,
        "the relay's walsender is not TLS"
    );
    let id: String = pg
        .query_one(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) \
             VALUES ('order', 'o-1', 'placed', '{\"n\": 1}') RETURNING id::text",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let delivery = tokio::time::timeout(Duration::from_secs(30), consumer.next())
        .await
        .unwrap_or_else(|_| {
            panic!(
                "no message within 30 s; relay log:\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            )
        })
        .expect("consumer ended")
        .expect("delivery");
    assert_eq!(
        delivery
            .properties
            .message_id()
            .as_ref()
            .map(|s| s.as_str()),
        Some(id.as_str())
    );
    assert_eq!(delivery.routing_key.as_str(), "order.placed");

    let (n, all_tls) = relay_backends(&pg).await;
    assert!(n >= 2, "expected SQL connections and a walsender, saw {n}");
    assert!(all_tls, "a relay connection to PostgreSQL is not TLS");
    let conns = rabbit.connections();
    let relay_conn = conns
        .lines()
        .find(|l| l.contains("outbox-relay"))
        .unwrap_or_else(|| panic!("no outbox-relay connection in\n{conns}"));
    assert!(
        relay_conn.trim_end().ends_with("true"),
        "the relay's AMQP connection is not TLS: {relay_conn}"
    );
    stop(relay, &log);
    wait_no_relay_backends(&pg).await;

    // amqps without rabbitmq.ca_file: the broker's certificate is not
    // trusted; `run` stops (no endless retry) and says what to set.
    cfg.write(
        &pg_server.url("127.0.0.1", ""),
        &format!("sslmode = \"verify-full\"\nca_file = \"{ca}\""),
        &amqps,
        "",
    );
    let (mut relay, log) = cfg.spawn();
    let status = wait_exit(&mut relay, Duration::from_secs(60), &log);
    let err = std::fs::read_to_string(&log).unwrap();
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(
        err.contains("rabbitmq.ca_file") && err.contains("not trusted"),
        "{err}"
    );
    assert!(!err.contains("guest:guest@"), "password leaked: {err}");

    // A ca_file that is not there is a configuration error naming the key.
    cfg.write(
        &pg_server.url("127.0.0.1", ""),
        "",
        &amqps,
        "ca_file = \"/nonexistent/ca.pem\"",
    );
    let out = cfg.cmd("run").output().unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("rabbitmq.ca_file"),
        "{}",
        stderr(&out)
    );
}

/// Each sslmode against a server that accepts only TLS, on both the SQL
/// connection and the replication connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_sslmodes_against_a_tls_only_server() {
    let pki = Pki::new();
    let server = ScratchPg::start(Some(&pki));
    let pg = server.prepare().await;
    let ca = pki.ca().display().to_string();
    let amqp = "amqp://guest:guest@127.0.0.1:1/%2f";
    let cfg = RelayConfig::new(&server.url("127.0.0.1", ""), "", amqp, "");
    publish(&pg, &cfg).await;

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
        amqp,
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
    let cfg = RelayConfig::new(
        &server.url("127.0.0.1", ""),
        "",
        "amqp://guest:guest@127.0.0.1:1/%2f",
        "",
    );
    publish(&pg, &cfg).await;

    let c = cfg.load();
    assert_eq!(c.postgres.sslmode, outbox_relay::tls::SslMode::Prefer);
    let sql = connect_sql(&c.postgres).await.unwrap();
    let repl = start_replication(&c.postgres, Lsn(0), None, 16)
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
        "amqp://guest:guest@127.0.0.1:1/%2f",
        "",
    );
    let c = cfg.load();
    for (what, e) in [
        ("SQL", connect_sql(&c.postgres).await.err()),
        (
            "replication",
            start_replication(&c.postgres, Lsn(0), None, 16).await.err(),
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
    let amqp = "amqp://guest:guest@127.0.0.1:1/%2f";
    let cfg = RelayConfig::new(&server.url("127.0.0.1", ""), "", amqp, "");
    publish(&pg, &cfg).await;
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
        cfg.write(&url, &extra, amqp, "");
        let err = cfg.load_with(&env).unwrap_err();
        assert!(err.contains("postgres.ca_file"), "{extra} {url}: {err}");
        let out = cfg
            .cmd("run")
            .env("SSL_CERT_FILE", &system)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
        assert!(
            stderr(&out).contains("postgres.ca_file"),
            "{}",
            stderr(&out)
        );
    }

    // sslrootcert=system with require would encrypt to anyone: refused.
    cfg.write(
        &server.url("localhost", "?sslrootcert=system&sslmode=require"),
        "",
        amqp,
        "",
    );
    let err = cfg.load_with(&env).unwrap_err();
    assert!(
        err.contains("postgres.sslmode") && err.contains("verify-full"),
        "{err}"
    );
    let out = cfg
        .cmd("run")
        .env("SSL_CERT_FILE", &system)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("postgres.sslmode"),
        "{}",
        stderr(&out)
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
    let counter = reached.clone();
    let decoy_task = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = decoy.accept().await {
            counter.fetch_add(1, Ordering::SeqCst);
            held.push(socket);
        }
    });
    let amqp = "amqp://guest:guest@127.0.0.1:1/%2f";
    let url = server.url("localhost", "?hostaddr=127.0.0.2");
    let cfg = RelayConfig::new(&url, "", amqp, "");
    publish(&pg, &cfg).await;
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
        cfg.write(&bad, "", amqp, "");
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

/// `rabbitmq.ca_file` pins the broker: the broker's certificate here chains
/// to a CA the system trusts (`SSL_CERT_FILE`), so without `ca_file` the
/// relay and `check` accept it, and with the relay's own CA configured both
/// refuse it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_ca_file_replaces_the_public_roots() {
    let own = Pki::new();
    let public = Pki::new();
    let rabbit = TlsRabbit::start(&public);
    let pg_server = ScratchPg::start(None);
    let pg = pg_server.prepare().await;
    let amqps = rabbit.var("TEST_AMQPS_URL").to_owned();
    let system = public.ca().display().to_string();
    let own_ca = format!("ca_file = \"{}\"", own.ca().display());
    let cfg = RelayConfig::new(&pg_server.url("127.0.0.1", ""), "", &amqps, "");
    let out = cfg.cmd("setup").output().unwrap();
    assert!(out.status.success(), "setup: {}", stderr(&out));

    // check (lapin): the system's CAs without ca_file, only ca_file with it.
    let check = |extra: &str| {
        cfg.write(&pg_server.url("127.0.0.1", ""), "", &amqps, extra);
        let out = cfg
            .cmd("check")
            .env("SSL_CERT_FILE", &system)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        stdout
            .lines()
            .find(|l| l.contains("RabbitMQ reachable"))
            .unwrap_or_else(|| panic!("no broker line in\n{stdout}"))
            .to_owned()
    };
    let line = check("");
    assert!(line.starts_with("ok "), "{line}");
    let line = check(&own_ca);
    assert!(
        line.starts_with("FAIL ") && line.contains("not trusted"),
        "{line}"
    );

    // lapin itself, with the roots `check` hands it (the relay's own
    // handshake runs first in `check`, so test lapin on its own): the own
    // CA alone refuses the broker, the system's CA accepts it.
    let lapin_with = |roots: String| {
        let url = amqps.clone();
        async move {
            let tls = outbox_relay::tls::rabbitmq_tls(std::path::Path::new(&roots)).unwrap();
            let builder = lapin::DefaultConnectionBuilder::new()
                .unwrap()
                .with_uri_str(url)
                .with_tls_config(tls);
            let connect = builder.connect();
            tokio::time::timeout(Duration::from_secs(20), connect)
                .await
                .expect("lapin got no answer")
        }
    };
    let own_path = own.ca().display().to_string();
    assert!(
        lapin_with(own_path).await.is_err(),
        "lapin accepted the broker"
    );
    let conn = lapin_with(system.clone())
        .await
        .expect("lapin with the system CA");
    let _ = conn.close(200, "ok".into()).await;

    // run (the relay's own client): refused with ca_file, at once.
    cfg.write(&pg_server.url("127.0.0.1", ""), "", &amqps, &own_ca);
    let (mut relay, log) = cfg.spawn_with(&[("SSL_CERT_FILE", &system)]);
    let status = wait_exit(&mut relay, Duration::from_secs(60), &log);
    let err = std::fs::read_to_string(&log).unwrap();
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(
        err.contains("rabbitmq.ca_file") && err.contains("not trusted"),
        "{err}"
    );

    // ... and accepted through the system's CAs without it: it streams.
    let amqp = Connection::connect(rabbit.var("TEST_AMQP_URL"), ConnectionProperties::default())
        .await
        .unwrap();
    common::declare_bound_on(&amqp, &cfg.exchange, None, "").await;
    cfg.write(&pg_server.url("127.0.0.1", ""), "", &amqps, "");
    let (relay, log) = cfg.spawn_with(&[("SSL_CERT_FILE", &system)]);
    let end = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let conns = rabbit.connections();
        if let Some(l) = conns.lines().find(|l| l.contains("outbox-relay")) {
            assert!(l.trim_end().ends_with("true"), "not TLS: {l}");
            break;
        }
        assert!(
            std::time::Instant::now() < end,
            "the relay did not connect over amqps; log:\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stop(relay, &log);
    drop(pg);
}
