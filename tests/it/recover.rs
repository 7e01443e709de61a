//! Recovery from LSN checkpoints: the relay records its checkpoint; when the
//! slot is really lost (invalidated by `max_slot_wal_keep_size`), `run`
//! refuses and says what to do, and `recover` recreates the slot and
//! re-publishes the rows written after the checkpoint. `republish` re-sends
//! chosen rows with the same message ids.
//!
//! Own binary: it changes a server-wide setting for a while.

use crate::common;
mod natural_end;
mod partitioned;
mod support;
mod text_forms;

use std::time::Duration;

use common::*;
use support::*;

/// One test at a time: losing a slot (a tiny server-wide
/// `max_slot_wal_keep_size`) would invalidate the others' slots too.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_slot_is_recovered_from_the_checkpoint_without_losing_events() {
    let _serial = SERIAL.lock().await;
    let mut fx = Fixture::new("recover").await;
    fx.start_consumer().await;
    let pg = pg_connect().await;
    let relay = fx.spawn_relay();
    let before = fx.insert_many(&pg, 20, "r", |i| format!("a{i}"), "e").await;
    fx.expect_delivered(&before, &relay).await;
    tokio::time::sleep(Duration::from_millis(1500)).await; // checkpoint written at most once a second
    relay.sigterm();

    let status = fx.relay_cmd("status").arg("--json").output().unwrap();
    let status: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert!(
        status["checkpoint"]["last_commit_time"].is_string(),
        "no checkpoint: {status}"
    );

    // While the relay is down: events it never sent, then the slot is lost.
    let while_down = fx.insert_many(&pg, 30, "r", |i| format!("b{i}"), "e").await;
    lose_slot(&fx, &pg).await;

    let out = fx.relay_cmd("run").output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("lost") && err.contains("outbox-relay recover"),
        "{err}"
    );

    let text = fx.relay_ok("recover", &["--dry-run"]);
    assert!(text.contains("would re-publish"), "{text}");
    let wal_status = wal_status(&fx, &pg).await;
    assert_eq!(
        wal_status.as_deref(),
        Some("lost"),
        "dry run changed the slot"
    );

    fx.relay_ok("recover", &[]);
    let got = fx
        .collect_until(
            &while_down,
            Duration::from_secs(30),
            Duration::from_millis(500),
            None,
        )
        .await;
    let counts = count_by_id(&got);
    for id in &while_down {
        assert!(
            counts.contains_key(id),
            "event {id} written while the slot was lost never arrived"
        );
    }

    // The recreated slot streams new events.
    let relay = fx.spawn_relay();
    let after = fx.insert(&pg, "r", "c1", "e", &serde_json::json!({})).await;
    fx.expect_delivered(std::slice::from_ref(&after), &relay)
        .await;
    relay.sigterm();

    // republish --id: the same message id again.
    let again = &before[3];
    fx.relay_ok("republish", &["--id", again]);
    let got = fx
        .collect_until(
            std::slice::from_ref(again),
            Duration::from_secs(30),
            Duration::from_millis(300),
            None,
        )
        .await;
    assert_eq!(got.len(), 1, "republish --id sent {} messages", got.len());
    assert_eq!(got[0].json(), serde_json::json!({"i": 3}));

    // republish --since: everything created since a time.
    let since: String = pg
        .query_one(
            "SELECT to_char(now() - interval '1 hour', 'YYYY-MM-DD\"T\"HH24:MI:SSOF')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    fx.relay_ok("republish", &["--since", &since]);
    let all: Vec<String> = before
        .iter()
        .chain(&while_down)
        .cloned()
        .chain([after])
        .collect();
    fx.collect_until(&all, Duration::from_secs(30), Duration::ZERO, None)
        .await;
    fx.cleanup().await;
}

