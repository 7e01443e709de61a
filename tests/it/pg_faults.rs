//! PostgreSQL goes away mid-stream, while a producer keeps committing:
//! (a) the relay's walsender is terminated (`pg_terminate_backend`), several
//! times; (b) PostgreSQL is restarted. Every committed event arrives, the
//! relay survives, and the slot's `confirmed_flush_lsn` reaches the last
//! commit.
//!
//! (c) After a PostgreSQL restart (whose slot forgets positions it never
//! wrote to disk) and after a `kill -9` of the relay on top of one, events
//! the broker already confirmed are not sent again.
//!
//! (b) and (c) take the whole server down, so the tests of this binary take
//! turns (`SERIAL`).

use crate::common;

use std::time::{Duration, Instant};

use common::*;
use outbox_relay::lsn::Lsn;

static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// How many times (a) terminates the walsender.
const TERMINATIONS: usize = 4;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn walsender_terminated_repeatedly_loses_nothing() {
    let _turn = SERIAL.lock().await;
    let started = Instant::now();
    let mut fx = Fixture::new("pgterm").await;
    fx.start_reconnecting_consumer().await;
    let mut relay = fx.spawn_relay();
    let load = Load::start(&fx, [ProducerSpec::new("agg", 2)]);

    let mut all = Vec::new();
    fx.wait_deliveries(&mut all, 50, Duration::from_secs(30), Some(&relay))
        .await;

    let pg = pg_connect().await;
    let mut reconnects = Vec::new();
    for round in 0..TERMINATIONS {
        // Mid-stream: the producer commits every few ms.
        tokio::time::sleep(Duration::from_millis(1000)).await;
        let pid = fx.terminate_walsender(&pg).await.unwrap_or_else(|| {
            panic!(
                "round {round}: nobody streams the slot; log:\n{}",
                relay.log_tail()
            )
        });
        let t = Instant::now();
        // A new session of the same relay takes the slot again.
        fx.wait_slot_active(Some(pid), Duration::from_secs(30))
            .await
            .unwrap_or_else(|| {
                panic!(
                    "round {round}: slot not streamed again within 30 s; log:\n{}",
                    relay.log_tail()
                )
            });
        reconnects.push(t.elapsed());
        relay.assert_running("after pg_terminate_backend of its walsender");
    }

    tokio::time::sleep(Duration::from_secs(1)).await;
    let report = load.stop_one().await;
    let duplicates = fx
        .committed_arrive(
            &mut all,
            &[&report],
            Duration::from_secs(60),
            Duration::from_secs(1),
            Some(&relay),
        )
        .await;
    let target = report.last_commit_lsn.expect("LSN of the last commit");
    let confirmed = fx
        .wait_confirmed_at_least(target, Duration::from_secs(30), Some(&relay))
        .await;
    relay.assert_running("at the end");
    let sessions = relay.log_text().matches("streaming from LSN").count();
    assert!(
        sessions > TERMINATIONS,
        "{sessions} sessions for {TERMINATIONS} terminations"
    );
    println!(
        "walsender terminated {TERMINATIONS}x: {} committed events, {} deliveries, {duplicates} duplicates; \
         slot streamed again after {reconnects:?}; relay sessions {sessions}; \
         confirmed_flush_lsn {confirmed} >= last commit {target}; test wall time {:.1}s",
        report.committed.len(),
        all.len(),
        started.elapsed().as_secs_f64()
    );
    relay.stop_ok();
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_restart_mid_stream_loses_nothing() {
    let _turn = SERIAL.lock().await;
    let started = Instant::now();
    let mut fx = Fixture::new("pgrestart").await;
    fx.start_reconnecting_consumer().await;
    let mut relay = fx.spawn_relay();
    let load = Load::start(&fx, [ProducerSpec::new("agg", 3)]);

    let mut all = Vec::new();
    fx.wait_deliveries(&mut all, 50, Duration::from_secs(30), Some(&relay))
        .await;
    let old_pid = fx.wait_slot_active(None, Duration::from_secs(5)).await;

    // `restart` is a fast shutdown: PostgreSQL waits for walsenders to hand
    // their WAL to the client before it stops (the harness falls back to an
    // immediate stop after 30 s), so its duration tells how the relay took it.
    let t = Instant::now();
    ctl_async(pg_ctl, &["restart"]).await;
    let restart_secs = t.elapsed().as_secs_f64();
    let new_pid = fx
        .wait_slot_active(old_pid, Duration::from_secs(60))
        .await
        .unwrap_or_else(|| panic!("slot not streamed again; log:\n{}", relay.log_tail()));
    let back_secs = t.elapsed().as_secs_f64();
    relay.assert_running("after the PostgreSQL restart");

    // Keep committing with the server back (the producer reconnects).
    tokio::time::sleep(Duration::from_secs(3)).await;
    let report = load.stop_one().await;
    // The restart broke the producer's connection: whichever statement
    // met it first (a transaction's, or the position query after a COMMIT).
    assert!(
        report.lost_connections > 0,
        "the producer never noticed the restart"
    );
    let duplicates = fx
        .committed_arrive(
            &mut all,
            &[&report],
            Duration::from_secs(60),
            Duration::from_secs(1),
            Some(&relay),
        )
        .await;
    let target: Lsn = report.last_commit_lsn.expect("LSN of the last commit");
    let confirmed = fx
        .wait_confirmed_at_least(target, Duration::from_secs(30), Some(&relay))
        .await;
    relay.assert_running("at the end");
    let in_doubt_delivered = {
        let got = count_by_id(&all);
        report
            .in_doubt
            .iter()
            .filter(|e| got.contains_key(&e.id))
            .count()
    };
    println!(
        "PostgreSQL restart: {} committed events, {} deliveries, {duplicates} duplicates; \
         {} in-doubt events ({in_doubt_delivered} delivered), {} failed txs; \
         restart took {restart_secs:.1}s, slot streamed again (pid {new_pid}) after {back_secs:.1}s; \
         confirmed_flush_lsn {confirmed} >= last commit {target}; test wall time {:.1}s",
        report.committed.len(),
        all.len(),
        report.in_doubt.len(),
        report.failed_txs,
        started.elapsed().as_secs_f64()
    );
    relay.stop_ok();
    fx.cleanup().await;
}

/// (c) A restart replays nothing the broker confirmed: PostgreSQL 15 does
/// not write a slot to disk when only its confirmed position moved, so
/// after a restart the slot is back where it was last saved. The relay
/// resumes from its own last position (after a restart of PostgreSQL), or
/// from the checkpoint table (after a restart and a `kill -9` of the relay).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn restarts_replay_nothing_already_confirmed() {
    let _turn = SERIAL.lock().await;
    let mut fx = Fixture::new("noreplay").await;
    fx.start_reconnecting_consumer().await;
    let mut relay = fx.spawn_relay();
    let mut sent: Vec<String> = Vec::new();
    let mut all = Vec::new();
    for round in 0..3 {
        let pg = pg_connect_retry().await;
        let mut batch = Vec::new();
        for i in 0..50 {
            let payload = serde_json::json!({"round": round, "i": i});
            batch.push(
                fx.insert(&pg, "r", &format!("r{round}"), "e", &payload)
                    .await,
            );
        }
        drop(pg);
        all.extend(
            fx.collect_until(
                &batch,
                Duration::from_secs(60),
                Duration::ZERO,
                Some(&relay),
            )
            .await,
        );
        sent.extend(batch);
        // The checkpoint table (written every 200 ms) and the slot (each
        // status interval) have the position.
        tokio::time::sleep(Duration::from_millis(2500)).await;
        match round {
            0 => ctl_async(pg_ctl, &["restart"]).await,
            1 => {
                relay.kill9();
                ctl_async(pg_ctl, &["restart"]).await;
                relay = fx.spawn_relay();
            }
            _ => {}
        }
    }
    // Long enough for a replay to show.
    let pg = pg_connect_retry().await;
    let again = fx.sent_again(&pg, &sent, &mut all, &relay).await;
    let log = relay.log_tail();
    println!(
        "replayed after the restarts: {} of {} events; resumed past the slot: {}",
        again.len(),
        sent.len(),
        log.lines().filter(|l| l.contains("resuming past")).count()
    );
    assert!(
        again.is_empty(),
        "{} events sent again; log:\n{log}",
        again.len()
    );
    relay.stop_ok();
    fx.cleanup().await;
}

