//! The three crash windows of the outbox pattern, end to end with the
//! idempotent consumer of `examples/consumer.rs` (built by `cargo test`):
//!
//! 1. the producer dies before its transaction commits: no business row,
//!    no outbox row, no message;
//! 2. the relay is killed (`kill -9`) after the broker has a message but
//!    before the slot's position was reported: the message comes again, and
//!    the consumer keeps exactly one business effect;
//! 3. the consumer dies after applying the change but before committing,
//!    and (separately) after committing but before acking: the message is
//!    redelivered, and exactly one business effect remains.
//!
//! Each test prints the duplicate deliveries the consumer saw. The tests
//! share the consumer's tables, so they take turns.

use crate::common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Rows of business effect for `id`.
async fn effects(pg: &tokio_postgres::Client, id: &str) -> i64 {
    pg.query_one(
        "SELECT count(*) FROM consumer_effects WHERE event_id = $1",
        &[&id],
    )
    .await
    .unwrap()
    .get(0)
}

async fn wait_effect(pg: &tokio_postgres::Client, id: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while effects(pg, id).await == 0 {
        assert!(Instant::now() < deadline, "{id} was never applied");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// 1. The producer dies with its transaction open: nothing of it exists,
/// nothing is sent; the stream goes on past it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producer_that_dies_before_commit_leaves_nothing() {
    let _turn = SERIAL.lock().await;
    let mut fx = Fixture::new("cw_producer").await;
    fx.start_consumer().await;
    let pg = pg_connect().await;
    pg.batch_execute(&format!(
        "CREATE TABLE biz_{0} (order_id text PRIMARY KEY)",
        fx.name
    ))
    .await
    .unwrap();
    let relay = fx.spawn_relay();
    let mut psql = Command::new("psql")
        .arg(pg_url())
        .args(["-X", "-q", "-v", "ON_ERROR_STOP=1"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .expect("psql");
    {
        use std::io::Write;
        let stdin = psql.stdin.as_mut().unwrap();
        writeln!(
            stdin,
            "BEGIN; INSERT INTO biz_{0} VALUES ('o1'); \
             INSERT INTO {1} (aggregate_type, aggregate_id, event_type, payload) \
             VALUES ('order', 'o1', 'placed', '{{}}'); SELECT pg_sleep(0);",
            fx.name, fx.table
        )
        .unwrap();
        stdin.flush().unwrap();
    }
    // Both rows written, not committed: the producer dies.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let open: i64 = pg
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'psql' \
                 AND state = 'idle in transaction' AND query LIKE '%pg_sleep(0)%'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        if open > 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "psql never opened its transaction"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    signal(psql.id(), "KILL");
    let _ = psql.wait();
    let count = |t: String| {
        let pg = &pg;
        async move {
            pg.query_one(&format!("SELECT count(*) FROM {t}"), &[])
                .await
                .unwrap()
                .get::<_, i64>(0)
        }
    };
    // The server rolls the transaction back when its client is gone.
    let deadline = Instant::now() + Duration::from_secs(20);
    while pg
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'psql'",
            &[],
        )
        .await
        .unwrap()
        .get::<_, i64>(0)
        > 0
    {
        assert!(
            Instant::now() < deadline,
            "the dead producer's backend lingers"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(count(format!("biz_{}", fx.name)).await, 0, "business row");
    assert_eq!(count(fx.table.clone()).await, 0, "outbox row");
    // A later event arrives, and nothing else does.
    let after = fx
        .insert(&pg, "order", "o2", "placed", &serde_json::json!({}))
        .await;
    let got = fx
        .collect_until(
            std::slice::from_ref(&after),
            Duration::from_secs(30),
            Duration::from_secs(1),
            Some(&relay),
        )
        .await;
    assert_eq!(got.len(), 1, "{got:?}");
    println!(
        "producer crash: 0 business rows, 0 outbox rows, {} deliveries (the later event only), {} duplicate deliveries",
        got.len(),
        got.len() - count_by_id(&got).len()
    );
    relay.stop_ok();
    pg.batch_execute(&format!("DROP TABLE biz_{}", fx.name))
        .await
        .unwrap();
    fx.cleanup().await;
}

/// 2. `kill -9` of the relay after the broker confirmed (the consumer even
/// applied it) and before the position was reported: the next relay sends
/// it again, and the consumer's inbox keeps one effect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_killed_before_reporting_resends_and_the_consumer_applies_once() {
    let _turn = SERIAL.lock().await;
    let fx = Fixture::new("cw_relay").await;
    let pg = pg_connect().await;
    prepare_consumer_tables(&pg).await;
    // Nothing reported for a minute, and no checkpoint table to resume
    // from: a kill replays everything since the start.
    let text = std::fs::read_to_string(&fx.config).unwrap().replace(
        "status_interval_ms = 200",
        &format!(
            "status_interval_ms = 60000\ncheckpoint_table = \"public.no_checkpoint_{}\"",
            fx.name
        ),
    );
    std::fs::write(&fx.config, text).unwrap();
    let consumer = Consumer::start(&fx, &fx.name, None, &[]);
    let relay = fx.spawn_relay();
    let id = fx
        .insert(&pg, "order", "o1", "placed", &serde_json::json!({"n": 1}))
        .await;
    wait_effect(&pg, &id).await;
    relay.kill9();
    let relay = fx.spawn_relay();
    let deadline = Instant::now() + Duration::from_secs(60);
    while consumer.counter("consumer_duplicates_total").await == 0 {
        assert!(
            Instant::now() < deadline,
            "the event was not sent again; log:\n{}",
            relay.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let duplicates = consumer.counter("consumer_duplicates_total").await;
    assert_eq!(effects(&pg, &id).await, 1, "one business effect");
    println!("relay crash: {duplicates} duplicate deliveries, 1 business effect");
    relay.stop_ok();
    drop(consumer);
    fx.cleanup().await;
}

/// 3. The consumer dies after applying the change, before committing (the
/// change rolls back with the inbox row), and after committing, before
/// acking (the redelivery finds the inbox row): either way the message
/// comes again and exactly one effect remains.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_that_dies_mid_message_still_applies_once() {
    let _turn = SERIAL.lock().await;
    let fx = Fixture::new("cw_consumer").await;
    let pg = pg_connect().await;
    prepare_consumer_tables(&pg).await;
    let relay = fx.spawn_relay();
    for (point, dup_expected) in [("apply", 0), ("commit", 1)] {
        let name = format!("{}_{point}", fx.name);
        let id = fx
            .insert(&pg, "order", point, "placed", &serde_json::json!({}))
            .await;
        let mut dying = Consumer::start(&fx, &name, Some((point, &id)), &[]);
        dying.wait_died();
        let applied = effects(&pg, &id).await;
        assert_eq!(
            applied,
            i64::from(point == "commit"),
            "after dying at {point}"
        );
        let consumer = Consumer::start(&fx, &name, None, &[]);
        wait_effect(&pg, &id).await;
        // The redelivery was handled (acked): one more insert shows it.
        let marker = fx
            .insert(&pg, "order", "marker", "placed", &serde_json::json!({}))
            .await;
        wait_effect(&pg, &marker).await;
        let duplicates = consumer.counter("consumer_duplicates_total").await;
        assert_eq!(effects(&pg, &id).await, 1, "one business effect ({point})");
        assert_eq!(duplicates, dup_expected, "duplicates seen ({point})");
        println!(
            "consumer crash after {point}: {duplicates} duplicate deliveries, 1 business effect"
        );
    }
    relay.stop_ok();
    fx.cleanup().await;
}
