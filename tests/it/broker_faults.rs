//! The broker goes away mid-stream, while a producer keeps committing:
//! (a) RabbitMQ stopped and started again, (b) every connection force-closed,
//! (c) the broker hung (its VM stopped with connections open). Every
//! committed event arrives at least once (duplicates counted), and the relay
//! process survives: it reconnects, it does not exit.
//!
//! The faults hit the whole broker, so the tests of this binary take turns
//! (`SERIAL`); cargo runs test binaries one after another.

use crate::common;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::*;

static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[derive(Debug, Clone, Copy)]
enum Fault {
    StopStart,
    CloseAllConnections,
    /// The broker's VM stopped (`SIGSTOP`), connections open: silence, not
    /// a closed socket. Only `rabbitmq.confirm_timeout_secs` can notice.
    Hang,
}

/// Confirm timeout of the `Hang` fault's relay.
const HANG_CONFIRM_TIMEOUT: &str = "confirm_timeout_secs = 2\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn broker_stop_start_mid_stream_loses_nothing() {
    broker_fault_mid_stream("brkstop", Fault::StopStart).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn broker_closes_all_connections_mid_stream_loses_nothing() {
    broker_fault_mid_stream("brkclose", Fault::CloseAllConnections).await;
}

/// Four publishing channels, each a connection the stop cuts: every
/// committed event arrives, and each aggregate's first deliveries are in
/// commit order (16 aggregates, over all four channels).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn broker_stop_start_with_four_channels_keeps_each_aggregate_in_order() {
    broker_fault_on("brkstop4", Fault::StopStart, "channels = 4\n", 16).await;
}

/// A hung broker while messages wait for confirms: the session must end
/// within the confirm timeout, and after the broker resumes every committed
/// event arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn hung_broker_ends_the_session_after_the_confirm_timeout() {
    broker_fault_mid_stream("brkhung", Fault::Hang).await;
}

async fn broker_fault_mid_stream(name: &str, fault: Fault) {
    broker_fault_on(name, fault, "", 4).await;
}

/// The fault, with `config` more in `[rabbitmq]` and a producer over
/// `aggregates` aggregates.
async fn broker_fault_on(name: &str, fault: Fault, config: &str, aggregates: u64) {
    let _turn = SERIAL.lock().await;
    let started = Instant::now();
    let config = match fault {
        Fault::Hang => format!("{HANG_CONFIRM_TIMEOUT}{config}"),
        _ => config.to_owned(),
    };
    let mut fx = Fixture::with_config(name, &config).await;
    // The test's own consumer connection dies with the fault too; this one
    // comes back by itself.
    let subscriptions = fx.start_reconnecting_consumer().await;
    let mut relay = fx.spawn_relay();

    let load = Load::start(
        &fx,
        [ProducerSpec {
            aggregates,
            ..ProducerSpec::new("agg", 1)
        }],
    );

    // Deliveries flowing first, so that the fault lands mid-stream.
    let mut all = Vec::new();
    fx.wait_deliveries(&mut all, 50, Duration::from_secs(30), Some(&relay))
        .await;

    let fault_at = Instant::now();
    match fault {
        Fault::StopStart => {
            ctl_async(rabbitmq_ctl, &["stop"]).await;
            // Stay down long enough for the relay to fail reconnects and back
            // off at least once.
            tokio::time::sleep(Duration::from_secs(2)).await;
            ctl_async(rabbitmq_ctl, &["start"]).await;
        }
        Fault::CloseAllConnections => {
            ctl_async(
                rabbitmq_ctl,
                &["ctl", "close_all_connections", "test: failure injection"],
            )
            .await;
        }
        Fault::Hang => {
            rabbitmq_ctl(&["freeze"]);
            let _thaw = Thaw;
            // The producer keeps committing, so messages wait for confirms
            // that cannot come. 2 s of timeout, checked every second, plus
            // margin.
            assert!(
                relay
                    .wait_log("no publisher confirm within", Duration::from_secs(6))
                    .await,
                "no confirm timeout within 6 s of the broker hanging ({}); log:\n{}",
                HANG_CONFIRM_TIMEOUT.trim(),
                relay.log_tail()
            );
            println!(
                "hung broker: confirm timeout noticed {:.1} s after the freeze",
                fault_at.elapsed().as_secs_f64()
            );
            relay.assert_running("while the broker is hung");
        }
    }
    let fault_secs = fault_at.elapsed().as_secs_f64();
    relay.assert_running("right after the broker fault");

    // Keep committing for a while with the broker back, then stop.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let report = load.stop_one().await;
    let drained_at = Instant::now();
    let duplicates = fx
        .committed_arrive(
            &mut all,
            &[&report],
            Duration::from_secs(90),
            Duration::from_secs(1),
            Some(&relay),
        )
        .await;
    let catch_up_secs = drained_at.elapsed().as_secs_f64();
    first_deliveries_in_commit_order(&[&report], &all, &refused_ids(&[&relay]));

    relay.assert_running("after the broker came back");
    // The fault really reached the relay: it ended a session and reconnected.
    let log = relay.log_text();
    assert!(
        log.contains("reconnecting"),
        "the relay never noticed the broker fault; log:\n{}",
        relay.log_tail()
    );
    let sessions = log.matches("streaming from LSN").count();
    assert!(
        sessions >= 2,
        "expected a new session after the fault, saw {sessions}"
    );
    // A hung broker keeps its connections: only the others cut them.
    if !matches!(fault, Fault::Hang) {
        assert!(
            subscriptions.load(Ordering::SeqCst) >= 2,
            "the test consumer was never cut off: did the fault happen?"
        );
    }
    println!(
        "broker fault {fault:?}: {} committed events in {} txs, {} deliveries, {duplicates} duplicates; \
         fault took {fault_secs:.1}s, catch-up after producer stop {catch_up_secs:.1}s, \
         relay sessions {sessions}, consumer subscriptions {}, test wall time {:.1}s",
        report.committed.len(),
        report.committed_txs,
        all.len(),
        subscriptions.load(Ordering::SeqCst),
        started.elapsed().as_secs_f64()
    );

    relay.stop_ok();
    fx.refresh_amqp().await;
    fx.cleanup().await;
}

