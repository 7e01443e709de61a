//! PostgreSQL 18's `idle_replication_slot_timeout`: a slot no walsender
//! uses for that long is invalidated at the next checkpoint. `check` warns
//! of a short setting before it bites; once it has, `status` names the
//! reason and `run` (with the default `on_slot_lost = "stop"`) stops and
//! says to run `recover`, which re-publishes what the slot lost.
//!
//! A module of its own: the setting is the server's, and every idle slot
//! on it would go. Modules of a lane run one after another, so no other
//! test's slot is on this server meanwhile; the setting is reset even if
//! the test fails.

use crate::common;

use std::time::Duration;

use common::*;

async fn set_idle_timeout(value: &str) {
    let pg = pg_connect().await;
    pg.batch_execute(&format!(
        "ALTER SYSTEM SET idle_replication_slot_timeout = '{value}'"
    ))
    .await
    .unwrap();
    pg.batch_execute("SELECT pg_reload_conf()").await.unwrap();
}

/// Puts the server's setting back when the test ends, however it ends.
struct ResetIdleTimeout;

impl Drop for ResetIdleTimeout {
    fn drop(&mut self) {
        let _ = std::thread::spawn(|| {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
                .block_on(set_idle_timeout("0"))
        })
        .join();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_timeout_invalidation_is_warned_of_named_and_recovered() {
    let major = server_major().await;
    if major < 18 {
        eprintln!("PostgreSQL {major} has no idle_replication_slot_timeout");
        return;
    }
    let mut fx = Fixture::new("idleslot").await;
    let (pg, relay) = fx.streaming().await;
    let before = fx
        .insert(&pg, "i", "before", "e", &serde_json::json!({}))
        .await;
    fx.expect_delivered(std::slice::from_ref(&before), &relay)
        .await;
    tokio::time::sleep(Duration::from_millis(1500)).await; // the checkpoint row
    relay.stop_ok();

    let _reset = ResetIdleTimeout;
    set_idle_timeout("1s").await;
    let out = fx.relay_cmd("check").output().unwrap();
    let said = String::from_utf8_lossy(&out.stdout).into_owned();
    let line = said
        .lines()
        .find(|l| l.contains("idle timeout"))
        .unwrap_or_else(|| panic!("check says nothing of the idle timeout:\n{said}"));
    assert!(
        line.starts_with("warn") && line.contains("idle_replication_slot_timeout = 1 s"),
        "{line}"
    );

    // Unused for longer than that, a checkpoint invalidates it; an event
    // written meanwhile is only in the WAL the slot no longer holds.
    let down = fx
        .insert(&pg, "i", "down", "e", &serde_json::json!({}))
        .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    pg.batch_execute("CHECKPOINT").await.unwrap();
    let reason: Option<String> = pg
        .query_one(
            "SELECT invalidation_reason FROM pg_replication_slots WHERE slot_name = $1",
            &[&fx.slot],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(reason.as_deref(), Some("idle_timeout"));
    let status = fx.relay_ok("status", &[]);
    assert!(
        status.contains("invalidated          idle_timeout") && status.contains("inactive since"),
        "{status}"
    );
    let json = fx.relay_ok("status", &["--json"]);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["invalidation_reason"], "idle_timeout", "{json}");

    let mut stopped = fx.spawn_relay();
    let (st, log) = Fixture::wait_exit(&mut stopped, Duration::from_secs(30));
    assert!(
        !st.success(),
        "run streamed from an invalidated slot:\n{log}"
    );
    assert!(
        log.contains("idle_timeout") && log.contains("outbox-relay recover"),
        "{log}"
    );
    set_idle_timeout("0").await;
    // `recover` re-publishes the row the slot lost; the relay streams on
    // from the new slot.
    fx.relay_ok("recover", &[]);
    let relay = fx.spawn_relay();
    let after = fx
        .insert(&pg, "i", "after", "e", &serde_json::json!({}))
        .await;
    fx.expect_delivered(&[down, after], &relay).await;
    relay.stop_ok();
    fx.cleanup().await;
}
