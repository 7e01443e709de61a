//! Several publishing channels (`rabbitmq.channels`): each aggregate's
//! events on one channel, in commit order, across a `kill -9` and a
//! walsender killed; and one watermark over all channels, held back by the
//! one a full queue keeps nacking while the others deliver.

use crate::common;

use std::collections::HashMap;
use std::time::Duration;

use common::*;

const FOUR: &str = "channels = 4\n";

/// 200 transactions of 5 events over 16 aggregates, a `kill -9` and a
/// walsender killed meanwhile: every event arrives, and each aggregate's
/// events arrive first in the order they were committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_channels_keep_each_aggregate_in_order_across_kill9_and_a_walsender_kill() {
    let mut fx = Fixture::with_config("chan4", FOUR).await;
    fx.start_consumer().await;
    let relay = fx.spawn_relay_env(&[("OUTBOX_RELAY_LOG_FORMAT", "json")]);
    let sql = fx.insert_sql();
    let producer = tokio::spawn(async move {
        let mut pg = pg_connect().await;
        let mut sent = Vec::new();
        for t in 0..200u32 {
            let tx = pg.transaction().await.unwrap();
            for k in 0..5u32 {
                let agg = format!("c{}", (t * 5 + k) % 16);
                let payload = serde_json::json!({ "n": t * 5 + k });
                let row = tx
                    .query_one(&sql, &[&"cart", &agg, &"item_added", &payload.to_string()])
                    .await
                    .unwrap();
                sent.push((row.get::<_, String>(0), agg, t * 5 + k));
            }
            tx.commit().await.unwrap();
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        sent
    });

    let early = fx.drain_for(Duration::from_millis(1500)).await;
    assert!(
        !early.is_empty(),
        "nothing delivered; log:\n{}",
        relay.log_tail()
    );
    let connected = relay.log_text().matches("connected to RabbitMQ").count();
    assert_eq!(
        connected,
        4,
        "one connection per channel:\n{}",
        relay.log_tail()
    );
    // Each connection says which channel it is, and so do the gauges.
    let log = relay.log_text();
    for c in 0..4 {
        assert!(
            log.contains(&format!("channel {c})")),
            "channel {c}:\n{log}"
        );
    }
    let (status, metrics) = http_get(&relay.http_addr().await, "/metrics").await;
    assert_eq!(status, 200);
    for c in 0..4 {
        let gauge = format!("outbox_relay_channel_in_flight_messages{{channel=\"{c}\"}}");
        let end = std::time::Instant::now() + Duration::from_secs(5);
        let mut text = metrics.clone();
        while !text.contains(&gauge) && std::time::Instant::now() < end {
            tokio::time::sleep(Duration::from_millis(200)).await;
            text = http_get(&relay.http_addr().await, "/metrics").await.1;
        }
        assert!(text.contains(&gauge), "{gauge} missing:\n{text}");
    }
    relay.kill9();
    let relay = fx.spawn_relay();
    let pg = pg_connect().await;
    let mut all = early;
    all.extend(fx.drain_for(Duration::from_millis(1500)).await);
    fx.terminate_walsender(&pg).await;

    let sent = producer.await.unwrap();
    let ids: Vec<String> = sent.iter().map(|(id, _, _)| id.clone()).collect();
    let seen = count_by_id(&all);
    let not_yet: Vec<String> = (ids.iter())
        .filter(|id| !seen.contains_key(*id))
        .cloned()
        .collect();
    all.extend(
        fx.collect_until(
            &not_yet,
            Duration::from_secs(90),
            Duration::from_secs(1),
            Some(&relay),
        )
        .await,
    );
    let counts = count_by_id(&all);
    let missing = ids.iter().filter(|id| !counts.contains_key(*id)).count();
    assert_eq!(missing, 0, "committed events never arrived");

    // First deliveries, per aggregate, in commit order.
    let of: HashMap<&str, (&str, u32)> = (sent.iter())
        .map(|(id, agg, n)| (id.as_str(), (agg.as_str(), *n)))
        .collect();
    let mut first = std::collections::HashSet::new();
    let mut last: HashMap<&str, u32> = HashMap::new();
    for r in &all {
        let id = r.message_id();
        if !first.insert(id.clone()) {
            continue;
        }
        let (agg, n) = of[id.as_str()];
        if let Some(before) = last.insert(agg, n) {
            assert!(
                before < n,
                "aggregate {agg}: event {n} first delivered after event {before}"
            );
        }
    }
    let duplicates: usize = counts.values().map(|c| c - 1).sum();
    println!(
        "four channels: {} events, {} deliveries, {duplicates} duplicates",
        ids.len(),
        all.len()
    );
    relay.stop_ok();
    fx.cleanup().await;
}