/// Sends SIGCONT when dropped, so that a failing test never leaves
/// PostgreSQL frozen for the tests after it.
struct Frozen(u32);

impl Frozen {
    /// SIGSTOP to the postmaster: the kernel still accepts TCP connections
    /// on its port, but nobody answers them, as with a host that hangs or a
    /// network that drops packets. Backends already running (the test's own
    /// connection) keep working.
    fn postmaster() -> Frozen {
        let dir = std::env::var("OUTBOX_IT_DIR").expect("OUTBOX_IT_DIR (source DIR/env)");
        let pid: u32 = std::fs::read_to_string(format!("{dir}/pg/postmaster.pid"))
            .expect("postmaster.pid")
            .lines()
            .next()
            .and_then(|l| l.trim().parse().ok())
            .expect("postmaster pid");
        signal(pid, "STOP");
        Frozen(pid)
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        signal(self.0, "CONT");
    }
}

/// PostgreSQL stops answering new connections for 20 s while the relay has
/// to reconnect (its walsender was terminated). That is an outage like any
/// other: the relay must keep retrying, not exit, and stream again once the
/// server answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_unresponsive_while_reconnecting_is_transient() {
    const UNRESPONSIVE: Duration = Duration::from_secs(20);
    let _turn = SERIAL.lock().await;
    let started = Instant::now();
    let mut fx = Fixture::new("pgfreeze").await;
    fx.start_reconnecting_consumer().await;
    let mut relay = fx.spawn_relay();
    let pg = pg_connect().await;
    let warm = fx
        .insert(&pg, "order", "o1", "placed", &serde_json::json!({}))
        .await;
    let mut all = fx.expect_delivered(&[warm], &relay).await;
    fx.wait_slot_active(None, Duration::from_secs(10))
        .await
        .expect("relay streaming");

    let frozen = Frozen::postmaster();
    // Through the test's existing backend: the relay must now reconnect to a
    // server that accepts TCP connections and never answers them.
    let terminated = fx.terminate_walsender(&pg).await;
    let t = Instant::now();
    let mut exited = None;
    while t.elapsed() < UNRESPONSIVE && exited.is_none() {
        exited = relay.child.try_wait().unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    drop(frozen);
    assert!(terminated.is_some(), "no walsender to terminate");
    if let Some(status) = exited {
        let msg = format!(
            "relay exited ({status}) {:.1}s into a {UNRESPONSIVE:?} PostgreSQL outage instead of retrying; log:\n{}",
            t.elapsed().as_secs_f64(),
            relay.log_tail()
        );
        // Leave no slot behind (it would retain WAL), then fail.
        fx.cleanup().await;
        panic!("{msg}");
    }

    // Server answers again: the relay streams again, new events arrive.
    let after = fx
        .insert(&pg, "order", "o1", "shipped", &serde_json::json!({}))
        .await;
    fx.collect_rest(
        &mut all,
        std::slice::from_ref(&after),
        Duration::from_secs(60),
        Duration::ZERO,
        Some(&relay),
    )
    .await;
    relay.assert_running("after PostgreSQL answered again");
    println!(
        "PostgreSQL unresponsive {UNRESPONSIVE:?}: relay survived; new event delivered {:.1}s after the server answered again; test wall time {:.1}s",
        t.elapsed().as_secs_f64() - UNRESPONSIVE.as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
    relay.stop_ok();
    fx.cleanup().await;
}

/// A walsender that stops answering (SIGSTOP: the socket stays open and
/// silent, as after a failover or a dead network path) ends the session
/// within the server's `wal_sender_timeout` (4 s for this test's role): the
/// relay probes the silence, gives up on the stream, `/readyz` turns 503,
/// and once the walsender is gone the relay streams again with nothing
/// lost. Prints how long noticing took.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_walsender_is_noticed() {
    let _turn = SERIAL.lock().await;
    let mut fx = Fixture::new("pgstall").await;
    let pg = pg_connect().await;
    let role = relay_role_with_timeout(&fx, &pg, "stall", "4s").await;

    fx.start_consumer().await;
    let relay = fx.spawn_relay();
    let first = fx
        .insert(&pg, "order", "o-1", "placed", &serde_json::json!({}))
        .await;
    fx.expect_delivered(&[first], &relay).await;
    let addr = relay
        .log_text()
        .split("addr=")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .expect("the relay logs its HTTP address")
        .to_owned();
    assert_eq!(http_get(&addr, "/readyz").await.0, 200);

    let walsender = fx.slot_active_pid(&pg).await.expect("the relay streams");
    assert!(
        !relay.log_text().contains("silent for"),
        "a stall before the fault"
    );
    // SIGCONT however this test ends: the server is shared.
    let cont = Cont(walsender as u32);
    signal(walsender as u32, "STOP");
    let stopped = Instant::now();
    let during = fx
        .insert(&pg, "order", "o-2", "shipped", &serde_json::json!({}))
        .await;
    let noticed = relay.wait_log("silent for", Duration::from_secs(30)).await;
    let took = stopped.elapsed();
    let readyz = http_get(&addr, "/readyz").await.0;
    drop(cont);
    assert!(noticed, "the stall was not noticed:\n{}", relay.log_tail());
    println!(
        "stalled walsender noticed after {:.1}s (wal_sender_timeout 4s)",
        took.as_secs_f64()
    );
    assert_eq!(readyz, 503, "/readyz while the stream is stalled");

    // The stopped walsender finds its client gone once it runs again; the
    // relay takes the slot back and the row written meanwhile arrives.
    fx.collect_until(
        &[during],
        Duration::from_secs(60),
        Duration::ZERO,
        Some(&relay),
    )
    .await;
    relay.stop_ok();
    fx.cleanup().await;
    pg.batch_execute(&format!("DROP ROLE {role}"))
        .await
        .unwrap();
}

