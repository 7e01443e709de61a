//! The per-test fixture: names, table, slot, exchange and queue, config, the relay command, inserts, consumers, cleanup.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use futures_util::StreamExt;
use lapin::options::{
    BasicConsumeOptions, ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Connection, ExchangeKind};
use outbox_relay::lsn::Lsn;
use tokio_postgres::Client;

use super::{Relay, amqp_connect_to, amqp_url, pg_connect_retry_to, pg_url};

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// The advisory lock that makes and drops relay roles one at a time.
pub const ROLE_LOCK: i64 = 7_140_371;

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
    pub(super) consumer: Option<tokio::sync::mpsc::UnboundedReceiver<Received>>,
    /// What the reconnecting consumer is doing, for failure messages.
    pub(super) consumer_state: Option<Arc<std::sync::Mutex<String>>>,
    /// The servers: the harness's own unless [`Fixture::on_servers`].
    /// `pg_url` is a superuser's, for the test itself and the operator's
    /// commands that change the schema (`setup`, `prune`).
    pub pg_url: String,
    pub amqp_urls: Vec<String>,
    /// The relay's own role, in its config: the least-privilege one
    /// `sql/role.sql` makes, unless the test asked for a superuser
    /// ([`Fixture::relay_as_superuser`]) or runs on other servers.
    pub relay_role: Option<RelayRole>,
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
        Self::build(
            test,
            rabbitmq_extra,
            ddl,
            (pg_url(), vec![amqp_url()]),
            false,
        )
        .await
    }

    /// As [`Fixture::new`], on other servers: `pg` (e.g. a primary/standby
    /// pair) and the broker nodes `amqp` (e.g. a cluster; the queue is
    /// then a quorum queue).
    pub async fn on_servers(test: &str, pg: &str, amqp: &[String]) -> Fixture {
        Self::on_servers_with(test, "", pg, amqp).await
    }

    /// As [`Fixture::on_servers`], with extra TOML in `[rabbitmq]`.
    pub async fn on_servers_with(
        test: &str,
        rabbitmq_extra: &str,
        pg: &str,
        amqp: &[String],
    ) -> Fixture {
        let ddl = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/sql/outbox.sql"))
            .unwrap()
            .replace("CREATE TABLE outbox", "CREATE TABLE {table}");
        Self::build(
            test,
            rabbitmq_extra,
            &ddl,
            (pg.to_owned(), amqp.to_vec()),
            amqp.len() > 1,
        )
        .await
    }

    async fn build(
        test: &str,
        rabbitmq_extra: &str,
        ddl: &str,
        (pg_url, amqp_urls): (String, Vec<String>),
        quorum: bool,
    ) -> Fixture {
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
            amqp: amqp_connect_to(&amqp_urls).await,
            consumer: None,
            consumer_state: None,
            name,
            pg_url,
            amqp_urls,
            relay_role: None,
        };
        let mut f = f;
        f.config = f.dir.path().join("relay.toml");
        std::fs::write(&f.config, f.config_text(rabbitmq_extra)).unwrap();
        let least_privilege = !quorum && f.pg_url == super::pg_url();

        let pg = pg_connect_retry_to(&f.pg_url).await;
        pg.batch_execute(&ddl.replace("{table}", &f.table))
            .await
            .unwrap();

        let mut args = FieldTable::default();
        if quorum {
            args.insert(
                "x-queue-type".into(),
                AMQPValue::LongString("quorum".into()),
            );
        }
        declare_bound_on(&f.amqp, &f.exchange, Some((&f.queue, args)), "#").await;

        let out = f.relay_cmd("setup").output().unwrap();
        assert!(
            out.status.success(),
            "setup failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        // A first setup says what it made (bbc3426 ran it twice and
        // printed the second pass: "already present" for both).
        let said = String::from_utf8_lossy(&out.stdout);
        for made in [
            format!("publication {}: created", f.publication),
            format!("replication slot {}: created", f.slot),
        ] {
            assert!(said.contains(&made), "setup did not say {made:?}: {said}");
        }
        // The relay runs as an operator would run it: a role with
        // REPLICATION, SELECT on its outbox and its own checkpoint row,
        // admitted by a database pg_hba line only.
        if least_privilege {
            f.relay_role = Some(f.least_privilege_role());
            std::fs::write(&f.config, f.config_text(rabbitmq_extra)).unwrap();
        }
        f
    }

    /// What an operator does for a table the relay's role was not granted
    /// (a new outbox, or one created again): `GRANT SELECT` to the role.
    pub async fn grant_to_relay(&self, pg: &Client, table: &str) {
        pg.batch_execute(&self.grant_sql(table)).await.unwrap();
    }

    /// [`Fixture::grant_to_relay`]'s statement (none for a superuser), to
    /// run in the transaction that creates the table.
    pub fn grant_sql(&self, table: &str) -> String {
        self.relay_role.as_ref().map_or(String::new(), |role| {
            format!("GRANT SELECT ON {table} TO \"{}\";", role.name)
        })
    }

    /// The relay's config names a superuser from now on (a test of what
    /// only an owner may do, or of tables `sql/role.sql` did not grant).
    pub async fn relay_as_superuser(&mut self) {
        let Some(role) = self.relay_role.take() else {
            return;
        };
        let text = std::fs::read_to_string(&self.config).unwrap().replace(
            &format!("url = \"{}\"", role.url),
            &format!("url = \"{}\"", self.pg_url),
        );
        std::fs::write(&self.config, text).unwrap();
        role.drop(&pg_connect_retry_to(&self.pg_url).await).await;
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
url = {amqp}
exchange = "{exchange}"
routing_key = "{{aggregate_type}}.{{event_type}}"
{rabbitmq_extra}

[http]
listen = "127.0.0.1:0"
"#,
            pg = self.relay_pg_url(),
            amqp = match &self.amqp_urls[..] {
                [one] => toml::Value::String(one.clone()),
                many => toml::Value::Array(
                    many.iter()
                        .map(|u| toml::Value::String(u.clone()))
                        .collect()
                ),
            },
            slot = self.slot,
            publication = self.publication,
            table = self.table,
            exchange = self.exchange,
        )
    }

    /// The PostgreSQL URL the relay's config names.
    pub fn relay_pg_url(&self) -> &str {
        self.relay_role.as_ref().map_or(&self.pg_url, |r| &r.url)
    }

    /// `outbox-relay <sub> --config <file>`; `setup` and `prune` (which
    /// change the schema or delete rows) as the superuser, as an operator
    /// would run them.
    pub fn relay_cmd(&self, sub: &str) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_outbox-relay"));
        c.arg(sub).arg("--config").arg(&self.config);
        if matches!(sub, "setup" | "prune") {
            c.env("OUTBOX_RELAY_POSTGRES_URL", &self.pg_url);
        }
        c.env(
            "OUTBOX_RELAY_LOG",
            std::env::var("TEST_RELAY_LOG").unwrap_or_else(|_| "info,outbox_relay=debug".into()),
        );
        c
    }

    /// Runs `outbox-relay <sub> <args>`; panics with what it said unless
    /// it succeeds; returns its standard output.
    pub fn relay_ok(&self, sub: &str, args: &[&str]) -> String {
        let out = self.relay_cmd(sub).args(args).output().unwrap();
        let said = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "{sub} {args:?} failed: {}{said}",
            String::from_utf8_lossy(&out.stderr)
        );
        said
    }

    /// Starts `outbox-relay run`, logging to a file in the test's directory.
    pub fn spawn_relay(&self) -> Relay {
        self.spawn_relay_env(&[])
    }

    /// As [`Fixture::spawn_relay`], with extra environment variables.
    pub fn spawn_relay_env(&self, env: &[(&str, &str)]) -> Relay {
        self.spawn_subcommand("run", env)
    }

    /// Starts `outbox-relay <sub>` (e.g. `recover`, to signal it half way)
    /// as [`Fixture::spawn_relay_env`] starts `run`.
    pub fn spawn_subcommand(&self, sub: &str, env: &[(&str, &str)]) -> Relay {
        let k = COUNTER.fetch_add(1, Ordering::SeqCst);
        let log = self.dir.path().join(format!("relay-{k}.log"));
        let mut cmd = self.relay_cmd(sub);
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
        Relay {
            child,
            log,
            started: std::time::Instant::now(),
        }
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

    /// Inserts `n` events, each in its own transaction, with payload
    /// `{"i": i}` and the aggregate id `aggregate_id(i)`; returns their ids
    /// in commit order.
    pub async fn insert_many(
        &self,
        pg: &Client,
        n: usize,
        aggregate_type: &str,
        aggregate_id: impl Fn(usize) -> String,
        event_type: &str,
    ) -> Vec<String> {
        let mut ids = Vec::with_capacity(n);
        for i in 0..n {
            let payload = serde_json::json!({ "i": i });
            ids.push(
                self.insert(pg, aggregate_type, &aggregate_id(i), event_type, &payload)
                    .await,
            );
        }
        ids
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
        consume_on(&self.amqp, queue).await
    }

    /// Declares a durable topic exchange and a durable queue bound to it
    /// with `key`; both are deleted by [`Fixture::cleanup`] when named with
    /// the fixture's name (use [`Fixture::scoped`]).
    pub async fn declare_bound(&self, exchange: &str, queue: Option<&str>, key: &str) {
        let queue = queue.map(|q| (q, FieldTable::default()));
        declare_bound_on(&self.amqp, exchange, queue, key).await;
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

    /// Declares a queue that holds one message and nacks every publish
    /// after it (`x-max-length = 1`, `x-overflow = reject-publish`), bound
    /// to the test exchange with `key`; returns its name.
    pub async fn full_queue(&self, key: &str) -> String {
        let full = self.scoped("full");
        let ch = self.amqp.create_channel().await.unwrap();
        let mut args = FieldTable::default();
        args.insert("x-max-length".into(), AMQPValue::LongInt(1));
        args.insert(
            "x-overflow".into(),
            AMQPValue::LongString("reject-publish".into()),
        );
        ch.queue_declare(full.as_str().into(), QueueDeclareOptions::default(), args)
            .await
            .unwrap();
        ch.queue_bind(
            full.as_str().into(),
            self.exchange.as_str().into(),
            key.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
        full
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

    /// Deletes a queue the test declared itself (`cleanup` deletes only the
    /// fixture's own); a queue already gone is fine.
    pub async fn delete_queue(&self, name: &str) {
        let ch = self.amqp.create_channel().await.unwrap();
        let _ = ch
            .queue_delete(name.into(), QueueDeleteOptions::default())
            .await;
    }

    /// A name unique to this fixture, e.g. for a dead-letter exchange.
    pub fn scoped(&self, what: &str) -> String {
        format!("{what}_{}", self.name)
    }

    /// A least-privilege role for this fixture, made by `sql/role.sql`
    /// itself (for its slot, outbox table and the checkpoint table), and
    /// its URL: the harness's server admits it with its database line only
    /// (`integration/servers.sh`: no replication line for it). Dropped with
    /// [`RelayRole::drop`].
    pub fn least_privilege_role(&self) -> RelayRole {
        let name = self.scoped(&format!("role{}", COUNTER.fetch_add(1, Ordering::SeqCst)));
        let password = format!("Pw-{}-NotInLogs", std::process::id());
        // One at a time, in one transaction: parallel tests' GRANTs on the
        // same database and checkpoint table (and DROP OWNED) otherwise
        // fail with "tuple concurrently updated", or deadlock.
        let out = Command::new("psql")
            .arg(&self.pg_url)
            .args(["-X", "-q", "-1", "-v", "ON_ERROR_STOP=1"])
            .args(["-c", &format!("SELECT pg_advisory_xact_lock({ROLE_LOCK})")])
            .args(["-v", &format!("relay_password={password}")])
            .args(["-v", &format!("relay_role={name}")])
            .args(["-v", &format!("slot={}", self.slot)])
            .args(["-v", &format!("outbox_table=public.{}", self.table)])
            .arg("-f")
            .arg(repo_path("sql/role.sql"))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "role.sql: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let (_, server) = self.pg_url.split_once('@').unwrap();
        let url = format!("postgres://{name}:{password}@{server}");
        RelayRole {
            name,
            password,
            url,
        }
    }

    /// Rewrites the config with extra TOML for `[rabbitmq]` and `[postgres]`.
    pub fn set_config_extra(&self, rabbitmq_extra: &str, postgres_extra: &str) {
        let text = self.config_text(rabbitmq_extra).replace(
            "status_interval_ms = 200",
            &format!("status_interval_ms = 200\n{postgres_extra}"),
        );
        std::fs::write(&self.config, text).unwrap();
    }

    /// Drops what the test created.
    pub async fn cleanup(self) {
        let pg = pg_connect_retry_to(&self.pg_url).await;
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
        if let Some(role) = self.relay_role {
            role.drop(&pg).await;
        }
    }
}

/// Consumes `queue` on `amqp` (no-ack) into a channel.
pub async fn consume_on(
    amqp: &Connection,
    queue: &str,
) -> tokio::sync::mpsc::UnboundedReceiver<Received> {
    let ch = amqp.create_channel().await.unwrap();
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

/// The default outbox table partitioned by list of `by` (in its primary
/// key with `id`), followed by `partitions` (`{table}` stands for the
/// table's name, as in [`Fixture::with_ddl`]).
pub fn partitioned_ddl(by: &str, partitions: &str) -> String {
    format!(
        "CREATE TABLE {{table}} (
  id             uuid        NOT NULL DEFAULT gen_random_uuid(),
  aggregate_type text        NOT NULL,
  aggregate_id   text        NOT NULL,
  event_type     text        NOT NULL,
  payload        jsonb       NOT NULL,
  headers        jsonb,
  created_at     timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY ({by}, id)
) PARTITION BY LIST ({by});
{partitions}"
    )
}

pub fn repo_path(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)
}

/// Declares on `amqp` a durable topic exchange and, if `queue` names one
/// (with its arguments), a durable queue bound to it with `key`.
pub async fn declare_bound_on(
    amqp: &lapin::Connection,
    exchange: &str,
    queue: Option<(&str, FieldTable)>,
    key: &str,
) {
    let ch = amqp.create_channel().await.unwrap();
    let durable = ExchangeDeclareOptions {
        durable: true,
        ..Default::default()
    };
    (ch.exchange_declare(
        exchange.into(),
        ExchangeKind::Topic,
        durable,
        FieldTable::default(),
    ))
    .await
    .unwrap();
    let Some((queue, args)) = queue else {
        return;
    };
    let durable = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    ch.queue_declare(queue.into(), durable, args).await.unwrap();
    let bind = QueueBindOptions::default();
    (ch.queue_bind(
        queue.into(),
        exchange.into(),
        key.into(),
        bind,
        FieldTable::default(),
    ))
    .await
    .unwrap();
}

/// A role `sql/role.sql` made ([`Fixture::least_privilege_role`]).
pub struct RelayRole {
    pub name: String,
    pub password: String,
    /// The fixture's server, as this role.
    pub url: String,
}

impl RelayRole {
    /// Drops the role, its grants and its checkpoint policy.
    pub async fn drop(self, pg: &Client) {
        if let Err(e) = pg
            .batch_execute(&format!(
                "BEGIN; SELECT pg_advisory_xact_lock({ROLE_LOCK}); \
                 DROP OWNED BY \"{0}\"; DROP ROLE \"{0}\"; COMMIT",
                self.name
            ))
            .await
        {
            eprintln!("dropping role {}: {e}", self.name);
            let _ = pg.batch_execute("ROLLBACK").await;
        }
    }
}
