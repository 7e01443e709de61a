//! Servers, certificates and relay helpers for the TLS tests (`tests/it/tls.rs`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use outbox_relay::config::Config;
use outbox_relay::lsn::Lsn;
use outbox_relay::source::{connect_sql, start_replication};
use tokio_postgres::Client;

pub static COUNTER: AtomicU32 = AtomicU32::new(0);

pub const RELAY_PASSWORD: &str = "relay-pw";

pub fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Runs `cmd`, which must stop as a configuration error (exit 2) naming
/// `key`.
pub fn refused_naming(cmd: &mut Command, key: &str) {
    let out = cmd.output().unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains(key), "{}", stderr(&out));
}

/// A throwaway CA and a server certificate it signed, for `localhost` and
/// 127.0.0.1, as ca.pem, server.pem and server.key.
pub struct Pki {
    pub dir: tempfile::TempDir,
    issuer: std::sync::Mutex<Option<rcgen::Issuer<'static, rcgen::KeyPair>>>,
}

impl Pki {
    pub fn new() -> Pki {
        use rcgen::{
            BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer,
            KeyPair, KeyUsagePurpose,
        };
        let dir = tempfile::Builder::new()
            .prefix("outbox-tls-pki")
            .tempdir()
            .unwrap();
        let ca_key = KeyPair::generate().unwrap();
        let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.distinguished_name
            .push(DnType::CommonName, "outbox-relay test CA");
        ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let ca_cert = ca.self_signed(&ca_key).unwrap();
        let issuer = Issuer::new(ca, ca_key);

        let key = KeyPair::generate().unwrap();
        let mut server =
            CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()]).unwrap();
        server
            .distinguished_name
            .push(DnType::CommonName, "localhost");
        server.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let cert = server.signed_by(&key, &issuer).unwrap();

        std::fs::write(dir.path().join("ca.pem"), ca_cert.pem()).unwrap();
        std::fs::write(dir.path().join("server.pem"), cert.pem()).unwrap();
        std::fs::write(dir.path().join("server.key"), key.serialize_pem()).unwrap();
        Pki {
            dir,
            issuer: std::sync::Mutex::new(Some(issuer)),
        }
    }

    /// A client certificate for user `cn` (its common name) that this CA
    /// signed, as `client-<cn>.pem` and `client-<cn>.key` (mode 600).
    pub fn client(&self, cn: &str) -> (PathBuf, PathBuf) {
        self.client_valid(cn, true)
    }

    /// As [`Pki::client`], but expired (valid in 2020 only), as
    /// `client-<cn>-expired.pem` and `.key`.
    pub fn expired_client(&self, cn: &str) -> (PathBuf, PathBuf) {
        self.client_valid(cn, false)
    }

    fn client_valid(&self, cn: &str, now: bool) -> (PathBuf, PathBuf) {
        use rcgen::{CertificateParams, DnType, ExtendedKeyUsagePurpose, KeyPair};
        use std::os::unix::fs::PermissionsExt;
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.distinguished_name.push(DnType::CommonName, cn);
        if !now {
            params.not_before = rcgen::date_time_ymd(2020, 1, 1);
            params.not_after = rcgen::date_time_ymd(2020, 12, 31);
        }
        let cn = if now {
            cn.to_owned()
        } else {
            format!("{cn}-expired")
        };
        let cn = cn.as_str();
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let issuer = self.issuer.lock().unwrap();
        let cert = params
            .signed_by(&key, issuer.as_ref().expect("made by Pki::new"))
            .unwrap();
        let (cert_file, key_file) = (
            self.dir.path().join(format!("client-{cn}.pem")),
            self.dir.path().join(format!("client-{cn}.key")),
        );
        std::fs::write(&cert_file, cert.pem()).unwrap();
        std::fs::write(&key_file, key.serialize_pem()).unwrap();
        std::fs::set_permissions(&key_file, std::fs::Permissions::from_mode(0o600)).unwrap();
        (cert_file, key_file)
    }

    pub fn ca(&self) -> PathBuf {
        self.dir.path().join("ca.pem")
    }
}

/// The scratch PostgreSQL of the other tests ([`crate::common::ScratchPg`])
/// with `wal_level = logical`, listening on 127.0.0.1 and 127.0.0.2 (an
/// address the certificate does not name). With a [`Pki`]: `ssl = on` and
/// only `hostssl` lines in pg_hba.conf; without: `ssl = off` and `host`
/// lines. TCP logins need a password (role `relay`, superuser); the test
/// itself uses the Unix socket.
pub struct ScratchPg(crate::common::ScratchPg);

