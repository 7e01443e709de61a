//! End to end against real servers: concurrent producers, rollbacks, message
//! format, per-aggregate order, restart from the slot.

use crate::common;

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use common::*;
use lapin::types::AMQPValue;

/// Several connections commit transactions of several events concurrently;
/// some transactions roll back. Every committed event arrives exactly once
/// (no faults here), with the right properties, routing key and headers; no
/// rolled-back event arrives; per aggregate, deliveries follow commit order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_commits_arrive_once_rollbacks_never() {
    let mut fx = Fixture::new("concurrent").await;
    fx.start_consumer().await;
    let relay = fx.spawn_relay();

    const PRODUCERS: usize = 6;
    const TXS: usize = 40;
    const PER_TX: usize = 5;
    let mut tasks = Vec::new();
    for p in 0..PRODUCERS {
        let sql = fx.insert_sql();
        tasks.push(tokio::spawn(async move {
            let mut pg = pg_connect().await;
            let mut committed = Vec::new();
            let mut rolled_back = Vec::new();
            let mut seq = 0u32;
            for t in 0..TXS {
                let tx = pg.transaction().await.unwrap();
                let mut ids = Vec::new();
                for _ in 0..PER_TX {
                    // One aggregate per producer, so commit order per
                    // aggregate is this producer's order.
                    let payload =
                        serde_json::json!({"producer": p, "seq": seq, "pad": "x".repeat(50)});
                    let agg = format!("agg-{p}");
                    let row = tx
                        .query_one(&sql, &[&"order", &agg, &"created", &payload.to_string()])
                        .await
                        .unwrap();
                    ids.push((row.get::<_, String>(0), seq));
                    seq += 1;
                }
                if t % 7 == 3 {
                    tx.rollback().await.unwrap();
                    rolled_back.extend(ids.into_iter().map(|(id, _)| id));
                } else {
                    tx.commit().await.unwrap();
                    committed.extend(ids);
                }
            }
            (committed, rolled_back)
        }));
    }
    let mut committed = Vec::new();
    let mut rolled_back = HashSet::new();
    for t in tasks {
        let (c, r) = t.await.unwrap();
        committed.extend(c);
        rolled_back.extend(r);
    }
    assert!(!rolled_back.is_empty());
    let ids: Vec<String> = committed.iter().map(|(id, _)| id.clone()).collect();
    // Settle long enough for a stray rolled-back event to show up.
    let got = fx
        .collect_until(
            &ids,
            Duration::from_secs(60),
            Duration::from_secs(2),
            Some(&relay),
        )
        .await;

    let counts = count_by_id(&got);
    for id in &ids {
        assert_eq!(
            counts.get(id),
            Some(&1),
            "event {id} delivered {:?} times",
            counts.get(id)
        );
    }
    for id in counts.keys() {
        assert!(
            !rolled_back.contains(id),
            "rolled-back event {id} was published"
        );
    }
    assert_eq!(got.len(), ids.len(), "unexpected extra deliveries");

    let seq_of: HashMap<&String, u32> = committed.iter().map(|(id, s)| (id, *s)).collect();
    let mut last_seq: HashMap<String, u32> = HashMap::new();
    for r in &got {
        assert_eq!(r.exchange, fx.exchange);
        assert_eq!(r.routing_key, "order.created");
        let p = &r.properties;
        assert_eq!(p.kind().as_ref().unwrap().as_str(), "created");
        assert_eq!(
            p.content_type().as_ref().unwrap().as_str(),
            "application/json"
        );
        assert_eq!(*p.delivery_mode(), Some(2));
        let ts = p.timestamp().expect("timestamp");
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs();
        assert!(
            ts <= now && ts + 600 > now,
            "timestamp {ts} is not the commit time"
        );
        assert_eq!(r.header_str("aggregate_type").as_deref(), Some("order"));
        let agg = r.header_str("aggregate_id").unwrap();
        let body = r.json();
        assert_eq!(format!("agg-{}", body["producer"]), agg);
        let seq = body["seq"].as_u64().unwrap() as u32;
        assert_eq!(
            seq_of[&r.message_id()],
            seq,
            "body does not belong to its message_id"
        );
        if let Some(prev) = last_seq.insert(agg.clone(), seq) {
            assert!(
                prev < seq,
                "aggregate {agg}: seq {seq} delivered after {prev}"
            );
        }
    }
    let (status, out) = relay.sigterm();
    assert!(status.success(), "relay exit {status}");
    assert!(out.contains("final confirmed LSN"), "{out}");
    fx.cleanup().await;
}

