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
        let ddl = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/sql/outbox.sql"))
            .unwrap()
            .replace("CREATE TABLE outbox", "CREATE TABLE {table}");
        Self::with_ddl(test, rabbitmq_extra, &ddl).await
    }

    /// As [`Fixture::with_config`], creating the outbox table with `ddl`
    /// (`{table}` stands for the table's name).
    pub async fn with_ddl(test: &str, rabbitmq_extra: &str, ddl: &str) -> Fixture {
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
        pg.batch_execute(&ddl.replace("{table}", &f.table))
            .await
            .unwrap();

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
        self.spawn_relay_env(&[])
    }

    /// As [`Fixture::spawn_relay`], with extra environment variables.
    pub fn spawn_relay_env(&self, env: &[(&str, &str)]) -> Relay {
        let k = COUNTER.fetch_add(1, Ordering::SeqCst);
        let log = self.dir.path().join(format!("relay-{k}.log"));
        let mut cmd = self.relay_cmd("run");
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd
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
        let q = self.queue.clone();
        self.consumer = Some(self.consume(&q).await);
    }

    /// Consumes `queue` (no-ack) into a channel.
    pub async fn consume(&self, queue: &str) -> tokio::sync::mpsc::UnboundedReceiver<Received> {
        let ch = self.amqp.create_channel().await.unwrap();
        let tag = format!("c_{}_{}", queue, COUNTER.fetch_add(1, Ordering::SeqCst));
        let mut consumer = ch
            .basic_consume(
                queue.into(),
                tag.as_str().into(),
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
        rx
    }

    /// Declares a durable topic exchange and a durable queue bound to it
    /// with `key`; both are deleted by [`Fixture::cleanup`] when named with
    /// the fixture's name (use [`Fixture::scoped`]).
    pub async fn declare_bound(&self, exchange: &str, queue: Option<&str>, key: &str) {
        let ch = self.amqp.create_channel().await.unwrap();
        ch.exchange_declare(
            exchange.into(),
            ExchangeKind::Topic,
            ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
        if let Some(queue) = queue {
            ch.queue_declare(
                queue.into(),
                QueueDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap();
            ch.queue_bind(
                queue.into(),
                exchange.into(),
                key.into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        }
    }

    /// Sends everything the test exchange routes to a transient queue that
    /// keeps only the newest few messages (the test queue is unbound): for
    /// gigabytes of large rows that nobody reads back.
    pub async fn bottomless_queue(&self) {
        let ch = self.amqp.create_channel().await.unwrap();
        let q = self.scoped("bottomless");
        let mut args = FieldTable::default();
        args.insert("x-max-length".into(), AMQPValue::LongInt(8));
        ch.queue_declare(
            q.as_str().into(),
            QueueDeclareOptions {
                auto_delete: true,
                ..Default::default()
            },
            args,
        )
        .await
        .unwrap();
        ch.queue_bind(
            q.as_str().into(),
            self.exchange.as_str().into(),
            "#".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
        self.rebind_queue("nothing.is.routed.here").await;
    }

    /// Inserts `rows` rows whose payload is about `bytes` bytes, `per_tx`
    /// rows per transaction; returns the WAL position after the last commit.
    pub async fn insert_large(&self, pg: &Client, rows: i64, bytes: i64, per_tx: i64) -> Lsn {
        let mut done = 0;
        while done < rows {
            let n = per_tx.min(rows - done);
            pg.execute(
                &format!(
                    "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload) \
                     SELECT 'big', 'b' || g, 'large', jsonb_build_object('pad', repeat(md5(g::text), ($2::bigint / 32)::int)) \
                     FROM generate_series(1, $1::bigint) g",
                    self.table
                ),
                &[&n, &bytes],
            )
            .await
            .unwrap();
            done += n;
        }
        let lsn: String = pg
            .query_one("SELECT pg_current_wal_insert_lsn()::text", &[])
            .await
            .unwrap()
            .get(0);
        lsn.parse().unwrap()
    }

    /// Re-binds the test queue to the test exchange with `key` only.
    pub async fn rebind_queue(&self, key: &str) {
        let ch = self.amqp.create_channel().await.unwrap();
        ch.queue_unbind(
            self.queue.as_str().into(),
            self.exchange.as_str().into(),
            "#".into(),
            FieldTable::default(),
        )
        .await
        .unwrap();
        ch.queue_bind(
            self.queue.as_str().into(),
            self.exchange.as_str().into(),
            key.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    }

    /// A name unique to this fixture, e.g. for a dead-letter exchange.
    pub fn scoped(&self, what: &str) -> String {
        format!("{what}_{}", self.name)
    }

    /// Rewrites the config with extra TOML for `[rabbitmq]` and `[postgres]`.
    pub fn set_config_extra(&self, rabbitmq_extra: &str, postgres_extra: &str) {
        let text = self.config_text(rabbitmq_extra).replace(
            "status_interval_ms = 200",
            &format!("status_interval_ms = 200\n{postgres_extra}"),
        );
        std::fs::write(&self.config, text).unwrap();
    }

    /// Waits for the relay process to exit by itself; returns status and stderr.
    pub fn wait_exit(relay: &mut Relay, within: Duration) -> (std::process::ExitStatus, String) {
        let status = wait_timeout(&mut relay.child, within).unwrap_or_else(|| {
            panic!(
                "relay still running after {within:?}; log:\n{}",
                relay.log_tail()
            )
        });
        (
            status,
            std::fs::read_to_string(&relay.log).unwrap_or_default(),
        )
    }

    /// [`Fixture::collect_until`] with the usual 30 s and no settling time.
    pub async fn expect_delivered(&mut self, ids: &[String], relay: &Relay) -> Vec<Received> {
        self.collect_until(ids, Duration::from_secs(30), Duration::ZERO, Some(relay))
            .await
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

    /// SIGTERM, and the relay must exit 0.
    pub fn stop_ok(self) {
        let (status, out) = self.sigterm();
        assert!(status.success(), "relay exited {status}: {out}");
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

// ---------------------------------------------------------------------------
// Failure injection (broker_faults, pg_faults, takeover, chaos): a consumer
// that outlives the broker, producers that outlive PostgreSQL, slot and
// walsender probes, a seeded PRNG.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use lapin::options::BasicAckOptions;

impl Fixture {
    /// Like [`Fixture::start_consumer`], but survives the broker: when its
    /// connection dies (broker stopped, connections force-closed) it connects
    /// again and re-subscribes, feeding the same receiver, so `collect_until`
    /// and `drain_for` see one stream across faults. Messages wait in the
    /// durable queue meanwhile, so the outage loses nothing to the test.
    ///
    /// It acks each delivery once recorded (rather than no-ack), so that a
    /// delivery in flight when the connection died is requeued by the broker
    /// instead of lost with the socket. A broker *redelivery* of a message id
    /// already recorded is not recorded again: the duplicates the tests count
    /// are then copies the relay published, not echoes of the test's own
    /// reconnects.
    ///
    /// Returns the number of subscriptions so far (1 once this returns).
    pub async fn start_reconnecting_consumer(&mut self) -> Arc<AtomicU32> {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
        let subscriptions = Arc::new(AtomicU32::new(0));
        let subs = subscriptions.clone();
        let queue = self.queue.clone();
        let tag = format!("rc_{}", self.name);
        tokio::spawn(async move {
            let mut ready = Some(ready_tx);
            let mut seen = HashSet::new();
            loop {
                let conn = amqp_connect().await;
                let consumer = match conn.create_channel().await {
                    Ok(ch) => ch
                        .basic_consume(
                            queue.as_str().into(),
                            tag.as_str().into(),
                            BasicConsumeOptions::default(),
                            FieldTable::default(),
                        )
                        .await
                        .ok(),
                    Err(_) => None,
                };
                if let Some(mut consumer) = consumer {
                    subs.fetch_add(1, Ordering::SeqCst);
                    if let Some(r) = ready.take() {
                        let _ = r.send(());
                    }
                    loop {
                        let next = tokio::select! {
                            d = consumer.next() => d,
                            // A dead connection does not always end the
                            // stream promptly: watch it too.
                            _ = tokio::time::sleep(Duration::from_millis(500)) => {
                                if conn.status().connected() { continue } else { None }
                            }
                        };
                        let Some(Ok(d)) = next else { break };
                        let r = Received {
                            exchange: d.exchange.to_string(),
                            routing_key: d.routing_key.to_string(),
                            body: d.data,
                            properties: d.properties,
                        };
                        let fresh = seen.insert(r.message_id());
                        if (fresh || !d.redelivered) && tx.send(r).is_err() {
                            return; // the test is done with us
                        }
                        let _ = tokio::time::timeout(
                            Duration::from_secs(5),
                            d.acker.ack(BasicAckOptions::default()),
                        )
                        .await;
                    }
                }
                let _ = tokio::time::timeout(
                    Duration::from_secs(2),
                    conn.close(200, "test consumer reconnecting".into()),
                )
                .await;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        });
        ready_rx
            .await
            .expect("test consumer task ended before subscribing");
        self.consumer = Some(rx);
        subscriptions
    }

    /// Replaces the fixture's own AMQP connection if a broker fault killed
    /// it (`diagnostics` and `cleanup` use it).
    pub async fn refresh_amqp(&mut self) {
        if !self.amqp.status().connected() {
            self.amqp = amqp_connect().await;
        }
    }

    /// Collects deliveries into `all` until every id in `ids` has been seen
    /// at least once in `all` (then for `settle` more); panics after
    /// `timeout` naming what is missing, like `collect_until`.
    pub async fn collect_rest(
        &mut self,
        all: &mut Vec<Received>,
        ids: &[String],
        timeout: Duration,
        settle: Duration,
        relay: Option<&Relay>,
    ) {
        let seen: HashSet<String> = all.iter().map(|r| r.message_id()).collect();
        let not_yet: Vec<String> = ids.iter().filter(|i| !seen.contains(*i)).cloned().collect();
        let rest = self.collect_until(&not_yet, timeout, settle, relay).await;
        all.extend(rest);
    }

    /// Drains deliveries into `all` until at least `n` more arrived; panics
    /// after `timeout`.
    pub async fn wait_deliveries(
        &mut self,
        all: &mut Vec<Received>,
        n: usize,
        timeout: Duration,
        relay: Option<&Relay>,
    ) {
        let end = Instant::now() + timeout;
        let target = all.len() + n;
        while all.len() < target {
            assert!(
                Instant::now() < end,
                "only {} of {n} deliveries within {timeout:?}; relay log:\n{}",
                n + all.len() - target,
                relay.map(|r| r.log_tail()).unwrap_or_default()
            );
            all.extend(self.drain_for(Duration::from_millis(100)).await);
        }
    }

    /// `active_pid` of the slot: the walsender streaming it, if any.
    pub async fn slot_active_pid(&self, pg: &Client) -> Option<i32> {
        pg.query_one(
            "SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1",
            &[&self.slot],
        )
        .await
        .expect("reading pg_replication_slots")
        .get(0)
    }

    /// Waits until a walsender other than `not` streams the slot; returns its
    /// pid, or `None` after `timeout`. Reconnects to PostgreSQL as needed.
    pub async fn wait_slot_active(&self, not: Option<i32>, timeout: Duration) -> Option<i32> {
        let end = Instant::now() + timeout;
        let mut pg = pg_connect_retry().await;
        loop {
            match pg
                .query_one(
                    "SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1",
                    &[&self.slot],
                )
                .await
            {
                Ok(row) => {
                    // (No let-chains: the crate's MSRV is 1.85.)
                    let pid: Option<i32> = row.get(0);
                    if pid.is_some() && pid != not {
                        return pid;
                    }
                }
                Err(_) => pg = pg_connect_retry().await,
            }
            if Instant::now() >= end {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// `pg_terminate_backend` of the walsender streaming the slot; returns
    /// its pid, or `None` when nobody streams it.
    pub async fn terminate_walsender(&self, pg: &Client) -> Option<i32> {
        pg.query_opt(
            "SELECT active_pid FROM pg_replication_slots \
             WHERE slot_name = $1 AND active_pid IS NOT NULL AND pg_terminate_backend(active_pid)",
            &[&self.slot],
        )
        .await
        .expect("terminating the walsender")
        .map(|r| r.get(0))
    }

    /// Waits until the slot's `confirmed_flush_lsn` reaches `target`; returns
    /// it. Panics after `timeout` with diagnostics.
    pub async fn wait_confirmed_at_least(
        &self,
        target: Lsn,
        timeout: Duration,
        relay: Option<&Relay>,
    ) -> Lsn {
        let end = Instant::now() + timeout;
        let mut pg = pg_connect_retry().await;
        loop {
            let s = pg
                .query_one(
                    "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
                    &[&self.slot],
                )
                .await;
            match s {
                Ok(row) => {
                    let lsn: Lsn = row.get::<_, String>(0).parse().unwrap();
                    if lsn >= target {
                        return lsn;
                    }
                    if Instant::now() >= end {
                        let diag = self.diagnostics().await;
                        panic!(
                            "confirmed_flush_lsn {lsn} did not reach the last commit {target} within {timeout:?}; {diag}\nrelay log:\n{}",
                            relay.map(|r| r.log_tail()).unwrap_or_default()
                        );
                    }
                }
                Err(_) => pg = pg_connect_retry().await,
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// `pg_current_wal_insert_lsn()`.
pub async fn wal_insert_lsn(pg: &Client) -> Lsn {
    let s: String = pg
        .query_one("SELECT pg_current_wal_insert_lsn()::text", &[])
        .await
        .unwrap()
        .get(0);
    s.parse().unwrap()
}

/// Walsenders of relays: `(pid, client_port)` of every `pg_stat_replication`
/// row with `application_name = 'outbox-relay'`.
pub async fn relay_walsenders(pg: &Client) -> Vec<(i32, Option<i32>)> {
    pg.query(
        "SELECT pid, client_port FROM pg_stat_replication WHERE application_name = 'outbox-relay'",
        &[],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| (r.get(0), r.get(1)))
    .collect()
}

/// Which of `pids` owns the TCP socket whose local port is `port` (the
/// client end of a connection, as `pg_stat_replication.client_port` shows
/// it): matches the socket inode in /proc/net/tcp* with /proc/PID/fd.
pub fn socket_owner(pids: &[u32], port: u16) -> Option<u32> {
    let mut inodes = HashSet::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let text = std::fs::read_to_string(table).unwrap_or_default();
        for line in text.lines().skip(1) {
            let cols: Vec<&str> = line.split_whitespace().collect();
            let local_port = cols
                .get(1)
                .and_then(|a| a.rsplit(':').next())
                .and_then(|p| u16::from_str_radix(p, 16).ok());
            if let (Some(p), Some(inode)) = (local_port, cols.get(9)) {
                if p == port {
                    inodes.insert(format!("socket:[{inode}]"));
                }
            }
        }
    }
    pids.iter().copied().find(|pid| {
        std::fs::read_dir(format!("/proc/{pid}/fd"))
            .map(|dir| {
                dir.flatten().any(|fd| {
                    std::fs::read_link(fd.path())
                        .map(|l| inodes.contains(&l.to_string_lossy().into_owned()))
                        .unwrap_or(false)
                })
            })
            .unwrap_or(false)
    })
}

/// Runs a blocking server control command off the async worker threads.
pub async fn ctl_async(f: fn(&[&str]), args: &'static [&'static str]) {
    tokio::task::spawn_blocking(move || f(args))
        .await
        .expect("server control command panicked");
}

impl Relay {
    /// The whole log so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits (polling every 100 ms) until the log contains `needle`; false
    /// if `within` passes first.
    pub async fn wait_log(&self, needle: &str, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        while !self.log_text().contains(needle) {
            if Instant::now() > deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        true
    }

    /// Panics, with the log, if the process has exited.
    pub fn assert_running(&mut self, context: &str) {
        if let Ok(Some(status)) = self.child.try_wait() {
            panic!(
                "relay exited ({status}) {context}; it should have reconnected; log:\n{}",
                self.log_tail()
            );
        }
    }
}

/// Small deterministic PRNG (xorshift64*), so a seed replays a schedule.
#[derive(Debug, Clone)]
pub struct XorShift(u64);

impl XorShift {
    pub fn new(seed: u64) -> Self {
        // splitmix64 of the seed: any seed, 0 included, gives a good state.
        let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        XorShift((z ^ (z >> 31)) | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
    /// Uniform duration in `lo_ms..hi_ms` milliseconds.
    pub fn millis(&mut self, lo_ms: u64, hi_ms: u64) -> Duration {
        Duration::from_millis(lo_ms + self.below(hi_ms - lo_ms))
    }
}

/// An outbox event as its producer knows it.
#[derive(Debug, Clone)]
pub struct Produced {
    pub id: String,
    pub aggregate: String,
    /// Per-aggregate sequence number (also in the payload as `seq`).
    pub seq: u64,
}

/// What a producer did.
#[derive(Debug, Default)]
pub struct ProducerReport {
    /// Events of transactions whose COMMIT returned Ok, in commit order.
    pub committed: Vec<Produced>,
    /// Events of transactions that certainly did not commit: rolled back on
    /// purpose, or cut off before COMMIT was sent.
    pub rolled_back: Vec<String>,
    /// Events of transactions whose COMMIT was sent but did not return Ok
    /// (connection lost): they may or may not have committed.
    pub in_doubt: Vec<Produced>,
    pub committed_txs: usize,
    pub rolled_back_txs: usize,
    pub failed_txs: usize,
    /// `pg_current_wal_insert_lsn()` right after the last COMMIT that
    /// returned Ok; `None` if there was none, or if that query failed (then
    /// the caller must use a later position).
    pub last_commit_lsn: Option<Lsn>,
}

/// How a producer behaves.
#[derive(Debug, Clone)]
pub struct ProducerSpec {
    /// Aggregate ids are `{name}-{k}` for `k` in `0..aggregates`. No other
    /// producer writes them and a producer's transactions are sequential, so
    /// per aggregate, sequence order is commit order.
    pub name: String,
    pub aggregates: u64,
    /// Events per transaction: uniform in `1..=max_events_per_tx`.
    pub max_events_per_tx: u64,
    /// Roll back about one transaction in this many (0: never).
    pub rollback_one_in: u64,
    /// Pause between transactions.
    pub pause: Duration,
    pub seed: u64,
}

impl ProducerSpec {
    pub fn new(name: &str, seed: u64) -> Self {
        ProducerSpec {
            name: name.to_owned(),
            aggregates: 4,
            max_events_per_tx: 3,
            rollback_one_in: 0,
            pause: Duration::from_millis(10),
            seed,
        }
    }
}

/// Commits transactions into the outbox until `stop` is set, reconnecting
/// whenever PostgreSQL goes away. A transaction counts as committed only
/// when COMMIT returned Ok. `synchronous_commit = on` for these sessions
/// (the harness turns it off server-wide): a COMMIT that returned Ok is then
/// in the WAL on disk and survives even an immediate shutdown, so a missing
/// event is the relay's fault, not an asynchronous commit the crash ate.
pub fn spawn_producer(
    fx: &Fixture,
    spec: ProducerSpec,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<ProducerReport> {
    const OP_TIMEOUT: Duration = Duration::from_secs(20);
    let sql = fx.insert_sql();
    tokio::spawn(async move {
        let mut rng = XorShift::new(spec.seed);
        let mut report = ProducerReport::default();
        let mut seqs = vec![0u64; spec.aggregates as usize];
        let mut conn: Option<(Client, tokio_postgres::Statement)> = None;
        while !stop.load(Ordering::SeqCst) {
            let (pg, stmt) = match &conn {
                Some(c) => c,
                None => {
                    let pg = pg_connect_retry().await;
                    let prepared = async {
                        pg.batch_execute("SET synchronous_commit = on").await?;
                        pg.prepare(&sql).await
                    }
                    .await;
                    match prepared {
                        Ok(stmt) => conn.insert((pg, stmt)),
                        Err(_) => {
                            tokio::time::sleep(Duration::from_millis(200)).await;
                            continue;
                        }
                    }
                }
            };
            let n = 1 + rng.below(spec.max_events_per_tx);
            let mut events: Vec<Produced> = (0..n)
                .map(|_| {
                    let k = rng.below(spec.aggregates) as usize;
                    seqs[k] += 1;
                    Produced {
                        id: String::new(),
                        aggregate: format!("{}-{k}", spec.name),
                        seq: seqs[k],
                    }
                })
                .collect();
            let rollback = spec.rollback_one_in > 0 && rng.below(spec.rollback_one_in) == 0;

            // BEGIN and the INSERTs. A failure here means COMMIT was never
            // sent: the transaction cannot have committed.
            let body = tokio::time::timeout(OP_TIMEOUT, async {
                pg.batch_execute("BEGIN").await?;
                for e in events.iter_mut() {
                    let payload = serde_json::json!({
                        "producer": spec.name, "aggregate": e.aggregate, "seq": e.seq,
                    });
                    let row = pg
                        .query_one(
                            stmt,
                            &[&"order", &e.aggregate, &"placed", &payload.to_string()],
                        )
                        .await?;
                    e.id = row.get(0);
                }
                Ok::<_, tokio_postgres::Error>(())
            })
            .await;
            let ids = || {
                events
                    .iter()
                    .filter(|e| !e.id.is_empty())
                    .map(|e| e.id.clone())
            };
            if !matches!(body, Ok(Ok(()))) {
                report.rolled_back.extend(ids());
                report.failed_txs += 1;
                conn = None;
                continue;
            }
            if rollback {
                report.rolled_back.extend(ids());
                report.rolled_back_txs += 1;
                if !matches!(
                    tokio::time::timeout(OP_TIMEOUT, pg.batch_execute("ROLLBACK")).await,
                    Ok(Ok(()))
                ) {
                    conn = None;
                }
            } else {
                match tokio::time::timeout(OP_TIMEOUT, pg.batch_execute("COMMIT")).await {
                    Ok(Ok(())) => {
                        report.committed.extend(events);
                        report.committed_txs += 1;
                        report.last_commit_lsn = match tokio::time::timeout(
                            OP_TIMEOUT,
                            pg.query_one("SELECT pg_current_wal_insert_lsn()::text", &[]),
                        )
                        .await
                        {
                            Ok(Ok(row)) => Some(row.get::<_, String>(0).parse().unwrap()),
                            _ => {
                                conn = None;
                                None
                            }
                        };
                    }
                    _ => {
                        report.in_doubt.extend(events);
                        report.failed_txs += 1;
                        conn = None;
                    }
                }
            }
            tokio::time::sleep(spec.pause).await;
        }
        report
    })
}

/// Checks deliveries against what producers did: every committed event
/// delivered, nothing rolled back delivered, nothing unknown delivered
/// (in-doubt events may or may not arrive). Returns the duplicate count.
pub fn check_deliveries(reports: &[&ProducerReport], got: &[Received]) -> usize {
    let counts = count_by_id(got);
    let committed: Vec<&Produced> = reports.iter().flat_map(|r| &r.committed).collect();
    let missing: Vec<&str> = committed
        .iter()
        .filter(|e| !counts.contains_key(&e.id))
        .map(|e| e.id.as_str())
        .collect();
    assert!(
        missing.is_empty(),
        "{} of {} committed events never arrived, e.g. {:?}",
        missing.len(),
        committed.len(),
        &missing[..missing.len().min(5)]
    );
    let rolled_back: HashSet<&String> = reports.iter().flat_map(|r| &r.rolled_back).collect();
    let leaked: Vec<&String> = counts
        .keys()
        .filter(|id| rolled_back.contains(id))
        .collect();
    assert!(
        leaked.is_empty(),
        "{} events of transactions that never committed were delivered, e.g. {:?}",
        leaked.len(),
        &leaked[..leaked.len().min(5)]
    );
    let known: HashSet<&String> = reports
        .iter()
        .flat_map(|r| r.committed.iter().chain(&r.in_doubt))
        .map(|e| &e.id)
        .collect();
    let unknown: Vec<&String> = counts.keys().filter(|id| !known.contains(id)).collect();
    assert!(
        unknown.is_empty(),
        "{} deliveries of events no producer wrote, e.g. {:?}",
        unknown.len(),
        &unknown[..unknown.len().min(5)]
    );
    counts.values().map(|c| c - 1).sum()
}

/// A throwaway PostgreSQL with the given `wal_level`, run as the `postgres`
/// OS user like the harness's .
pub struct ScratchPg {
    pub dir: tempfile::TempDir,
    pub port: u16,
}

impl ScratchPg {
    pub fn start(wal_level: &str) -> ScratchPg {
        Self::start_with(wal_level, "")
    }

    /// With extra `postgres` options, e.g. `-c name=value`.
    pub fn start_with(wal_level: &str, extra_opts: &str) -> ScratchPg {
        let bin = pg_bin();
        let dir = tempfile::Builder::new()
            .prefix("outbox-scratch-pg")
            .tempdir()
            .unwrap();
        let data = dir.path().join("data");
        let chown = Command::new("chown")
            .arg("-R")
            .arg("postgres:postgres")
            .arg(dir.path())
            .status()
            .unwrap();
        assert!(chown.success());
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let ok = Command::new("runuser")
            .args(["-u", "postgres", "--"])
            .arg(bin.join("initdb"))
            .args(["-A", "trust", "-U", "postgres", "-D"])
            .arg(&data)
            .output()
            .unwrap();
        assert!(
            ok.status.success(),
            "initdb: {}",
            String::from_utf8_lossy(&ok.stderr)
        );
        let opts = format!(
            "-p {port} -k {} -c listen_addresses=127.0.0.1 -c wal_level={wal_level} -c fsync=off {extra_opts}",
            dir.path().display()
        );
        let ok = Command::new("runuser")
            .args(["-u", "postgres", "--"])
            .arg(bin.join("pg_ctl"))
            .args(["-w", "-D"])
            .arg(&data)
            .args(["-o", &opts, "-l"])
            .arg(dir.path().join("log"))
            .arg("start")
            .output()
            .unwrap();
        assert!(
            ok.status.success(),
            "pg_ctl start: {}",
            String::from_utf8_lossy(&ok.stderr)
        );
        ScratchPg { dir, port }
    }

    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }
}

impl Drop for ScratchPg {
    fn drop(&mut self) {
        let _ = Command::new("runuser")
            .args(["-u", "postgres", "--"])
            .arg(pg_bin().join("pg_ctl"))
            .args(["-m", "immediate", "-D"])
            .arg(self.dir.path().join("data"))
            .arg("stop")
            .output();
    }
}

pub fn pg_bin() -> PathBuf {
    let mut versions: Vec<_> = std::fs::read_dir("/usr/lib/postgresql")
        .expect("PostgreSQL server packages in /usr/lib/postgresql")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("bin/initdb").exists())
        .collect();
    versions.sort();
    versions
        .pop()
        .expect("a PostgreSQL version with initdb")
        .join("bin")
}

/// `GET path` over HTTP/1.0: the status code and the body.
pub async fn http_get(addr: &str, path: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut buf = String::new();
    s.read_to_string(&mut buf).await.unwrap();
    let code = buf.split_whitespace().nth(1).unwrap().parse().unwrap();
    let body = buf.split("\r\n\r\n").nth(1).unwrap_or_default().to_owned();
    (code, body)
}
