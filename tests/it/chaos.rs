//! Seeded chaos: three producers commit (and sometimes roll back)
//! transactions over several aggregates while faults hit the relay, the
//! broker and PostgreSQL, one every few seconds. Afterwards:
//!
//! - every committed event was delivered at least once;
//! - no event of a transaction that did not commit was delivered;
//! - per aggregate, first deliveries follow commit order;
//! - the slot's `confirmed_flush_lsn` reaches the last commit.
//!
//! The test prints `CHAOS_SEED=<n>`; `CHAOS_SEED=<n> cargo test --test chaos`
//! replays the same schedule (fault kinds, gaps, producer choices; the
//! timing of the servers themselves still varies). `CHAOS_ONLY=<fault>`
//! (e.g. `KillRelay`) keeps only that kind of fault, to see what it costs.

use crate::common;

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::*;
use outbox_relay::lsn::Lsn;

/// Faults keep coming until this much time has passed and...
const CHAOS_PHASE: Duration = Duration::from_secs(60);
/// ...at least this many faults happened, but never after this (the whole
/// test must stay under two minutes).
const MIN_FAULTS: usize = 6;
const HARD_STOP: Duration = Duration::from_secs(80);
const PRODUCERS: usize = 3;

/// A knob of the load, from the environment, for measuring (say, the
/// duplicates per `kill -9` at a given rate): `CHAOS_PRODUCERS`,
/// `CHAOS_PAUSE_MS` (between a producer's transactions),
/// `CHAOS_EVENTS_PER_TX` (at most).
fn knob(name: &str, default: u64) -> u64 {
    std::env::var(name).map_or(default, |v| {
        v.trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name} must be an unsigned integer"))
    })
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Fault {
    KillRelay,
    BrokerStopStart,
    TerminateWalsender,
    PgRestart,
}

const FAULTS: [Fault; 4] = [
    Fault::KillRelay,
    Fault::BrokerStopStart,
    Fault::TerminateWalsender,
    Fault::PgRestart,
];

