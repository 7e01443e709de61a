//! PostgreSQL 17's failover slots, for real: a primary and a physical
//! standby (`servers.sh pgha`, which on 17+ sets the standby's
//! `sync_replication_slots`, `hot_standby_feedback` and `dbname` in
//! `primary_conninfo`), the relay given both hosts. The primary names the
//! standby's slot in `synchronized_standby_slots`, so nothing is decoded
//! that the standby does not have. The primary crashes under load; once
//! the standby is promoted the relay streams on from the synchronized copy
//! of its slot: no recovery, nothing lost (table-less events included),
//! nothing delivered that the new primary lacks. On 15 and 16 there is no
//! such slot to test (`ha.rs` covers their recovery instead).

use crate::common;
use crate::ha::{
    failover_fixture, fence_read_only, harness_async, log_lines, pgha, producer_spec, tails,
    wait_streaming_again,
};

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::*;

/// `check`'s line on the standby (the URL's other host).
fn check_standby_line(fx: &Fixture) -> String {
    let out = fx.relay_cmd("check").output().unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    said.lines()
        .find(|l| {
            l.split_once(' ')
                .is_some_and(|(_, what)| what.starts_with("standby "))
        })
        .unwrap_or_else(|| panic!("check names no standby:\n{said}"))
        .to_owned()
}