/// A role for the relay whose sessions have `wal_sender_timeout` =
/// `timeout`; the fixture's config now connects as it. Returns its name.
async fn relay_role_with_timeout(
    fx: &Fixture,
    pg: &tokio_postgres::Client,
    name: &str,
    timeout: &str,
) -> String {
    let role = fx.scoped(name);
    pg.batch_execute(&format!(
        "CREATE ROLE {role} LOGIN SUPERUSER REPLICATION PASSWORD '{name}-pw'; \
         ALTER ROLE {role} SET wal_sender_timeout = '{timeout}'"
    ))
    .await
    .unwrap();
    let text = std::fs::read_to_string(&fx.config).unwrap();
    let url = fx.relay_pg_url();
    let (_, after_scheme) = url.split_once("://").unwrap();
    let (_, host) = after_scheme.split_once('@').unwrap();
    let role_url = format!("postgres://{role}:{name}-pw@{host}");
    let changed = text.replace(url, &role_url);
    assert_ne!(changed, text, "the config does not name {url}");
    std::fs::write(&fx.config, changed).unwrap();
    role
}

/// Sends SIGCONT to a process when dropped, however the test ends (the
/// server is shared).
struct Cont(u32);

impl Drop for Cont {
    fn drop(&mut self) {
        signal(self.0, "CONT");
    }
}

