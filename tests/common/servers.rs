//! The servers: their URLs and control script, connecting to them, a scratch PostgreSQL, the broker's log.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use lapin::{Connection, ConnectionProperties};
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
    if let Err(e) = try_server_ctl(var, args) {
        panic!("{e}");
    }
}

/// As [`server_ctl`], reporting failure instead of panicking: for `Drop`
/// guards, where a second panic while a test unwinds would abort the whole
/// test binary.
pub fn try_server_ctl(var: &str, args: &[&str]) -> Result<(), String> {
    let ctl = std::env::var(var).map_err(|_| {
        format!("{var} is not set: this test needs the servers started by integration/servers.sh")
    })?;
    let mut parts = ctl.split_whitespace();
    let prog = parts.next().ok_or("empty ctl command")?;
    let status = Command::new(prog)
        .args(parts)
        .args(args)
        .status()
        .map_err(|e| format!("running {ctl}: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{ctl} {args:?} failed: {status}"))
    }
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
    pg_connect_retry_to(&pg_url()).await
}

/// As [`pg_connect_retry`], to `url`.
pub async fn pg_connect_retry_to(url: &str) -> Client {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match tokio_postgres::connect(url, NoTls).await {
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
    amqp_connect_to(&[amqp_url()]).await
}

/// The first of `urls` (a cluster's nodes) that accepts a connection,
/// retrying for a minute.
pub async fn amqp_connect_to(urls: &[String]) -> Connection {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut k = 0;
    loop {
        let url = &urls[k % urls.len()];
        k += 1;
        match Connection::connect(url, ConnectionProperties::default()).await {
            Ok(c) => return c,
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("RabbitMQ is not reachable: {e}"),
        }
    }
}

/// Runs a blocking server control command off the async worker threads.
pub async fn ctl_async(f: fn(&[&str]), args: &'static [&'static str]) {
    tokio::task::spawn_blocking(move || f(args))
        .await
        .expect("server control command panicked");
}

/// A throwaway PostgreSQL run as the `postgres` OS user like the
/// harness's, in a directory of its own, on a free port, listening on
/// 127.0.0.1 (and its Unix socket in that directory). One server start
/// for every test that needs a server of its own (`tests/tls` adds TLS).
pub struct ScratchPg {
    pub dir: tempfile::TempDir,
    pub port: u16,
}

impl ScratchPg {
    /// With `wal_level`.
    pub fn start(wal_level: &str) -> ScratchPg {
        Self::start_with(wal_level, "")
    }

    /// With `wal_level` and `extra` lines for postgresql.conf.
    pub fn start_with(wal_level: &str, extra: &str) -> ScratchPg {
        Self::start_custom(
            &format!("listen_addresses = '127.0.0.1'\nwal_level = {wal_level}\n{extra}"),
            None,
            |_| {},
        )
    }

    /// A minimal relay config for this server and the test broker, in a
    /// directory of its own: `[postgres] url`, `sections` (TOML, may be
    /// empty), `[rabbitmq]` with `exchange`. Returns the directory (keep
    /// it) and the file.
    pub fn minimal_config(&self, sections: &str, exchange: &str) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("relay.toml");
        let text = format!(
            "[postgres]\nurl = \"{}\"\n{sections}[rabbitmq]\nurl = \"{}\"\nexchange = \"{exchange}\"\n",
            self.url(),
            amqp_url()
        );
        std::fs::write(&config, text).unwrap();
        (dir, config)
    }

    /// `conf` appended to postgresql.conf (port, socket directory and
    /// `fsync = off` are set), `hba` as pg_hba.conf when given; `prepare`
    /// puts files into the directory before the server's user owns it.
    pub fn start_custom(
        conf: &str,
        hba: Option<&str>,
        prepare: impl FnOnce(&std::path::Path),
    ) -> ScratchPg {
        let bin = pg_bin();
        let dir = tempfile::Builder::new()
            .prefix("outbox-scratch-pg")
            .tempdir()
            .unwrap();
        let data = dir.path().join("data");
        prepare(dir.path());
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
        let out = as_postgres(&bin.join("initdb"))
            .args(["-A", "trust", "-U", "postgres", "--no-sync", "-D"])
            .arg(&data)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "initdb: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let conf_path = data.join("postgresql.conf");
        let mut text = std::fs::read_to_string(&conf_path).unwrap();
        text += &format!(
            "\nport = {port}\nunix_socket_directories = '{}'\nfsync = off\n{conf}\n",
            dir.path().display()
        );
        std::fs::write(&conf_path, text).unwrap();
        if let Some(hba) = hba {
            std::fs::write(data.join("pg_hba.conf"), hba).unwrap();
        }
        let out = as_postgres(&bin.join("pg_ctl"))
            .args(["-w", "-D"])
            .arg(&data)
            .arg("-l")
            .arg(dir.path().join("log"))
            .arg("start")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "pg_ctl start: {}\n{}",
            String::from_utf8_lossy(&out.stderr),
            std::fs::read_to_string(dir.path().join("log")).unwrap_or_default()
        );
        ScratchPg { dir, port }
    }

    /// The superuser over TCP, no password.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// The superuser over the Unix socket (never TLS).
    pub async fn admin(&self) -> Client {
        let mut cfg = tokio_postgres::Config::new();
        cfg.host_path(self.dir.path())
            .port(self.port)
            .user("postgres")
            .dbname("postgres");
        let (client, conn) = cfg.connect(NoTls).await.expect("scratch PostgreSQL");
        tokio::spawn(async move {
            let _ = conn.await;
        });
        client
    }
}

