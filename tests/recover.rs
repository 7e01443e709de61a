//! Recovery from LSN checkpoints: the relay records its checkpoint; when the
//! slot is really lost (invalidated by `max_slot_wal_keep_size`), `run`
//! refuses and says what to do, and `recover` recreates the slot and
//! re-publishes the rows written after the checkpoint. `republish` re-sends
//! chosen rows with the same message ids.
//!
//! Own binary: it changes a server-wide setting for a while.

mod common;

use std::time::Duration;

use common::*;

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
    let mut before = Vec::new();
    for i in 0..20 {
        before.push(
            fx.insert(
                &pg,
                "r",
                &format!("a{i}"),
                "e",
                &serde_json::json!({"i": i}),
            )
            .await,
        );
    }
    fx.collect_until(
        &before,
        Duration::from_secs(30),
        Duration::ZERO,
        Some(&relay),
    )
    .await;
    tokio::time::sleep(Duration::from_millis(1500)).await; // checkpoint written at most once a second
    relay.sigterm();

    let status = fx.relay_cmd("status").arg("--json").output().unwrap();
    let status: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert!(
        status["checkpoint"]["last_commit_time"].is_string(),
        "no checkpoint: {status}"
    );

    // While the relay is down: events it never sent, then the slot is lost.
    let mut while_down = Vec::new();
    for i in 0..30 {
        while_down.push(
            fx.insert(
                &pg,
                "r",
                &format!("b{i}"),
                "e",
                &serde_json::json!({"i": i}),
            )
            .await,
        );
    }
    lose_slot(&fx, &pg).await;

    let out = fx.relay_cmd("run").output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("lost") && err.contains("outbox-relay recover"),
        "{err}"
    );

    let dry = fx.relay_cmd("recover").arg("--dry-run").output().unwrap();
    assert!(
        dry.status.success(),
        "{}",
        String::from_utf8_lossy(&dry.stderr)
    );
    let text = String::from_utf8_lossy(&dry.stdout);
    assert!(text.contains("would re-publish"), "{text}");
    let wal_status: Option<String> = pg
        .query_one(
            "SELECT wal_status FROM pg_replication_slots WHERE slot_name = $1",
            &[&fx.slot],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        wal_status.as_deref(),
        Some("lost"),
        "dry run changed the slot"
    );

    let rec = fx.relay_cmd("recover").output().unwrap();
    assert!(
        rec.status.success(),
        "{}",
        String::from_utf8_lossy(&rec.stderr)
    );
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
    fx.collect_until(
        std::slice::from_ref(&after),
        Duration::from_secs(30),
        Duration::ZERO,
        Some(&relay),
    )
    .await;
    relay.sigterm();

    // republish --id: the same message id again.
    let again = &before[3];
    let out = fx
        .relay_cmd("republish")
        .args(["--id", again])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
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
    let out = fx
        .relay_cmd("republish")
        .args(["--since", &since])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
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
    fx.start_consumer().await;
    let pg = pg_connect().await;
    let relay = fx.spawn_relay();
    let first = fx.insert(&pg, "r", "a", "e", &serde_json::json!({})).await;
    fx.expect_delivered(&[first], &relay).await;
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
    let recorded: Option<f64> = pg
        .query_one(
            "SELECT longest_tx_secs FROM outbox_relay_checkpoint WHERE slot_name = $1",
            &[&fx.slot],
        )
        .await
        .unwrap()
        .get(0);
    assert!(
        recorded.is_some_and(|s| s >= 4.0),
        "longest transaction recorded: {recorded:?}"
    );
    // The slot is lost (dropped here): recover with a 1 s overlap.
    pg.execute("SELECT pg_drop_replication_slot($1)", &[&fx.slot])
        .await
        .unwrap();
    let rec = fx
        .relay_cmd("recover")
        .args(["--overlap-secs", "1"])
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&rec.stdout);
    assert!(
        rec.status.success(),
        "{out}{}",
        String::from_utf8_lossy(&rec.stderr)
    );
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

/// An undeliverable row (unroutable, no dead-letter exchange) stops
/// `recover` half way, after its slot was made; the rows before it are not
/// sent again, and `run` finishes the recovery before it streams.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_finishes_a_recovery_an_undeliverable_row_stopped() {
    let _serial = SERIAL.lock().await;
    let mut fx = Fixture::new("recover_resume").await;
    fx.start_consumer().await;
    let pg = pg_connect().await;
    let relay = fx.spawn_relay();
    let warm = fx.insert(&pg, "ok", "w", "e", &serde_json::json!({})).await;
    fx.expect_delivered(&[warm], &relay).await;
    tokio::time::sleep(Duration::from_millis(1500)).await; // the checkpoint
    relay.stop_ok();
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
    pg.execute("SELECT pg_drop_replication_slot($1)", &[&fx.slot])
        .await
        .unwrap();
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
    let done: Option<i64> = pg
        .query_one(
            "SELECT recovery_done FROM outbox_relay_checkpoint WHERE slot_name = $1",
            &[&fx.slot],
        )
        .await
        .unwrap()
        .get(0);
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
    let pending: Option<String> = pg
        .query_one(
            "SELECT recovery_since::text FROM outbox_relay_checkpoint WHERE slot_name = $1",
            &[&fx.slot],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(pending, None, "the recovery is still recorded");
    fx.cleanup().await;
}

/// Makes the slot's WAL go away: a tiny `max_slot_wal_keep_size`, WAL written
/// past it, checkpoints. Restores the setting afterwards.
async fn lose_slot(fx: &Fixture, pg: &tokio_postgres::Client) {
    // One statement per call: ALTER SYSTEM refuses to run in the implicit
    // transaction of a multi-statement query.
    for sql in [
        "ALTER SYSTEM SET max_slot_wal_keep_size = '1MB'",
        "SELECT pg_reload_conf()",
    ] {
        pg.batch_execute(sql).await.unwrap();
    }
    let noise = fx.scoped("noise");
    pg.batch_execute(&format!("CREATE TABLE {noise} (pad text)"))
        .await
        .unwrap();
    let mut lost = false;
    for _ in 0..40 {
        for sql in [
            format!(
                "INSERT INTO {noise} SELECT repeat(md5(g::text), 30) FROM generate_series(1, 20000) g"
            ),
            "SELECT pg_switch_wal()".to_owned(),
            "CHECKPOINT".to_owned(),
        ] {
            pg.batch_execute(&sql).await.unwrap();
        }
        let s: Option<String> = pg
            .query_one(
                "SELECT wal_status FROM pg_replication_slots WHERE slot_name = $1",
                &[&fx.slot],
            )
            .await
            .unwrap()
            .get(0);
        if s.as_deref() == Some("lost") {
            lost = true;
            break;
        }
    }
    for sql in [
        "ALTER SYSTEM RESET max_slot_wal_keep_size".to_owned(),
        "SELECT pg_reload_conf()".to_owned(),
        format!("DROP TABLE {noise}"),
    ] {
        pg.batch_execute(&sql).await.unwrap();
    }
    assert!(lost, "could not invalidate the slot");
}
