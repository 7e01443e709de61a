//! What an operator sees: /metrics values move as events flow and sessions
//! reconnect, /healthz and /readyz answer, JSON logs carry the state changes,
//! and no password reaches logs or `status` output. The relay runs as the
//! least-privilege role of `sql/role.sql`.
//!
//! Own binary: it closes every broker connection on purpose.

use crate::common;

use std::time::{Duration, Instant};

use common::*;

async fn wait_for(what: &str, mut f: impl AsyncFnMut() -> bool) {
    let end = Instant::now() + Duration::from_secs(30);
    while Instant::now() < end {
        if f().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!("timed out waiting for {what}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_health_logs_and_secrets() {
    let mut fx = Fixture::new("observe").await;
    let pg = pg_connect().await;

    // The least-privilege role, made by sql/role.sql itself.
    let role = fx.least_privilege_role();
    let (password, role_url) = (role.password.clone(), role.url.clone());

    fx.start_consumer().await;
    let relay = fx.spawn_relay_env(&[
        ("OUTBOX_RELAY_POSTGRES_URL", &role_url),
        ("OUTBOX_RELAY_LOG_FORMAT", "json"),
    ]);
    let addr = relay.http_addr().await;

    assert_eq!(http_get(&addr, "/healthz").await.0, 200);
    wait_for("/readyz 200", async || {
        http_get(&addr, "/readyz").await.0 == 200
    })
    .await;
    let (_, m0) = http_get(&addr, "/metrics").await;
    let lsn0 = sample(&m0, "outbox_relay_confirmed_lsn");
    assert!(lsn0 > 0.0, "confirmed LSN not exported:\n{m0}");

    let ids = fx.insert_many(&pg, 10, "m", |_| "1".into(), "e").await;
    fx.expect_delivered(&ids, &relay).await;
    wait_for("published events counted", async || {
        sample(
            &http_get(&addr, "/metrics").await.1,
            "outbox_relay_events_total{outcome=\"published\"}",
        ) >= 10.0
    })
    .await;
    let (_, m1) = http_get(&addr, "/metrics").await;
    assert_eq!(
        sample(&m1, "outbox_relay_events_total{outcome=\"published\"}"),
        10.0,
        "{m1}"
    );
    assert!(sample(&m1, "outbox_relay_published_bytes_total") >= 10.0 * 8.0);
    assert!(sample(&m1, "outbox_relay_transactions_total") >= 10.0);
    assert_eq!(
        sample(&m1, "outbox_relay_confirm_latency_seconds_count"),
        10.0
    );
    assert!(sample(&m1, "outbox_relay_confirmed_lsn") > lsn0);
    assert!(
        sample(&m1, "outbox_relay_received_lsn") >= sample(&m1, "outbox_relay_confirmed_lsn") - 1.0
    );
    assert_eq!(sample(&m1, "outbox_relay_streaming"), 1.0);
    assert_eq!(sample(&m1, "outbox_relay_broker_blocked"), 0.0);
    wait_for("in-flight back to 0 and lag 0 when idle", async || {
        let m = http_get(&addr, "/metrics").await.1;
        sample(&m, "outbox_relay_in_flight_messages") == 0.0
            && sample(&m, "outbox_relay_replication_lag_seconds") == 0.0
    })
    .await;
    wait_for("retained WAL polled", async || {
        http_get(&addr, "/metrics")
            .await
            .1
            .contains("outbox_relay_retained_wal_bytes ")
    })
    .await;

    // Every broker connection closed: the relay reconnects, counts it, is
    // ready again, and goes on publishing.
    rabbitmq_ctl(&["ctl", "close_all_connections", "test"]);
    wait_for("a counted reconnect", async || {
        sample(
            &http_get(&addr, "/metrics").await.1,
            "outbox_relay_reconnects_total{target=\"rabbitmq\"}",
        ) >= 1.0
    })
    .await;
    wait_for("/readyz 200 again", async || {
        http_get(&addr, "/readyz").await.0 == 200
    })
    .await;
    fx.insert(&pg, "m", "1", "e", &serde_json::json!({"after": true}))
        .await;
    wait_for("the event after the reconnect counted", async || {
        sample(
            &http_get(&addr, "/metrics").await.1,
            "outbox_relay_events_total{outcome=\"published\"}",
        ) >= 11.0
    })
    .await;

    // Logs: JSON, one object a line, with the state changes, no password.
    let status = fx
        .relay_cmd("status")
        .env("OUTBOX_RELAY_POSTGRES_URL", &role_url)
        .output()
        .unwrap();
    assert!(
        status.status.success(),
        "{}",
        String::from_utf8_lossy(&status.stderr)
    );
    let log_path = relay.log.clone();
    relay.sigterm();
    let log = std::fs::read_to_string(&log_path).unwrap();
    let mut messages = Vec::new();
    for line in log.lines() {
        let v: serde_json::Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("log line is not JSON ({e}): {line}"));
        messages.push(v["message"].as_str().unwrap_or_default().to_owned());
    }
    for expected in [
        "connected to RabbitMQ",
        "streaming from LSN",
        "reconnecting",
        "stopped; final confirmed LSN",
    ] {
        assert!(
            messages.iter().any(|m| m == expected),
            "no {expected:?} line in:\n{messages:#?}"
        );
    }
    let status_text = String::from_utf8_lossy(&status.stdout);
    for (what, text) in [("log", log.as_str()), ("status", &status_text)] {
        assert!(!text.contains(&password), "password in {what}");
    }
    fx.cleanup().await;
    role.drop(&pg).await;
}
