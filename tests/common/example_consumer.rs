//! The example consumer (`examples/consumer.rs`) as a child process.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::{Fixture, amqp_url, pg_url};

/// The example consumer: the one `make test` built before the suite
/// (`TEST_CONSUMER_BIN`, set by integration/suite.sh), or else built
/// once per test run here: `cargo test` compiles examples but does not
/// always leave them at a stable path, and a clean checkout has none yet.
fn consumer_bin() -> std::path::PathBuf {
    static BUILT: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            if let Some(bin) = std::env::var_os("TEST_CONSUMER_BIN") {
                let bin = std::path::PathBuf::from(bin);
                assert!(bin.is_file(), "TEST_CONSUMER_BIN: no file {bin:?}");
                return bin;
            }
            let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
            let status = Command::new(cargo)
                .args(["build", "--quiet", "--example", "consumer"])
                .current_dir(env!("CARGO_MANIFEST_DIR"))
                .status()
                .expect("running cargo build --example consumer");
            assert!(status.success(), "cargo build --example consumer failed");
            let relay = std::path::PathBuf::from(env!("CARGO_BIN_EXE_outbox-relay"));
            relay.parent().unwrap().join("examples").join("consumer")
        })
        .clone()
}

pub struct Consumer {
    pub child: Child,
    metrics: String,
}

impl Drop for Consumer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Consumer {
    /// Starts it on the fixture's queue as consumer `name`, with `args`
    /// more (`--partitions`); `exit`: the crash hook's point and event.
    pub fn start(fx: &Fixture, name: &str, exit: Option<(&str, &str)>, args: &[&str]) -> Consumer {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let metrics = format!("127.0.0.1:{port}");
        let mut cmd = Command::new(consumer_bin());
        cmd.args([
            "--amqp",
            &amqp_url(),
            "--queue",
            &fx.queue,
            "--pg",
            &pg_url(),
        ])
        .args(["--consumer", name, "--prefetch", "8", "--metrics", &metrics])
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::from(
            std::fs::File::create(fx.dir.path().join(format!("consumer-{name}.log"))).unwrap(),
        ));
        if let Some((at, id)) = exit {
            cmd.env("CONSUMER_EXIT_AFTER", at)
                .env("CONSUMER_EXIT_EVENT", id);
        }
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", consumer_bin().display()));
        Consumer { child, metrics }
    }

    /// A counter from its `/metrics`.
    pub async fn counter(&self, name: &str) -> u64 {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(mut s) = tokio::net::TcpStream::connect(&self.metrics).await {
                s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").await.unwrap();
                let mut text = String::new();
                s.read_to_string(&mut text).await.unwrap();
                if let Some(v) = text
                    .lines()
                    .find_map(|l| l.strip_prefix(&format!("{name} ")))
                {
                    return v.trim().parse().unwrap();
                }
            }
            assert!(Instant::now() < deadline, "no /metrics from the consumer");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until the process died (the crash hook).
    pub fn wait_died(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.child.try_wait().unwrap().is_none() {
            assert!(Instant::now() < deadline, "the consumer did not die");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// The inbox and the example's business table.
pub async fn prepare_consumer_tables(pg: &tokio_postgres::Client) {
    let inbox =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/sql/inbox.sql")).unwrap();
    pg.batch_execute(&inbox).await.unwrap();
    pg.batch_execute(include_str!("../../examples/consumer_effects.sql"))
        .await
        .unwrap();
}
