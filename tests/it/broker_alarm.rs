//! While the broker withholds confirms (memory alarm), the slot's
//! `confirmed_flush_lsn` never passes the first unconfirmed event; a relay
//! killed in that state loses nothing; once the broker is back, everything
//! arrives.
//!
//! Shutdown while the broker withholds confirms: SIGTERM drains within the
//! grace period and reports nothing unconfirmed; a second signal exits at once.
//!
//! Own test binary: the alarm is broker-wide, and cargo runs test binaries
//! one after another; inside it, [`ALARM`] runs the tests one at a time.

use crate::common;

use std::time::Duration;

use common::*;

static ALARM: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_alarm_holds_the_slot_before_unconfirmed_events() {
    let _alarm = ALARM.lock().await;
    let mut fx = Fixture::new("alarm").await;
    let (pg, relay) = fx.streaming().await;

    // An observer slot tells the exact end LSN of the transactions below.
    let observer = format!("obs_{}", fx.name);
    create_observer_slot(&pg, &observer).await;

    rabbitmq_ctl(&["ctl", "set_vm_memory_high_watermark", "0"]);
    let result = std::panic::AssertUnwindSafe(async {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let ids = fx
            .insert_many(&pg, 20, "acct", |i| format!("a{}", i % 3), "debited")
            .await;
        let first_end = first_commit_end(&pg, &observer, &fx.publication).await;

        // Several status intervals (200 ms) pass; keepalives come and go.
        for _ in 0..15 {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let confirmed = fx.confirmed_flush_lsn(&pg).await;
            assert!(
                confirmed < first_end,
                "confirmed_flush_lsn {confirmed} passed unconfirmed transaction ending at {first_end}"
            );
        }
        let leaked = fx.drain_for(Duration::from_millis(100)).await;
        assert!(
            leaked.is_empty(),
            "{} messages got through a blocked broker",
            leaked.len()
        );
        ids
    });
    let outcome = futures_util::FutureExt::catch_unwind(result).await;
    // Kill -9 while blocked: only the slot remembers where to resume.
    relay.kill9();
    rabbitmq_ctl(&["ctl", "set_vm_memory_high_watermark", "0.4"]);
    let _ = pg
        .execute("SELECT pg_drop_replication_slot($1)", &[&observer])
        .await;
    let ids = match outcome {
        Ok(ids) => ids,
        Err(panic) => std::panic::resume_unwind(panic),
    };

    let relay = fx.spawn_relay();
    let got = fx
        .collect_until(&ids, Duration::from_secs(60), Duration::ZERO, Some(&relay))
        .await;
    assert!(count_by_id(&got).len() >= ids.len());
    relay.sigterm();
    fx.cleanup().await;
}

