//! Secrets that rotate: a `password_file` is read again at every connect,
//! so a rotated password (a Vault agent, a Kubernetes secret update) takes
//! effect without a restart; a login refused while the server already has
//! the new password and the file does not yet is tried again, with what
//! the file then holds.

use crate::common;

use std::time::Duration;

use common::*;

/// What the relay says while it waits for a rotation to reach the file.
const ROTATING: &str = "may be in the middle of a rotation";

fn write_secret(path: &std::path::Path, password: &str) {
    // Written aside and renamed into place, as a Vault agent or the
    // kubelet does: the relay never reads half a file.
    let tmp = path.with_extension("new");
    std::fs::write(&tmp, format!("{password}\n")).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_postgres_password_takes_effect_at_the_next_connect() {
    let mut fx = Fixture::new("rotpg").await;
    let role = (fx.relay_role.as_ref())
        .expect("a least-privilege role")
        .name
        .clone();
    let password = fx.relay_role.as_ref().unwrap().password.clone();
    let (_, server) = fx.relay_pg_url().split_once('@').unwrap();
    let url = format!("postgres://{role}@{server}");
    let file = fx.dir.path().join("pg-password");
    write_secret(&file, &password);
    fx.start_consumer().await;
    let relay = fx.spawn_relay_env(&[
        ("OUTBOX_RELAY_POSTGRES_URL", &url),
        (
            "OUTBOX_RELAY_POSTGRES_PASSWORD_FILE",
            file.to_str().unwrap(),
        ),
    ]);
    let pg = pg_connect().await;
    let kick = || async {
        // Every session of the relay's role: the next connect logs in again.
        pg.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1",
            &[&role],
        )
        .await
        .unwrap();
    };
    let first = fx
        .insert_many(&pg, 3, "order", |i| format!("a{i}"), "placed")
        .await;
    fx.expect_delivered(&first, &relay).await;

    // The file first, then the server: the next connect takes the new one.
    write_secret(&file, "Rotated-1");
    pg.batch_execute(&format!("ALTER ROLE {role} PASSWORD 'Rotated-1'"))
        .await
        .unwrap();
    kick().await;
    let second = fx
        .insert_many(&pg, 3, "order", |i| format!("b{i}"), "placed")
        .await;
    fx.expect_delivered(&second, &relay).await;

    // The server first: the relay's logins are refused until the file has
    // it too, and it waits for that instead of stopping.
    pg.batch_execute(&format!("ALTER ROLE {role} PASSWORD 'Rotated-2'"))
        .await
        .unwrap();
    kick().await;
    let third = fx
        .insert_many(&pg, 3, "order", |i| format!("c{i}"), "placed")
        .await;
    assert!(
        relay.wait_log(ROTATING, Duration::from_secs(30)).await,
        "no refused login was retried:\n{}",
        relay.log_tail()
    );
    write_secret(&file, "Rotated-2");
    fx.collect_until(
        &third,
        Duration::from_secs(60),
        Duration::ZERO,
        Some(&relay),
    )
    .await;
    let log = relay.log_text();
    for secret in [password.as_str(), "Rotated-1", "Rotated-2"] {
        assert!(!log.contains(secret), "the log shows a password");
    }
    relay.stop_ok();
    fx.cleanup().await;
}

/// Without a password file, a refused password stops the relay at once,
/// naming what to fix: only a file can change under it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_password_in_the_url_stops_the_relay() {
    let fx = Fixture::new("rotpgurl").await;
    let role = fx.relay_role.as_ref().unwrap().name.clone();
    let (_, server) = fx.relay_pg_url().split_once('@').unwrap();
    let url = format!("postgres://{role}:Wrong-Password@{server}");
    let mut relay = fx.spawn_relay_env(&[("OUTBOX_RELAY_POSTGRES_URL", &url)]);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while relay.is_running() && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(!relay.is_running(), "still retrying a wrong password");
    let log = relay.log_text();
    assert!(log.contains("password authentication failed"), "{log}");
    assert!(!log.contains(ROTATING), "{log}");
    assert!(
        !log.contains("Wrong-Password"),
        "the log shows the password"
    );
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_rabbitmq_password_takes_effect_at_the_next_connect() {
    let mut fx = Fixture::new("rotmq").await;
    let user = fx.scoped("rot");
    let user_ = user.clone();
    tokio::task::spawn_blocking(move || {
        rabbitmq_ctl(&["ctl", "add_user", &user_, "First-Secret"]);
        rabbitmq_ctl(&[
            "ctl",
            "set_permissions",
            "-p",
            "/",
            &user_,
            ".*",
            ".*",
            ".*",
        ]);
    })
    .await
    .unwrap();
    let (_, node) = fx.amqp_urls[0].split_once('@').unwrap();
    let url = format!("amqp://{user}@{node}");
    let file = fx.dir.path().join("amqp-password");
    write_secret(&file, "First-Secret");
    fx.start_consumer().await;
    let relay = fx.spawn_relay_env(&[
        ("OUTBOX_RELAY_RABBITMQ_URL", &url),
        (
            "OUTBOX_RELAY_RABBITMQ_PASSWORD_FILE",
            file.to_str().unwrap(),
        ),
    ]);
    let pg = pg_connect().await;
    let first = fx
        .insert_many(&pg, 3, "order", |i| format!("a{i}"), "placed")
        .await;
    fx.expect_delivered(&first, &relay).await;

    // The broker first, then (seconds later) the file.
    let user_ = user.clone();
    tokio::task::spawn_blocking(move || {
        rabbitmq_ctl(&["ctl", "change_password", &user_, "Second-Secret"]);
        rabbitmq_ctl(&["ctl", "close_all_user_connections", &user_, "rotation test"]);
    })
    .await
    .unwrap();
    let second = fx
        .insert_many(&pg, 3, "order", |i| format!("b{i}"), "placed")
        .await;
    assert!(
        relay.wait_log(ROTATING, Duration::from_secs(30)).await,
        "no refused login was retried:\n{}",
        relay.log_tail()
    );
    write_secret(&file, "Second-Secret");
    fx.collect_until(
        &second,
        Duration::from_secs(60),
        Duration::ZERO,
        Some(&relay),
    )
    .await;
    let log = relay.log_text();
    assert!(!log.contains("First-Secret") && !log.contains("Second-Secret"));
    relay.stop_ok();
    let user_ = user.clone();
    tokio::task::spawn_blocking(move || rabbitmq_ctl(&["ctl", "delete_user", &user_]))
        .await
        .unwrap();
    fx.cleanup().await;
}
