//! An idle outbox in a busy database does not retain WAL: keepalive positions
//! are reported while nothing is unconfirmed. And the optional heartbeat
//! moves the slot when the database writes nothing at all.
//!
//! One test per binary phase, run in sequence: the measurements are about
//! WAL written by the whole server.

use crate::common;

use std::time::{Duration, Instant};

use common::*;
use outbox_relay::lsn::Lsn;

const MIB: u64 = 1024 * 1024;

async fn current_lsn(pg: &tokio_postgres::Client) -> Lsn {
    let s: String = pg
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await
        .unwrap()
        .get(0);
    s.parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_outbox_in_a_busy_database_retains_little_wal_and_heartbeat_moves_an_idle_one() {
    let mut fx = Fixture::new("idlewal").await;
    let (pg, relay) = fx.streaming().await;

    // 64 MiB of WAL into another table; the outbox stays quiet.
    let noise = fx.scoped("noise");
    pg.batch_execute(&format!("CREATE TABLE {noise} (id bigint, pad text)"))
        .await
        .unwrap();
    let start = current_lsn(&pg).await;
    while current_lsn(&pg).await.0 - start.0 < 64 * MIB {
        pg.batch_execute(&format!(
            "INSERT INTO {noise} SELECT g, repeat(md5(g::text), 30) FROM generate_series(1, 5000) g"
        ))
        .await
        .unwrap();
    }
    let written = current_lsn(&pg).await.0 - start.0;
    let t0 = Instant::now();
    let mut retained = u64::MAX;
    while t0.elapsed() < Duration::from_secs(10) {
        retained = current_lsn(&pg)
            .await
            .0
            .saturating_sub(fx.confirmed_flush_lsn(&pg).await.0);
        if retained < 16 * MIB {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    println!(
        "idle outbox: {:.1} MiB of other WAL written; retained {:.2} MiB after {:.1} s",
        written as f64 / MIB as f64,
        retained as f64 / MIB as f64,
        t0.elapsed().as_secs_f64()
    );
    assert!(
        retained < 16 * MIB,
        "slot retains {retained} bytes of WAL 10 s after the writes"
    );
    relay.sigterm();
    pg.batch_execute(&format!("DROP TABLE {noise}"))
        .await
        .unwrap();

    // Heartbeat: with no writes at all from anyone else in this database the
    // slot still moves, because the relay's own heartbeat is a transaction.
    fx.set_config_extra("", "heartbeat_secs = 1");
    fx.wait_slot_inactive(&pg).await;
    let before = fx.confirmed_flush_lsn(&pg).await;
    // An observer slot shows the heartbeat messages themselves.
    let observer = fx.scoped("obs");
    create_observer_slot(&pg, &observer).await;
    let relay = fx.spawn_relay();
    let t0 = Instant::now();
    let mut moved = false;
    while t0.elapsed() < Duration::from_secs(10) {
        if fx.confirmed_flush_lsn(&pg).await > before {
            moved = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        moved,
        "heartbeat did not move the slot; log:\n{}",
        relay.log_tail()
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    let rows = pg
        .query(
            "SELECT data FROM pg_logical_slot_peek_binary_changes($1, NULL, NULL, \
             'proto_version', '1', 'publication_names', $2, 'messages', 'true')",
            &[&observer, &fx.publication],
        )
        .await
        .unwrap();
    let heartbeats = rows
        .iter()
        .filter(|r| {
            matches!(
                outbox_relay::pgoutput::decode(bytes::Bytes::from(r.get::<_, Vec<u8>>(0))),
                Ok(outbox_relay::pgoutput::LogicalMessage::Message(m)) if m.prefix == "outbox-relay-heartbeat"
            )
        })
        .count();
    pg.execute("SELECT pg_drop_replication_slot($1)", &[&observer])
        .await
        .unwrap();
    assert!(
        heartbeats >= 2,
        "expected a heartbeat a second, saw {heartbeats}"
    );

    // A heartbeat as often as the checkpoint (1 s) does not starve it: an
    // event's transaction reaches the checkpoint table within a few seconds
    // (it is written once a second while the heartbeat fires every second).
    let id = fx.insert(&pg, "w", "2", "e", &serde_json::json!({})).await;
    fx.expect_delivered(&[id], &relay).await;
    let committed = current_lsn(&pg).await;
    let t0 = Instant::now();
    let mut recorded = None;
    while t0.elapsed() < Duration::from_secs(10) {
        let row = pg
            .query_opt(
                "SELECT confirmed_lsn::text FROM public.outbox_relay_checkpoint WHERE slot_name = $1",
                &[&fx.slot],
            )
            .await
            .unwrap();
        recorded = row.map(|r| r.get::<_, String>(0).parse::<Lsn>().unwrap());
        if recorded.is_some_and(|l| l >= committed) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        recorded.is_some_and(|l| l >= committed),
        "checkpoint at {recorded:?}, not past {committed}, 10 s after the event (heartbeat_secs = 1); log:\n{}",
        relay.log_tail()
    );
    relay.sigterm();
    fx.cleanup().await;
}