/// Sets the memory alarm, runs `f`, always clears the alarm.
async fn with_alarm<T>(f: impl std::future::Future<Output = T>) -> T {
    rabbitmq_ctl(&["ctl", "set_vm_memory_high_watermark", "0"]);
    let out = futures_util::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(f)).await;
    rabbitmq_ctl(&["ctl", "set_vm_memory_high_watermark", "0.4"]);
    match out {
        Ok(v) => v,
        Err(p) => std::panic::resume_unwind(p),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_with_unconfirmed_messages_exits_within_grace_and_reports_nothing_unconfirmed() {
    let _alarm = ALARM.lock().await;
    let mut fx = Fixture::new("shutdown").await;
    fx.set_config_extra("shutdown_grace_secs = 2", "");
    let (pg, relay) = fx.streaming().await;
    let observer = format!("obs_{}", fx.name);
    create_observer_slot(&pg, &observer).await;

    let (ids, first_end, elapsed, status, out) = with_alarm(async {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let ids = fx.insert_many(&pg, 10, "s", |_| "1".into(), "e").await;
        let first_end = first_commit_end(&pg, &observer, &fx.publication).await;
        tokio::time::sleep(Duration::from_secs(1)).await;
        let t0 = std::time::Instant::now();
        let log = relay.log.clone();
        let (status, out) = relay.sigterm();
        let out = format!(
            "{out}\n--- relay log ---\n{}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
        (ids, first_end, t0.elapsed(), status, out)
    })
    .await;
    let _ = pg
        .execute("SELECT pg_drop_replication_slot($1)", &[&observer])
        .await;
    println!(
        "shutdown with unconfirmed messages took {:.1} s (grace 2 s)",
        elapsed.as_secs_f64()
    );
    assert!(status.success(), "exit status {status}: {out}");
    assert!(
        elapsed < Duration::from_secs(10),
        "took {elapsed:?} with a 2 s grace period: {out}"
    );
    assert!(out.contains("final confirmed LSN"), "{out}");
    fx.wait_slot_inactive(&pg).await;
    let confirmed = fx.confirmed_flush_lsn(&pg).await;
    assert!(
        confirmed < first_end,
        "shutdown reported {confirmed}, past unconfirmed {first_end}"
    );

    let relay = fx.spawn_relay();
    fx.collect_until(&ids, Duration::from_secs(60), Duration::ZERO, Some(&relay))
        .await;
    relay.sigterm();
    fx.cleanup().await;
}

/// A fast shutdown of PostgreSQL while the broker withholds confirms:
/// the server ends the relay's SQL backend, then waits for the walsender,
/// which waits until the relay confirms all it was sent, which it cannot.
/// The relay ends its session on the closed SQL connection (its grace
/// period for the outstanding confirms), so the server stops cleanly
/// instead of waiting out the alarm (the harness falls back to an
/// immediate stop after 30 s); once both are back, everything arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_fast_shutdown_is_not_held_up_by_withheld_confirms() {
    let _alarm = ALARM.lock().await;
    let mut fx = Fixture::new("pgstop_alarm").await;
    fx.set_config_extra("shutdown_grace_secs = 2", "");
    let (pg, mut relay) = fx.streaming().await;
    let (ids, stop_took) = with_alarm(async {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let ids = fx.insert_many(&pg, 10, "s", |_| "1".into(), "e").await;
        // The walsender sends them; the relay publishes into the alarm.
        tokio::time::sleep(Duration::from_secs(2)).await;
        let t = std::time::Instant::now();
        ctl_async(pg_ctl, &["stop"]).await;
        let took = t.elapsed();
        ctl_async(pg_ctl, &["start"]).await;
        (ids, took)
    })
    .await;
    println!(
        "PostgreSQL fast shutdown with confirms withheld took {:.1} s",
        stop_took.as_secs_f64()
    );
    assert!(
        stop_took < Duration::from_secs(20),
        "the fast shutdown waited {stop_took:?} (the harness's fallback to an immediate stop \
         comes at 30 s); log:\n{}",
        relay.log_tail()
    );
    fx.collect_until(&ids, Duration::from_secs(90), Duration::ZERO, Some(&relay))
        .await;
    relay.assert_running("after PostgreSQL came back");
    relay.stop_ok();
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_signal_exits_at_once() {
    let _alarm = ALARM.lock().await;
    let mut fx = Fixture::new("twosignals").await;
    fx.set_config_extra("shutdown_grace_secs = 600", "");
    let (pg, mut relay) = fx.streaming().await;
    let (status, elapsed) = with_alarm(async {
        tokio::time::sleep(Duration::from_millis(500)).await;
        fx.insert(&pg, "s", "1", "e", &serde_json::json!({"stuck": true}))
            .await;
        tokio::time::sleep(Duration::from_secs(1)).await;
        signal(relay.pid(), "TERM");
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(
            relay.is_running(),
            "exited on the first signal despite unconfirmed messages and a 600 s grace"
        );
        let t0 = std::time::Instant::now();
        signal(relay.pid(), "TERM");
        let status = wait_timeout(&mut relay.child, Duration::from_secs(5));
        (status, t0.elapsed())
    })
    .await;
    let status = status.expect("relay still running 5 s after the second signal");
    println!("second signal: exit after {:.2} s", elapsed.as_secs_f64());
    assert_eq!(status.code(), Some(130));
    fx.cleanup().await;
}

/// 400 rows of 1 MiB wait behind a broker memory alarm: the relay reads
/// only what its byte-bounded buffers hold (peak RSS far below the 400 MiB
/// backlog), and delivers everything once the alarm clears.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_rows_behind_a_memory_alarm_stay_bounded_in_memory() {
    let _alarm = ALARM.lock().await;
    let fx = Fixture::new("alarm_mib").await;
    fx.bottomless_queue().await;
    let pg = pg_connect().await;
    let end = fx.insert_large(&pg, 400, 1 << 20, 50).await;
    // The alarm is up before the relay starts: set after, a loaded machine
    // let the relay send everything while `rabbitmqctl` started.
    let (relay, peak) = with_alarm(async {
        let relay = fx.spawn_relay();
        // Long enough for the walsender to decode far more than the
        // buffers hold (it decodes these rows at a few hundred a second).
        let mut peak = 0;
        for _ in 0..40 {
            tokio::time::sleep(Duration::from_millis(250)).await;
            peak = peak.max(relay.peak_rss_bytes());
        }
        assert!(
            fx.confirmed_flush_lsn(&pg).await < end,
            "confirmed while blocked"
        );
        (relay, peak)
    })
    .await;
    let started = std::time::Instant::now();
    while fx.confirmed_flush_lsn(&pg).await < end {
        assert!(
            started.elapsed() < Duration::from_secs(300),
            "not confirmed after the alarm; log:\n{}",
            relay.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    println!(
        "400 rows of 1 MiB behind a memory alarm: relay peak RSS {:.1} MB",
        peak as f64 / 1e6
    );
    assert!(
        peak < 256 << 20,
        "relay peak RSS {peak} bytes while blocked"
    );
    relay.stop_ok();
    fx.cleanup().await;
}

/// `recover` blocked by a memory alarm and stopped with SIGINT says the
/// recovery is recorded and exits non-zero; the slot is already recreated,
/// yet running `recover` again finishes the job.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_recover_is_finished_by_running_it_again() {
    let _alarm = ALARM.lock().await;
    let mut fx = Fixture::new("alarm_recover").await;
    fx.set_config_extra("shutdown_grace_secs = 1", "");
    let pg = fx.checkpointed().await;
    let lost = fx.insert_many(&pg, 50, "r", |i| format!("l{i}"), "e").await;
    fx.drop_slot(&pg).await;
    let stderr = with_alarm(async {
        let mut rec = fx
            .relay_cmd("recover")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // It records the window, makes the slot, and waits on the broker.
        let mut slot_made = false;
        for _ in 0..100 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let n: i64 = pg
                .query_one(
                    "SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1",
                    &[&fx.slot],
                )
                .await
                .unwrap()
                .get(0);
            if n == 1 {
                slot_made = true;
                break;
            }
        }
        assert!(slot_made, "recover did not recreate the slot");
        tokio::time::sleep(Duration::from_millis(500)).await;
        signal(rec.id(), "INT");
        let status =
            wait_timeout(&mut rec, Duration::from_secs(30)).expect("recover exits on SIGINT");
        let mut err = String::new();
        std::io::Read::read_to_string(rec.stderr.as_mut().unwrap(), &mut err).unwrap();
        assert_eq!(status.code(), Some(1), "{err}");
        err
    })
    .await;
    assert!(
        stderr.contains("run `outbox-relay recover` again"),
        "{stderr}"
    );
    let out = fx.relay_ok("recover", &[]);
    assert!(
        out.contains("resuming the recovery recorded earlier"),
        "{out}"
    );
    assert!(out.contains("recovery complete"), "{out}");
    fx.collect_until(&lost, Duration::from_secs(30), Duration::ZERO, None)
        .await;
    // Done: nothing is left to recover.
    let third = fx.relay_cmd("recover").output().unwrap();
    let out = String::from_utf8_lossy(&third.stdout);
    assert!(out.contains("nothing to recover"), "{out}");
    fx.cleanup().await;
}

/// Restores the broker's `max_message_size` when dropped.
struct MaxMessageSize;
impl MaxMessageSize {
    fn set(bytes: u64) -> MaxMessageSize {
        rabbitmq_ctl(&[
            "ctl",
            "eval",
            &format!("application:set_env(rabbit, max_message_size, {bytes})."),
        ]);
        MaxMessageSize
    }
}
impl Drop for MaxMessageSize {
    fn drop(&mut self) {
        rabbitmq_ctl(&[
            "ctl",
            "eval",
            "application:set_env(rabbit, max_message_size, 134217728).",
        ]);
    }
}

/// The broker refuses a body under `rabbitmq.max_message_bytes` but over
/// its own `max_message_size` (406 PRECONDITION_FAILED, closing the
/// channel): the relay learns the broker's limit, dead-letters the row
/// without its body, and the rows after it flow. (Broker-wide setting: run
/// with the alarm tests, one at a time.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_over_the_brokers_own_limit_is_dead_lettered_without_it() {
    let _alarm = ALARM.lock().await;
    let mut fx = Fixture::new("brokerlimit").await;
    fx.declare_bound(&fx.scoped("dlx"), Some(&fx.scoped("dlq")), "#")
        .await;
    fx.set_config_extra(
        &format!("dead_letter_exchange = \"{}\"", fx.scoped("dlx")),
        "",
    );
    fx.start_consumer().await;
    let mut dlq = fx.consume(&fx.scoped("dlq")).await;
    let _limit = MaxMessageSize::set(65_536);
    let pg = pg_connect().await;
    let relay = fx.spawn_relay();
    let before = fx.insert(&pg, "f", "1", "e", &serde_json::json!({})).await;
    let big = fx
        .insert(
            &pg,
            "big",
            "b",
            "e",
            &serde_json::json!({"pad": "x".repeat(100_000)}),
        )
        .await;
    let after = fx.insert(&pg, "f", "2", "e", &serde_json::json!({})).await;
    let dl = tokio::time::timeout(Duration::from_secs(60), dlq.recv())
        .await
        .unwrap_or_else(|_| panic!("no dead letter; log:\n{}", relay.log_tail()))
        .unwrap();
    assert_eq!(dl.message_id(), big);
    assert!(
        dl.body.is_empty(),
        "the body the broker refused was sent again"
    );
    let err = dl.header_str("x-outbox-error").unwrap();
    assert!(err.contains("65536"), "{err}");
    fx.expect_delivered(&[before, after], &relay).await;
    relay.stop_ok();
    fx.cleanup().await;
}