impl std::ops::Deref for ScratchPg {
    type Target = crate::common::ScratchPg;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl ScratchPg {
    pub fn start(pki: Option<&Pki>) -> ScratchPg {
        ScratchPg::start_on(pki, "127.0.0.1,127.0.0.2")
    }

    /// As [`ScratchPg::start`], listening on `listen` (`listen_addresses`).
    pub fn start_on(pki: Option<&Pki>, listen: &str) -> ScratchPg {
        Self::start_custom(pki, listen, None)
    }

    /// As [`ScratchPg::start`] with the [`Pki`], where role `cert_user`
    /// logs in with a client certificate the CA signed (pg_hba.conf
    /// `cert`), on both kinds of connection, and with nothing else.
    pub fn start_with_client_certs(pki: &Pki, cert_user: &str) -> ScratchPg {
        Self::start_custom(Some(pki), "127.0.0.1,127.0.0.2", Some(cert_user))
    }

    fn start_custom(pki: Option<&Pki>, listen: &str, cert_user: Option<&str>) -> ScratchPg {
        let mut conf = format!(
            "listen_addresses = '{listen}'\nwal_level = logical\nmax_wal_senders = 10\n\
             max_replication_slots = 10\nsynchronous_commit = off\n"
        );
        let hba_type = if pki.is_some() { "hostssl" } else { "host" };
        let mut hba = String::from("local all all trust\nlocal replication all trust\n");
        if let Some(user) = cert_user {
            hba += &format!(
                "hostssl all {user} 127.0.0.0/8 cert\nhostssl replication {user} 127.0.0.0/8 cert\n"
            );
            conf += "ssl_ca_file = '../ca.pem'\n";
        }
        hba += &format!(
            "{hba_type} all all 127.0.0.0/8 scram-sha-256\n\
             {hba_type} replication all 127.0.0.0/8 scram-sha-256\n"
        );
        // The certificate and key, readable by the server's user only.
        let certs: Option<&Path> = pki.map(|p| p.dir.path());
        if certs.is_some() {
            // Relative to the data directory, which is in the server's.
            conf += "ssl = on\nssl_cert_file = '../server.pem'\nssl_key_file = '../server.key'\n";
        }
        let server = crate::common::ScratchPg::start_custom(&conf, Some(&hba), |dir| {
            if let Some(from) = certs {
                for f in ["server.pem", "server.key", "ca.pem"] {
                    std::fs::copy(from.join(f), dir.join(f)).unwrap();
                }
                use std::os::unix::fs::PermissionsExt;
                let key = dir.join("server.key");
                std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
            }
        });
        ScratchPg(server)
    }

    /// The relay's URL: password login over TCP to `host`.
    pub fn url(&self, host: &str, query: &str) -> String {
        format!(
            "postgres://relay:{RELAY_PASSWORD}@{host}:{}/postgres{query}",
            self.port
        )
    }

    /// The relay role and an outbox table.
    pub async fn prepare(&self) -> Client {
        let pg = self.admin().await;
        pg.batch_execute(&format!(
            "CREATE ROLE relay LOGIN SUPERUSER REPLICATION PASSWORD '{RELAY_PASSWORD}';"
        ))
        .await
        .unwrap();
        let ddl = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/sql/outbox.sql"))
            .unwrap();
        pg.batch_execute(&ddl).await.unwrap();
        pg
    }
}

/// A private RabbitMQ node (and an unused PostgreSQL) from
/// `integration/servers.sh up`, with an AMQPS listener using the [`Pki`]
/// server certificate.
pub struct TlsRabbit {
    dir: PathBuf,
    env: HashMap<String, String>,
}

impl TlsRabbit {
    pub fn start(pki: &Pki) -> TlsRabbit {
        let dir = std::env::temp_dir().join(format!(
            "outbox-tls-rmq-{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::SeqCst)
        ));
        let out = Command::new("bash")
            .arg(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/integration/servers.sh"
            ))
            .arg("up")
            .arg(&dir)
            .env("OUTBOX_IT_RABBITMQ_TLS_DIR", pki.dir.path())
            .output()
            .unwrap();
        let mut rabbit = TlsRabbit {
            env: HashMap::new(),
            dir,
        };
        assert!(out.status.success(), "servers.sh up: {}", stderr(&out));
        let env = std::fs::read_to_string(rabbit.dir.join("env")).unwrap();
        let env = env
            .lines()
            .filter_map(|l| l.strip_prefix("export "))
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_owned(), v.replace('\\', "")))
            .collect();
        rabbit.env = env;
        rabbit
    }

    pub fn var(&self, k: &str) -> &str {
        self.env
            .get(k)
            .unwrap_or_else(|| panic!("{k} missing from {}/env", self.dir.display()))
    }

    /// `rabbitmqctl list_connections client_properties ssl`.
    pub fn connections(&self) -> String {
        self.ctl(&["list_connections", "client_properties", "ssl"])
    }

    /// `rabbitmqctl ARGS` against this node; its output.
    pub fn ctl(&self, args: &[&str]) -> String {
        let out = Command::new("bash")
            .arg(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/integration/servers.sh"
            ))
            .args(["rabbitmq", "ctl"])
            .args(args)
            .env("OUTBOX_IT_DIR", &self.dir)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "rabbitmqctl {args:?}: {}",
            stderr(&out)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

