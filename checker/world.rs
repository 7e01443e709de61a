//! What one run sets up and tears down: its outbox tables, the side
//! record, the publication, the relay's slot and role, an observer slot,
//! the exchanges and queues, the proxies in front of both servers, and the
//! relay's config.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};

use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use tokio_postgres::Client;

use crate::common::{
    Relay, amqp_connect, amqp_url, partitioned_ddl, pg_connect_retry, pg_url, repo_path,
};
use crate::proxy::Proxy;
use crate::schedule::{Schedule, Setup, Shape};

static RUNS: AtomicU32 = AtomicU32::new(0);

/// Aggregate types ordinary rows use; partitions exist for these.
pub const TYPES: [&str; 3] = ["order", "user", "late"];
/// Aggregates shared by every producer (the order oracle's unit).
pub const AGGREGATES: u64 = 6;

/// The running world's directory and prefix: what a run that hangs keeps.
pub static CURRENT: std::sync::Mutex<Option<(std::path::PathBuf, String)>> =
    std::sync::Mutex::new(None);

pub struct World {
    /// Every object's name starts with it.
    pub p: String,
    pub shape: Shape,
    pub tables: Vec<String>,
    /// The side record: one row per outbox event, in the event's own
    /// transaction (unpublished; the observer slot decodes it).
    pub record: String,
    pub bulk: String,
    pub slot: String,
    pub observer: String,
    pub publication: String,
    pub prefix: String,
    pub role: String,
    pub exchanges: Vec<String>,
    pub queue: String,
    pub dlq: String,
    pub victim: String,
    pub dlx: String,
    pub templated: bool,
    pub dir: tempfile::TempDir,
    pub config: PathBuf,
    pub pg_proxy: Proxy,
    pub amqp_proxy: Proxy,
    /// When the run started, by the database's clock (`--since`).
    pub started_at: String,
}

fn addr_of(url: &str) -> SocketAddr {
    let host_port = url
        .split('@')
        .nth(1)
        .and_then(|r| r.split('/').next())
        .expect("a URL with user@host:port/");
    host_port.parse().expect("host:port")
}

