//! Two relays on the same config and slot: exactly one streams, the other
//! stands by (and keeps running); `kill -9` of the active one hands the slot
//! to the standby within seconds, and every committed event arrives.

use crate::common;

use std::time::{Duration, Instant};

use common::*;

/// The standby polls the slot every ~2 s (jittered); anything near this is
/// a regression, not jitter.
const TAKEOVER_LIMIT: Duration = Duration::from_secs(30);

/// The takeover test counts every relay walsender on the server: the tests
/// of this binary take turns.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn standby_takes_over_after_kill9_of_the_active_relay() {
    let _turn = SERIAL.lock().await;
    let started = Instant::now();
    let mut fx = Fixture::new("takeover").await;
    fx.start_reconnecting_consumer().await;
    // Both at once: they race for the slot.
    let mut relays = [Some(fx.spawn_relay()), Some(fx.spawn_relay())];
    let pids: Vec<u32> = relays.iter().flatten().map(|r| r.pid()).collect();

    let load = Load::start(&fx, [ProducerSpec::new("agg", 4)]);
    let mut all = Vec::new();
    fx.wait_deliveries(&mut all, 50, Duration::from_secs(30), relays[0].as_ref())
        .await;

    // Steady state, sampled over more than two standby polls (~2 s each):
    // one walsender holds the slot, it is the only relay walsender, and it
    // is a connection of one of the two relays; both relays keep running.
    let pg = pg_connect().await;
    let mut active = None;
    for _ in 0..25 {
        let slot_pid = fx.slot_active_pid(&pg).await;
        let senders = relay_walsenders(&pg).await;
        assert_eq!(
            senders.len(),
            1,
            "relay walsenders {senders:?} (slot active_pid {slot_pid:?})"
        );
        let (sender_pid, port) = senders[0];
        assert_eq!(slot_pid, Some(sender_pid), "the slot's walsender");
        let port = u16::try_from(port.expect("TCP client port")).unwrap();
        let owner = socket_owner(&pids, port)
            .unwrap_or_else(|| panic!("walsender {sender_pid} (port {port}) is no relay's"));
        assert!(
            active.is_none_or(|a| a == owner),
            "the slot moved from relay {active:?} to {owner} without a fault"
        );
        active = Some(owner);
        for r in relays.iter_mut().flatten() {
            r.assert_running("while two relays share the slot");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let active_pid = active.unwrap();
    let a = pids.iter().position(|p| *p == active_pid).unwrap();
    let s = 1 - a;
    // The logs agree: the standby said so, and the active one streams.
    let standby_log = relays[s].as_ref().unwrap().log_text();
    assert!(
        standby_log.contains("standing by"),
        "the standby never logged that it stands by:\n{standby_log}"
    );
    assert!(
        relays[a]
            .as_ref()
            .unwrap()
            .log_text()
            .contains("streaming from LSN")
    );
    let standby_streamed_before = standby_log.matches("streaming from LSN").count();
    let old_walsender = fx.slot_active_pid(&pg).await;

    // kill -9 the active relay, then commit a marker event: the time until
    // it is delivered is the time until *new* events flow again.
    let killed_at = Instant::now();
    relays[a].take().unwrap().kill9();
    let marker = fx
        .insert(&pg, "order", "marker", "placed", &serde_json::json!({}))
        .await;

    let new_walsender = fx
        .wait_slot_active(old_walsender, TAKEOVER_LIMIT)
        .await
        .unwrap_or_else(|| {
            panic!(
                "standby did not take the slot within {TAKEOVER_LIMIT:?}; its log:\n{}",
                relays[s].as_ref().unwrap().log_tail()
            )
        });
    let slot_takeover = killed_at.elapsed();
    let standby = relays[s].as_mut().unwrap();
    let port = relay_walsenders(&pg)
        .await
        .into_iter()
        .find(|(pid, _)| *pid == new_walsender)
        .and_then(|(_, port)| port)
        .expect("the new walsender in pg_stat_replication");
    assert_eq!(
        socket_owner(&pids, u16::try_from(port).unwrap()),
        Some(pids[s]),
        "the slot was taken by something other than the standby"
    );

    let mut got_marker = false;
    while !got_marker {
        assert!(
            killed_at.elapsed() < TAKEOVER_LIMIT,
            "no new event within {TAKEOVER_LIMIT:?} of the kill; standby log:\n{}",
            standby.log_tail()
        );
        let batch = fx.drain_for(Duration::from_millis(20)).await;
        got_marker = batch.iter().any(|r| r.message_id() == marker);
        all.extend(batch);
    }
    let event_takeover = killed_at.elapsed();
    standby.assert_running("after taking over");
    assert!(
        standby.log_text().matches("streaming from LSN").count() > standby_streamed_before,
        "the standby's log does not show it streaming"
    );

    tokio::time::sleep(Duration::from_secs(1)).await;
    let report = load.stop_one().await;
    let standby = relays[s].take().unwrap();
    // The marker was not produced by the producer: count it as one of its
    // (it has arrived already).
    let marker_report = ProducerReport {
        committed: vec![Produced {
            id: marker,
            aggregate: "marker".into(),
            seq: 1,
        }],
        ..Default::default()
    };
    let duplicates = fx
        .committed_arrive(
            &mut all,
            &[&report, &marker_report],
            Duration::from_secs(60),
            Duration::from_secs(1),
            Some(&standby),
        )
        .await;
    println!(
        "takeover: slot streamed by the standby {:.2}s after kill -9, new events delivered after {:.2}s; \
         {} committed events, {} deliveries, {duplicates} duplicates; test wall time {:.1}s",
        slot_takeover.as_secs_f64(),
        event_takeover.as_secs_f64(),
        report.committed.len() + 1,
        all.len(),
        started.elapsed().as_secs_f64()
    );
    assert!(slot_takeover < TAKEOVER_LIMIT && event_takeover < TAKEOVER_LIMIT);
    standby.stop_ok();
    fx.cleanup().await;
}

/// A stop asked for while nothing streams is a clean stop: SIGTERM to a
/// relay standing by for the slot, to one waiting to reconnect to a broker
/// that refuses connections, and to one connecting to a broker that accepts
/// the TCP connection but never answers, each exits 0 without waiting out a
/// timeout, and says the slot keeps its position.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_while_standing_by_or_reconnecting_exits_zero() {
    let _turn = SERIAL.lock().await;
    let fx = Fixture::new("stopidle").await;
    let active = fx.spawn_relay();
    assert!(
        active
            .wait_log("streaming from LSN", Duration::from_secs(30))
            .await,
        "{}",
        active.log_tail()
    );
    let standby = fx.spawn_relay();
    assert!(
        standby
            .wait_log("standing by", Duration::from_secs(30))
            .await,
        "{}",
        standby.log_tail()
    );
    let (status, out) = standby.sigterm();
    assert!(status.success(), "standby: {status}\n{out}");
    assert!(out.contains("stopped before streaming"), "{out}");
    let (status, out) = active.sigterm();
    assert!(status.success(), "active: {status}\n{out}");

    // A broker port that refuses: the relay backs off between attempts.
    let text = std::fs::read_to_string(&fx.config).unwrap();
    let refusing = text.replace(&amqp_url(), "amqp://guest:guest@127.0.0.1:1/%2f");
    std::fs::write(&fx.config, &refusing).unwrap();
    let relay = fx.spawn_relay();
    assert!(
        relay
            .wait_log("reconnecting", Duration::from_secs(30))
            .await,
        "{}",
        relay.log_tail()
    );
    let (status, out) = relay.sigterm();
    assert!(status.success(), "reconnecting: {status}\n{out}");

    // A broker that accepts and never answers: the stop ends the connect.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = silent.local_addr().unwrap().port();
    let hanging = text.replace(
        &amqp_url(),
        &format!("amqp://guest:guest@127.0.0.1:{port}/%2f"),
    );
    std::fs::write(&fx.config, &hanging).unwrap();
    let mut relay = fx.spawn_relay();
    silent.set_nonblocking(true).unwrap();
    let end = Instant::now() + Duration::from_secs(30);
    let _sock = loop {
        match silent.accept() {
            Ok((sock, _)) => break sock,
            Err(_) if Instant::now() < end => tokio::time::sleep(Duration::from_millis(50)).await,
            Err(e) => panic!(
                "the relay never reached the silent broker ({e}):\n{}",
                relay.log_tail()
            ),
        }
    };
    signal(relay.pid(), "TERM");
    let (status, log) = Fixture::wait_exit(&mut relay, Duration::from_secs(10));
    assert!(status.success(), "connecting: {status}\n{log}");
    assert!(log.contains("stopped while connecting"), "{log}");
    std::fs::write(&fx.config, &text).unwrap();
    fx.cleanup().await;
}
