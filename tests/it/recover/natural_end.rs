//! The end of a recovery pass is not a shutdown (`tests/it/recover.rs`): when
//! it has handed over its last row, its confirms are waited for within the
//! confirm deadline, not the shutdown grace period, and an unfinished
//! recovery never exits 0.

use std::time::{Duration, Instant};

use super::common::*;

/// As a user tried it: `shutdown_grace_secs = 1`, `on_slot_lost =
/// "recover"`, and the recovered rows routed to a queue of length 1 that
/// nacks the rest (`x-overflow = reject-publish`) and is never drained.
/// The nacks outlast the grace period. `run` must not exit 0 with rows
/// unsettled (it exited 0, "stopped before streaming", with 1 of 30
/// settled): here every row ends up in the queue or dead-lettered (after
/// its nacks), the recovery completes, and the relay streams on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recovery_s_late_confirms_are_waited_for_not_cut_at_the_grace_period() {
    let _serial = super::SERIAL.lock().await;
    let mut fx = Fixture::new("rec_natural").await;
    let pg = fx.checkpointed().await;
    let dlx = fx.scoped("dlx");
    fx.declare_bound(&dlx, Some(&fx.scoped("dlq")), "#").await;
    let mut dlq = fx.consume(&fx.scoped("dlq")).await;
    fx.rebind_queue("ok.#").await;
    let full = fx.full_queue("full.#").await;
    let ids = fx
        .insert_many(&pg, 30, "full", |i| format!("f{i}"), "e")
        .await;
    fx.drop_slot(&pg).await;
    fx.set_config_extra(
        &format!(
            "shutdown_grace_secs = 1\ndead_letter_exchange = \"{dlx}\"\nretry_backoff_ms = 20"
        ),
        "on_slot_lost = \"recover\"",
    );
    let mut relay = fx.spawn_relay();
    let deadline = Instant::now() + Duration::from_secs(90);
    while !relay.log_text().contains("recovery complete") {
        if !relay.is_running() {
            let (status, log) = Fixture::wait_exit(&mut relay, Duration::from_secs(5));
            let settled: Option<i64> = fx.checkpoint_column(&pg, "recovery_done").await;
            panic!(
                "the relay exited ({status}) with the recovery unfinished ({settled:?} of 30 rows \
                 settled):\n{log}"
            );
        }
        assert!(Instant::now() < deadline, "no end:\n{}", relay.log_tail());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Every row settled: one in the full queue, the others dead-lettered.
    let mut dead = std::collections::HashSet::new();
    while dead.len() < 29 {
        match tokio::time::timeout(Duration::from_secs(30), dlq.recv()).await {
            Ok(Some(r)) => {
                assert!(ids.contains(&r.message_id()), "{}", r.message_id());
                dead.insert(r.message_id());
            }
            _ => panic!("{} of 29 rows dead-lettered", dead.len()),
        }
    }
    let pending: Option<String> = fx.checkpoint_column(&pg, "recovery_since::text").await;
    assert_eq!(pending, None, "the recovery is still recorded");
    // And it streams on.
    let new = fx.insert(&pg, "ok", "n", "e", &serde_json::json!({})).await;
    fx.expect_delivered(&[new], &relay).await;
    relay.assert_running("after the recovery");
    relay.stop_ok();
    fx.delete_queue(&full).await;
    fx.cleanup().await;
}

/// A signal while `run` re-publishes a recovery: the grace period, then
/// exit 1, not 0 (it printed "stopped before streaming" and exited 0, and
/// a service manager restarting on failure left the recovery unfinished).
/// The rows wait on nacks (no dead-letter exchange, the default backoff),
/// so the recovery cannot end before the signal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_signal_during_a_recovery_exits_non_zero_and_keeps_the_record() {
    let _serial = super::SERIAL.lock().await;
    let mut fx = Fixture::new("rec_signal").await;
    let pg = fx.checkpointed().await;
    fx.rebind_queue("ok.#").await;
    let full = fx.full_queue("full.#").await;
    fx.insert_many(&pg, 5, "full", |i| format!("f{i}"), "e")
        .await;
    fx.drop_slot(&pg).await;
    fx.set_config_extra("shutdown_grace_secs = 1", "on_slot_lost = \"recover\"");
    let relay = fx.spawn_relay();
    assert!(
        relay
            .wait_log("broker nacked; will publish again", Duration::from_secs(30))
            .await,
        "set-up: no nack:\n{}",
        relay.log_tail()
    );
    let log = relay.log.clone();
    let (status, _) = relay.sigterm();
    let log = std::fs::read_to_string(log).unwrap_or_default();
    assert_eq!(status.code(), Some(1), "{log}");
    assert!(log.contains("stopped before the recovery"), "{log}");
    let pending: Option<String> = fx.checkpoint_column(&pg, "recovery_since::text").await;
    assert!(pending.is_some(), "the recovery's record is gone");
    fx.delete_queue(&full).await;
    fx.cleanup().await;
}