/// Resumes a frozen broker however the test ends: a stopped VM would hang
/// every later test.
struct Thaw;

/// Lifts the memory alarm however a test ends (a broker left blocking would
/// stall every later test of this binary).
struct LiftAlarm;

impl Drop for LiftAlarm {
    fn drop(&mut self) {
        let args = ["ctl", "set_vm_memory_high_watermark", "0.4"];
        if let Err(e) = try_server_ctl("TEST_RABBITMQ_CTL", &args) {
            eprintln!("lifting the memory alarm: {e}");
        }
    }
}

impl Drop for Thaw {
    fn drop(&mut self) {
        if let Err(e) = try_server_ctl("TEST_RABBITMQ_CTL", &["thaw"]) {
            eprintln!("thawing the broker: {e}");
        }
    }
}

/// Heartbeats, both ways, on the relay's own AMQP connection
/// (`?heartbeat=1` in `rabbitmq.url`): (a) idle for several intervals, the
/// relay keeps its connection: it sends heartbeats, else RabbitMQ closes
/// it after two missed ones and the relay has to reconnect; (b) with the
/// broker hung and nothing waiting for a confirm (so the confirm timeout
/// cannot fire), the relay notices the silence from missed heartbeats and
/// starts a new session; (c) the events committed meanwhile arrive.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn heartbeats_keep_an_idle_connection_and_notice_a_silent_broker() {
    let _turn = SERIAL.lock().await;
    let mut fx = Fixture::new("heartbeat").await;
    let text = fx
        .config_text("")
        .replace(&amqp_url(), &format!("{}?heartbeat=1", amqp_url()));
    assert!(text.contains("heartbeat=1"), "{text}");
    std::fs::write(&fx.config, text).unwrap();
    fx.start_consumer().await;
    let mut relay = fx.spawn_relay();
    let pg = pg_connect().await;
    let payload = serde_json::json!({"n": 1});

    let first = fx.insert(&pg, "hb", "1", "Beat", &payload).await;
    fx.expect_delivered(std::slice::from_ref(&first), &relay)
        .await;

    // (a) Idle for 5 heartbeat intervals.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let second = fx.insert(&pg, "hb", "2", "Beat", &payload).await;
    fx.expect_delivered(std::slice::from_ref(&second), &relay)
        .await;
    let log = relay.log_text();
    assert!(
        !log.contains("reconnecting") && log.matches("streaming from LSN").count() == 1,
        "an idle connection with heartbeats was lost; log:\n{}",
        relay.log_tail()
    );

    // (b) Hung broker, nothing in flight.
    let frozen_at = Instant::now();
    {
        rabbitmq_ctl(&["freeze"]);
        let _thaw = Thaw;
        assert!(
            relay
                .wait_log("no heartbeat from the broker", Duration::from_secs(8))
                .await,
            "a silent broker went unnoticed for 8 s with heartbeat=1; log:\n{}",
            relay.log_tail()
        );
        println!(
            "silent broker noticed {:.1} s after the freeze",
            frozen_at.elapsed().as_secs_f64()
        );
        relay.assert_running("while the broker is hung");
    }

    // (c) Back: a new session delivers what was committed meanwhile.
    let third = fx.insert(&pg, "hb", "3", "Beat", &payload).await;
    fx.collect_until(
        std::slice::from_ref(&third),
        Duration::from_secs(60),
        Duration::ZERO,
        Some(&relay),
    )
    .await;
    relay.stop_ok();
    fx.refresh_amqp().await;
    fx.cleanup().await;
}