/// How far walsender `pid` has read WAL.
async fn sent_lsn(pg: &tokio_postgres::Client, pid: i32) -> Option<String> {
    pg.query_one(
        "SELECT sent_lsn::text FROM pg_stat_replication WHERE pid = $1",
        &[&pid],
    )
    .await
    .ok()
    .and_then(|r| r.get(0))
}

/// Rows of the bulk transaction in
/// [`a_busy_walsender_is_not_taken_for_a_dead_one`]. Replaying them takes
/// 0.5 to 2.5 s a million, depending on the machine and its load (CI's
/// machine did 12 million in about 6 s, so at a third of the time, 18 s:
/// too short); the walsender runs a sixth of the time during the replay (a
/// slow server, [`BULK_STOPPED`]), so that it lasts well over
/// `wal_sender_timeout` (25 s) however fast the machine.
const BULK_ROWS: i64 = 12_000_000;

/// How long the walsender stands stopped in each cycle of the throttle in
/// [`a_busy_walsender_is_not_taken_for_a_dead_one`]; it then runs 50 ms.
const BULK_STOPPED: Duration = Duration::from_millis(250);

/// While PostgreSQL replays, at its commit, a large transaction whose
/// changes are all on a table the publication does not cover, nothing
/// reaches the relay and `sent_lsn` stands still; the walsender reads the
/// relay's status updates only every half `wal_sender_timeout`, and pings
/// only if none of them was waiting. The relay asks for a reply when the
/// stream goes quiet, so the walsender answers: the session lives through
/// the replay (one walsender, the log never says the stream was silent),
/// and the outbox row at the end of the transaction and the one after it
/// arrive. With 25 s, the old silence handling (a status every 10 s that
/// asked for nothing) ended every session before the replay did.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_walsender_is_not_taken_for_a_dead_one() {
    let _turn = SERIAL.lock().await;
    let mut fx = Fixture::new("pgbusy").await;
    let pg = pg_connect().await;
    let role = relay_role_with_timeout(&fx, &pg, "busy", "25s").await;
    let bulk = fx.scoped("bulk");
    pg.batch_execute(&format!("CREATE TABLE {bulk} (i int)"))
        .await
        .unwrap();
    fx.start_consumer().await;
    let relay = fx.spawn_relay();
    let first = fx
        .insert(&pg, "order", "o-1", "placed", &serde_json::json!({}))
        .await;
    fx.expect_delivered(&[first], &relay).await;
    let walsender = fx.slot_active_pid(&pg).await.expect("the relay streams");

    // One transaction: the bulk rows, then one outbox row. It commits once
    // the walsender has read (and spilled) all of it, so that what follows
    // is the replay alone.
    pg.batch_execute(&format!(
        "BEGIN; INSERT INTO {bulk} SELECT generate_series(1, {BULK_ROWS})"
    ))
    .await
    .unwrap();
    let at_end = fx
        .insert(&pg, "order", "o-2", "after-bulk", &serde_json::json!({}))
        .await;
    let watch = pg_connect().await;
    let written = wal_insert_lsn(&watch).await;
    while sent_lsn(&watch, walsender)
        .await
        .and_then(|l| l.parse::<Lsn>().ok())
        < Some(written)
    {
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    pg.batch_execute("COMMIT").await.unwrap();
    // A slow server: the walsender runs 50 ms of every 300 (it stays a live
    // process that reads, on its own clock, what the relay sends).
    let throttle = tokio::spawn(async move {
        let _cont = Cont(walsender as u32);
        loop {
            signal(walsender as u32, "STOP");
            tokio::time::sleep(BULK_STOPPED).await;
            signal(walsender as u32, "CONT");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
    // How long sent_lsn stands still: the replay.
    let done = tokio_util::sync::CancellationToken::new();
    let still = tokio::spawn({
        let done = done.clone();
        async move {
            let (mut last, mut since, mut longest) = (None, Instant::now(), Duration::ZERO);
            while !done.is_cancelled() {
                let now = sent_lsn(&watch, walsender).await;
                if now != last {
                    (last, since) = (now, Instant::now());
                }
                longest = longest.max(since.elapsed());
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            longest
        }
    });
    let after = fx
        .insert(&pg, "order", "o-3", "next", &serde_json::json!({}))
        .await;
    let got = fx
        .collect_until(
            &[at_end.clone(), after],
            Duration::from_secs(300),
            Duration::ZERO,
            Some(&relay),
        )
        .await;
    throttle.abort();
    let _ = throttle.await;
    done.cancel();
    let replay = still.await.unwrap();
    println!(
        "{BULK_ROWS} rows on another table: sent_lsn stood still for {:.1}s (wal_sender_timeout 25s)",
        replay.as_secs_f64()
    );
    let log = relay.log_text();
    assert!(
        !log.contains("silent for"),
        "the busy walsender was taken for a dead one:\n{}",
        relay.log_tail()
    );
    assert_eq!(
        fx.slot_active_pid(&pg).await,
        Some(walsender),
        "the session did not live through the replay:\n{}",
        relay.log_tail()
    );
    assert!(
        got.iter().any(|r| r.message_id() == at_end),
        "the outbox row at the end of the bulk transaction"
    );
    // Otherwise this test proved nothing: raise BULK_ROWS or BULK_STOPPED.
    assert!(
        replay > Duration::from_secs(25),
        "sent_lsn stood still for {replay:?} only, less than wal_sender_timeout: too short to test \
         anything"
    );
    relay.stop_ok();
    fx.cleanup().await;
    pg.batch_execute(&format!("DROP TABLE {bulk}; DROP ROLE {role}"))
        .await
        .unwrap();
}

/// The checkpoint table locked by someone else (a migration, `VACUUM
/// FULL`, a `LOCK TABLE` left open) when the relay starts: reading it for
/// a recovery to finish, the first thing every start does, is bounded, so
/// the relay says what it waits on and retries, instead of hanging in
/// silence; once the lock is gone it streams, nothing lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_locked_checkpoint_table_at_start_is_waited_out_aloud() {
    let _turn = SERIAL.lock().await;
    let mut fx = Fixture::new("lockedcp").await;
    fx.start_consumer().await;
    let pg = pg_connect().await;
    let locker = pg_connect().await;
    locker
        .batch_execute("BEGIN; LOCK TABLE outbox_relay_checkpoint IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    let mut relay = fx.spawn_relay();
    let said = relay
        .wait_log("reading the checkpoint timed out", Duration::from_secs(40))
        .await;
    // Retried, and each attempt's backend gives up its wait on the server
    // too (lock_timeout): they do not queue up behind the lock.
    let end = Instant::now() + Duration::from_secs(60);
    while said
        && relay
            .log_text()
            .matches("reading the checkpoint timed out")
            .count()
            < 2
    {
        assert!(Instant::now() < end, "not retried:\n{}", relay.log_text());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    // The relay's own backends (other tests' relays may queue too).
    let role = fx.relay_role.as_ref().map(|r| r.name.clone());
    let queued: i64 = pg
        .query_one(
            "SELECT count(*) FROM pg_stat_activity \
             WHERE wait_event_type = 'Lock' AND usename = $1",
            &[&role.expect("the fixture's relay runs as its own role")],
        )
        .await
        .unwrap()
        .get(0);
    let running = relay.is_running();
    locker.batch_execute("COMMIT").await.unwrap();
    assert!(said, "no word of the locked table:\n{}", relay.log_text());
    assert!(running, "the relay exited:\n{}", relay.log_text());
    assert!(queued <= 1, "{queued} backends wait for the lock");
    let id = fx
        .insert(&pg, "order", "o1", "placed", &serde_json::json!({}))
        .await;
    fx.expect_delivered(&[id], &relay).await;
    relay.stop_ok();
    fx.cleanup().await;
}