/// A row whose transaction stayed open longer than the overlap, and
/// committed after the last checkpoint, carries a `created_at` before the
/// window `--overlap-secs` alone would give. The relay measured that
/// transaction while it was open, and `recover` widens the window to cover
/// it (track_commit_timestamp is off on the test server).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_transaction_committed_after_the_checkpoint_is_recovered() {
    let _serial = SERIAL.lock().await;
    let mut fx = Fixture::new("recover_long").await;
    let (pg, relay) = fx.streaming().await;
    // The long transaction: its row's created_at is its start.
    let mut long_pg = pg_connect().await;
    let long_tx = long_pg.transaction().await.unwrap();
    let long_id: String = long_tx
        .query_one(&fx.insert_sql(), &[&"r", &"long", &"e", &"{}"])
        .await
        .unwrap()
        .get(0);
    // Open across two of the relay's samples (every 5 s), while the stream
    // moves on and the checkpoint follows it.
    tokio::time::sleep(Duration::from_secs(7)).await;
    let later = fx.insert(&pg, "r", "b", "e", &serde_json::json!({})).await;
    fx.expect_delivered(&[later], &relay).await;
    tokio::time::sleep(Duration::from_millis(3000)).await;
    relay.kill9();
    long_tx.commit().await.unwrap();
    let recorded: Option<f64> = fx.checkpoint_column(&pg, "longest_tx_secs").await;
    assert!(
        recorded.is_some_and(|s| s >= 4.0),
        "longest transaction recorded: {recorded:?}"
    );
    // The slot is lost (dropped here): recover with a 1 s overlap.
    fx.drop_slot(&pg).await;
    let out = fx.relay_ok("recover", &["--overlap-secs", "1"]);
    // The window was widened by what was measured, not by the margin alone.
    let measured: f64 = out
        .split("longest transaction seen, ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no measured transaction in: {out}"));
    assert!(measured >= 5.0, "measured {measured} s: {out}");
    fx.collect_until(&[long_id], Duration::from_secs(30), Duration::ZERO, None)
        .await;
    fx.cleanup().await;
}

/// An idle server has no open transaction: the relay does not take its
/// unchanging snapshot horizon (no id handed out meanwhile) for a
/// transaction that stays open, which would widen every later recovery's
/// window by the whole idle time. (Other tests writing meanwhile can only
/// hide the fault, never fake it.) A transaction that is open, though no
/// session's `xact_start` shows it (prepared) and no snapshot lists it (the
/// newest), is measured.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_server_is_no_long_transaction_a_prepared_one_is() {
    let _serial = SERIAL.lock().await;
    let mut fx = Fixture::new("recover_idle").await;
    let (pg, relay) = fx.streaming().await;
    // Idle across two of the relay's samples (every 5 s): the second saw
    // the same horizon 5 s after the first.
    tokio::time::sleep(Duration::from_secs(12)).await;
    let recorded: Option<f64> = fx.checkpoint_column(&pg, "longest_tx_secs").await;
    assert!(
        recorded.unwrap_or(0.0) < 4.0,
        "an idle server measured as a transaction open {recorded:?} s"
    );
    // A prepared transaction (in no session's xact_start), the newest and
    // only one open (in no snapshot's list of running ones), is measured.
    let gid = fx.scoped("idle_gid");
    pg.batch_execute(&format!(
        "BEGIN; INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload) \
         VALUES ('r', 'p', 'e', '{{}}'); PREPARE TRANSACTION '{gid}'",
        fx.table
    ))
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_secs(12)).await;
    let recorded: Option<f64> = fx.checkpoint_column(&pg, "longest_tx_secs").await;
    pg.batch_execute(&format!("COMMIT PREPARED '{gid}'"))
        .await
        .unwrap();
    relay.stop_ok();
    assert!(
        recorded.is_some_and(|s| s >= 4.0),
        "a prepared transaction open 12 s measured as {recorded:?} s"
    );
    fx.cleanup().await;
}

/// An undeliverable row (unroutable, no dead-letter exchange) stops
/// `recover` half way, after its slot was made; the rows before it are not
/// sent again, and `run` finishes the recovery before it streams.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_finishes_a_recovery_an_undeliverable_row_stopped() {
    let _serial = SERIAL.lock().await;
    let mut fx = Fixture::new("recover_resume").await;
    let pg = fx.checkpointed().await;
    let mut before_bad = Vec::new();
    for i in 0..10 {
        before_bad.push(
            fx.insert(&pg, "ok", &format!("a{i}"), "e", &serde_json::json!({}))
                .await,
        );
    }
    let bad = fx
        .insert(&pg, "bad", "x", "e", &serde_json::json!({}))
        .await;
    let mut after_bad = Vec::new();
    for i in 0..10 {
        after_bad.push(
            fx.insert(&pg, "ok", &format!("b{i}"), "e", &serde_json::json!({}))
                .await,
        );
    }
    fx.drop_slot(&pg).await;
    fx.rebind_queue("ok.#").await;
    let rec = fx.relay_cmd("recover").output().unwrap();
    let err = String::from_utf8_lossy(&rec.stderr);
    assert_eq!(rec.status.code(), Some(1), "{err}");
    assert!(err.contains(&bad) && err.contains("unroutable"), "{err}");
    let got = fx
        .collect_until(
            &before_bad,
            Duration::from_secs(30),
            Duration::from_millis(300),
            None,
        )
        .await;
    let first_pass = count_by_id(&got);
    let done: Option<i64> = fx.checkpoint_column(&pg, "recovery_done").await;
    assert!(done.is_some_and(|d| d >= 10), "recorded progress {done:?}");

    // Routable again: `run` finishes the recovery, then streams.
    fx.rebind_queue("#").await;
    let relay = fx.spawn_relay();
    let new = fx.insert(&pg, "ok", "n", "e", &serde_json::json!({})).await;
    let mut rest = after_bad.clone();
    rest.push(bad.clone());
    rest.push(new);
    let got = fx.expect_delivered(&rest, &relay).await;
    let second_pass = count_by_id(&got);
    for id in &before_bad {
        assert_eq!(
            first_pass.get(id).copied().unwrap_or(0) + second_pass.get(id).copied().unwrap_or(0),
            1,
            "row {id}, confirmed before the stop, was sent again"
        );
    }
    relay.stop_ok();
    let pending: Option<String> = fx.checkpoint_column(&pg, "recovery_since::text").await;
    assert_eq!(pending, None, "the recovery is still recorded");
    fx.cleanup().await;
}

