//! `kill -9` of the relay mid-stream, then a restart: every committed event
//! arrives at least once (duplicates allowed, counted).

use crate::common;

use std::time::Duration;

use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill9_mid_stream_then_restart_loses_nothing() {
    let mut fx = Fixture::new("kill9").await;
    fx.start_consumer().await;
    let relay = fx.spawn_relay();

    // Producer: 400 transactions of 5 events, paced so the kill lands
    // mid-stream, with transactions both before and after it.
    let sql = fx.insert_sql();
    let producer = tokio::spawn(async move {
        let mut pg = pg_connect().await;
        let mut ids = Vec::new();
        for t in 0..400 {
            let tx = pg.transaction().await.unwrap();
            for k in 0..5 {
                let payload = serde_json::json!({"t": t, "k": k});
                let row = tx
                    .query_one(
                        &sql,
                        &[
                            &"cart",
                            &format!("c{}", t % 10),
                            &"item_added",
                            &payload.to_string(),
                        ],
                    )
                    .await
                    .unwrap();
                ids.push(row.get::<_, String>(0));
            }
            tx.commit().await.unwrap();
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        ids
    });

    // Wait until deliveries are flowing, then kill -9 mid-stream.
    let early = fx.drain_for(Duration::from_millis(1500)).await;
    assert!(
        !early.is_empty(),
        "nothing delivered before the kill; log:\n{}",
        relay.log_tail()
    );
    relay.kill9();
    let during = fx.drain_for(Duration::from_millis(500)).await;
    let relay = fx.spawn_relay();

    let ids = producer.await.unwrap();
    let mut all = early;
    all.extend(during);
    let seen = count_by_id(&all);
    let not_yet: Vec<String> = ids
        .iter()
        .filter(|id| !seen.contains_key(*id))
        .cloned()
        .collect();
    let rest = fx
        .collect_until(
            &not_yet,
            Duration::from_secs(90),
            Duration::from_secs(1),
            Some(&relay),
        )
        .await;
    all.extend(rest);
    let counts = count_by_id(&all);
    let missing: Vec<&String> = ids.iter().filter(|id| !counts.contains_key(*id)).collect();
    assert!(
        missing.is_empty(),
        "{} committed events never arrived",
        missing.len()
    );
    let duplicates: usize = counts.values().map(|c| c - 1).sum();
    println!(
        "kill -9 test: {} events, {} deliveries, {} duplicates",
        ids.len(),
        all.len(),
        duplicates
    );
    assert_eq!(counts.len(), ids.len(), "deliveries of unknown events");
    relay.sigterm();
    fx.cleanup().await;
}

/// A `kill -9` soon after the broker confirmed a batch replays none of it:
/// with the relay's own defaults (this test sets no `status_interval_ms`),
/// the confirmed position reaches PostgreSQL at once when the stream is
/// idle (and within 0.1 s when busy), and the checkpoint row within 0.2 s.
/// With the old once-a-second report and checkpoint, a kill 0.4 s after
/// delivery found the batch recorded by neither about a third of the time,
/// so twelve rounds all passing by luck is under 1 %.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_soon_after_the_confirms_replays_nothing() {
    let mut fx = Fixture::new("killsoon").await;
    let defaults = std::fs::read_to_string(&fx.config)
        .unwrap()
        .replace("status_interval_ms = 200\n", "");
    assert!(!defaults.contains("status_interval_ms"));
    std::fs::write(&fx.config, defaults).unwrap();
    fx.start_consumer().await;
    let pg = pg_connect().await;
    let mut relay = fx.spawn_relay();
    let (mut sent, mut all) = (Vec::new(), Vec::new());
    for round in 0..12 {
        let batch = fx
            .insert_many(&pg, 10, "k", |i| format!("k{round}_{i}"), "e")
            .await;
        all.extend(
            fx.collect_until(
                &batch,
                Duration::from_secs(60),
                Duration::ZERO,
                Some(&relay),
            )
            .await,
        );
        sent.extend(batch);
        tokio::time::sleep(Duration::from_millis(400)).await;
        relay.kill9();
        relay = fx.spawn_relay();
    }
    // A replay of the last round shows within the settle time.
    let again = fx.sent_again(&pg, &sent, &mut all, &relay).await;
    assert!(
        again.is_empty(),
        "{} of {} events sent again after a kill 0.4 s past their confirms; log:\n{}",
        again.len(),
        sent.len(),
        relay.log_tail()
    );
    relay.sigterm();
    fx.cleanup().await;
}
