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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_slot_is_recovered_from_the_checkpoint_without_losing_events() {
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
