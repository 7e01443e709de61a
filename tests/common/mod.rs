//! Test fixture: real PostgreSQL and RabbitMQ (started by `integration/servers.sh`,
//! or pointed at with `TEST_PG_URL` / `TEST_AMQP_URL`), one outbox table,
//! publication, slot, exchange and queue per test, and the relay binary as a
//! real child process.

#![allow(dead_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use lapin::options::{
    BasicConsumeOptions, ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Connection, ConnectionProperties, ExchangeKind};
use outbox_relay::lsn::Lsn;
use tokio_postgres::{Client, NoTls};

pub fn pg_url() -> String {
    std::env::var("TEST_PG_URL").expect(
        "TEST_PG_URL is not set: run the suite with `make test` (integration/servers.sh with ...)",
    )
}

pub fn amqp_url() -> String {
    std::env::var("TEST_AMQP_URL")
        .expect("TEST_AMQP_URL is not set: run the suite with `make test` (integration/servers.sh with ...)")
}

/// Runs `integration/servers.sh <target> <args>`: stop/start the broker,
/// restart PostgreSQL, set a memory alarm.
pub fn server_ctl(var: &str, args: &[&str]) {
    let ctl = std::env::var(var).unwrap_or_else(|_| {
        panic!("{var} is not set: this test needs the servers started by integration/servers.sh")
    });
    let mut parts = ctl.split_whitespace();
    let prog = parts.next().expect("empty ctl command");
    let status = Command::new(prog)
        .args(parts)
        .args(args)
        .status()
        .unwrap_or_else(|e| panic!("running {ctl}: {e}"));
    assert!(status.success(), "{ctl} {args:?} failed: {status}");
}

pub fn rabbitmq_ctl(args: &[&str]) {
    server_ctl("TEST_RABBITMQ_CTL", args);
}

pub fn pg_ctl(args: &[&str]) {
    server_ctl("TEST_PG_CTL", args);
}

pub async fn pg_connect() -> Client {
    let (client, conn) = tokio_postgres::connect(&pg_url(), NoTls)
        .await
        .expect("connecting to the test PostgreSQL");
    tokio::spawn(async move {
        let _ = conn.await;
    });
    client
}

/// Like [`pg_connect`], retrying while the server restarts.
pub async fn pg_connect_retry() -> Client {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match tokio_postgres::connect(&pg_url(), NoTls).await {
            Ok((client, conn)) => {
                tokio::spawn(async move {
                    let _ = conn.await;
                });
                return client;
            }
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("PostgreSQL did not come back: {e}"),
        }
    }
}

pub async fn amqp_connect() -> Connection {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match Connection::connect(&amqp_url(), ConnectionProperties::default()).await {
            Ok(c) => return c,
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("RabbitMQ is not reachable: {e}"),
        }
    }
}

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// One message as a consumer saw it.
#[derive(Debug, Clone)]
pub struct Received {
    pub exchange: String,
    pub routing_key: String,
    pub body: Vec<u8>,
    pub properties: BasicProperties,
}

impl Received {
    pub fn message_id(&self) -> String {
        self.properties
            .message_id()
            .as_ref()
            .map(|s| s.to_string())
            .unwrap_or_default()
    }
    pub fn header(&self, k: &str) -> Option<AMQPValue> {
        self.properties
            .headers()
            .as_ref()
            .and_then(|h| h.inner().get(k).cloned())
    }
    pub fn header_str(&self, k: &str) -> Option<String> {
        match self.header(k)? {
            AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
            AMQPValue::ShortString(s) => Some(s.to_string()),
            _ => None,
        }
    }
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).expect("body is JSON")
    }
}

/// Per-test names, config and cleanup.
pub struct Fixture {
    pub name: String,
    pub table: String,
    pub slot: String,
    pub publication: String,
    pub exchange: String,
    pub queue: String,
    pub dir: tempfile::TempDir,
    pub config: PathBuf,
    pub amqp: Connection,
    consumer: Option<tokio::sync::mpsc::UnboundedReceiver<Received>>,
}

