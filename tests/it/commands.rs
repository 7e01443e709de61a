//! The command line against real servers: `setup` is idempotent and refuses
//! `wal_level != logical`; bad configuration and a missing slot stop `run`
//! with a message that names what to fix; passwords never appear.

use crate::common;

use std::process::Command;
use std::time::Duration;

use common::*;

fn stderr(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setup_is_idempotent() {
    let fx = Fixture::new("setup").await; // ran setup once
    let text = fx.relay_ok("setup", &[]);
    assert!(
        text.contains(&format!("publication {}: already present", fx.publication)),
        "{text}"
    );
    assert!(
        text.contains(&format!("replication slot {}: already present", fx.slot)),
        "{text}"
    );
    let pg = pg_connect().await;
    let n: i64 = pg
        .query_one(
            "SELECT count(*) FROM pg_publication_tables WHERE pubname = $1",
            &[&fx.publication],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(n, 1);
    let pubinsert: (bool, bool) = pg
        .query_one(
            "SELECT pubinsert, pubupdate FROM pg_publication WHERE pubname = $1",
            &[&fx.publication],
        )
        .await
        .map(|r| (r.get(0), r.get(1)))
        .unwrap();
    assert_eq!(
        pubinsert,
        (true, false),
        "publication must publish inserts only"
    );
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_config_is_refused_naming_the_key_without_secrets() {
    let fx = Fixture::new("badcfg").await;
    let good = std::fs::read_to_string(&fx.config).unwrap();

    let cases = [
        (
            good.replace("[http]", "[http]\nlisten_addr = \"x\""),
            "listen_addr",
        ),
        (
            good.replace("status_interval_ms = 200", "status_interval_ms = \"soon\""),
            "postgres.status_interval_ms",
        ),
        (
            good.replace("[rabbitmq]", "[rabbitmq]\nwindow = 0"),
            "rabbitmq.window",
        ),
    ];
    for (text, key) in cases {
        std::fs::write(&fx.config, &text).unwrap();
        let out = fx.relay_cmd("run").output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{key}: {}", stderr(&out));
        assert!(stderr(&out).contains(key), "{key}: {}", stderr(&out));
    }
    std::fs::write(&fx.config, &good).unwrap();
    let out = fx
        .relay_cmd("run")
        .env("OUTBOX_RELAY_RABBITMQ_WINDOW", "many")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("rabbitmq.window"), "{}", stderr(&out));

    // A wrong password: the error names the server but never the password.
    let secret = "Sup3rS3cretPw";
    let url = pg_url().replace(":postgres@", &format!(":{secret}@"));
    let out = fx
        .relay_cmd("run")
        .env("OUTBOX_RELAY_POSTGRES_URL", &url)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(err.contains("password authentication failed"), "{err}");
    assert!(!err.contains(secret), "password leaked: {err}");
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_without_a_slot_says_to_run_setup() {
    let fx = Fixture::new("noslot").await;
    let pg = pg_connect().await;
    fx.drop_slot(&pg).await;
    let out = fx.relay_cmd("run").output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(
        err.contains(&fx.slot) && err.contains("outbox-relay setup"),
        "{err}"
    );
    fx.cleanup().await;
}

/// A command that cannot reach the broker says why once: the error and
/// its causes, without a cause repeated ("refused: refused: refused", as
/// an error that shows its source, then the source, used to print).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_broker_connection_is_told_once() {
    let fx = Fixture::new("refusedonce").await;
    let pg = pg_connect().await;
    let id = fx
        .insert(&pg, "order", "o-1", "created", &serde_json::json!({"n": 1}))
        .await;
    let text = std::fs::read_to_string(&fx.config).unwrap();
    let refusing = text.replace(&amqp_url(), "amqp://guest:guest@127.0.0.1:1/%2f");
    assert_ne!(text, refusing, "the broker URL is in the config");
    std::fs::write(&fx.config, &refusing).unwrap();
    let out = fx
        .relay_cmd("republish")
        .args(["--id", &id])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(err.contains("connecting to RabbitMQ"), "{err}");
    // The log's line and the last one, each saying it once.
    let last = err
        .lines()
        .rfind(|l| l.starts_with("outbox-relay: "))
        .unwrap_or_default();
    assert_eq!(last.matches("Connection refused").count(), 1, "{err}");
    for line in err.lines() {
        assert!(line.matches("Connection refused").count() <= 1, "{err}");
    }
    std::fs::write(&fx.config, &text).unwrap();
    fx.cleanup().await;
}

/// Once a relay has streamed from the slot, `setup` does not make a
/// dropped slot again: the new one would start at the current WAL
/// position, and the events committed since the relay's last confirmed
/// one would never be sent (checker seed 1808600037). It says to run
/// `recover`, which re-publishes them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setup_does_not_make_a_dropped_slot_again_after_a_relay_streamed_from_it() {
    let mut fx = Fixture::new("resetup").await;
    let (pg, relay) = fx.streaming().await;
    tokio::time::sleep(Duration::from_millis(1500)).await; // the checkpoint row
    relay.stop_ok();
    let gap = fx
        .insert(&pg, "s", "gap", "e", &serde_json::json!({}))
        .await;
    fx.drop_slot(&pg).await;
    let out = fx.relay_cmd("setup").output().unwrap();
    let err = stderr(&out);
    assert!(!out.status.success(), "setup made the slot again: {err}");
    assert!(
        err.contains("is gone, but a relay") && err.contains("outbox-relay recover"),
        "{err}"
    );
    let exists: bool = pg
        .query_one(
            "SELECT EXISTS (SELECT FROM pg_replication_slots WHERE slot_name = $1)",
            &[&fx.slot],
        )
        .await
        .unwrap()
        .get(0);
    assert!(!exists, "setup refused, yet made the slot");
    fx.relay_ok("recover", &[]);
    let relay = fx.spawn_relay();
    let after = fx
        .insert(&pg, "s", "after", "e", &serde_json::json!({}))
        .await;
    fx.expect_delivered(&[gap, after], &relay).await;
    relay.stop_ok();
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_reports_the_slot() {
    let fx = Fixture::new("status").await;
    let v: serde_json::Value = serde_json::from_str(&fx.relay_ok("status", &["--json"])).unwrap();
    assert_eq!(v["slot"], fx.slot.as_str());
    assert_eq!(v["exists"], true);
    assert_eq!(v["active"], false);
    assert!(v["confirmed_flush_lsn"].as_str().unwrap().contains('/'));
    assert!(v["retained_wal_bytes"].as_i64().unwrap() >= 0);
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setup_refuses_when_wal_level_is_not_logical() {
    let scratch = ScratchPg::start("replica");
    let (_dir, config) = scratch.minimal_config("[outbox]\ntable = \"outbox\"\n", "x");
    let out = Command::new(env!("CARGO_BIN_EXE_outbox-relay"))
        .args(["setup", "--config"])
        .arg(&config)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(
        err.contains("wal_level") && err.contains("logical") && err.contains("restart"),
        "{err}"
    );
}

/// `password_file`: the URL carries no password; the file does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn password_file_authenticates() {
    let fx = Fixture::new("pwfile").await;
    let url = pg_url();
    let (userinfo, rest) = url["postgres://".len()..].split_once('@').unwrap();
    let (user, password) = userinfo.split_once(':').unwrap();
    let file = fx.dir.path().join("pg-password");
    std::fs::write(&file, format!("{password}\n")).unwrap();
    let out = fx
        .relay_cmd("status")
        .env(
            "OUTBOX_RELAY_POSTGRES_URL",
            format!("postgres://{user}@{rest}"),
        )
        .env("OUTBOX_RELAY_POSTGRES_PASSWORD_FILE", &file)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    // And without it, the same URL is refused by the server.
    let out = fx
        .relay_cmd("status")
        .env(
            "OUTBOX_RELAY_POSTGRES_URL",
            format!("postgres://{user}@{rest}"),
        )
        .output()
        .unwrap();
    assert!(!out.status.success());
    fx.cleanup().await;
}