impl Drop for TlsRabbit {
    fn drop(&mut self) {
        let _ = Command::new("bash")
            .arg(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/integration/servers.sh"
            ))
            .arg("down")
            .arg(&self.dir)
            .output();
    }
}

/// A relay config file.
pub struct RelayConfig {
    pub dir: tempfile::TempDir,
    pub path: PathBuf,
    pub slot: String,
    pub publication: String,
    pub exchange: String,
}

impl RelayConfig {
    pub fn new(pg_url: &str, pg_extra: &str, amqp_url: &str, rabbitmq_extra: &str) -> RelayConfig {
        let n = COUNTER.fetch_add(1, Ordering::SeqCst);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("relay.toml");
        let c = RelayConfig {
            path,
            slot: format!("slot_tls_{n}"),
            publication: format!("pub_tls_{n}"),
            exchange: format!("ex_tls_{n}"),
            dir,
        };
        c.write(pg_url, pg_extra, amqp_url, rabbitmq_extra);
        c
    }

    pub fn write(&self, pg_url: &str, pg_extra: &str, amqp_url: &str, rabbitmq_extra: &str) {
        let text = format!(
            "[postgres]\nurl = \"{pg_url}\"\nslot = \"{}\"\npublication = \"{}\"\n\
             status_interval_ms = 200\n{pg_extra}\n\
             [outbox]\ntable = \"public.outbox\"\n\
             [rabbitmq]\nurl = \"{amqp_url}\"\nexchange = \"{}\"\n{rabbitmq_extra}\n\
             [http]\nlisten = \"127.0.0.1:0\"\n",
            self.slot, self.publication, self.exchange
        );
        std::fs::write(&self.path, text).unwrap();
    }

    pub fn load(&self) -> Config {
        self.load_with(&[]).unwrap()
    }

    /// Loads the file with the process environment, `env` added to it.
    pub fn load_with(&self, env: &[(&str, &str)]) -> Result<Config, String> {
        let text = std::fs::read_to_string(&self.path).unwrap();
        let vars = std::env::vars()
            .filter(|(k, _)| !k.starts_with("OUTBOX_RELAY_") && !env.iter().any(|(e, _)| e == k))
            .chain(env.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        Config::from_toml(&text, "relay.toml", vars).map_err(|e| e.to_string())
    }

    pub fn cmd(&self, sub: &str) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_outbox-relay"));
        c.arg(sub).arg("--config").arg(&self.path);
        c.env("OUTBOX_RELAY_LOG", "info,outbox_relay=debug");
        // The environment must not override the file.
        for (k, _) in std::env::vars() {
            if k.starts_with("OUTBOX_RELAY_") && k != "OUTBOX_RELAY_LOG" {
                c.env_remove(k);
            }
        }
        c
    }

    pub fn spawn(&self) -> (Child, PathBuf) {
        self.spawn_with(&[])
    }

    /// `run`, with `env` added to its environment.
    pub fn spawn_with(&self, env: &[(&str, &str)]) -> (Child, PathBuf) {
        let log = self.dir.path().join(format!(
            "relay-{}.log",
            COUNTER.fetch_add(1, Ordering::SeqCst)
        ));
        let child = self
            .cmd("run")
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::from(std::fs::File::create(&log).unwrap()))
            .spawn()
            .unwrap();
        (child, log)
    }
}