/// One watermark: an event a full queue keeps nacking holds the slot
/// before its transaction, while the events after it, on every channel,
/// are delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_channel_held_by_nacks_holds_the_slot_while_the_others_deliver() {
    let mut fx = Fixture::with_config("chanwm", FOUR).await;
    fx.rebind_queue("ok.#").await;
    let full = fx.full_queue("full.#").await;
    fx.start_consumer().await;
    let pg = pg_connect().await;
    let relay = fx.spawn_relay();
    // The one message the full queue holds.
    let fills = fx
        .insert(&pg, "full", "f", "e", &serde_json::json!({}))
        .await;
    let warm = fx.insert(&pg, "ok", "w", "e", &serde_json::json!({})).await;
    fx.expect_delivered(&[warm], &relay).await;
    let _ = fills;

    let observer = format!("obs_{}", fx.name);
    create_observer_slot(&pg, &observer).await;
    fx.insert(&pg, "full", "f", "e", &serde_json::json!({"nacked": true}))
        .await;
    let nacked_end = first_commit_end(&pg, &observer, &fx.publication).await;
    let mut after = Vec::new();
    for i in 0..40 {
        let id = fx
            .insert(
                &pg,
                "ok",
                &format!("o{i}"),
                "e",
                &serde_json::json!({ "i": i }),
            )
            .await;
        after.push(id);
    }
    fx.expect_delivered(&after, &relay).await;
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let confirmed = fx.confirmed_flush_lsn(&pg).await;
        assert!(
            confirmed < nacked_end,
            "confirmed_flush_lsn {confirmed} passed the nacked event's transaction ending at {nacked_end}"
        );
    }
    assert!(
        relay.log_text().contains("broker nacked"),
        "the event was not nacked:\n{}",
        relay.log_tail()
    );
    relay.kill9();
    let _ = pg
        .execute("SELECT pg_drop_replication_slot($1)", &[&observer])
        .await;
    fx.delete_queue(&full).await;
    fx.cleanup().await;
}

