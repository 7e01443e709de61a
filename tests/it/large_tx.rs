//! One transaction of 1,000,000 outbox rows streams through, and so do a
//! GiB of 1 MiB rows; the relay's peak RSS stays far below either: memory
//! is bounded by the window, not by the transaction. Own test binary, so the figure is not disturbed.

use crate::common;

use std::time::Duration;

use common::*;

/// The tests run one at a time: each measures the relay's memory and time.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A single transaction of 1,000,000 outbox rows is delivered in full, the
/// relay's peak RSS stays under 200 MB, and once it is confirmed the slot is
/// past it. The consumer keeps one bit per row, not the messages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn million_row_transaction_is_delivered_in_full_in_bounded_memory() {
    const ROWS: usize = 1_000_000;
    let _one = ONE_AT_A_TIME.lock().await;
    let fx = Fixture::new("million").await;
    let mut pg = pg_connect().await;
    let relay = fx.spawn_relay();
    let mut rx = fx.consume(&fx.queue).await;
    let t0 = std::time::Instant::now();
    let tx = pg.transaction().await.unwrap();
    tx.execute(
        &format!(
            "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload) \
             SELECT 'bulk', 'b' || (g % 1000), 'imported', \
                    jsonb_build_object('n', g, 'pad', repeat('x', 250)) \
             FROM generate_series(0, $1::int - 1) g",
            fx.table
        ),
        &[&(ROWS as i32)],
    )
    .await
    .unwrap();
    // A position inside the transaction, before its commit record: once the
    // transaction is confirmed, the slot must be past it.
    let inside: String = tx
        .query_one("SELECT pg_current_wal_insert_lsn()::text", &[])
        .await
        .unwrap()
        .get(0);
    tx.commit().await.unwrap();
    let inside: outbox_relay::lsn::Lsn = inside.parse().unwrap();
    let committed = t0.elapsed();
    let mut seen = vec![false; ROWS];
    let (mut distinct, mut deliveries) = (0usize, 0usize);
    let mut peak = 0u64;
    while distinct < ROWS {
        match tokio::time::timeout(Duration::from_secs(60), rx.recv()).await {
            Ok(Some(r)) => {
                deliveries += 1;
                let n = r.json()["n"].as_u64().unwrap() as usize;
                if !std::mem::replace(&mut seen[n], true) {
                    distinct += 1;
                }
                if deliveries % 50_000 == 0 {
                    peak = peak.max(relay.peak_rss_bytes());
                }
            }
            _ => panic!(
                "{} of {ROWS} rows missing (no delivery for 60 s); {}\nrelay log:\n{}",
                ROWS - distinct,
                fx.diagnostics().await,
                relay.log_tail()
            ),
        }
    }
    peak = peak.max(relay.peak_rss_bytes());
    println!(
        "1M-row transaction: committed in {:.1} s, all delivered after {:.1} s, {} duplicates, relay peak RSS {:.1} MB",
        committed.as_secs_f64(),
        t0.elapsed().as_secs_f64(),
        deliveries - distinct,
        peak as f64 / 1e6
    );
    assert!(peak < 200_000_000, "relay peak RSS {peak} bytes");
    relay.stop_ok();
    fx.wait_slot_inactive(&pg).await;
    let confirmed = fx.confirmed_flush_lsn(&pg).await;
    assert!(
        confirmed > inside,
        "slot at {confirmed}, not past the transaction ({inside})"
    );
    fx.cleanup().await;
}

/// 1,000 rows of 1 MiB each (a GiB, four times the bound below): everything
/// in flight is bounded in bytes (the replication buffer, the queue to the
/// publisher, the confirm window, the write buffer), so the relay's peak RSS
/// stays far below the rows' total.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_one_mib_rows_stream_in_bounded_memory() {
    const ROWS: i64 = 1_000;
    let _one = ONE_AT_A_TIME.lock().await;
    let fx = Fixture::new("mib").await;
    fx.bottomless_queue().await;
    let pg = pg_connect().await;
    // A backlog (written while the relay is down) fills every buffer.
    let end = fx.insert_large(&pg, ROWS, 1 << 20, 100).await;
    let (n, smallest): (i64, i32) = {
        let r = pg
            .query_one(
                &format!(
                    "SELECT count(*), min(octet_length(payload::text)) FROM {}",
                    fx.table
                ),
                &[],
            )
            .await
            .unwrap();
        (r.get(0), r.get(1))
    };
    assert_eq!(n, ROWS);
    assert!(smallest >= 1 << 20, "rows of {smallest} bytes");
    let relay = fx.spawn_relay();
    let started = std::time::Instant::now();
    let mut peak = 0;
    loop {
        peak = peak.max(relay.peak_rss_bytes());
        if fx.confirmed_flush_lsn(&pg).await >= end {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(600),
            "not confirmed within 10 minutes; log:\n{}",
            relay.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    peak = peak.max(relay.peak_rss_bytes());
    println!(
        "1,000 rows of 1 MiB: relay peak RSS {:.1} MB, {:.1} s",
        peak as f64 / 1e6,
        started.elapsed().as_secs_f64()
    );
    assert!(peak < 256 << 20, "relay peak RSS {peak} bytes");
    relay.stop_ok();
    fx.cleanup().await;
}
