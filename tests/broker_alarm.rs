//! While the broker withholds confirms (memory alarm), the slot's
//! `confirmed_flush_lsn` never passes the first unconfirmed event; a relay
//! killed in that state loses nothing; once the broker is back, everything
//! arrives.
//!
//! Shutdown while the broker withholds confirms: SIGTERM drains within the
//! grace period and reports nothing unconfirmed; a second signal exits at once.
//!
//! Own test binary: the alarm is broker-wide, and cargo runs test binaries
//! one after another; inside it, [`ALARM`] runs the tests one at a time.

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::*;
use outbox_relay::lsn::Lsn;
use outbox_relay::pgoutput::{LogicalMessage, decode};

static ALARM: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_alarm_holds_the_slot_before_unconfirmed_events() {
    let _alarm = ALARM.lock().await;
    let mut fx = Fixture::new("alarm").await;
    fx.start_consumer().await;
    let pg = pg_connect().await;
    let relay = fx.spawn_relay();
    let warm = fx
        .insert(&pg, "acct", "a1", "opened", &serde_json::json!({}))
        .await;
    fx.collect_until(
        &[warm],
        Duration::from_secs(30),
        Duration::ZERO,
        Some(&relay),
    )
    .await;

    // An observer slot tells the exact end LSN of the transactions below.
    let observer = format!("obs_{}", fx.name);
    pg.query_one(
        "SELECT 1 FROM pg_create_logical_replication_slot($1, 'pgoutput')",
        &[&observer],
    )
    .await
    .unwrap();

    rabbitmq_ctl(&["ctl", "set_vm_memory_high_watermark", "0"]);
    let result = std::panic::AssertUnwindSafe(async {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let mut ids = Vec::new();
        for i in 0..20 {
            ids.push(
                fx.insert(
                    &pg,
                    "acct",
                    &format!("a{}", i % 3),
                    "debited",
                    &serde_json::json!({"i": i}),
                )
                .await,
            );
        }
        let first_end = first_commit_end(&pg, &observer, &fx.publication).await;

        // Several status intervals (200 ms) pass; keepalives come and go.
        for _ in 0..15 {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let confirmed = fx.confirmed_flush_lsn(&pg).await;
            assert!(
                confirmed < first_end,
                "confirmed_flush_lsn {confirmed} passed unconfirmed transaction ending at {first_end}"
            );
        }
        let leaked = fx.drain_for(Duration::from_millis(100)).await;
        assert!(
            leaked.is_empty(),
            "{} messages got through a blocked broker",
            leaked.len()
        );
        ids
    });
    let outcome = futures_util::FutureExt::catch_unwind(result).await;
    // Kill -9 while blocked: only the slot remembers where to resume.
    relay.kill9();
    rabbitmq_ctl(&["ctl", "set_vm_memory_high_watermark", "0.4"]);
    let _ = pg
        .execute("SELECT pg_drop_replication_slot($1)", &[&observer])
        .await;
    let ids = match outcome {
        Ok(ids) => ids,
        Err(panic) => std::panic::resume_unwind(panic),
    };

    let relay = fx.spawn_relay();
    let got = fx
        .collect_until(&ids, Duration::from_secs(60), Duration::ZERO, Some(&relay))
        .await;
    assert!(count_by_id(&got).len() >= ids.len());
    relay.sigterm();
    fx.cleanup().await;
}