impl World {
    pub async fn create(s: &Schedule, pg: &Client) -> World {
        let n = RUNS.fetch_add(1, Ordering::SeqCst);
        let p = format!("chk{}_{n}", std::process::id());
        let setup = &s.setup;
        let tables: Vec<String> = (0..setup.shape.tables())
            .map(|i| format!("{p}_ob{i}"))
            .collect();
        let exchanges: Vec<String> = if setup.templated {
            TYPES.iter().map(|t| format!("{p}_{t}")).collect()
        } else {
            vec![format!("{p}_ex")]
        };
        let pg_proxy = Proxy::start(addr_of(&pg_url())).await;
        let amqp_proxy = Proxy::start(addr_of(&amqp_url())).await;
        let dir = tempfile::tempdir().unwrap();
        *CURRENT.lock().unwrap() = Some((dir.path().to_owned(), p.clone()));
        let w = World {
            shape: setup.shape,
            record: format!("{p}_rec"),
            bulk: format!("{p}_bulk"),
            slot: format!("{p}_slot"),
            observer: format!("{p}_obs"),
            publication: format!("{p}_pub"),
            prefix: format!("{p}_msg"),
            role: format!("{p}_role"),
            queue: format!("{p}_q"),
            dlq: format!("{p}_dlq"),
            victim: format!("{p}_victim"),
            dlx: format!("{p}_dlx"),
            templated: setup.templated,
            config: dir.path().join("relay.toml"),
            dir,
            tables,
            exchanges,
            pg_proxy,
            amqp_proxy,
            started_at: String::new(),
            p,
        };
        let mut w = w;
        sweep(pg, &w.p).await;
        for t in w.tables.clone() {
            pg.batch_execute(&w.table_ddl(&t)).await.unwrap();
        }
        pg.batch_execute(&format!(
            "CREATE TABLE {rec} (id text NOT NULL, agg text NOT NULL); \
             CREATE TABLE {bulk} (n int); \
             CREATE ROLE {role} LOGIN SUPERUSER REPLICATION PASSWORD 'chk-pw'; \
             ALTER ROLE {role} SET wal_sender_timeout = '{wst}s'",
            rec = w.record,
            bulk = w.bulk,
            role = w.role,
            wst = setup.wal_sender_timeout,
        ))
        .await
        .unwrap();
        // Before any event: the observer decodes every commit after it.
        // (Creating a slot waits for every running transaction, prepared
        // ones too.)
        let created = tokio::time::timeout(
            std::time::Duration::from_secs(60),
            pg.execute(
                "SELECT pg_create_logical_replication_slot($1, 'test_decoding')",
                &[&w.observer],
            ),
        )
        .await;
        assert!(
            matches!(created, Ok(Ok(_))),
            "creating the observer slot: {created:?} (a transaction left open on the server?)"
        );
        w.started_at = pg
            .query_one(
                "SELECT to_char(now() AT TIME ZONE 'UTC' - interval '1 second', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"')",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        w.declare(setup.bounded_queue).await;
        std::fs::write(&w.config, w.config_text(setup)).unwrap();
        let out = w.relay_cmd("setup").output().unwrap();
        assert!(
            out.status.success(),
            "setup failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        w
    }

    /// The DDL of outbox table `t` (the default table, or partitioned).
    pub fn table_ddl(&self, t: &str) -> String {
        if self.shape == Shape::Partitioned {
            // "late" gets its partition mid-run (attach-partition).
            let parts: String = TYPES[..2]
                .iter()
                .map(|ty| {
                    format!(
                        "CREATE TABLE {t}_{ty} PARTITION OF {t} FOR VALUES IN ('{p}_{ty}');\n",
                        p = self.p
                    )
                })
                .collect();
            partitioned_ddl("aggregate_type", &parts).replace("{table}", t)
        } else {
            std::fs::read_to_string(repo_path("sql/outbox.sql"))
                .unwrap()
                .replace("CREATE TABLE outbox", &format!("CREATE TABLE {t}"))
        }
    }

    /// The aggregate type of ordinary rows of kind `i`.
    pub fn aggregate_type(&self, i: usize) -> String {
        format!("{}_{}", self.p, TYPES[i % TYPES.len()])
    }

    async fn declare(&self, bounded: bool) {
        let amqp = amqp_connect().await;
        let ch = amqp.create_channel().await.unwrap();
        let durable = QueueDeclareOptions {
            durable: true,
            ..Default::default()
        };
        let mut args = FieldTable::default();
        if bounded {
            args.insert("x-max-length".into(), AMQPValue::LongInt(50));
            args.insert(
                "x-overflow".into(),
                AMQPValue::LongString("reject-publish".into()),
            );
        }
        for (q, a) in [
            (&self.queue, args),
            (&self.dlq, FieldTable::default()),
            (&self.victim, FieldTable::default()),
        ] {
            ch.queue_declare(q.as_str().into(), durable, a)
                .await
                .unwrap();
        }
        let bind = |ch: &lapin::Channel, q: &str, x: &str, key: &str| {
            let (ch, q, x, key) = (ch.clone(), q.to_owned(), x.to_owned(), key.to_owned());
            async move {
                ch.queue_bind(
                    q.as_str().into(),
                    x.as_str().into(),
                    key.as_str().into(),
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await
                .unwrap();
            }
        };
        for x in self.exchanges.iter().chain([&self.dlx]) {
            ch.exchange_declare(
                x.as_str().into(),
                lapin::ExchangeKind::Topic,
                ExchangeDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap();
        }
        for x in &self.exchanges {
            // Ordinary routing keys are `<type>.<event>`: never `victim.cc`.
            for t in TYPES {
                bind(&ch, &self.queue, x, &format!("{}_{t}.*", self.p)).await;
            }
            bind(&ch, &self.victim, x, "victim.cc").await;
        }
        bind(&ch, &self.dlq, &self.dlx, "#").await;
        let _ = amqp.close(200, "declared".into()).await;
    }

    fn config_text(&self, setup: &Setup) -> String {
        let pg: tokio_postgres::Config = pg_url().parse().unwrap();
        let db = pg.get_dbname().unwrap_or("postgres");
        let outboxes: String = match self.shape {
            Shape::Multi => self
                .tables
                .iter()
                .map(|t| format!("[[outbox]]\ntable = \"public.{t}\"\n\n"))
                .collect(),
            Shape::Messages => format!(
                "[[outbox]]\ntable = \"public.{}\"\n\n[[outbox]]\nsource = \"message\"\nprefix = \"{}\"\n\n",
                self.tables[0], self.prefix
            ),
            _ => format!("[outbox]\ntable = \"public.{}\"\n\n", self.tables[0]),
        };
        format!(
            r#"[postgres]
url = "postgres://{role}:chk-pw@{pgaddr}/{db}"
slot = "{slot}"
publication = "{publication}"
on_slot_lost = "recover"

{outboxes}[rabbitmq]
url = "amqp://guest:guest@{amqpaddr}/%2f"
exchange = "{exchange}"
routing_key = "{{aggregate_type}}.{{event_type}}"
dead_letter_exchange = "{dlx}"
shutdown_grace_secs = {grace}
channels = {channels}

[http]
listen = "127.0.0.1:0"
"#,
            role = self.role,
            pgaddr = self.pg_proxy.addr,
            amqpaddr = self.amqp_proxy.addr,
            slot = self.slot,
            publication = self.publication,
            exchange = if self.templated {
                "{aggregate_type}".to_owned()
            } else {
                self.exchanges[0].clone()
            },
            dlx = self.dlx,
            grace = setup.grace,
            channels = setup.channels,
        )
    }

    /// `outbox-relay <sub> --config <file>`.
    pub fn relay_cmd(&self, sub: &str) -> std::process::Command {
        // CHECK_RELAY_BIN: another build (a defect put back, to see the
        // checker find it).
        let bin = std::env::var("CHECK_RELAY_BIN")
            .unwrap_or_else(|_| env!("CARGO_BIN_EXE_outbox-relay").into());
        let mut c = std::process::Command::new(bin);
        c.arg(sub).arg("--config").arg(&self.config);
        c.env(
            "OUTBOX_RELAY_LOG",
            std::env::var("CHECK_RELAY_LOG").unwrap_or_else(|_| "info".into()),
        );
        // Text, with its UTC timestamps: the oracle reads when a relay
        // first logged a nack.
        c.env("OUTBOX_RELAY_LOG_FORMAT", "text");
        c
    }

    /// Starts `outbox-relay run`, its log in the run's directory.
    pub fn spawn_relay(&self) -> Relay {
        let k = RUNS.fetch_add(1, Ordering::SeqCst);
        let log = self.dir.path().join(format!("relay-{k}.log"));
        let child = self
            .relay_cmd("run")
            .stdout(std::fs::File::create(log.with_extension("out")).unwrap())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("starting the relay");
        Relay {
            child,
            log,
            started: std::time::Instant::now(),
        }
    }

    /// Drops what the run made (the observer slot included).
    pub async fn cleanup(&self) {
        // A later hang must not point at this run's directory.
        CURRENT.lock().unwrap().take();
        let pg = pg_connect_retry().await;
        for slot in [&self.slot, &self.observer] {
            for _ in 0..50 {
                let _ = pg
                    .execute(
                        "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots \
                         WHERE slot_name = $1 AND active_pid IS NOT NULL",
                        &[slot],
                    )
                    .await;
                let gone = pg
                    .query_opt(
                        "SELECT 1 FROM pg_replication_slots WHERE slot_name = $1",
                        &[slot],
                    )
                    .await
                    .map(|r| r.is_none())
                    .unwrap_or(false);
                if gone
                    || pg
                        .execute("SELECT pg_drop_replication_slot($1)", &[slot])
                        .await
                        .is_ok()
                {
                    break;
                }
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
        }
        let prepared = pg
            .query(
                "SELECT gid FROM pg_prepared_xacts WHERE gid LIKE $1",
                &[&format!("{}\\_%", self.p.replace('_', "\\_"))],
            )
            .await
            .unwrap_or_default();
        for r in prepared {
            let gid: String = r.get(0);
            let _ = pg
                .batch_execute(&format!("ROLLBACK PREPARED '{gid}'"))
                .await;
        }
        let mut ddl = format!(
            "DROP PUBLICATION IF EXISTS {pub_}; DROP TABLE IF EXISTS {rec}, {bulk}; ",
            pub_ = self.publication,
            rec = self.record,
            bulk = self.bulk
        );
        for t in &self.tables {
            ddl.push_str(&format!("DROP TABLE IF EXISTS {t} CASCADE; "));
        }
        let _ = pg.batch_execute(&ddl).await;
        // One by one: a failing statement must not keep the role.
        let _ = pg
            .execute(
                "DELETE FROM public.outbox_relay_checkpoint WHERE slot_name = $1",
                &[&self.slot],
            )
            .await;
        // What the role made (the checkpoint table, if it was the first)
        // is kept, for the next runs.
        let _ = pg
            .batch_execute(&format!(
                "REASSIGN OWNED BY {0} TO CURRENT_USER; DROP ROLE {0}",
                self.role
            ))
            .await;
        if let Ok(amqp) =
            tokio::time::timeout(std::time::Duration::from_secs(10), amqp_connect()).await
            && let Ok(ch) = amqp.create_channel().await
        {
            for q in [&self.queue, &self.dlq, &self.victim] {
                let _ = ch.queue_delete(q.as_str().into(), Default::default()).await;
            }
            for x in self.exchanges.iter().chain([&self.dlx]) {
                let _ = ch
                    .exchange_delete(x.as_str().into(), Default::default())
                    .await;
            }
        }
    }
}

/// Removes what earlier runs left on these servers (a run that hung, a
/// checker killed mid-run): their prepared transactions (which would block creating a
/// slot), slots (which hold WAL), tables and roles.
async fn sweep(pg: &Client, p: &str) {
    let mine = format!("{}\\_%", p.replace('_', "\\_"));
    let stale = |sql: &str| sql.replace("{mine}", &mine);
    for r in pg
        .query(
            &stale(
                "SELECT gid FROM pg_prepared_xacts WHERE gid LIKE 'chk%' AND gid NOT LIKE '{mine}'",
            ),
            &[],
        )
        .await
        .unwrap_or_default()
    {
        let gid: String = r.get(0);
        let _ = pg
            .batch_execute(&format!("ROLLBACK PREPARED '{gid}'"))
            .await;
    }
    let _ = pg
        .batch_execute(&stale(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots \
             WHERE slot_name LIKE 'chk%' AND slot_name NOT LIKE '{mine}' AND NOT active; \
             DO $$ DECLARE t text; BEGIN \
               FOR t IN SELECT tablename FROM pg_tables WHERE schemaname = 'public' \
                 AND tablename LIKE 'chk%' AND tablename NOT LIKE '{mine}' LOOP \
                 EXECUTE format('DROP TABLE IF EXISTS %I CASCADE', t); END LOOP; \
               FOR t IN SELECT pubname FROM pg_publication WHERE pubname LIKE 'chk%' \
                 AND pubname NOT LIKE '{mine}' LOOP \
                 EXECUTE format('DROP PUBLICATION %I', t); END LOOP; \
               FOR t IN SELECT rolname FROM pg_roles WHERE rolname LIKE 'chk%' \
                 AND rolname NOT LIKE '{mine}' LOOP \
                 EXECUTE format('REASSIGN OWNED BY %I TO CURRENT_USER; DROP ROLE %I', t, t); END LOOP; \
             END $$",
        ))
        .await;
}
