//! `outbox-relay prune`: deletes outbox rows that are older than the age
//! given and behind the last checkpoint, in batches; keeps (and reports)
//! older rows the checkpoint does not cover yet; a dry run deletes nothing;
//! the deletes never become messages.

use crate::common;

use std::time::Duration;

use common::*;

async fn rows(pg: &tokio_postgres::Client, fx: &Fixture) -> i64 {
    pg.query_one(&format!("SELECT count(*) FROM {}", fx.table), &[])
        .await
        .unwrap()
        .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prune_deletes_only_old_confirmed_rows_and_publishes_nothing() {
    let mut fx = Fixture::new("prune").await;
    // A checkpoint table of its own: prune weighs every slot's row.
    let checkpoint = format!("public.ckpt_{}", fx.name);
    let text = std::fs::read_to_string(&fx.config).unwrap().replace(
        "status_interval_ms = 200",
        &format!("status_interval_ms = 200\ncheckpoint_table = \"{checkpoint}\""),
    );
    std::fs::write(&fx.config, text).unwrap();
    assert!(fx.relay_cmd("setup").status().unwrap().success());
    // As `sql/role.sql` grants the relay's role the checkpoint table.
    if let Some(role) = &fx.relay_role {
        pg_connect()
            .await
            .batch_execute(&format!(
                "GRANT SELECT, INSERT, UPDATE ON {checkpoint} TO \"{}\"",
                role.name
            ))
            .await
            .unwrap();
    }
    fx.start_consumer().await;
    let pg = pg_connect().await;
    let relay = fx.spawn_relay();
    let ids = fx.insert_many(&pg, 20, "p", |i| format!("p{i}"), "e").await;
    fx.expect_delivered(&ids, &relay).await;
    // The checkpoint (written every 200 ms) covers them.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    relay.stop_ok();
    // Ten rows made old (an UPDATE, which the publication does not carry).
    pg.execute(
        &format!(
            "UPDATE {} SET created_at = now() - interval '2 days' WHERE id::text = ANY($1)",
            fx.table
        ),
        &[&ids[..10].to_vec()],
    )
    .await
    .unwrap();
    let set_commit = |age: &str| {
        format!(
            "UPDATE {checkpoint} SET last_commit_time = now() - interval '{age}' WHERE slot_name = '{}'",
            fx.slot
        )
    };

    // Another slot's recent row, and none for this relay's slot: nothing
    // is known of what this slot confirmed, so nothing is pruned.
    pg.execute(
        &format!("UPDATE {checkpoint} SET slot_name = 'another_slot' WHERE slot_name = $1"),
        &[&fx.slot],
    )
    .await
    .unwrap();
    let out = fx
        .relay_cmd("prune")
        .args(["--older-than", "1d"])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && said.contains("no confirmed position recorded"),
        "prune without this slot's checkpoint: {said}"
    );
    assert_eq!(rows(&pg, &fx).await, 20);
    pg.execute(
        &format!("UPDATE {checkpoint} SET slot_name = $1 WHERE slot_name = 'another_slot'"),
        &[&fx.slot],
    )
    .await
    .unwrap();

    // A checkpoint older than the rows: none of them is known confirmed.
    pg.execute(&set_commit("3 days"), &[]).await.unwrap();
    let out = fx.relay_ok("prune", &["--older-than", "1d"]);
    assert!(
        out.contains("deleted 0 rows") && out.contains("kept 10 older rows"),
        "{out}"
    );
    assert_eq!(rows(&pg, &fx).await, 20);

    // A recent checkpoint: the dry run counts, and deletes nothing.
    pg.execute(&set_commit("0 s"), &[]).await.unwrap();
    let out = fx.relay_ok("prune", &["--older-than", "1d", "--dry-run"]);
    assert!(out.contains("would delete 10 rows"), "{out}");
    assert_eq!(rows(&pg, &fx).await, 20);

    // For real, in batches of 3, with the relay streaming: the ten old rows
    // go, the others stay, and no message comes of it.
    let relay = fx.spawn_relay();
    fx.wait_slot_active(None, Duration::from_secs(30)).await;
    let out = fx.relay_ok("prune", &["--older-than", "1d", "--batch", "3"]);
    assert!(out.contains("deleted 10 rows"), "{out}");
    assert_eq!(rows(&pg, &fx).await, 10);
    // The ten young rows are the ones left, not any ten.
    let left: Vec<String> = pg
        .query(
            &format!("SELECT id::text FROM {} ORDER BY created_at, id", fx.table),
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let mut young = ids[10..].to_vec();
    young.sort();
    let mut left_sorted = left.clone();
    left_sorted.sort();
    assert_eq!(left_sorted, young, "prune deleted young rows");
    // The deletes never reach the stream because the publication carries
    // inserts only (the relay would also ignore a DELETE it was sent, so
    // the message check below alone could not tell).
    let publishes: (bool, bool, bool) = {
        let r = pg
            .query_one(
                "SELECT pubdelete, pubupdate, pubtruncate FROM pg_publication WHERE pubname = $1",
                &[&fx.publication],
            )
            .await
            .unwrap();
        (r.get(0), r.get(1), r.get(2))
    };
    assert_eq!(
        publishes,
        (false, false, false),
        "the publication carries deletes, updates or truncates"
    );
    let after = fx
        .insert(&pg, "p", "after", "e", &serde_json::json!({}))
        .await;
    let got = fx
        .collect_until(
            std::slice::from_ref(&after),
            Duration::from_secs(30),
            Duration::from_secs(1),
            Some(&relay),
        )
        .await;
    let others: Vec<String> = got
        .iter()
        .map(Received::message_id)
        .filter(|id| *id != after)
        .collect();
    assert!(others.is_empty(), "the prune was published: {others:?}");
    relay.stop_ok();
    fx.cleanup().await;
}