fn seed() -> u64 {
    match std::env::var("CHAOS_SEED") {
        Ok(s) => s
            .trim()
            .parse()
            .expect("CHAOS_SEED must be an unsigned integer"),
        Err(_) => {
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap();
            t.as_nanos() as u64 ^ u64::from(std::process::id())
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chaos_schedule_loses_nothing_and_keeps_order() {
    let seed = seed();
    println!("CHAOS_SEED={seed}");
    let mut rng = XorShift::new(seed);
    let started = Instant::now();

    let mut fx = Fixture::new("chaos").await;
    let subscriptions = fx.start_reconnecting_consumer().await;
    let mut relay = fx.spawn_relay();
    let mut relays_started = 1;

    let specs: Vec<ProducerSpec> = (0..knob("CHAOS_PRODUCERS", PRODUCERS as u64))
        .map(|p| ProducerSpec {
            aggregates: 3,
            max_events_per_tx: knob("CHAOS_EVENTS_PER_TX", 4) as _,
            rollback_one_in: 5,
            pause: Duration::from_millis(knob("CHAOS_PAUSE_MS", 30)),
            ..ProducerSpec::new(&format!("p{p}"), rng.next_u64())
        })
        .collect();
    let load = Load::start(&fx, specs);

    let mut all = Vec::new();
    fx.wait_deliveries(&mut all, 20, Duration::from_secs(30), Some(&relay))
        .await;

    // The schedule. Each fault finishes (servers back up, relay restarted)
    // before the next gap starts, so faults do not overlap.
    let only = std::env::var("CHAOS_ONLY").ok();
    let chaos = Instant::now();
    let mut log: Vec<String> = Vec::new();
    let mut count: HashMap<Fault, usize> = HashMap::new();
    while (log.len() < MIN_FAULTS || chaos.elapsed() < CHAOS_PHASE) && chaos.elapsed() < HARD_STOP {
        tokio::time::sleep(rng.millis(1000, 3000)).await;
        let fault = FAULTS[rng.below(FAULTS.len() as u64) as usize];
        if only.as_ref().is_some_and(|o| *o != format!("{fault:?}")) {
            continue;
        }
        let at = chaos.elapsed().as_secs_f64();
        let t = Instant::now();
        let done = match fault {
            Fault::KillRelay => {
                relay.kill9();
                tokio::time::sleep(rng.millis(0, 500)).await;
                relay = fx.spawn_relay();
                relays_started += 1;
                true
            }
            Fault::BrokerStopStart => {
                ctl_async(rabbitmq_ctl, &["stop"]).await;
                tokio::time::sleep(rng.millis(300, 1500)).await;
                ctl_async(rabbitmq_ctl, &["start"]).await;
                true
            }
            Fault::TerminateWalsender => {
                // Only meaningful while the relay streams; it may still be
                // backing off from the previous fault.
                fx.wait_slot_active(None, Duration::from_secs(10)).await;
                let pg = pg_connect_retry().await;
                fx.terminate_walsender(&pg).await.is_some()
            }
            Fault::PgRestart => {
                ctl_async(pg_ctl, &["restart"]).await;
                true
            }
        };
        let took = t.elapsed().as_secs_f64();
        if done {
            *count.entry(fault).or_default() += 1;
            log.push(format!("{at:.1}s {fault:?} ({took:.1}s)"));
        } else {
            println!("{at:.1}s {fault:?}: nothing streamed the slot, skipped");
        }
        // A relay that exits on a transient fault is a bug.
        relay.assert_running(&format!("after {fault:?}"));
    }
    let chaos_secs = chaos.elapsed().as_secs_f64();
    println!("faults: {}", log.join(", "));
    assert!(
        log.len() >= MIN_FAULTS || only.is_some(),
        "only {} faults within {HARD_STOP:?}",
        log.len()
    );

    // Quiet period: stop producing, then everything committed must arrive.
    let reports = load.stop().await;
    let report_refs: Vec<&ProducerReport> = reports.iter().collect();
    fx.refresh_amqp().await;
    let recovery = Instant::now();
    let duplicates = fx
        .committed_arrive(
            &mut all,
            &report_refs,
            Duration::from_secs(60),
            // Long enough for a stray rolled-back event or a late duplicate.
            Duration::from_secs(2),
            Some(&relay),
        )
        .await;
    let recovery_secs = recovery.elapsed().as_secs_f64();

    // Per aggregate, first deliveries in commit order.
    first_deliveries_in_commit_order(
        &reports.iter().collect::<Vec<_>>(),
        &all,
        &Default::default(),
    );

    // The slot reaches the last commit. A producer whose last LSN query was
    // cut off did commit after its last known LSN: use a later position.
    let pg = pg_connect_retry().await;
    let mut target = reports
        .iter()
        .filter_map(|r| r.last_commit_lsn)
        .max()
        .unwrap_or(Lsn(0));
    if reports
        .iter()
        .any(|r| r.committed_txs > 0 && r.last_commit_lsn.is_none())
    {
        target = target.max(wal_insert_lsn(&pg).await);
    }
    let confirmed = fx
        .wait_confirmed_at_least(target, Duration::from_secs(30), Some(&relay))
        .await;
    relay.assert_running("at the end");

    let sum = |f: fn(&ProducerReport) -> usize| reports.iter().map(f).sum::<usize>();
    println!(
        "chaos: seed {seed}, {} faults in {chaos_secs:.1}s ({count:?}); relays started {relays_started}; \
         {} committed events in {} txs, {} rolled-back txs, {} failed txs ({} in-doubt events); \
         {} deliveries, {duplicates} duplicates; consumer subscriptions {}; \
         all delivered {recovery_secs:.1}s after the producers stopped; \
         confirmed_flush_lsn {confirmed} >= last commit {target}; test wall time {:.1}s",
        log.len(),
        sum(|r| r.committed.len()),
        sum(|r| r.committed_txs),
        sum(|r| r.rolled_back_txs),
        sum(|r| r.failed_txs),
        sum(|r| r.in_doubt.len()),
        all.len(),
        subscriptions.load(Ordering::SeqCst),
        started.elapsed().as_secs_f64()
    );
    let kills = count.get(&Fault::KillRelay).copied().unwrap_or(0);
    if kills > 0 {
        let rate = sum(|r| r.committed.len()) as f64 / chaos_secs;
        println!(
            "chaos: {rate:.0} events/s; {:.0} duplicates per kill -9 ({:.2} s of traffic)",
            duplicates as f64 / kills as f64,
            duplicates as f64 / kills as f64 / rate
        );
    }
    relay.stop_ok();
    fx.cleanup().await;
}