/// Table-less events, one a transaction, each with a row in `log` (not
/// published) in the same transaction, so that the new primary says
/// which ones it has. Runs until `stop`; returns the ids whose COMMIT
/// returned (some may have been lost with the primary).
async fn emit_messages(
    url: String,
    prefix: String,
    log: String,
    stop: Arc<AtomicBool>,
) -> Vec<String> {
    let mut committed = Vec::new();
    let mut pg = pg_connect_retry_to(&url).await;
    let mut n = 0;
    while !stop.load(Ordering::Relaxed) {
        n += 1;
        let id = format!("fs-msg-{n}-{}", std::process::id());
        let content = serde_json::json!({
            "id": id, "aggregate_type": "order", "aggregate_id": format!("m{}", n % 3),
            "event_type": "placed", "payload": {"n": n},
        });
        let sql = format!(
            "BEGIN; INSERT INTO {log} VALUES ('{id}'); \
             SELECT pg_logical_emit_message(true, '{prefix}', '{content}'); COMMIT"
        );
        match pg.batch_execute(&sql).await {
            Ok(()) => committed.push(id),
            Err(_) => {
                // The primary went: carry on on whichever server accepts
                // writes (the URL lists both, read-write only).
                tokio::time::sleep(Duration::from_millis(200)).await;
                pg = pg_connect_retry_to(&url).await;
            }
        }
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    committed
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_promoted_standby_streams_on_from_the_synchronized_slot() {
    let major = server_major().await;
    if major < 17 {
        eprintln!("PostgreSQL {major} has no failover slots: tests/it/ha.rs covers its failover");
        return;
    }
    let started = Instant::now();
    let name = format!("fs{}", std::process::id());
    let (mut fx, env) = failover_fixture(&name, "", false).await;
    let primary = pg_connect_retry_to(&env["TEST_PGHA_PRIMARY_URL"]).await;
    // `setup` (run by the fixture) made a failover slot.
    let failover: bool = primary
        .query_one(
            "SELECT failover FROM pg_replication_slots WHERE slot_name = $1",
            &[&fx.slot],
        )
        .await
        .unwrap()
        .get(0);
    assert!(
        failover,
        "setup on PostgreSQL {major} made a slot without failover"
    );
    // Before the primary guards the standby's slot: check says so, read
    // from both servers.
    let standby = check_standby_line(&fx);
    assert!(
        standby.starts_with("warn ") && standby.contains("synchronized_standby_slots"),
        "{standby}"
    );
    // One statement each: ALTER SYSTEM refuses a multi-statement string
    // (an implicit transaction block).
    for sql in [
        "ALTER SYSTEM SET synchronized_standby_slots = 'pgha_standby'",
        "SELECT pg_reload_conf()",
    ] {
        primary.batch_execute(sql).await.unwrap();
    }
    // A table-less outbox next to the table.
    let prefix = fx.scoped("fsmsg");
    let log = format!("{}_msglog", fx.table);
    primary
        .batch_execute(&format!("CREATE TABLE {log} (id text PRIMARY KEY)"))
        .await
        .unwrap();
    let single = format!("[outbox]\ntable = \"public.{}\"\n", fx.table);
    let text = std::fs::read_to_string(&fx.config).unwrap();
    assert!(text.contains(&single), "{text}");
    let text = text.replace(
        &single,
        &format!(
            "[[outbox]]\ntable = \"public.{}\"\n\n[[outbox]]\nsource = \"message\"\nprefix = \"{prefix}\"\n",
            fx.table
        ),
    );
    std::fs::write(&fx.config, text).unwrap();
    fx.relay_ok("setup", &[]);
    drop(primary);

    fx.start_reconnecting_consumer().await;
    let relays = vec![fx.spawn_relay()];
    let load = Load::start(&fx, [producer_spec("fs")]);
    let stop = Arc::new(AtomicBool::new(false));
    let emitter = tokio::spawn(emit_messages(
        fx.pg_url.clone(),
        prefix.clone(),
        log.clone(),
        Arc::clone(&stop),
    ));
    let mut all = Vec::new();
    fx.wait_deliveries(&mut all, 50, Duration::from_secs(60), Some(&relays[0]))
        .await;
    let ctl = |what: &str| pgha(&name, what);
    // The standby's copy of the slot is ready to take over.
    harness_async(ctl(&format!("synced {}", fx.slot))).await;
    harness_async(ctl("catchup")).await;
    // `check` reads the standby's own settings and its copy of the slot.
    let standby = check_standby_line(&fx);
    assert!(
        standby.starts_with("ok ") && standby.contains("ready for a promotion"),
        "{standby}"
    );

    let before = log_lines(&relays, "streaming from LSN").len();
    let t0 = Instant::now();
    harness_async(ctl("kill primary")).await;
    harness_async(ctl("promote")).await;
    let secs = wait_streaming_again(&relays, before, |_| true, t0).await;
    let lost = log_lines(&relays, "replication slot lost");
    assert!(
        lost.is_empty(),
        "the synchronized slot was not used:\n{}",
        tails(&relays)
    );
    // Keep producing on the new primary for a while.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let report = load.stop_one().await;
    stop.store(true, Ordering::Relaxed);
    let emitted = emitter.await.unwrap();

    // What the new primary has is the truth: rows and logged messages.
    let pg = pg_connect_retry_to(&env["TEST_PGHA_STANDBY_URL"]).await;
    let mut ids: Vec<String> = Vec::new();
    for q in [
        format!("SELECT id::text FROM {}", fx.table),
        format!("SELECT id FROM {log}"),
    ] {
        ids.extend(
            pg.query(&q, &[])
                .await
                .unwrap()
                .iter()
                .map(|r| r.get::<_, String>(0)),
        );
    }
    let messages_there = emitted.iter().filter(|id| ids.contains(id)).count();
    assert!(
        messages_there > 0,
        "no table-less event reached the new primary"
    );
    fx.collect_rest(
        &mut all,
        &ids,
        Duration::from_secs(90),
        Duration::from_secs(2),
        Some(&relays[0]),
    )
    .await;
    let have: HashSet<&String> = ids.iter().collect();
    let counts = count_by_id(&all);
    for id in &report.rolled_back {
        assert!(!counts.contains_key(id), "rolled-back event {id} delivered");
    }
    // synchronized_standby_slots: nothing the standby lacked was decoded.
    let ghosts: Vec<&String> = counts.keys().filter(|id| !have.contains(id)).collect();
    assert!(
        ghosts.is_empty(),
        "delivered, but not on the promoted standby: {ghosts:?}"
    );
    let duplicates: usize = counts.values().map(|n| n - 1).sum();
    let lost_with_primary = report
        .committed
        .iter()
        .filter(|e| !have.contains(&e.id))
        .count()
        + emitted.iter().filter(|id| !have.contains(id)).count();
    println!(
        "PostgreSQL {major} failover slot: streaming again {secs:.1}s after the primary crashed \
         (promotion included); {} rows and table-less events on the new primary ({messages_there} \
         table-less) all delivered, {} deliveries, {duplicates} duplicates, no recovery; \
         {lost_with_primary} commits never reached the standby, none delivered; test wall time {:.1}s",
        ids.len(),
        all.len(),
        started.elapsed().as_secs_f64()
    );
    for r in relays {
        r.stop_ok();
    }
    fx.cleanup().await;
    harness_async(ctl("down")).await;
}

/// A slot that is not a failover slot (made on 16 and upgraded, or by
/// hand) is made one in place by `setup` (ALTER_REPLICATION_SLOT), keeping
/// its position: an event written meanwhile still arrives. While a relay
/// streams from it, `setup` leaves it and says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setup_makes_an_existing_slot_a_failover_slot_in_place() {
    let major = server_major().await;
    if major < 17 {
        eprintln!("PostgreSQL {major} has no failover slots");
        return;
    }
    let mut fx = Fixture::new("tofailover").await;
    let pg = pg_connect().await;
    let is_failover = async |pg: &tokio_postgres::Client, slot: &str| -> bool {
        pg.query_one(
            "SELECT failover FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .unwrap()
        .get(0)
    };
    fx.drop_slot(&pg).await;
    pg.execute(
        "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
        &[&fx.slot],
    )
    .await
    .unwrap();
    assert!(!is_failover(&pg, &fx.slot).await);

    fx.start_consumer().await;
    let relay = fx.spawn_relay();
    fx.wait_slot_active(None, Duration::from_secs(30))
        .await
        .expect("the relay streams");
    let said = fx.relay_ok("setup", &[]);
    assert!(said.contains("not a failover slot, in use"), "{said}");
    assert!(!is_failover(&pg, &fx.slot).await);
    relay.stop_ok();
    let deadline = Instant::now() + Duration::from_secs(30);
    while fx.slot_active_pid(&pg).await.is_some() {
        assert!(Instant::now() < deadline, "the walsender stayed");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let meanwhile = fx
        .insert(&pg, "order", "a", "placed", &serde_json::json!({}))
        .await;
    let said = fx.relay_ok("setup", &[]);
    assert!(said.contains("made a failover slot"), "{said}");
    assert!(is_failover(&pg, &fx.slot).await);
    let relay = fx.spawn_relay();
    fx.expect_delivered(std::slice::from_ref(&meanwhile), &relay)
        .await;
    relay.stop_ok();
    fx.cleanup().await;
}

/// A primary fenced read only (`default_transaction_read_only`) after its
/// standby was promoted, and listed first in `postgres.url`: `setup` makes
/// the new primary's slot a failover slot, not the fenced one's (the
/// replication connection passes over a read-only host, as the SQL
/// connection does).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setup_passes_over_a_primary_fenced_read_only() {
    let major = server_major().await;
    if major < 17 {
        eprintln!("PostgreSQL {major} has no failover slots");
        return;
    }
    let name = format!("fence{}", std::process::id());
    let (fx, env) = failover_fixture(&name, "", false).await;
    harness_async(pgha(&name, "promote")).await;
    fence_read_only(&env["TEST_PGHA_PRIMARY_URL"]).await;
    // The new primary's slot, not a failover slot (as made on 16).
    let new = pg_connect_retry_to(&env["TEST_PGHA_STANDBY_URL"]).await;
    new.execute(
        "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots \
         WHERE slot_name = $1",
        &[&fx.slot],
    )
    .await
    .unwrap();
    new.execute(
        "SELECT pg_create_logical_replication_slot($1, 'pgoutput', false, false, false)",
        &[&fx.slot],
    )
    .await
    .unwrap();
    let is_failover = async |pg: &tokio_postgres::Client| -> Option<bool> {
        pg.query_one(
            "SELECT (SELECT failover FROM pg_replication_slots WHERE slot_name = $1)",
            &[&fx.slot],
        )
        .await
        .unwrap()
        .get(0)
    };
    assert_eq!(is_failover(&new).await, Some(false));

    let said = fx.relay_ok("setup", &[]);
    assert!(said.contains("made a failover slot"), "{said}");
    assert_eq!(is_failover(&new).await, Some(true), "{said}");
    fx.cleanup().await;
    harness_async(pgha(&name, "down")).await;
}