/// The message as DESIGN.md specifies it, checked against the JSON Schema in
/// `schema/message.schema.json`, with user headers and a custom routing key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn published_message_matches_the_schema() {
    let mut fx = Fixture::with_config("schema", "").await;
    // Route on a column that is not a role, and on aggregate_id.
    let text = std::fs::read_to_string(&fx.config).unwrap().replace(
        "routing_key = \"{aggregate_type}.{event_type}\"",
        "routing_key = \"evt.{aggregate_id}.{event_type}\"",
    );
    std::fs::write(&fx.config, text).unwrap();
    fx.start_consumer().await;
    let relay = fx.spawn_relay();
    let pg = pg_connect().await;
    let id: String = pg
        .query_one(
            &format!(
                "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload, headers) VALUES \
                 ('invoice', 'inv-7', 'paid', '{{\"amount\": 12.5, \"currency\": \"EUR\"}}', \
                  '{{\"tenant\": \"acme\", \"priority\": 3, \"traced\": true}}') RETURNING id::text",
                fx.table
            ),
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let got = fx.expect_delivered(std::slice::from_ref(&id), &relay).await;
    let r = &got[0];
    assert_eq!(r.routing_key, "evt.inv-7.paid");
    assert_eq!(r.message_id(), id);
    // jsonb normalizes its text form; the body is that text, unchanged.
    assert_eq!(
        r.json(),
        serde_json::json!({"amount": 12.5, "currency": "EUR"})
    );
    assert_eq!(r.header_str("tenant").as_deref(), Some("acme"));
    assert_eq!(r.header("priority"), Some(AMQPValue::LongLongInt(3)));
    assert_eq!(r.header("traced"), Some(AMQPValue::Boolean(true)));

    let doc = message_document(r);
    let schema: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(repo_path("schema/message.schema.json")).unwrap(),
    )
    .unwrap();
    let validator = jsonschema::validator_for(&schema).expect("valid JSON Schema");
    let errors: Vec<String> = validator.iter_errors(&doc).map(|e| e.to_string()).collect();
    assert!(
        errors.is_empty(),
        "message does not match schema: {errors:?}\n{doc:#}"
    );
    // The schema must be able to fail: a message without message_id is refused.
    let mut broken = doc.clone();
    broken["properties"]
        .as_object_mut()
        .unwrap()
        .remove("message_id");
    assert!(
        !validator.is_valid(&broken),
        "schema accepts a message without message_id"
    );

    relay.sigterm();
    fx.cleanup().await;
}

/// The delivered message as the JSON document `schema/message.schema.json`
/// describes.
fn message_document(r: &Received) -> serde_json::Value {
    let p = &r.properties;
    let mut headers = serde_json::Map::new();
    for (k, v) in p.headers().as_ref().unwrap().inner() {
        let v = match v {
            AMQPValue::LongString(s) => serde_json::json!(String::from_utf8_lossy(s.as_bytes())),
            AMQPValue::Boolean(b) => serde_json::json!(b),
            AMQPValue::LongLongInt(i) => serde_json::json!(i),
            AMQPValue::Double(d) => serde_json::json!(d),
            AMQPValue::Void => serde_json::Value::Null,
            other => serde_json::json!(format!("{other:?}")),
        };
        headers.insert(k.to_string(), v);
    }
    serde_json::json!({
        "exchange": r.exchange,
        "routing_key": r.routing_key,
        "properties": {
            "message_id": p.message_id().as_ref().map(|s| s.to_string()),
            "type": p.kind().as_ref().map(|s| s.to_string()),
            "content_type": p.content_type().as_ref().map(|s| s.to_string()),
            "delivery_mode": p.delivery_mode(),
            "timestamp": p.timestamp(),
            "headers": headers,
        },
        "body": String::from_utf8_lossy(&r.body),
    })
}

/// A relay stopped with SIGTERM reports its final position: a new relay
/// started later sends only what was committed while none ran, each once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_restart_resumes_from_the_slot_without_duplicates() {
    let mut fx = Fixture::new("restart").await;
    fx.start_consumer().await;
    let pg = pg_connect().await;
    let relay = fx.spawn_relay();
    let first = fx
        .insert_many(&pg, 50, "user", |i| format!("u{i}"), "registered")
        .await;
    fx.expect_delivered(&first, &relay).await;
    relay.stop_ok();
    // It said goodbye: connection.close, answered, before the socket shut.
    assert_eq!(
        broker_logged_closes(&fx.slot),
        [true],
        "the broker did not log one clean close"
    );
    fx.wait_slot_inactive(&pg).await;

    let second = fx
        .insert_many(&pg, 50, "user", |i| format!("u{i}"), "renamed")
        .await;
    let relay = fx.spawn_relay();
    let got = fx
        .collect_until(
            &second,
            Duration::from_secs(30),
            Duration::from_secs(1),
            Some(&relay),
        )
        .await;
    let counts = count_by_id(&got);
    for id in &first {
        assert!(
            !counts.contains_key(id),
            "event {id} from before the restart was sent again"
        );
    }
    for id in &second {
        assert_eq!(counts.get(id), Some(&1), "event {id}");
    }
    relay.sigterm();
    fx.cleanup().await;
}

