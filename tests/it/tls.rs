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
//!
//! Here: end to end, and the broker's side; `tls/postgres.rs`: the
//! PostgreSQL connections' cases.

use crate::common;
mod postgres;
mod support;

use std::time::Duration;

use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties};
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
    let mut consumer = common::consume_on(&amqp, "tls_q").await;

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
    let delivery = tokio::time::timeout(Duration::from_secs(30), consumer.recv())
        .await
        .unwrap_or_else(|_| {
            panic!(
                "no message within 30 s; relay log:\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            )
        })
        .expect("consumer ended");
    assert_eq!(delivery.message_id(), id);
    assert_eq!(delivery.routing_key, "order.placed");

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
    refused_naming(&mut cfg.cmd("run"), "rabbitmq.ca_file");
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

    // check (the relay's own client): the system's CAs without ca_file,
    // only ca_file with it.
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

/// SASL EXTERNAL: `auth_mechanism=external` in an `amqps://` URL logs in
/// as the user the client certificate (`rabbitmq.cert_file`/`key_file`)
/// names, with no password anywhere; a certificate for a user the broker
/// does not have is refused, an expired one told as the relay's own.
/// Without the certificate, or over `amqp://`, the configuration is
/// refused when loaded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_external_logs_in_with_the_client_certificate() {
    let pki = Pki::new();
    let rabbit = TlsRabbit::start(&pki);
    rabbit.ctl(&["add_user", "relaycert", "unused-password"]);
    rabbit.ctl(&["clear_password", "relaycert"]);
    rabbit.ctl(&["set_permissions", "-p", "/", "relaycert", ".*", ".*", ".*"]);
    let pg_server = ScratchPg::start(None);
    let pg = pg_server.prepare().await;
    let pg_url = pg_server.url("127.0.0.1", "");
    let (_, node) = rabbit.var("TEST_AMQPS_URL").split_once('@').unwrap();
    let external = format!(
        "amqps://127.0.0.1:{}",
        node.trim_start_matches("127.0.0.1:")
    );
    let external = format!("{external}?auth_mechanism=external");
    let ca = pki.ca().display().to_string();
    let (cert, key) = pki.client("relaycert");
    let (stranger, stranger_key) = pki.client("stranger");
    let with = |c: &std::path::Path, k: &std::path::Path| {
        format!(
            "ca_file = \"{ca}\"\ncert_file = \"{}\"\nkey_file = \"{}\"",
            c.display(),
            k.display()
        )
    };
    let cfg = RelayConfig::new(&pg_url, "", &external, &with(&cert, &key));
    let out = cfg.cmd("setup").output().unwrap();
    assert!(out.status.success(), "setup: {}", stderr(&out));
    let broker_line = |extra: &str| {
        cfg.write(&pg_url, "", &external, extra);
        let out = cfg.cmd("check").output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        stdout
            .lines()
            .find(|l| l.contains("RabbitMQ reachable"))
            .unwrap_or_else(|| panic!("no broker line in\n{stdout}{}", stderr(&out)))
            .to_owned()
    };
    let line = broker_line(&with(&cert, &key));
    assert!(
        line.starts_with("ok ") && line.contains("client certificate"),
        "{line}"
    );
    let line = broker_line(&with(&stranger, &stranger_key));
    assert!(
        line.starts_with("FAIL ") && line.contains("refused"),
        "{line}"
    );
    // An expired certificate: the broker resets the connection after the
    // handshake (its alert is not seen); the line says the certificate
    // may be why, and which setting holds it.
    let (old_cert, old_key) = pki.expired_client("relaycert");
    let line = broker_line(&with(&old_cert, &old_key));
    assert!(
        line.starts_with("FAIL ")
            && line.contains("client certificate")
            && line.contains("rabbitmq.cert_file")
            && !line.contains("broker certificate"),
        "{line}"
    );

    // run: the broker sees user relaycert, logged in by EXTERNAL, over TLS.
    let amqp = Connection::connect(rabbit.var("TEST_AMQP_URL"), ConnectionProperties::default())
        .await
        .unwrap();
    common::declare_bound_on(&amqp, &cfg.exchange, None, "").await;
    cfg.write(&pg_url, "", &external, &with(&cert, &key));
    let (relay, log) = cfg.spawn();
    let end = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let conns = rabbit.ctl(&[
            "list_connections",
            "user",
            "auth_mechanism",
            "ssl",
            "client_properties",
        ]);
        if let Some(l) = conns.lines().find(|l| l.contains("outbox-relay")) {
            assert!(
                l.starts_with("relaycert") && l.contains("EXTERNAL") && l.contains("true"),
                "{l}"
            );
            break;
        }
        assert!(
            std::time::Instant::now() < end,
            "the relay did not connect with its certificate; log:\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stop(relay, &log);

    // `run` with the expired certificate: the broker's alert, when it
    // arrives, stops the relay with the refusal (it is for good); a reset
    // instead, which says nothing for sure, is retried, each attempt's
    // line naming the certificate's setting. Which one depends on when
    // the broker closes.
    cfg.write(&pg_url, "", &external, &with(&old_cert, &old_key));
    let (mut relay, log) = cfg.spawn();
    let end = std::time::Instant::now() + Duration::from_secs(60);
    let text = loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if text.contains("rabbitmq.cert_file") {
            break text;
        }
        assert!(
            std::time::Instant::now() < end,
            "no line named rabbitmq.cert_file; log:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    if !text.contains("refused the relay's client certificate") {
        assert!(text.contains("with the client certificate"), "{text}");
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &relay.id().to_string()])
            .status();
    }
    let status = wait_exit(&mut relay, Duration::from_secs(30), &log);
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    // Stopped by the signal, or by a later attempt's alert.
    let refused = text.contains("refused the relay's client certificate");
    assert!(
        status.success() || (refused && status.code() == Some(1)),
        "{status}: {text}"
    );
    assert!(!text.contains("broker certificate"), "{text}");

    // Refused at load: EXTERNAL without a certificate, a certificate
    // without TLS.
    cfg.write(&pg_url, "", &external, &format!("ca_file = \"{ca}\""));
    let e = cfg.load_with(&[]).unwrap_err();
    assert!(e.contains("rabbitmq.cert_file"), "{e}");
    let plain = rabbit.var("TEST_AMQP_URL").to_owned();
    let only_cert = format!(
        "cert_file = \"{}\"\nkey_file = \"{}\"",
        cert.display(),
        key.display()
    );
    cfg.write(&pg_url, "", &plain, &only_cert);
    let e = cfg.load_with(&[]).unwrap_err();
    assert!(
        e.contains("rabbitmq.cert_file") && e.contains("amqps://"),
        "{e}"
    );
    drop(pg);
}