pub fn wait_exit(child: &mut Child, within: Duration, log: &Path) -> std::process::ExitStatus {
    let end = Instant::now() + within;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if Instant::now() >= end {
            let _ = child.kill();
            panic!(
                "relay still running after {within:?}; log:\n{}",
                std::fs::read_to_string(log).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

pub fn stop(mut child: Child, log: &Path) {
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let status = wait_exit(&mut child, Duration::from_secs(30), log);
    assert!(
        status.success(),
        "relay did not stop cleanly: {status}\n{}",
        std::fs::read_to_string(log).unwrap_or_default()
    );
}

/// `(pid, ssl)` of the walsenders of `outbox-relay` connections.
pub async fn relay_walsenders(pg: &Client) -> Vec<(i32, bool)> {
    pg.query(
        "SELECT a.pid, s.ssl FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) \
         WHERE a.backend_type = 'walsender' AND a.application_name = 'outbox-relay'",
        &[],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| (r.get(0), r.get(1)))
    .collect()
}

/// Waits for one walsender of the relay; returns whether it runs over TLS.
pub async fn walsender_ssl(pg: &Client, context: &str) -> bool {
    let end = Instant::now() + Duration::from_secs(30);
    loop {
        let w = relay_walsenders(pg).await;
        if let Some((pid, ssl)) = w.first() {
            let again: bool = pg
                .query_one("SELECT ssl FROM pg_stat_ssl WHERE pid = $1", &[pid])
                .await
                .unwrap()
                .get(0);
            assert_eq!(again, *ssl);
            return *ssl;
        }
        assert!(
            Instant::now() < end,
            "no walsender for the relay: {context}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Backends of role `relay` (SQL connections and walsenders): `(count, all TLS)`.
pub async fn relay_backends(pg: &Client) -> (i64, bool) {
    let r = pg
        .query_one(
            "SELECT count(*), coalesce(bool_and(s.ssl), false) FROM pg_stat_activity a \
             JOIN pg_stat_ssl s USING (pid) WHERE a.usename = 'relay'",
            &[],
        )
        .await
        .unwrap();
    (r.get(0), r.get(1))
}

pub async fn wait_no_relay_backends(pg: &Client) {
    let end = Instant::now() + Duration::from_secs(20);
    while relay_backends(pg).await.0 > 0 {
        assert!(Instant::now() < end, "relay backends did not go away");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A broker URL nobody listens on, for the tests of PostgreSQL alone.
pub const NO_BROKER: &str = "amqp://guest:guest@127.0.0.1:1/%2f";

/// A config for PostgreSQL at `pg_url` alone ([`NO_BROKER`]), with its
/// publication and slot made.
pub async fn published(pg: &Client, pg_url: &str) -> RelayConfig {
    let cfg = RelayConfig::new(pg_url, "", NO_BROKER, "");
    publish(pg, &cfg).await;
    cfg
}

/// The publication and slot of `cfg`, as `setup` would make them.
pub async fn publish(pg: &Client, cfg: &RelayConfig) {
    pg.batch_execute(&format!(
        "CREATE PUBLICATION {} FOR TABLE outbox",
        cfg.publication
    ))
    .await
    .unwrap();
    pg.execute(
        "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
        &[&cfg.slot],
    )
    .await
    .unwrap();
}

pub type ConnectErrors = (Option<(String, bool)>, Option<(String, bool)>);

/// Opens the SQL and the replication connection with `url` and extra
/// `[postgres]` keys: Ok(whether the walsender runs over TLS; all relay
/// backends must agree), or `(message, transient)` of each failure.
pub async fn both_connections(
    cfg: &RelayConfig,
    pg: &Client,
    url: String,
    pg_extra: String,
) -> Result<bool, ConnectErrors> {
    both_connections_with(cfg, pg, url, pg_extra, &[]).await
}

/// [`both_connections`] with `env` added to the environment the
/// configuration is loaded with (e.g. `SSL_CERT_FILE`).
pub async fn both_connections_with(
    cfg: &RelayConfig,
    pg: &Client,
    url: String,
    pg_extra: String,
    env: &[(&str, &str)],
) -> Result<bool, ConnectErrors> {
    cfg.write(&url, &pg_extra, NO_BROKER, "");
    let c = cfg.load_with(env).unwrap();
    let sql = connect_sql(&c.postgres).await;
    let repl = start_replication(
        &c.postgres,
        Lsn(0),
        None,
        outbox_relay::source::StreamLimits {
            buffer_events: 16,
            silence_limit: std::time::Duration::from_secs(60),
        },
    )
    .await;
    let result = match (&sql, &repl) {
        (Ok(_), Ok(_)) => {
            let ssl = walsender_ssl(pg, &pg_extra).await;
            let (n, all_tls) = relay_backends(pg).await;
            assert_eq!(n, 2, "{pg_extra}");
            assert_eq!(ssl, all_tls, "{pg_extra}");
            Ok(ssl)
        }
        _ => Err((
            sql.as_ref()
                .err()
                .map(|e| (with_sources(e), e.is_transient())),
            repl.as_ref()
                .err()
                .map(|e| (with_sources(e), e.is_transient())),
        )),
    };
    drop(repl);
    drop(sql);
    wait_no_relay_backends(pg).await;
    result
}

/// `e` and its sources, as the relay prints an error it stops for.
pub fn with_sources(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text = format!("{text}: {s}");
        source = s.source();
    }
    text
}