/// `ALTER TABLE` mid-stream: pgoutput sends a new Relation message and the
/// relay maps columns by name from it, without a restart. Dropping `headers`
/// shifts the columns after it; with a stale mapping, the relay would read
/// `created_at`'s text as the headers object and stop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schema_change_mid_stream_is_followed_without_a_restart() {
    let mut fx = Fixture::new("altertable").await;
    fx.start_consumer().await;
    let pg = pg_connect().await;
    let mut relay = fx.spawn_relay();
    let before = fx
        .insert(&pg, "doc", "d1", "v1", &serde_json::json!({"v": 1}))
        .await;
    fx.expect_delivered(std::slice::from_ref(&before), &relay)
        .await;

    pg.batch_execute(&format!("ALTER TABLE {} ADD COLUMN note text", fx.table))
        .await
        .unwrap();
    pg.batch_execute(&format!("ALTER TABLE {} DROP COLUMN headers", fx.table))
        .await
        .unwrap();
    let after: String = pg
        .query_one(
            &format!(
                "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload, note) \
                 VALUES ('doc', 'd1', 'v2', '{{\"v\": 2}}', 'hello') RETURNING id::text",
                fx.table
            ),
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let got = fx
        .expect_delivered(std::slice::from_ref(&after), &relay)
        .await;
    let r = &got[0];
    assert_eq!(r.routing_key, "doc.v2");
    assert_eq!(r.json(), serde_json::json!({"v": 2}));
    assert_eq!(r.header_str("aggregate_id").as_deref(), Some("d1"));
    assert!(r.header("source").is_none(), "headers column is gone");
    assert!(
        relay.is_running(),
        "relay restarted or stopped:\n{}",
        relay.log_tail()
    );
    let log = std::fs::read_to_string(&relay.log).unwrap();
    assert_eq!(
        log.matches("streaming from LSN").count(),
        1,
        "the relay reconnected:\n{log}"
    );
    relay.sigterm();
    fx.cleanup().await;
}

/// Bodies that span frames, and bodies at a frame's edge, arrive byte for
/// byte: with the default frame_max (131,072: 131,064 bytes of body per
/// frame) and with `frame_max=4096` in rabbitmq.url (4,088 per frame).
/// With 4096, a 3,000-byte header still fits and arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multi_frame_bodies_and_frame_edges_arrive_intact() {
    for frame_max in [131_072usize, 4096] {
        let mut fx = Fixture::new(&format!("frames{frame_max}")).await;
        fx.start_consumer().await;
        let pg = pg_connect().await;
        let url = format!("{}?frame_max={frame_max}", amqp_url());
        let relay = fx.spawn_relay_env(&[("OUTBOX_RELAY_RABBITMQ_URL", url.as_str())]);
        let per_frame = frame_max - 8;
        let sizes = [
            per_frame - 1,
            per_frame,
            per_frame + 1,
            2 * per_frame,
            3 * per_frame + 5,
            200_000,
        ];
        let mut want = HashMap::new();
        for (i, &size) in sizes.iter().enumerate() {
            // jsonb prints {"p": "..."}: 9 bytes around the string.
            let payload = serde_json::json!({"p": "x".repeat(size - 9)});
            let id = fx.insert(&pg, "f", &format!("s{i}"), "e", &payload).await;
            want.insert(id, size);
        }
        let big_header = "h".repeat(3000);
        let with_header: String = pg
            .query_one(
                &format!(
                    "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload, headers) \
                     VALUES ('f', 'h', 'e', '{{}}', jsonb_build_object('big', $1::text)) RETURNING id::text",
                    fx.table
                ),
                &[&big_header],
            )
            .await
            .unwrap()
            .get(0);
        let mut ids: Vec<String> = want.keys().cloned().collect();
        ids.push(with_header.clone());
        let got = fx.expect_delivered(&ids, &relay).await;
        for r in &got {
            let id = r.message_id();
            if id == with_header {
                assert_eq!(r.header_str("big").as_deref(), Some(big_header.as_str()));
                continue;
            }
            let size = want[&id];
            assert_eq!(r.body.len(), size, "frame_max {frame_max}: body of {id}");
            assert_eq!(&r.body[..7], b"{\"p\": \"");
            assert!(r.body[7..size - 2].iter().all(|&b| b == b'x'));
        }
        relay.stop_ok();
        fx.cleanup().await;
    }
}