impl Fixture {
    /// Creates table, exchange (topic), queue bound with `#`, config, and runs
    /// `outbox-relay setup`.
    pub async fn new(test: &str) -> Fixture {
        Self::with_config(test, "").await
    }

    /// As [`Fixture::new`], with extra TOML appended to the `[rabbitmq]` section.
    pub async fn with_config(test: &str, rabbitmq_extra: &str) -> Fixture {
        let n = COUNTER.fetch_add(1, Ordering::SeqCst);
        let name = format!("{test}_{}_{n}", std::process::id());
        let f = Fixture {
            table: format!("ob_{name}"),
            slot: format!("slot_{name}"),
            publication: format!("pub_{name}"),
            exchange: format!("ex_{name}"),
            queue: format!("q_{name}"),
            dir: tempfile::tempdir().unwrap(),
            config: PathBuf::new(),
            amqp: amqp_connect().await,
            consumer: None,
            name,
        };
        let mut f = f;
        f.config = f.dir.path().join("relay.toml");
        std::fs::write(&f.config, f.config_text(rabbitmq_extra)).unwrap();

        let pg = pg_connect().await;
        let ddl = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/sql/outbox.sql"))
            .unwrap()
            .replace("CREATE TABLE outbox", &format!("CREATE TABLE {}", f.table));
        pg.batch_execute(&ddl).await.unwrap();

        let ch = f.amqp.create_channel().await.unwrap();
        ch.exchange_declare(
            f.exchange.as_str().into(),
            ExchangeKind::Topic,
            ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
        ch.queue_declare(
            f.queue.as_str().into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
        ch.queue_bind(
            f.queue.as_str().into(),
            f.exchange.as_str().into(),
            "#".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();

        let out = f.relay_cmd("setup").output().unwrap();
        assert!(
            out.status.success(),
            "setup failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        f
    }

    pub fn config_text(&self, rabbitmq_extra: &str) -> String {
        format!(
            r#"[postgres]
url = "{pg}"
slot = "{slot}"
publication = "{publication}"
status_interval_ms = 200

[outbox]
table = "public.{table}"

[rabbitmq]
url = "{amqp}"
exchange = "{exchange}"
routing_key = "{{aggregate_type}}.{{event_type}}"
{rabbitmq_extra}

[http]
listen = "127.0.0.1:0"
"#,
            pg = pg_url(),
            amqp = amqp_url(),
            slot = self.slot,
            publication = self.publication,
            table = self.table,
            exchange = self.exchange,
        )
    }

    /// `outbox-relay <sub> --config <file>`.
    pub fn relay_cmd(&self, sub: &str) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_outbox-relay"));
        c.arg(sub).arg("--config").arg(&self.config);
        c.env(
            "OUTBOX_RELAY_LOG",
            std::env::var("TEST_RELAY_LOG").unwrap_or_else(|_| "info,outbox_relay=debug".into()),
        );
        c
    }

    /// Starts `outbox-relay run`, logging to a file in the test's directory.
    pub fn spawn_relay(&self) -> Relay {
        let k = COUNTER.fetch_add(1, Ordering::SeqCst);
        let log = self.dir.path().join(format!("relay-{k}.log"));
        let child = self
            .relay_cmd("run")
            .stdout(Stdio::from(
                std::fs::File::create(log.with_extension("out")).unwrap(),
            ))
            .stderr(Stdio::from(std::fs::File::create(&log).unwrap()))
            .spawn()
            .expect("starting the relay");
        Relay { child, log }
    }

    /// Inserts one event in its own transaction.
    pub async fn insert(
        &self,
        pg: &Client,
        aggregate_type: &str,
        aggregate_id: &str,
        event_type: &str,
        payload: &serde_json::Value,
    ) -> String {
        let row = pg
            .query_one(
                &format!(
                    "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload, headers) \
                     VALUES ($1, $2, $3, $4::text::jsonb, '{{\"source\": \"test\"}}') RETURNING id::text",
                    self.table
                ),
                &[&aggregate_type, &aggregate_id, &event_type, &payload.to_string()],
            )
            .await
            .unwrap();
        row.get(0)
    }

    /// SQL that inserts one event, for use inside explicit transactions.
    pub fn insert_sql(&self) -> String {
        format!(
            "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload) \
             VALUES ($1, $2, $3, $4::text::jsonb) RETURNING id::text",
            self.table
        )
    }

    /// Starts consuming the test queue (no-ack; every delivery is recorded).
    pub async fn start_consumer(&mut self) {
        let ch = self.amqp.create_channel().await.unwrap();
        let mut consumer = ch
            .basic_consume(
                self.queue.as_str().into(),
                format!("c_{}", self.name).as_str().into(),
                BasicConsumeOptions {
                    no_ack: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap();
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            let _ch = ch;
            while let Some(Ok(d)) = consumer.next().await {
                let r = Received {
                    exchange: d.exchange.to_string(),
                    routing_key: d.routing_key.to_string(),
                    body: d.data,
                    properties: d.properties,
                };
                if tx.send(r).is_err() {
                    break;
                }
            }
        });
        self.consumer = Some(rx);
    }

    /// Collects deliveries until `ids` have all been seen at least once (then
    /// for `settle` more), or panics after `timeout` naming what is missing.
    pub async fn collect_until(
        &mut self,
        ids: &[String],
        timeout: Duration,
        settle: Duration,
        relay: Option<&Relay>,
    ) -> Vec<Received> {
        let rx = self.consumer.as_mut().expect("start_consumer first");
        let mut want: std::collections::HashSet<&String> = ids.iter().collect();
        let mut got = Vec::new();
        let deadline = Instant::now() + timeout;
        while !want.is_empty() {
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, rx.recv()).await {
                Ok(Some(r)) => {
                    want.remove(&r.message_id());
                    got.push(r);
                }
                _ => {
                    let log = relay.map(|r| r.log_tail()).unwrap_or_default();
                    let missing = want.len();
                    let diag = self.diagnostics().await;
                    panic!(
                        "{missing} of {} events missing after {timeout:?}; {diag}\nrelay log:\n{log}",
                        ids.len()
                    );
                }
            }
        }
        let settle_end = Instant::now() + settle;
        while let Ok(Some(r)) = tokio::time::timeout(
            settle_end.saturating_duration_since(Instant::now()),
            rx.recv(),
        )
        .await
        {
            got.push(r);
        }
        got
    }

    /// Slot position and queue depth, for failure messages.
    pub async fn diagnostics(&self) -> String {
        let pg = pg_connect_retry().await;
        let slot = pg
            .query_one(
                "SELECT format('slot active_pid=%s confirmed_flush_lsn=%s current=%s', active_pid, confirmed_flush_lsn, pg_current_wal_lsn()) FROM pg_replication_slots WHERE slot_name = $1",
                &[&self.slot],
            )
            .await
            .map(|r| r.get::<_, String>(0))
            .unwrap_or_else(|e| e.to_string());
        let depth = match self.amqp.create_channel().await {
            Ok(ch) => ch
                .queue_declare(
                    self.queue.as_str().into(),
                    QueueDeclareOptions {
                        passive: true,
                        ..Default::default()
                    },
                    FieldTable::default(),
                )
                .await
                .map(|q| {
                    format!(
                        "queue depth {} consumers {}",
                        q.message_count(),
                        q.consumer_count()
                    )
                })
                .unwrap_or_else(|e| e.to_string()),
            Err(e) => e.to_string(),
        };
        format!("{slot}; {depth}")
    }

    /// Everything delivered within `wait`.
    pub async fn drain_for(&mut self, wait: Duration) -> Vec<Received> {
        let rx = self.consumer.as_mut().expect("start_consumer first");
        let mut got = Vec::new();
        let end = Instant::now() + wait;
        while let Ok(Some(r)) =
            tokio::time::timeout(end.saturating_duration_since(Instant::now()), rx.recv()).await
        {
            got.push(r);
        }
        got
    }

    /// The slot's `confirmed_flush_lsn`.
    pub async fn confirmed_flush_lsn(&self, pg: &Client) -> Lsn {
        let s: String = pg
            .query_one(
                "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
                &[&self.slot],
            )
            .await
            .unwrap()
            .get(0);
        s.parse().unwrap()
    }

    /// Waits until the slot is no longer held by a walsender.
    pub async fn wait_slot_inactive(&self, pg: &Client) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let active: bool = pg
                .query_one(
                    "SELECT active FROM pg_replication_slots WHERE slot_name = $1",
                    &[&self.slot],
                )
                .await
                .unwrap()
                .get(0);
            if !active {
                return;
            }
            assert!(Instant::now() < deadline, "slot {} still active", self.slot);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Drops what the test created.
    pub async fn cleanup(self) {
        let pg = pg_connect_retry().await;
        let _ = pg
            .execute(
                "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = $1 AND active_pid IS NOT NULL",
                &[&self.slot],
            )
            .await;
        for _ in 0..50 {
            if pg
                .execute("SELECT pg_drop_replication_slot($1)", &[&self.slot])
                .await
                .is_ok()
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let _ = pg
            .batch_execute(&format!(
                "DROP PUBLICATION IF EXISTS {}; DROP TABLE IF EXISTS {};",
                self.publication, self.table
            ))
            .await;
        if let Ok(ch) = self.amqp.create_channel().await {
            let _ = ch
                .queue_delete(self.queue.as_str().into(), QueueDeleteOptions::default())
                .await;
            let _ = ch
                .exchange_delete(
                    self.exchange.as_str().into(),
                    ExchangeDeleteOptions::default(),
                )
                .await;
        }
    }
}

/// A running relay process.
pub struct Relay {
    pub child: Child,
    pub log: PathBuf,
}

impl Relay {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// `kill -9`.
    pub fn kill9(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM, then waits for exit; returns the exit status and stdout.
    pub fn sigterm(mut self) -> (std::process::ExitStatus, String) {
        signal(self.pid(), "TERM");
        let status = wait_timeout(&mut self.child, Duration::from_secs(30)).unwrap_or_else(|| {
            panic!(
                "relay did not exit after SIGTERM; log:\n{}",
                self.log_tail()
            )
        });
        let out = std::fs::read_to_string(self.log.with_extension("out")).unwrap_or_default();
        (status, out)
    }

    /// Peak resident set size so far, in bytes (Linux `VmHWM`).
    pub fn peak_rss_bytes(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap();
        let kb: u64 = status
            .lines()
            .find(|l| l.starts_with("VmHWM:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .expect("VmHWM in /proc/PID/status");
        kb * 1024
    }

    pub fn is_running(&mut self) -> bool {
        self.child.try_wait().ok().flatten().is_none()
    }

    pub fn log_tail(&self) -> String {
        let s = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = s.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn signal(pid: u32, sig: &str) {
    let _ = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status();
}

pub fn wait_timeout(child: &mut Child, d: Duration) -> Option<std::process::ExitStatus> {
    let end = Instant::now() + d;
    while Instant::now() < end {
        if let Ok(Some(s)) = child.try_wait() {
            return Some(s);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    None
}

/// Counts deliveries per message id.
pub fn count_by_id(got: &[Received]) -> HashMap<String, usize> {
    let mut m = HashMap::new();
    for r in got {
        *m.entry(r.message_id()).or_insert(0) += 1;
    }
    m
}

pub fn repo_path(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)
}