/// The consuming half (README, "Consuming in parallel"): the example
/// consumer with `--partitions 4` (a consistent-hash exchange on the
/// `aggregate_id` header, four single-active-consumer queues), two
/// processes of it, the active one killed (`kill -9`) midway. Every event
/// has exactly one effect, each aggregate's effects were applied from one
/// queue and in commit order, and more than one queue was used.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_partitioned_workers_apply_each_aggregate_in_order_across_a_worker_kill() {
    let fx = Fixture::with_config("chanpart", FOUR).await;
    let pg = pg_connect().await;
    prepare_consumer_tables(&pg).await;
    let args = ["--partitions", "4", "--exchange", fx.exchange.as_str()];
    let name = format!("part_{}", fx.name);
    let mut active = Consumer::start(&fx, &name, None, &args);
    // Its workers consume all four queues (declared and bound before)
    // before anything is written, so that it is the active consumer of
    // each.
    let passive = lapin::options::QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let mut consumed = 0;
    while consumed < 4 {
        consumed = 0;
        for i in 0..4 {
            let q = format!("{}.{i}", fx.queue);
            let ch = fx.amqp.create_channel().await.unwrap();
            if let Ok(q) = (ch.queue_declare(q.as_str().into(), passive, Default::default())).await
            {
                consumed += usize::from(q.consumer_count() == 1);
            }
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the consumer never consumed its four partitions"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let standby = Consumer::start(&fx, &name, None, &args);
    let relay = fx.spawn_relay();

    let sql = fx.insert_sql();
    let mut sent: Vec<(String, String, u32)> = Vec::new();
    let mut producer = pg_connect().await;
    for t in 0..120u32 {
        if t == 60 {
            // Midway, once it applied some, the active consumer dies: the
            // standby takes its queues over, the unacked messages first.
            let deadline = std::time::Instant::now() + Duration::from_secs(30);
            while active.counter("consumer_applied_total").await == 0 {
                assert!(
                    std::time::Instant::now() < deadline,
                    "the active consumer applied nothing; relay log:\n{}",
                    relay.log_tail()
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            active.child.kill().unwrap();
            active.child.wait().unwrap();
        }
        let tx = producer.transaction().await.unwrap();
        for k in 0..5u32 {
            let n = t * 5 + k;
            let agg = format!("p{}", n % 16);
            let row = tx
                .query_one(
                    &sql,
                    &[&"cart", &agg, &"item_added", &format!("{{\"n\": {n}}}")],
                )
                .await
                .unwrap();
            sent.push((row.get(0), agg, n));
        }
        tx.commit().await.unwrap();
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    let ids: Vec<&str> = sent.iter().map(|(id, _, _)| id.as_str()).collect();
    let deadline = std::time::Instant::now() + Duration::from_secs(90);
    let rows = loop {
        let rows = pg
            .query(
                "SELECT event_id, queue FROM consumer_effects WHERE event_id = ANY($1) ORDER BY seq",
                &[&ids],
            )
            .await
            .unwrap();
        if rows.len() >= ids.len() {
            break rows;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{} of {} events applied; relay log:\n{}",
            rows.len(),
            ids.len(),
            relay.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    // Settle: a late duplicate effect would show now.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let again: i64 = pg
        .query_one(
            "SELECT count(*) FROM consumer_effects WHERE event_id = ANY($1)",
            &[&ids],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(again as usize, ids.len(), "an event applied twice");

    let of: HashMap<&str, (&str, u32)> = (sent.iter())
        .map(|(id, agg, n)| (id.as_str(), (agg.as_str(), *n)))
        .collect();
    let mut last: HashMap<&str, (u32, String)> = HashMap::new();
    let mut queues = std::collections::HashSet::new();
    for r in &rows {
        let id: String = r.get(0);
        let queue: String = r.get(1);
        let (agg, n) = of[id.as_str()];
        queues.insert(queue.clone());
        if let Some((before, q)) = last.insert(agg, (n, queue.clone())) {
            assert!(
                before < n,
                "aggregate {agg}: event {n} applied after {before}"
            );
            assert_eq!(q, queue, "aggregate {agg} applied from two queues");
        }
    }
    assert!(
        queues.len() > 1,
        "every aggregate went to one queue: {queues:?}"
    );
    let took_over = standby.counter("consumer_applied_total").await;
    assert!(took_over > 0, "the standby applied nothing: no takeover");
    println!(
        "four partitions: {} events applied once each from {} queues, in commit order per aggregate; \
         the standby applied {took_over} and saw {} duplicates",
        ids.len(),
        queues.len(),
        standby.counter("consumer_duplicates_total").await
    );

    relay.stop_ok();
    drop(standby);
    let ch = fx.amqp.create_channel().await.unwrap();
    for i in 0..4 {
        let q = format!("{}.{i}", fx.queue);
        let _ = ch.queue_delete(q.as_str().into(), Default::default()).await;
    }
    let hash = format!("{}.partitions", fx.queue);
    let _ = ch
        .exchange_delete(hash.as_str().into(), Default::default())
        .await;
    fx.cleanup().await;
}