/// The broker restarted while it blocked the relay (a resource alarm): the
/// next session is not blocked, so `outbox_relay_broker_blocked` goes back
/// to 0 and `/readyz` to 200 without a `connection.unblocked` ever arriving
/// (the restart clears the runtime watermark; the old connection is gone).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_broker_restarted_while_blocking_leaves_nothing_blocked() {
    let _turn = SERIAL.lock().await;
    let mut fx = Fixture::new("brkblk").await;
    let subscriptions = fx.start_reconnecting_consumer().await;
    let relay = fx.spawn_relay_env(&[("OUTBOX_RELAY_LOG_FORMAT", "json")]);
    let addr = relay.http_addr().await;
    let pg = pg_connect().await;
    let payload = serde_json::json!({"n": 1});
    let first = fx.insert(&pg, "agg", "a1", "created", &payload).await;
    fx.expect_delivered(&[first], &relay).await;

    // Blocked: the alarm, then a publish that the broker holds back.
    rabbitmq_ctl(&["ctl", "set_vm_memory_high_watermark", "0"]);
    let _lift = LiftAlarm;
    let held = fx.insert(&pg, "agg", "a1", "held", &payload).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while sample(
        &http_get(&addr, "/metrics").await.1,
        "outbox_relay_broker_blocked",
    ) != 1.0
    {
        assert!(
            Instant::now() < deadline,
            "the relay never reported the broker blocked; log:\n{}",
            relay.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(
        http_get(&addr, "/readyz").await.0,
        503,
        "ready while blocked"
    );
    // The held event is the backlog: received, not confirmed (the gauges
    // are refreshed once a second).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let m = http_get(&addr, "/metrics").await.1;
    assert!(
        sample(&m, "outbox_relay_unconfirmed_events") >= 1.0
            && sample(&m, "outbox_relay_unconfirmed_bytes") > 0.0,
        "a held event is not counted as unconfirmed:\n{m}"
    );

    // A restart resets the watermark to the node's configured one.
    ctl_async(rabbitmq_ctl, &["stop"]).await;
    ctl_async(rabbitmq_ctl, &["start"]).await;
    fx.expect_delivered(&[held], &relay).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (code, _) = http_get(&addr, "/readyz").await;
        let m = http_get(&addr, "/metrics").await.1;
        let blocked = sample(&m, "outbox_relay_broker_blocked");
        let waiting = sample(&m, "outbox_relay_unconfirmed_events");
        if code == 200 && blocked == 0.0 && waiting == 0.0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "after the restart: /readyz {code}, broker_blocked {blocked}, unconfirmed {waiting}; log:\n{}",
            relay.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(subscriptions.load(std::sync::atomic::Ordering::SeqCst) >= 2);
    relay.stop_ok();
    fx.cleanup().await;
}
