//! While the broker withholds confirms (memory alarm), the slot's
//! `confirmed_flush_lsn` never passes the first unconfirmed event; a relay
//! killed in that state loses nothing; once the broker is back, everything
//! arrives.
//!
//! Own test binary: the alarm is broker-wide, and cargo runs test binaries
//! one after another.

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::*;
use outbox_relay::lsn::Lsn;
use outbox_relay::pgoutput::{LogicalMessage, decode};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_alarm_holds_the_slot_before_unconfirmed_events() {
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