impl Drop for ScratchPg {
    fn drop(&mut self) {
        let _ = as_postgres(&pg_bin().join("pg_ctl"))
            .args(["-m", "immediate", "-D"])
            .arg(self.dir.path().join("data"))
            .arg("stop")
            .output();
    }
}

/// `program` run as the `postgres` OS user.
pub fn as_postgres(program: &std::path::Path) -> Command {
    let mut c = Command::new("runuser");
    c.args(["-u", "postgres", "--"]).arg(program);
    c
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

/// How the broker logged the end of each connection the relay of `slot`
/// opened (its client-provided name names the slot), in order: `true` for
/// a clean close (`connection.close` answered), `false` for anything else
/// (a dropped socket, a frame error). Waits up to 10 s for every connection
/// it has seen to end, as the broker logs asynchronously.
pub fn broker_logged_closes(slot: &str) -> Vec<bool> {
    let dir = std::env::var("OUTBOX_IT_DIR")
        .expect("OUTBOX_IT_DIR is not set: this test reads the log of the broker integration/servers.sh started");
    let path = format!("{dir}/rabbitmq/log/rabbit.log");
    let name = format!(" - outbox-relay (slot {slot})");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let log = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        let lines: Vec<&str> = log.lines().collect();
        // Each connection by its Erlang pid, from the line naming it; its
        // end is the first line after that one about the same pid (a pid
        // an earlier connection had says nothing of this one).
        let closes: Vec<Option<bool>> = lines
            .iter()
            .enumerate()
            .filter(|(_, l)| l.contains(&name) && l.contains("authenticated and granted access"))
            .filter_map(|(i, l)| Some((i, l.split(" connection ").nth(1)?.split(' ').next()?)))
            .map(|(i, pid)| {
                let mut after = lines[i + 1..].iter().skip_while(|l| {
                    !l.contains(&format!("closing AMQP connection {pid} "))
                        && !l.contains(&format!("Error on AMQP connection {pid} "))
                });
                let first = after.next()?;
                let next = after.next().copied().unwrap_or_default();
                Some(
                    first.contains("[info]")
                        && first.ends_with(')')
                        && !next.contains("unexpectedly closed"),
                )
            })
            .collect();
        // The broker writes its log a little after the fact: wait for the
        // connection to show up, and for each to end.
        if (!closes.is_empty() && closes.iter().all(Option::is_some)) || Instant::now() > deadline {
            return closes.into_iter().map(|c| c.unwrap_or(false)).collect();
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The major version of the shared server (`server_version_num`), as the
/// server says: a test of a version's feature asks it, not the harness.
pub async fn server_major() -> u32 {
    let v: i32 = pg_connect()
        .await
        .query_one("SELECT current_setting('server_version_num')::int", &[])
        .await
        .unwrap()
        .get(0);
    (v / 10_000) as u32
}