/// A transaction's events are re-published in the order they were
/// written, whatever their ids: one aggregate's five events, in one
/// transaction, with ids that sort backwards. (Ordered by id, a recovery
/// would send them backwards: per-aggregate order broken.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_is_re_published_in_the_order_it_was_written() {
    let _serial = SERIAL.lock().await;
    let mut fx = Fixture::new("recover_order").await;
    let pg = fx.checkpointed().await;
    let ids: Vec<String> = (1..=5)
        .rev()
        .map(|i| format!("00000000-0000-0000-0000-00000000000{i}"))
        .collect();
    let values: Vec<String> = ids
        .iter()
        .enumerate()
        .map(|(seq, id)| format!("('{id}', 'order', 'o1', 'e', '{{\"seq\": {seq}}}')"))
        .collect();
    pg.batch_execute(&format!(
        "BEGIN; {} COMMIT;",
        values
            .iter()
            .map(|v| format!(
                "INSERT INTO {} (id, aggregate_type, aggregate_id, event_type, payload) VALUES {v};",
                fx.table
            ))
            .collect::<String>()
    ))
    .await
    .unwrap();
    fx.drop_slot(&pg).await;
    fx.relay_ok("recover", &[]);
    let got = fx
        .collect_until(
            &ids,
            Duration::from_secs(30),
            Duration::from_millis(300),
            None,
        )
        .await;
    let order: Vec<u64> = got
        .iter()
        .filter(|r| ids.contains(&r.message_id()))
        .map(|r| r.json()["seq"].as_u64().unwrap())
        .collect();
    assert_eq!(order, [0, 1, 2, 3, 4], "re-published out of written order");
    fx.cleanup().await;
}

/// A recovery recorded while a relay streams (another relay re-publishing
/// after a failover, or `outbox-relay recover`): the relay's next session
/// does not stream past it, it finishes the recovery first (streaming
/// first would deliver newer events before the re-published older ones).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_finishes_a_recovery_recorded_meanwhile_before_streaming() {
    let _serial = SERIAL.lock().await;
    let mut fx = Fixture::new("rec_meanwhile").await;
    fx.start_consumer().await;
    let pg = pg_connect().await;
    let relay = fx.spawn_relay();
    let old = fx.insert(&pg, "ok", "a", "e", &serde_json::json!({})).await;
    let mut got = fx
        .expect_delivered(std::slice::from_ref(&old), &relay)
        .await;
    tokio::time::sleep(Duration::from_millis(1500)).await; // the checkpoint row
    let n = pg
        .execute(
            "UPDATE outbox_relay_checkpoint SET recovery_since = now() - interval '1 hour', \
             recovery_after_created = NULL, recovery_after_id = NULL, recovery_done = 0 \
             WHERE slot_name = $1",
            &[&fx.slot],
        )
        .await
        .unwrap();
    assert_eq!(n, 1, "no checkpoint row for the slot");
    fx.terminate_walsender(&pg).await.expect("a walsender");
    assert!(
        relay
            .wait_log("recovery complete", Duration::from_secs(30))
            .await,
        "the next session streamed past the recorded recovery:\n{}",
        relay.log_tail()
    );
    let new = fx.insert(&pg, "ok", "a", "e", &serde_json::json!({})).await;
    got.extend(
        fx.collect_until(
            &[old.clone(), new.clone()],
            Duration::from_secs(30),
            Duration::from_secs(1),
            Some(&relay),
        )
        .await,
    );
    let counts = count_by_id(&got);
    assert_eq!(counts[&old], 2, "re-published by the recovery");
    // Streaming resumed after it, in order: the old event's second copy
    // before the new one.
    let pos = |id: &String| got.iter().rposition(|r| &r.message_id() == id).unwrap();
    assert!(pos(&old) < pos(&new));
    assert!(relay.log_text().contains("a recovery is under way"));
    relay.stop_ok();
    fx.cleanup().await;
}