/// End LSN of the first transaction the observer slot has decoded.
/// Retries: with `synchronous_commit = off` decoding sees a commit only once
/// the WAL writer has flushed it.
async fn first_commit_end(pg: &tokio_postgres::Client, slot: &str, publication: &str) -> Lsn {
    for _ in 0..50 {
        if let Some(lsn) = peek_first_commit_end(pg, slot, publication).await {
            return lsn;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("observer slot saw no commit");
}

async fn peek_first_commit_end(
    pg: &tokio_postgres::Client,
    slot: &str,
    publication: &str,
) -> Option<Lsn> {
    let rows = pg
        .query(
            "SELECT data FROM pg_logical_slot_peek_binary_changes($1, NULL, NULL, \
             'proto_version', '1', 'publication_names', $2)",
            &[&slot, &publication],
        )
        .await
        .unwrap();
    for row in rows {
        let data: Vec<u8> = row.get(0);
        if let Ok(LogicalMessage::Commit(c)) = decode(Bytes::from(data)) {
            return Some(Lsn(c.end_lsn));
        }
    }
    None
}

/// Sets the memory alarm, runs `f`, always clears the alarm.
async fn with_alarm<T>(f: impl std::future::Future<Output = T>) -> T {
    rabbitmq_ctl(&["ctl", "set_vm_memory_high_watermark", "0"]);
    let out = futures_util::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(f)).await;
    rabbitmq_ctl(&["ctl", "set_vm_memory_high_watermark", "0.4"]);
    match out {
        Ok(v) => v,
        Err(p) => std::panic::resume_unwind(p),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_with_unconfirmed_messages_exits_within_grace_and_reports_nothing_unconfirmed() {
    let _alarm = ALARM.lock().await;
    let mut fx = Fixture::new("shutdown").await;
    fx.set_config_extra("shutdown_grace_secs = 2", "");
    fx.start_consumer().await;
    let pg = pg_connect().await;
    let relay = fx.spawn_relay();
    let warm = fx.insert(&pg, "s", "1", "e", &serde_json::json!({})).await;
    fx.collect_until(
        &[warm],
        Duration::from_secs(30),
        Duration::ZERO,
        Some(&relay),
    )
    .await;
    let observer = format!("obs_{}", fx.name);
    pg.query_one(
        "SELECT 1 FROM pg_create_logical_replication_slot($1, 'pgoutput')",
        &[&observer],
    )
    .await
    .unwrap();

    let (ids, first_end, elapsed, status, out) = with_alarm(async {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let mut ids = Vec::new();
        for i in 0..10 {
            ids.push(
                fx.insert(&pg, "s", "1", "e", &serde_json::json!({"i": i}))
                    .await,
            );
        }
        let first_end = first_commit_end(&pg, &observer, &fx.publication).await;
        tokio::time::sleep(Duration::from_secs(1)).await;
        let t0 = std::time::Instant::now();
        let log = relay.log.clone();
        let (status, out) = relay.sigterm();
        let out = format!(
            "{out}\n--- relay log ---\n{}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
        (ids, first_end, t0.elapsed(), status, out)
    })
    .await;
    let _ = pg
        .execute("SELECT pg_drop_replication_slot($1)", &[&observer])
        .await;
    println!(
        "shutdown with unconfirmed messages took {:.1} s (grace 2 s)",
        elapsed.as_secs_f64()
    );
    assert!(status.success(), "exit status {status}: {out}");
    assert!(
        elapsed < Duration::from_secs(10),
        "took {elapsed:?} with a 2 s grace period: {out}"
    );
    assert!(out.contains("final confirmed LSN"), "{out}");
    fx.wait_slot_inactive(&pg).await;
    let confirmed = fx.confirmed_flush_lsn(&pg).await;
    assert!(
        confirmed < first_end,
        "shutdown reported {confirmed}, past unconfirmed {first_end}"
    );

    let relay = fx.spawn_relay();
    fx.collect_until(&ids, Duration::from_secs(60), Duration::ZERO, Some(&relay))
        .await;
    relay.sigterm();
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_signal_exits_at_once() {
    let _alarm = ALARM.lock().await;
    let mut fx = Fixture::new("twosignals").await;
    fx.set_config_extra("shutdown_grace_secs = 600", "");
    fx.start_consumer().await;
    let pg = pg_connect().await;
    let mut relay = fx.spawn_relay();
    let warm = fx.insert(&pg, "s", "1", "e", &serde_json::json!({})).await;
    fx.collect_until(
        &[warm],
        Duration::from_secs(30),
        Duration::ZERO,
        Some(&relay),
    )
    .await;
    let (status, elapsed) = with_alarm(async {
        tokio::time::sleep(Duration::from_millis(500)).await;
        fx.insert(&pg, "s", "1", "e", &serde_json::json!({"stuck": true}))
            .await;
        tokio::time::sleep(Duration::from_secs(1)).await;
        signal(relay.pid(), "TERM");
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(
            relay.is_running(),
            "exited on the first signal despite unconfirmed messages and a 600 s grace"
        );
        let t0 = std::time::Instant::now();
        signal(relay.pid(), "TERM");
        let status = wait_timeout(&mut relay.child, Duration::from_secs(5));
        (status, t0.elapsed())
    })
    .await;
    let status = status.expect("relay still running 5 s after the second signal");
    println!("second signal: exit after {:.2} s", elapsed.as_secs_f64());
    assert_eq!(status.code(), Some(130));
    fx.cleanup().await;
}