/// A templated exchange looked for (a passive declare) while the broker
/// blocks the connection: the declare went out behind publishes the broker
/// stopped reading at, so its answer waits for the alarm to pass. It is due
/// as a confirm is (the alarm's time does not count), and nothing waits for
/// it: the session waits the alarm out, then everything arrives once. (Found
/// by review, issue 26: the declare had 15 s of its own, alarm or not, and
/// every session under a longer alarm ended on it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exchange_looked_for_under_a_memory_alarm_waits_it_out() {
    let _alarm = ALARM.lock().await;
    let mut fx = Fixture::new("alarmlook").await;
    fx.declare_bound(&fx.scoped("dlx"), Some(&fx.scoped("dlq")), "#")
        .await;
    let other = fx.scoped("other");
    fx.declare_bound(&other, Some(&fx.queue), "#").await;
    fx.set_config_extra(
        &format!("dead_letter_exchange = \"{}\"", fx.scoped("dlx")),
        "",
    );
    let text = std::fs::read_to_string(&fx.config).unwrap();
    let fixed = format!("exchange = \"{}\"", fx.exchange);
    assert!(text.contains(&fixed), "{text}");
    std::fs::write(
        &fx.config,
        text.replacen(&fixed, "exchange = \"{aggregate_type}\"", 1),
    )
    .unwrap();
    fx.start_consumer().await;
    let pg = pg_connect().await;
    let relay = fx.spawn_relay();
    let first = fx
        .insert(&pg, &fx.exchange, "w", "e", &serde_json::json!({}))
        .await;
    fx.expect_delivered(std::slice::from_ref(&first), &relay)
        .await;
    let ids = with_alarm(async {
        tokio::time::sleep(Duration::from_millis(500)).await;
        // One transaction: 400 events to the known exchange, the 200th to
        // one not yet looked for.
        let rows = pg
            .query(
                &format!(
                    "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload) \
                     SELECT CASE WHEN i = 200 THEN $1 ELSE $2 END, 'a' || (i % 7), 'e', \
                            jsonb_build_object('i', i) \
                     FROM generate_series(1, 400) i RETURNING id::text",
                    fx.table
                ),
                &[&other, &fx.exchange],
            )
            .await
            .unwrap();
        // Longer than the declare's old deadline.
        tokio::time::sleep(Duration::from_secs(20)).await;
        rows.iter()
            .map(|r| r.get::<_, String>(0))
            .collect::<Vec<_>>()
    })
    .await;
    let got = fx
        .collect_until(
            &ids,
            Duration::from_secs(60),
            Duration::from_secs(2),
            Some(&relay),
        )
        .await;
    let twice: Vec<_> = count_by_id(&got)
        .into_iter()
        .filter(|(id, n)| *n > 1 && *id != first)
        .collect();
    assert!(twice.is_empty(), "sent twice: {twice:?}");
    let log = relay.log_text();
    assert_eq!(
        log.matches("streaming from LSN").count(),
        1,
        "the alarm ended a session:\n{log}"
    );
    relay.stop_ok();
    fx.delete_queue(&fx.scoped("dlq")).await;
    fx.cleanup().await;
}