/// Physical order is not written order: a transaction's rows can land in
/// space VACUUM freed before rows it wrote earlier (here a large first row
/// takes the last page, the small ones fill it and then go back to page 0).
/// Re-read in `(created_at, ctid)` order they come out of order; with the
/// table's identity column as `outbox.sequence`, in the order written.
/// (Found by tests/it/ha.rs: a recovery after a failover sent seq 72 before
/// seq 71 of one transaction.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sequence_column_keeps_a_transaction_s_rows_in_written_order() {
    // VACUUM must free space: no other test's transaction may hold it back.
    let _serial = SERIAL.lock().await;
    let ddl = std::fs::read_to_string(repo_path("sql/outbox.sql"))
        .unwrap()
        .replace("CREATE TABLE outbox", "CREATE TABLE {table}")
        + "; ALTER TABLE {table} ADD COLUMN seq bigint GENERATED ALWAYS AS IDENTITY";
    let mut fx = Fixture::with_ddl("recover_seq", "", &ddl).await;
    fx.start_consumer().await;
    let pg = pg_connect().await;
    let t = fx.table.clone();
    let t = &t;
    let insert = |agg: &str, pad: usize, range: &str| {
        format!(
            "INSERT INTO {t} (aggregate_type, aggregate_id, event_type, payload) \
             SELECT 'order', '{agg}', 'e', jsonb_build_object('seq', i, 'pad', repeat('x', {pad})) \
             FROM generate_series({range}) i;"
        )
    };
    pg.batch_execute(&insert("filler", 300, "1, 100"))
        .await
        .unwrap();
    pg.batch_execute(&format!(
        "DELETE FROM {t} WHERE ctid = ANY('{{\"(0,1)\",\"(0,2)\"}}'::tid[])"
    ))
    .await
    .unwrap();
    pg.batch_execute(&format!("VACUUM (INDEX_CLEANUP ON) {t}"))
        .await
        .unwrap();
    // One transaction, on a fresh connection: seq 1 large, 2..=40 small.
    let writer = pg_connect().await;
    writer
        .batch_execute(&format!(
            "BEGIN; {} {} COMMIT;",
            insert("o", 1500, "1, 1"),
            insert("o", 200, "2, 40")
        ))
        .await
        .unwrap();
    let physical: Vec<i64> = pg
        .query(
            &format!(
                "SELECT (payload->>'seq')::int8 FROM {t} WHERE aggregate_id = 'o' ORDER BY ctid"
            ),
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let written: Vec<i64> = (1..=40).collect();
    assert_ne!(
        physical, written,
        "set-up: the heap kept written order this time"
    );

    let ids: Vec<String> = pg
        .query(
            &format!("SELECT id::text FROM {t} WHERE aggregate_id = 'o'"),
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let republished = |fx: &Fixture| fx.relay_ok("republish", &["--since", "2000-01-01"]);
    let seqs = |got: &[Received]| -> Vec<i64> {
        got.iter()
            .filter(|r| r.header_str("aggregate_id").as_deref() == Some("o"))
            .map(|r| r.json()["seq"].as_i64().unwrap())
            .collect()
    };
    // Without the key: physical order.
    republished(&fx);
    let got = fx
        .collect_until(
            &ids,
            Duration::from_secs(30),
            Duration::from_millis(300),
            None,
        )
        .await;
    assert_eq!(seqs(&got), physical, "(created_at, ctid) order");

    // A key that is not a NOT NULL integer is refused by check, naming it.
    let text = std::fs::read_to_string(&fx.config).unwrap();
    let with = |col: &str| {
        text.replace(
            &format!("table = \"public.{t}\""),
            &format!("table = \"public.{t}\"\nsequence = \"{col}\""),
        )
    };
    std::fs::write(&fx.config, with("aggregate_id")).unwrap();
    let check = fx.relay_cmd("check").output().unwrap();
    let said = String::from_utf8_lossy(&check.stdout);
    assert!(
        !check.status.success() && said.contains("outbox.sequence"),
        "{said}"
    );

    // With it: written order.
    std::fs::write(&fx.config, with("seq")).unwrap();
    let check = fx.relay_cmd("check").output().unwrap();
    assert!(
        check.status.success(),
        "{}",
        String::from_utf8_lossy(&check.stdout)
    );
    republished(&fx);
    let got = fx
        .collect_until(
            &ids,
            Duration::from_secs(30),
            Duration::from_millis(300),
            None,
        )
        .await;
    assert_eq!(seqs(&got), written, "sequence order");
    fx.cleanup().await;
}
