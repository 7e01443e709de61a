//! `outbox-relay check` against real servers: all `ok`/`warn` and exit 0 on
//! a good set-up; exit 1 and a `FAIL` line naming the problem for each
//! broken one; passwords never printed. Privileges: warnings for a
//! superuser and for a checkpoint table someone else owns or has put
//! triggers on; the least-privilege role of `sql/role.sql` relays, cannot
//! take a base backup, nor write another slot's checkpoint, nor be steered
//! by its search_path. A host of `postgres.url` of another cluster, or a
//! second primary of this one, fails.

use crate::common;
use crate::ha::{env_file, failover_fixture, fence_read_only, harness_async, host_port, pgha};

use std::net::TcpListener;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::*;

/// What one `check` run printed.
struct Checked {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

impl Checked {
    fn lines(&self) -> Vec<&str> {
        self.stdout.lines().collect()
    }

    /// The `FAIL` lines.
    fn fails(&self) -> Vec<&str> {
        self.lines()
            .into_iter()
            .filter(|l| l.starts_with("FAIL "))
            .collect()
    }

    /// Asserts exit 1 and a `FAIL` line containing every one of `words`.
    fn assert_fails_with(&self, words: &[&str]) {
        assert_eq!(self.code, Some(1), "{self}");
        assert!(
            self.fails()
                .iter()
                .any(|l| words.iter().all(|w| l.contains(w))),
            "no FAIL line containing {words:?}:\n{self}"
        );
    }

    fn assert_hides(&self, secret: &str) {
        assert!(
            !self.stdout.contains(secret) && !self.stderr.contains(secret),
            "password leaked:\n{self}"
        );
    }
}

impl std::fmt::Display for Checked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "exit {:?}\n--- stdout\n{}--- stderr\n{}",
            self.code, self.stdout, self.stderr
        )
    }
}

fn run_check(mut cmd: Command) -> Checked {
    let out = cmd.output().expect("running outbox-relay check");
    Checked {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// The role the fixture's relay logs in as.
fn relay_user(fx: &Fixture) -> &str {
    fx.relay_role
        .as_ref()
        .map_or("postgres", |r| r.name.as_str())
}

/// `check` of the fixture's config, with extra environment.
fn check(fx: &Fixture, env: &[(&str, &str)]) -> Checked {
    let mut cmd = fx.relay_cmd("check");
    cmd.envs(env.iter().copied());
    run_check(cmd)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn good_setup_is_all_ok() {
    let fx = Fixture::new("chk_good").await;
    let c = check(&fx, &[]);
    assert_eq!(c.code, Some(0), "{c}");
    for line in c.lines() {
        assert!(
            line.starts_with("ok ") || line.starts_with("warn "),
            "line {line:?}:\n{c}"
        );
    }
    // Every check, in order.
    let expected = [
        "ok PostgreSQL reachable at ".to_owned(),
        "ok wal_level = logical".to_owned(),
        "ok replication slots: ".to_owned(),
        "ok WAL senders: ".to_owned(),
        format!("ok role {} may replicate", relay_user(&fx)),
        format!("ok publication {:?}: publishes inserts", fx.publication),
        format!("ok outbox table public.{}: columns ", fx.table),
        format!("ok replication slot {:?}: pgoutput", fx.slot),
        "ok RabbitMQ reachable at ".to_owned(),
        format!("ok exchange {:?}: exists", fx.exchange),
    ];
    let lines = c.lines();
    let mut at = 0;
    for want in &expected {
        let found = lines[at..]
            .iter()
            .position(|l| l.starts_with(want.as_str()));
        let Some(i) = found else {
            panic!("no line starting with {want:?} (in order):\n{c}");
        };
        at += i + 1;
    }
    // URLs are shown rebuilt from their parts, without the password.
    assert!(
        c.stdout
            .contains(&format!("reachable at postgres://{}@", relay_user(&fx))),
        "{c}"
    );
    assert!(c.stdout.contains("reachable at amqp://guest@"), "{c}");
    assert!(!c.stdout.contains(":postgres@"), "{c}");
    if let Some(role) = &fx.relay_role {
        assert!(!c.stdout.contains(&role.password), "{c}");
    }
    assert!(!c.stdout.contains(":guest@"), "{c}");
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn active_slot_and_template_exchange_are_warnings() {
    let dlx = format!("dlx_chk_active_{}", std::process::id());
    let dlx_name = dlx.as_str();
    let fx = Fixture::with_config(
        "chk_active",
        &format!("dead_letter_exchange = \"{dlx_name}\""),
    )
    .await;
    fx.declare_bound(dlx_name, None, "#").await;
    let relay = fx.spawn_relay();
    let pid = fx
        .wait_slot_active(None, Duration::from_secs(30))
        .await
        .unwrap_or_else(|| panic!("relay never streamed; log:\n{}", relay.log_tail()));
    let c = check(
        &fx,
        &[("OUTBOX_RELAY_RABBITMQ_EXCHANGE", "{aggregate_type}.events")],
    );
    assert_eq!(c.code, Some(0), "{c}");
    assert!(
        c.lines()
            .iter()
            .any(|l| l.starts_with("warn replication slot")
                && l.contains(&format!("slot is active (pid {pid})"))),
        "{c}"
    );
    assert!(
        c.lines()
            .iter()
            .any(|l| l.starts_with("warn exchange template")
                && l.contains("cannot be checked statically")),
        "{c}"
    );
    assert!(
        c.lines()
            .iter()
            .any(|l| l.starts_with(&format!("ok dead-letter exchange {dlx_name:?}"))),
        "{c}"
    );
    drop(relay);
    if let Ok(ch) = fx.amqp.create_channel().await {
        let _ = ch
            .exchange_delete(dlx_name.into(), Default::default())
            .await;
    }
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_publication_fails() {
    let fx = Fixture::new("chk_nopub").await;
    let pg = pg_connect().await;
    pg.batch_execute(&format!("DROP PUBLICATION {}", fx.publication))
        .await
        .unwrap();
    let c = check(&fx, &[]);
    c.assert_fails_with(&[
        &format!("publication {:?}", fx.publication),
        "does not exist",
        "outbox-relay setup",
    ]);
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_column_fails() {
    let fx = Fixture::new("chk_nocol").await;
    let pg = pg_connect().await;
    pg.batch_execute(&format!("ALTER TABLE {} DROP COLUMN event_type", fx.table))
        .await
        .unwrap();
    let c = check(&fx, &[]);
    c.assert_fails_with(&[
        &format!("outbox table public.{}", fx.table),
        "\"event_type\"",
        "outbox.event_type",
    ]);
    assert_eq!(c.fails().len(), 1, "only the table is broken:\n{c}");
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_exchange_fails() {
    let fx = Fixture::new("chk_noex").await;
    let other = fx.scoped("no_such_exchange");
    let c = check(&fx, &[("OUTBOX_RELAY_RABBITMQ_EXCHANGE", &other)]);
    c.assert_fails_with(&[
        &format!("exchange {other:?}"),
        "does not exist",
        "rabbitmq.exchange",
    ]);
    assert_eq!(c.fails().len(), 1, "only the exchange is missing:\n{c}");
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_postgres_password_fails_without_printing_it() {
    let fx = Fixture::new("chk_pgpw").await;
    let secret = "Sup3rS3cretPgPw";
    let url = pg_url().replace(":postgres@", &format!(":{secret}@"));
    assert!(url.contains(secret), "unexpected TEST_PG_URL {}", pg_url());
    let c = check(&fx, &[("OUTBOX_RELAY_POSTGRES_URL", &url)]);
    c.assert_fails_with(&[
        "PostgreSQL reachable",
        "password authentication failed",
        "postgres.url",
    ]);
    c.assert_hides(secret);
    // The later PostgreSQL checks say in one line that they were skipped;
    // the broker is still checked.
    let skipped: Vec<&str> = c
        .lines()
        .into_iter()
        .filter(|l| l.contains("skipped"))
        .collect();
    assert_eq!(skipped.len(), 1, "{c}");
    assert!(!c.stdout.contains("wal_level ="), "{c}");
    assert!(c.stdout.contains("ok RabbitMQ reachable"), "{c}");
    assert_eq!(c.fails().len(), 1, "{c}");
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_amqp_password_fails_without_printing_it() {
    let fx = Fixture::new("chk_amqppw").await;
    let secret = "Sup3rS3cretAmqpPw";
    let url = amqp_url().replace("guest:guest@", &format!("guest:{secret}@"));
    assert!(
        url.contains(secret),
        "unexpected TEST_AMQP_URL {}",
        amqp_url()
    );
    let c = check(&fx, &[("OUTBOX_RELAY_RABBITMQ_URL", &url)]);
    c.assert_fails_with(&["RabbitMQ reachable", "ACCESS_REFUSED", "rabbitmq.url"]);
    c.assert_hides(secret);
    assert_eq!(c.fails().len(), 1, "{c}");
    assert!(
        c.lines()
            .iter()
            .any(|l| l.starts_with("warn RabbitMQ checks skipped")),
        "{c}"
    );
    fx.cleanup().await;
}

/// The shapes URL masking missed (issue 25, C11): percent-encoded query
/// keys, a value that only `&` ends, an AMQP URL without a host. Neither
/// `check` nor `setup` prints the password the driver would send.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_url_shape_prints_its_password() {
    let fx = Fixture::new("chk_shapes").await;
    let secret = "Sup3rS3cretShape";
    let pg = pg_url().replace(":postgres@", "@");
    let pg = |query: &str| format!("{pg}{}{query}", if pg.contains('?') { '&' } else { '?' });
    let shapes = [
        (
            "OUTBOX_RELAY_POSTGRES_URL",
            pg(&format!("pass%77ord={secret}")),
        ),
        (
            "OUTBOX_RELAY_POSTGRES_URL",
            pg(&format!("%70assword={secret}")),
        ),
        (
            "OUTBOX_RELAY_POSTGRES_URL",
            pg(&format!("password=ab#{secret}")),
        ),
        (
            "OUTBOX_RELAY_RABBITMQ_URL",
            format!("amqp://guest:{secret}"),
        ),
    ];
    for (var, url) in &shapes {
        let c = check(&fx, &[(var, url)]);
        c.assert_hides(secret);
        if var.contains("POSTGRES") {
            // The driver sent the password (and the server refused it).
            c.assert_fails_with(&[
                "PostgreSQL reachable at postgres://postgres@",
                "password authentication failed",
            ]);
        } else {
            assert!(
                c.code != Some(0)
                    && c.stderr.contains("rabbitmq.url")
                    && c.stderr.contains("not a valid URL"),
                "{c}"
            );
        }
        // The others that connect print the target too, `run` in its log.
        for sub in ["setup", "status", "run"] {
            let mut cmd = fx.relay_cmd(sub);
            cmd.env(var, url);
            let s = run_bounded(cmd, &fx.dir.path().join(sub), Duration::from_secs(10));
            assert_ne!(s.code, Some(0), "{sub}: {s}");
            assert!(!s.stderr.is_empty(), "{sub} said nothing");
            s.assert_hides(secret);
        }
    }
    fx.cleanup().await;
}

/// As [`run_check`], for a command that may not end by itself (`run`
/// retrying): stopped after `bound`, what it printed so far is judged.
fn run_bounded(mut cmd: Command, out: &Path, bound: Duration) -> Checked {
    let (o, e) = (out.with_extension("out"), out.with_extension("err"));
    let mut child = cmd
        .stdout(std::fs::File::create(&o).unwrap())
        .stderr(std::fs::File::create(&e).unwrap())
        .spawn()
        .unwrap();
    let status = wait_timeout(&mut child, bound).or_else(|| {
        let _ = child.kill();
        let _ = child.wait();
        None
    });
    Checked {
        code: status.and_then(|s| s.code()),
        stdout: std::fs::read_to_string(o).unwrap_or_default(),
        stderr: std::fs::read_to_string(e).unwrap_or_default(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_vhost_fails() {
    let fx = Fixture::new("chk_vhost").await;
    let url = amqp_url().replace("/%2f", "/no_such_vhost");
    assert!(url.ends_with("/no_such_vhost"), "unexpected TEST_AMQP_URL");
    let c = check(&fx, &[("OUTBOX_RELAY_RABBITMQ_URL", &url)]);
    c.assert_fails_with(&["RabbitMQ reachable", "vhost", "no_such_vhost"]);
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_servers_fail() {
    // A port nobody listens on.
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("relay.toml");
    std::fs::write(
        &config,
        format!(
            "[postgres]\nurl = \"postgres://postgres:pw@127.0.0.1:{port}/postgres\"\n\
             [rabbitmq]\nurl = \"amqp://guest:guest@127.0.0.1:{port}/%2f\"\nexchange = \"x\"\n"
        ),
    )
    .unwrap();
    let c = run_check(check_cmd(&config));
    c.assert_fails_with(&["PostgreSQL reachable", "is PostgreSQL running"]);
    c.assert_fails_with(&["RabbitMQ reachable", "connection refused"]);
    assert_eq!(c.fails().len(), 2, "{c}");
}

fn check_cmd(config: &Path) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_outbox-relay"));
    cmd.arg("check").arg("--config").arg(config);
    cmd
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_level_replica_fails() {
    let scratch = ScratchPg::start("replica");
    let (_dir, config) = scratch.minimal_config("[outbox]\ntable = \"outbox\"\n", "");
    let c = run_check(check_cmd(&config));
    c.assert_fails_with(&["wal_level", "replica", "wal_level = logical", "restart"]);
    assert!(c.stdout.contains("ok PostgreSQL reachable"), "{c}");
}

/// A private server (so that losing WAL cannot touch other tests' slots)
/// with a tiny `max_slot_wal_keep_size`: WAL written past it invalidates the
/// slot, and `check` says to run `recover`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_slot_fails_naming_recover() {
    let scratch = ScratchPg::start_with("logical", "max_slot_wal_keep_size = '1MB'");
    let (pg, conn) = tokio_postgres::connect(&scratch.url(), tokio_postgres::NoTls)
        .await
        .expect("connecting to the scratch PostgreSQL");
    tokio::spawn(conn);
    let ddl = std::fs::read_to_string(repo_path("sql/outbox.sql")).unwrap();
    pg.batch_execute(&ddl).await.unwrap();
    let (_dir, config) = scratch.minimal_config("", "");
    let out = Command::new(env!("CARGO_BIN_EXE_outbox-relay"))
        .arg("setup")
        .arg("--config")
        .arg(&config)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "setup: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let c = run_check(check_cmd(&config));
    assert_eq!(c.code, Some(0), "before losing the slot:\n{c}");

    pg.batch_execute("CREATE TABLE noise (pad text)")
        .await
        .unwrap();
    let mut lost = false;
    for _ in 0..40 {
        pg.batch_execute(
            "INSERT INTO noise SELECT repeat(md5(g::text), 30) FROM generate_series(1, 20000) g",
        )
        .await
        .unwrap();
        pg.batch_execute("SELECT pg_switch_wal()").await.unwrap();
        pg.batch_execute("CHECKPOINT").await.unwrap();
        let s: Option<String> = pg
            .query_one(
                "SELECT wal_status FROM pg_replication_slots WHERE slot_name = 'outbox_relay'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        if s.as_deref() == Some("lost") {
            lost = true;
            break;
        }
    }
    assert!(lost, "could not invalidate the slot");
    let c = run_check(check_cmd(&config));
    c.assert_fails_with(&[
        "replication slot \"outbox_relay\"",
        "wal_status = lost",
        "run `outbox-relay recover`",
    ]);
    assert_eq!(c.fails().len(), 1, "{c}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn superuser_and_a_foreign_owned_or_triggered_checkpoint_table_are_warnings() {
    let mut fx = Fixture::new("chk_priv").await;
    fx.relay_as_superuser().await;
    let pg = pg_connect().await;
    // A checkpoint table of this test's own: the shared one is written by
    // every other test's relay.
    let table = fx.scoped("cp");
    let env = [(
        "OUTBOX_RELAY_POSTGRES_CHECKPOINT_TABLE",
        format!("public.{table}"),
    )];
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let out = fx
        .relay_cmd("setup")
        .envs(env.iter().copied())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let c = check(&fx, &env);
    assert_eq!(c.code, Some(0), "{c}");
    let lines = c.lines();
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("warn role postgres: is a superuser")
                && l.contains("sql/role.sql")),
        "{c}"
    );
    let what = format!("checkpoint table public.{table}");
    assert!(
        lines.contains(
            &format!("ok {what}: owned by postgres, no triggers, the relay's role granted what its row needs (a policy's condition not checked)")
                .as_str()
        ),
        "{c}"
    );

    let (owner, function) = (fx.scoped("cp_owner"), fx.scoped("cp_trigger"));
    pg.batch_execute(&format!(
        "CREATE ROLE {owner} NOLOGIN; ALTER TABLE {table} OWNER TO {owner}; \
         CREATE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql AS 'BEGIN RETURN NEW; END'; \
         CREATE TRIGGER steal BEFORE INSERT OR UPDATE ON {table} FOR EACH ROW EXECUTE FUNCTION {function}()"
    ))
    .await
    .unwrap();
    let c = check(&fx, &env);
    assert_eq!(c.code, Some(0), "warnings only:\n{c}");
    let warned = |words: &[&str]| {
        c.lines().iter().any(|l| {
            l.starts_with(&format!("warn {what}: ")) && words.iter().all(|w| l.contains(w))
        })
    };
    assert!(warned(&["owned by role", &owner, "OWNER TO"]), "{c}");
    assert!(
        warned(&["has triggers (steal)", "DROP TRIGGER \"steal\""]),
        "{c}"
    );
    assert!(!c.stdout.contains(&format!("ok {what}")), "{c}");

    pg.batch_execute(&format!(
        "DROP TABLE {table}; DROP FUNCTION {function}(); DROP ROLE {owner}"
    ))
    .await
    .unwrap();
    fx.cleanup().await;
}

/// The role `sql/role.sql` makes, admitted by a database line of pg_hba.conf
/// only (`integration/servers.sh`), relays end to end; `pg_basebackup` as it
/// is refused; it cannot write another slot's checkpoint row; and a
/// search_path set on it (here to a schema whose `now()` fails) does not
/// reach the relay's SQL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn least_privilege_role_relays_and_cannot_take_a_base_backup() {
    let mut fx = Fixture::new("chk_least").await;
    let pg = pg_connect().await;
    let role = fx.least_privilege_role();
    let hijack = fx.scoped("hijack");
    pg.batch_execute(&format!(
        "CREATE SCHEMA {hijack}; GRANT USAGE ON SCHEMA {hijack} TO {r}; \
         CREATE FUNCTION {hijack}.now() RETURNS timestamptz LANGUAGE plpgsql \
           AS $$BEGIN RAISE EXCEPTION 'search_path hijacked'; END$$; \
         ALTER ROLE {r} SET search_path = {hijack}, pg_catalog",
        r = role.name
    ))
    .await
    .unwrap();
    let as_role = [("OUTBOX_RELAY_POSTGRES_URL", role.url.as_str())];

    // check: no superuser warning, and the role may replicate.
    let c = check(&fx, &as_role);
    assert_eq!(c.code, Some(0), "{c}");
    assert!(!c.stdout.contains("superuser"), "{c}");
    assert!(
        c.lines()
            .iter()
            .any(|l| l.starts_with(&format!("ok role {} may replicate", role.name))),
        "{c}"
    );
    c.assert_hides(&role.password);

    // Events flow, and the relay records its checkpoint (with now()).
    fx.start_consumer().await;
    let relay = fx.spawn_relay_env(&as_role);
    // The rows commit after this position: a checkpoint past it, with a
    // commit time, is the relay's write for them (the row the relay makes
    // at start has none). Not pg_current_wal_lsn() after the delivery: a
    // checkpoint is written for a transaction, not for the keepalives
    // that move the position past it later.
    let before: String = pg
        .query_one("SELECT pg_current_wal_insert_lsn()::text", &[])
        .await
        .unwrap()
        .get(0);
    let ids = fx.insert_many(&pg, 5, "lp", |i| i.to_string(), "e").await;
    fx.expect_delivered(&ids, &relay).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let recorded = pg
            .query_opt(
                "SELECT 1 FROM outbox_relay_checkpoint \
                 WHERE slot_name = $1 AND confirmed_lsn > $2::text::pg_lsn \
                   AND last_commit_time IS NOT NULL",
                &[&fx.slot, &before],
            )
            .await
            .unwrap();
        if recorded.is_some() {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the relay never recorded its checkpoint as {}; log:\n{}",
            role.name,
            relay.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let log = relay.log_text();
    assert!(!log.contains("hijacked"), "{log}");
    relay.stop_ok();

    // Its own checkpoint row only.
    let client = pg_connect_retry_to(&role.url).await;
    let other = fx.scoped("other_slot");
    let err = client
        .execute(
            "INSERT INTO public.outbox_relay_checkpoint (slot_name, confirmed_lsn) \
             VALUES ($1, '0/0')",
            &[&other],
        )
        .await
        .expect_err("wrote another slot's checkpoint row");
    assert!(
        err.as_db_error()
            .is_some_and(|e| e.message().contains("row-level security")),
        "{err:?}"
    );
    let touched = client
        .execute(
            "UPDATE public.outbox_relay_checkpoint SET confirmed_lsn = '0/0' WHERE slot_name <> $1",
            &[&fx.slot],
        )
        .await
        .unwrap();
    assert_eq!(touched, 0, "updated other slots' checkpoint rows");
    drop(client);

    // It sees its own checkpoint row only: `prune` as it refuses, since it
    // could not know what the other slots have confirmed.
    let out = fx
        .relay_cmd("prune")
        .args(["--older-than", "1s", "--dry-run"])
        .envs(as_role.iter().copied())
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "prune as {} ran: {said}", role.name);
    assert!(
        said.contains("row-level security") && said.contains("owner"),
        "{said}"
    );

    // A lost slot is recovered as it too: the checkpoint table's DDL runs
    // only what is missing (the role may not create in the schema, which
    // PostgreSQL checks even for CREATE TABLE IF NOT EXISTS).
    let lost = fx
        .insert(&pg, "ok", "lp-lost", "e", &serde_json::json!({}))
        .await;
    fx.drop_slot(&pg).await;
    let out = fx
        .relay_cmd("recover")
        .envs(as_role.iter().copied())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "recover as {}: {}",
        role.name,
        String::from_utf8_lossy(&out.stderr)
    );
    fx.collect_until(&[lost], Duration::from_secs(30), Duration::ZERO, None)
        .await;

    // No physical replication connection: pg_basebackup is refused.
    let backup = tempfile::tempdir().unwrap();
    let out = Command::new(pg_bin().join("pg_basebackup"))
        .arg("-d")
        .arg(&role.url)
        .arg("-D")
        .arg(backup.path().join("copy"))
        .args(["-X", "none", "--no-sync"])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "pg_basebackup as {} worked",
        role.name
    );
    assert!(
        said.contains("no pg_hba.conf entry for replication connection"),
        "{said}"
    );
    assert!(!backup.path().join("copy/PG_VERSION").exists());

    fx.cleanup().await;
    role.drop(&pg).await;
    let _ = pg
        .batch_execute(&format!("DROP SCHEMA {hijack} CASCADE"))
        .await;
}

/// A server that asks every client for its password in the clear (issue
/// 25, C12): answers an SSLRequest with `N`, the startup with
/// `AuthenticationCleartextPassword`, then records whether a password
/// message (`p`) ever came, one report per connection.
fn cleartext_asker() -> (u16, std::sync::mpsc::Receiver<bool>) {
    use std::io::{Read, Write};
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut s) = stream else { return };
            let tx = tx.clone();
            std::thread::spawn(move || {
                s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
                let packet = |s: &mut std::net::TcpStream| -> Option<Vec<u8>> {
                    let mut len = [0u8; 4];
                    s.read_exact(&mut len).ok()?;
                    let mut body = vec![0u8; u32::from_be_bytes(len) as usize - 4];
                    s.read_exact(&mut body).ok()?;
                    Some(body)
                };
                let Some(mut body) = packet(&mut s) else {
                    return;
                };
                if body[..4] == 80877103u32.to_be_bytes() {
                    s.write_all(b"N").unwrap();
                    let Some(next) = packet(&mut s) else { return };
                    body = next;
                }
                let _ = body;
                s.write_all(&[b'R', 0, 0, 0, 8, 0, 0, 0, 3]).unwrap();
                let mut rest = Vec::new();
                let _ = s.read_to_end(&mut rest);
                let _ = tx.send(rest.first() == Some(&b'p'));
            });
        }
    });
    (port, rx)
}

#[test]
fn a_server_asking_for_a_cleartext_password_gets_nothing() {
    let secret = "Sup3rS3cretCleartext";
    let (port, answered) = cleartext_asker();
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("relay.toml");
    std::fs::write(
        &config,
        format!(
            "[postgres]\nurl = \"postgres://relay:{secret}@127.0.0.1:{port}/app\"\n\
             [rabbitmq]\nurl = \"amqp://guest:guest@127.0.0.1:1/%2f\"\nexchange = \"x\"\n"
        ),
    )
    .unwrap();
    let c = run_check(check_cmd(&config));
    c.assert_fails_with(&[
        "PostgreSQL reachable",
        "the password in the clear",
        "postgres.sslmode",
    ]);
    c.assert_hides(secret);
    assert!(
        c.lines()
            .iter()
            .any(|l| l.starts_with("warn postgres.sslmode = prefer")),
        "{c}"
    );
    let mut run = Command::new(env!("CARGO_BIN_EXE_outbox-relay"));
    run.arg("run").arg("--config").arg(&config);
    let r = run_check(run);
    assert!(r.code.is_some_and(|c| c != 0), "{r}");
    assert!(
        r.stderr.contains("postgres.sslmode") || r.stdout.contains("postgres.sslmode"),
        "{r}"
    );
    r.assert_hides(secret);
    let first = answered
        .recv_timeout(Duration::from_secs(30))
        .expect("nobody connected");
    let answers: Vec<bool> = std::iter::once(first).chain(answered.try_iter()).collect();
    assert!(
        answers.iter().all(|sent| !sent),
        "a password was sent: {answers:?}"
    );
}

/// The exchanges are looked for on the first node that answers, before
/// the next node is tried: the client sends heartbeats only while it is
/// read, so a first connection left idle while a silent second node takes
/// `check`'s whole timeout would be closed by the broker (heartbeat 2 s),
/// and every exchange reported unchecked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_second_node_does_not_cost_the_exchange_checks() {
    // Takes connections (the kernel's backlog) and never speaks.
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = silent.local_addr().unwrap().port();
    let good = format!("{}?heartbeat=2", amqp_url());
    let mute = format!("amqp://guest:guest@127.0.0.1:{port}/%2f");
    let fx = Fixture::on_servers("chk_silent", &pg_url(), &[good, mute]).await;
    let c = check(&fx, &[]);
    assert!(
        c.lines()
            .iter()
            .any(|l| l.starts_with(&format!("ok exchange {:?}: exists", fx.exchange))),
        "{c}"
    );
    // The silent node is said, as a warning: the other answered.
    assert!(
        c.lines()
            .iter()
            .any(|l| l.starts_with("warn RabbitMQ reachable at") && l.contains(&port.to_string())),
        "{c}"
    );
    assert_eq!(c.code, Some(0), "{c}");
    drop(silent);
    fx.cleanup().await;
}

/// A relay's role that cannot record its checkpoint (a privilege revoked,
/// or row-level security with no policy for it) streams on, warning at
/// every write, and leaves `recover` nothing to start from: `check` says
/// so, naming what is missing and the fix.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_that_cannot_record_its_checkpoint_is_warned() {
    let fx = Fixture::new("chk_cpaccess").await;
    let pg = pg_connect().await;
    let role = relay_user(&fx).to_owned();
    assert_ne!(role, "postgres", "the fixture's relay runs as its own role");
    let what = "checkpoint table public.outbox_relay_checkpoint";
    let line = |c: &Checked| {
        let l = c.lines().into_iter().find(|l| l.contains(what));
        l.unwrap_or_else(|| panic!("no {what} line:\n{c}"))
            .to_owned()
    };
    let c = check(&fx, &[]);
    assert!(
        line(&c).contains(
            "the relay's role granted what its row needs (a policy's condition not checked)"
        ),
        "{c}"
    );
    // As sql/role.sql's GRANTs are made: one at a time (a GRANT beside
    // another test's on the same table can fail "tuple concurrently
    // updated").
    let locked =
        |sql: String| format!("BEGIN; SELECT pg_advisory_xact_lock({ROLE_LOCK}); {sql}; COMMIT");
    pg.batch_execute(&locked(format!(
        "REVOKE UPDATE ON public.outbox_relay_checkpoint FROM \"{role}\""
    )))
    .await
    .unwrap();
    let c = check(&fx, &[]);
    let l = line(&c);
    assert!(
        l.starts_with("warn ")
            && l.contains("lacks UPDATE")
            && l.contains("GRANT SELECT, INSERT, UPDATE"),
        "{c}"
    );
    pg.batch_execute(&locked(format!(
        "GRANT UPDATE ON public.outbox_relay_checkpoint TO \"{role}\"; \
         DROP POLICY \"{role}\" ON public.outbox_relay_checkpoint"
    )))
    .await
    .unwrap();
    let c = check(&fx, &[]);
    let l = line(&c);
    assert!(
        l.starts_with("warn ")
            && l.contains("no policy lets the relay's role SELECT, INSERT, UPDATE its row")
            && l.contains(&format!("USING (slot_name = '{}')", fx.slot)),
        "{c}"
    );
    fx.cleanup().await;
}

/// The system identifier of the server at `url`.
async fn system_identifier(url: &str) -> String {
    pg_connect_retry_to(url)
        .await
        .query_one(
            "SELECT system_identifier::text FROM pg_control_system()",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

/// The one line `check` prints on `host` (host:port) as a standby or
/// another host of `postgres.url`, if any.
fn host_line(checked: &Checked, host: &str) -> Option<String> {
    let about = |l: &&str| {
        l.split_once(' ').is_some_and(|(_, what)| {
            [format!("standby {host}:"), format!("host {host}:")]
                .iter()
                .any(|w| what.starts_with(w.as_str()))
        })
    };
    let mut lines = checked.lines().into_iter().filter(about);
    let line = lines.next().map(str::to_owned);
    assert!(lines.next().is_none(), "two lines on {host}:\n{checked}");
    line
}

/// The other hosts of `postgres.url` must be this primary's standbys, on
/// every version and whatever the slot's state: `check` fails on a host
/// of another cluster (in recovery or read-write; were it promoted, or
/// reached first, the relay would stream another database), naming both
/// system identifiers, and on a second primary of this cluster (a
/// promoted standby whose old primary still runs: which one the relay
/// reaches depends on the order of the hosts), unless it is fenced read
/// only (the relay never connects to it). Neither the primary itself nor
/// the pair's own standby is flagged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_of_another_cluster_or_a_second_primary_fails() {
    let name = format!("hc{}", std::process::id());
    let other = format!("hx{}", std::process::id());
    let (fx, env) = failover_fixture(&name, "", false).await;
    harness_async(pgha(&other, "up")).await;
    let foreign = env_file(&format!("pgha-{other}/env"));
    let ours = system_identifier(&env["TEST_PGHA_PRIMARY_URL"]).await;
    let theirs = system_identifier(&foreign["TEST_PGHA_STANDBY_URL"]).await;
    assert_ne!(ours, theirs, "two clusters, two identifiers");
    let (head, _) = env["TEST_PGHA_URL"].split_once('@').unwrap();
    let primary = host_port(&env["TEST_PGHA_PRIMARY_URL"]);
    let standby = host_port(&env["TEST_PGHA_STANDBY_URL"]);
    let text = std::fs::read_to_string(&fx.config).unwrap();
    let url_line = format!("url = \"{}\"", fx.pg_url);
    assert!(text.contains(&url_line), "{text}");
    let slot_line = format!("slot = \"{}\"", fx.slot);
    assert!(text.contains(&slot_line), "{text}");
    // `check` with postgres.url = our primary, then `second` (the slot
    // named `slot`); the primary itself is never flagged.
    let check_with = |second: &str, slot: &str| {
        let url = format!("{head}@{primary},{second}/postgres?target_session_attrs=read-write");
        let config = text
            .replace(&url_line, &format!("url = \"{url}\""))
            .replace(&slot_line, &format!("slot = \"{slot}\""));
        std::fs::write(&fx.config, config).unwrap();
        let checked = check(&fx, &[]);
        assert_eq!(host_line(&checked, primary), None, "{checked}");
        checked
    };

    for (second, role, slot) in [
        (
            host_port(&foreign["TEST_PGHA_STANDBY_URL"]),
            "in recovery",
            fx.slot.as_str(),
        ),
        (
            host_port(&foreign["TEST_PGHA_PRIMARY_URL"]),
            "a primary",
            fx.slot.as_str(),
        ),
        // Before `setup` (no slot yet): the hosts are read all the same.
        (
            host_port(&foreign["TEST_PGHA_STANDBY_URL"]),
            "in recovery",
            "no_such_slot",
        ),
    ] {
        let checked = check_with(second, slot);
        let line = host_line(&checked, second).unwrap_or_else(|| panic!("{checked}"));
        assert!(
            line.starts_with("FAIL ")
                && line.contains(&format!("{role}, but of another cluster"))
                && line.contains(&format!("system identifier {theirs}"))
                && line.contains(&format!("the primary's {ours}")),
            "{line}"
        );
        assert_eq!(checked.code, Some(1), "{checked}");
    }

    // A role that may not call pg_control_system() (EXECUTE revoked, as
    // some hardened installs do): the hosts are not compared, check says
    // so once, and fails nothing for it.
    let pg = pg_connect_retry_to(&env["TEST_PGHA_PRIMARY_URL"]).await;
    pg.batch_execute(
        "CREATE ROLE hc_plain LOGIN PASSWORD 'hc_plain'; \
         REVOKE EXECUTE ON FUNCTION pg_control_system() FROM PUBLIC",
    )
    .await
    .unwrap();
    let second = host_port(&foreign["TEST_PGHA_STANDBY_URL"]);
    let url = format!(
        "postgres://hc_plain:hc_plain@{primary},{second}/postgres?target_session_attrs=read-write"
    );
    std::fs::write(
        &fx.config,
        text.replace(&url_line, &format!("url = \"{url}\"")),
    )
    .unwrap();
    let checked = check(&fx, &[]);
    assert!(
        checked
            .lines()
            .iter()
            .any(|l| l.starts_with("warn hosts of postgres.url: ")
                && l.contains("the primary's system identifier is unread")),
        "{checked}"
    );
    assert!(
        !checked
            .fails()
            .iter()
            .any(|l| l.contains("hosts of postgres.url") || l.contains(&format!(" {second}:"))),
        "{checked}"
    );
    pg.batch_execute("GRANT EXECUTE ON FUNCTION pg_control_system() TO PUBLIC; DROP ROLE hc_plain")
        .await
        .unwrap();
    drop(pg);

    // The pair's own standby is this primary's: nothing fails (on 17+ a
    // line on its copy of the failover slot, on 15 and 16 none).
    let checked = check_with(standby, &fx.slot);
    assert!(checked.fails().is_empty(), "{checked}");
    // Promoted while the old primary runs on: two primaries.
    harness_async(pgha(&name, "promote")).await;
    let checked = check_with(standby, &fx.slot);
    let line = host_line(&checked, standby).unwrap_or_else(|| panic!("{checked}"));
    assert!(
        line.starts_with("FAIL ") && line.contains("a second primary of this cluster"),
        "{line}"
    );
    assert_eq!(checked.code, Some(1), "{checked}");
    // Fenced read only, the promoted one is none the relay would reach.
    fence_read_only(&env["TEST_PGHA_STANDBY_URL"]).await;
    let checked = check_with(standby, &fx.slot);
    assert_eq!(host_line(&checked, standby), None, "{checked}");
    assert!(checked.fails().is_empty(), "{checked}");
    std::fs::write(&fx.config, &text).unwrap();
    fx.cleanup().await;
    harness_async(pgha(&other, "down")).await;
    harness_async(pgha(&name, "down")).await;
}

/// The relay's sessions ask the server for TCP keepalives: a relay whose
/// host vanished without a reset (its session holding a recovery's
/// advisory lock) is noticed by the server in about a minute, not after
/// the kernel's two hours. Read on the relay's own SQL session, over TCP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relays_sessions_ask_the_server_for_keepalives() {
    let fx = Fixture::new("chk_keepalive").await;
    let cfg = outbox_relay::config::Config::from_toml(
        &fx.config_text(""),
        "test.toml",
        std::iter::empty(),
    )
    .unwrap();
    let sql = outbox_relay::source::connect_sql(&cfg.postgres)
        .await
        .unwrap();
    for (name, want) in [
        ("tcp_keepalives_idle", "30"),
        ("tcp_keepalives_interval", "10"),
        ("tcp_keepalives_count", "3"),
    ] {
        let got: String = sql
            .query_one("SELECT setting FROM pg_settings WHERE name = $1", &[&name])
            .await
            .unwrap()
            .get(0);
        assert_eq!(got, want, "{name}");
    }
    drop(sql);
    fx.cleanup().await;
}

/// A foreign table as a partition of the outbox takes its rows to another
/// server (no WAL here, nothing relayed): `check` warns, naming it, and
/// still passes (such a partition usually holds old rows elsewhere).
/// Needs file_fdw (Debian's PostgreSQL has it; a server without it skips).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreign_partition_is_warned_about() {
    // No unique index: PostgreSQL refuses foreign partitions under one.
    let ddl = partitioned_ddl(
        "aggregate_type",
        "CREATE TABLE {table}_orders PARTITION OF {table} FOR VALUES IN ('order');",
    )
    .replace(",\n  PRIMARY KEY (aggregate_type, id)", "");
    assert!(!ddl.contains("PRIMARY KEY"), "{ddl}");
    let fx = Fixture::with_ddl("chk_foreign", "", &ddl).await;
    let pg = pg_connect().await;
    if pg
        .batch_execute("CREATE EXTENSION IF NOT EXISTS file_fdw")
        .await
        .is_err()
    {
        println!("skipped: no file_fdw on this server");
        fx.cleanup().await;
        return;
    }
    let server = fx.scoped("files");
    pg.batch_execute(&format!(
        "CREATE SERVER {server} FOREIGN DATA WRAPPER file_fdw; \
         CREATE FOREIGN TABLE {0}_archive PARTITION OF {0} FOR VALUES IN ('archive') \
           SERVER {server} OPTIONS (filename '/dev/null', format 'csv')",
        fx.table
    ))
    .await
    .unwrap();
    let c = check(&fx, &[]);
    let archive = format!("{}_archive", fx.table);
    assert!(
        c.lines().iter().any(|l| l.starts_with("warn outbox table")
            && l.contains(&archive)
            && l.contains("never relayed")),
        "{c}"
    );
    assert_eq!(c.code, Some(0), "{c}");
    pg.batch_execute(&format!(
        "DROP FOREIGN TABLE {}_archive; DROP SERVER {server}",
        fx.table
    ))
    .await
    .unwrap();
    fx.cleanup().await;
}
