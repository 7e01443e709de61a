//! The Debian package (`deploy/deb/build.sh`, what `make deb` ships),
//! installed on this machine with `dpkg -i`: its files, the service user and
//! the config's permissions, `systemd-analyze verify` on the unit, the
//! installed binary's `check` run as the service user against the test
//! servers, an upgrade that keeps the operator's config, and a clean
//! removal. The package is built around the debug binary (the packaging is
//! the same for any binary; `make deb` puts the release one in).
//!
//! Needs root (dpkg) and refuses to run where outbox-relay is already
//! installed rather than replace it, unless this test installed it in a
//! run that was killed before it could purge (its marker file says so):
//! that leftover is purged first.

use crate::common;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::{Command, Output};

use common::*;

fn run(cmd: &mut Command) -> Output {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("running {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}):\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn id_of(db: &str, name: &str) -> Option<u32> {
    let out = Command::new("getent").args([db, name]).output().unwrap();
    let line = String::from_utf8_lossy(&out.stdout).into_owned();
    line.split(':').nth(2).and_then(|n| n.parse().ok())
}

/// Written before the test installs the package, removed once it is
/// purged: a run killed in between (`kill -9`, a session cut short) leaves
/// it, so the next run knows the installed package is its own leftover and
/// not an operator's. It holds "created-user" when the test made the user.
const MARKER: &str = "/var/lib/outbox-relay-package-test";

/// The link `systemctl enable outbox-relay` makes (the unit's WantedBy).
const ENABLED: &str = "/etc/systemd/system/multi-user.target.wants/outbox-relay.service";

/// A file an operator keeps beside the config (a name no operator uses).
const OPERATOR_CA: &str = "/etc/outbox-relay/package-test-ca.pem";

/// Purges the package (and the user, when the test created it) however
/// the test ends short of a kill; the marker covers a kill.
struct Installed {
    created_user: bool,
}

impl Installed {
    fn new(created_user: bool) -> Installed {
        let what = if created_user { "created-user\n" } else { "\n" };
        std::fs::write(MARKER, what).unwrap_or_else(|e| panic!("{MARKER}: {e}"));
        Installed { created_user }
    }

    /// Purges what an earlier, killed run of this test left installed.
    fn purge_leftover() -> bool {
        let Ok(marker) = std::fs::read_to_string(MARKER) else {
            return false;
        };
        drop(Installed {
            created_user: marker.trim() == "created-user",
        });
        true
    }
}

impl Drop for Installed {
    fn drop(&mut self) {
        let _ = Command::new("dpkg")
            .args(["--purge", "outbox-relay"])
            .output();
        if self.created_user {
            let _ = Command::new("userdel").arg("outbox-relay").output();
            let _ = Command::new("groupdel").arg("outbox-relay").output();
        }
        let _ = std::fs::remove_file(ENABLED);
        let _ = std::fs::remove_file(OPERATOR_CA);
        let _ = std::fs::remove_dir("/etc/outbox-relay");
        let _ = std::fs::remove_file(MARKER);
    }
}

fn installed() -> bool {
    Command::new("dpkg")
        .args(["-s", "outbox-relay"])
        .output()
        .unwrap()
        .status
        .success()
}

fn mode(path: &str) -> (u32, u32, u32) {
    let m = std::fs::metadata(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    (m.permissions().mode() & 0o7777, m.uid(), m.gid())
}

#[tokio::test]
async fn the_package_installs_checks_upgrades_and_purges_cleanly() {
    let uid = String::from_utf8(run(Command::new("id").arg("-u")).stdout).unwrap();
    assert_eq!(uid.trim(), "0", "installing a package needs root");
    if Installed::purge_leftover() {
        eprintln!("purged the package an earlier, killed run of this test left ({MARKER})");
    }
    assert!(
        !installed(),
        "outbox-relay is already installed on this machine (not by this test): not replacing it"
    );

    let out_dir = tempfile::tempdir().unwrap();
    let built = run(Command::new(repo_path("deploy/deb/build.sh"))
        .arg(env!("CARGO_BIN_EXE_outbox-relay"))
        .env("DEB_OUT", out_dir.path())
        .env("DEB_COMPRESS", "gzip"));
    let deb = String::from_utf8(built.stdout).unwrap().trim().to_owned();
    assert!(deb.ends_with(".deb") && Path::new(&deb).exists(), "{deb}");
    let fields = text(&run(Command::new("dpkg-deb").args(["-f", &deb])));
    for f in [
        "Package: outbox-relay",
        "Depends: libc6 (>= 2.",
        "Version: ",
    ] {
        assert!(
            fields.contains(f),
            "{f} missing from the control file:\n{fields}"
        );
    }

    let guard = Installed::new(id_of("passwd", "outbox-relay").is_none());
    run(Command::new("dpkg").args(["-i", &deb]));

    // The service user: a system account without a login.
    let user_uid = id_of("passwd", "outbox-relay").expect("the package creates its user");
    let gid = id_of("group", "outbox-relay").expect("and its group");
    assert!(user_uid < 1000, "a system uid, not {user_uid}");
    let passwd = text(&run(Command::new("getent").args(["passwd", "outbox-relay"])));
    assert!(passwd.trim().ends_with("/usr/sbin/nologin"), "{passwd}");

    // The files, where the README says, with the right owners and modes.
    assert_eq!(mode("/usr/bin/outbox-relay"), (0o755, 0, 0));
    assert_eq!(mode("/etc/outbox-relay"), (0o750, 0, gid));
    let config = "/etc/outbox-relay/outbox-relay.toml";
    assert_eq!(
        mode(config),
        (0o640, 0, gid),
        "{config}: 0640 root:outbox-relay"
    );
    for (installed, ours) in [
        (
            "/etc/outbox-relay/outbox-relay.toml",
            "examples/outbox-relay.toml",
        ),
        (
            "/lib/systemd/system/outbox-relay.service",
            "deploy/systemd/outbox-relay.service",
        ),
        ("/usr/share/outbox-relay/sql/outbox.sql", "sql/outbox.sql"),
        (
            "/usr/share/outbox-relay/sql/checkpoint.sql",
            "sql/checkpoint.sql",
        ),
        ("/usr/share/outbox-relay/sql/role.sql", "sql/role.sql"),
        ("/usr/share/outbox-relay/sql/inbox.sql", "sql/inbox.sql"),
        (
            "/usr/share/outbox-relay/schema/message.schema.json",
            "schema/message.schema.json",
        ),
        (
            "/usr/share/outbox-relay/schema/config.schema.json",
            "schema/config.schema.json",
        ),
        (
            "/usr/share/outbox-relay/prometheus/outbox-relay.rules.yml",
            "deploy/prometheus/outbox-relay.rules.yml",
        ),
        (
            "/usr/share/outbox-relay/grafana/outbox-relay.json",
            "deploy/grafana/outbox-relay.json",
        ),
    ] {
        let a = std::fs::read(installed).unwrap_or_else(|e| panic!("{installed}: {e}"));
        assert_eq!(
            a,
            std::fs::read(repo_path(ours)).unwrap(),
            "{installed} is not {ours}"
        );
    }
    // The service reads its config; it cannot change it.
    let as_service = |args: &[&str]| {
        Command::new("runuser")
            .args(["-u", "outbox-relay", "--"])
            .args(args)
            .status()
            .unwrap()
            .success()
    };
    assert!(
        as_service(&["test", "-r", config]),
        "the service cannot read {config}"
    );
    assert!(
        !as_service(&["test", "-w", config]),
        "the service can write {config}"
    );

    // The unit: systemd's own verifier says nothing, and the settings the
    // README promises are there.
    let unit = "/lib/systemd/system/outbox-relay.service";
    let verify = Command::new("systemd-analyze")
        .args(["verify", unit])
        .output()
        .unwrap();
    assert!(
        verify.status.success() && text(&verify).trim().is_empty(),
        "systemd-analyze verify {unit}:\n{}",
        text(&verify)
    );
    let unit_text = std::fs::read_to_string(unit).unwrap();
    let setting = |key: &str| {
        unit_text
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{key}=")))
            .unwrap_or_else(|| panic!("{key}= missing from {unit}"))
            .to_owned()
    };
    assert_eq!(setting("User"), "outbox-relay");
    assert_eq!(setting("Restart"), "on-failure");
    assert_eq!(setting("KillSignal"), "SIGTERM");
    assert_eq!(
        setting("RestartPreventExitStatus"),
        "2",
        "exit 2 is a bad config"
    );
    for sandbox in [
        "NoNewPrivileges",
        "ProtectHome",
        "PrivateTmp",
        "PrivateDevices",
    ] {
        assert_eq!(setting(sandbox), "yes", "{sandbox}");
    }
    assert_eq!(setting("ProtectSystem"), "strict");
    let stop_secs: u64 = setting("TimeoutStopSec")
        .trim_end_matches('s')
        .parse()
        .unwrap();
    let grace = outbox_relay::config::Config::from_toml(
        &std::fs::read_to_string(config).unwrap(),
        config,
        std::iter::empty(),
    )
    .unwrap()
    .rabbitmq
    .shutdown_grace
    .as_secs();
    assert!(
        stop_secs >= grace + 10,
        "TimeoutStopSec={stop_secs}s leaves no room for the {grace}s shutdown grace"
    );

    // The installed binary, as the service user with the installed config
    // (the servers given by environment overrides), checks the test servers.
    let fx = Fixture::new("package").await;
    let amqp = fx.amqp_urls.join(",");
    let check = Command::new("runuser")
        .args(["-u", "outbox-relay", "--", "env"])
        .arg(format!("OUTBOX_RELAY_POSTGRES_URL={}", fx.pg_url))
        .arg(format!("OUTBOX_RELAY_POSTGRES_SLOT={}", fx.slot))
        .arg(format!(
            "OUTBOX_RELAY_POSTGRES_PUBLICATION={}",
            fx.publication
        ))
        .arg(format!("OUTBOX_RELAY_OUTBOX_TABLE=public.{}", fx.table))
        .arg(format!("OUTBOX_RELAY_RABBITMQ_URL={amqp}"))
        .arg(format!("OUTBOX_RELAY_RABBITMQ_EXCHANGE={}", fx.exchange))
        .arg("OUTBOX_RELAY_HTTP_LISTEN=127.0.0.1:0")
        .args(["/usr/bin/outbox-relay", "check", "--config", config])
        .output()
        .unwrap();
    let said = text(&check);
    assert!(check.status.success(), "installed check failed:\n{said}");
    assert!(said.contains("ok ") && !said.contains("FAIL"), "{said}");

    // An upgrade (the same package again) keeps the operator's edits and
    // the config's permissions.
    let mut edited = std::fs::read_to_string(config).unwrap();
    edited.push_str("\n# edited by the operator\n");
    std::fs::write(config, &edited).unwrap();
    run(Command::new("dpkg")
        .args(["-i", "--force-confold", &deb])
        .env("DEBIAN_FRONTEND", "noninteractive"));
    assert_eq!(std::fs::read_to_string(config).unwrap(), edited);
    assert_eq!(mode(config), (0o640, 0, gid));
    // An operator's stricter choice survives an upgrade; a config the
    // operator deleted (dpkg does not bring it back) does not fail one.
    std::fs::set_permissions(config, std::fs::Permissions::from_mode(0o600)).unwrap();
    run(Command::new("dpkg").args(["-i", "--force-confold", &deb]));
    assert_eq!(mode(config).0, 0o600, "upgrade reset the operator's mode");
    std::fs::remove_file(config).unwrap();
    run(Command::new("dpkg").args(["-i", "--force-confold", &deb]));
    assert!(
        !Path::new(config).exists(),
        "dpkg brought back a deleted conffile"
    );
    std::fs::write(config, &edited).unwrap();

    // What an operator adds: the unit enabled (the link `systemctl enable`
    // makes from its [Install] section) and a CA file beside the config.
    std::fs::create_dir_all(Path::new(ENABLED).parent().unwrap()).unwrap();
    std::os::unix::fs::symlink(unit, ENABLED).unwrap();
    std::fs::write(OPERATOR_CA, "operator's CA\n").unwrap();

    // Removal keeps the config (a conffile), purge takes it and the enable
    // link, and keeps the operator's own file; nothing of the package is
    // left.
    run(Command::new("dpkg").args(["-r", "outbox-relay"]));
    assert!(!Path::new("/usr/bin/outbox-relay").exists());
    assert!(!Path::new(unit).exists());
    assert!(!Path::new("/usr/share/outbox-relay").exists());
    assert!(Path::new(config).exists(), "remove keeps the config");
    run(Command::new("dpkg").args(["--purge", "outbox-relay"]));
    assert!(!Path::new(config).exists(), "purge removes the config");
    assert!(
        std::fs::symlink_metadata(ENABLED).is_err(),
        "purge left the enable link {ENABLED}"
    );
    assert_eq!(
        std::fs::read_to_string(OPERATOR_CA).unwrap(),
        "operator's CA\n",
        "purge removed a file the operator put in /etc/outbox-relay"
    );
    std::fs::remove_file(OPERATOR_CA).unwrap();
    std::fs::remove_dir("/etc/outbox-relay").unwrap();
    assert!(!installed(), "still known to dpkg after purge");
    drop(guard);
    fx.cleanup().await;
}

/// The container recipe and the Kubernetes manifest agree with the relay:
/// the manifest's config is one the relay accepts, its grace period covers
/// the shutdown grace, the image runs as non-root on the port the probes
/// use, and a relay started with the image's environment answers every
/// probe path of the manifest with 200 once streaming. (No image is built
/// here: this machine cannot pull base images; see README, Deploying.)
#[tokio::test]
async fn the_container_recipe_and_manifest_match_the_relay() {
    let dockerfile = std::fs::read_to_string(repo_path("deploy/Dockerfile")).unwrap();
    let manifest =
        std::fs::read_to_string(repo_path("deploy/kubernetes/outbox-relay.yaml")).unwrap();

    // The Dockerfile: non-root, the port exposed, listening on it.
    let user = dockerfile
        .lines()
        .filter_map(|l| l.strip_prefix("USER "))
        .next_back()
        .expect("a USER line");
    assert!(
        !user.starts_with('0') && !user.starts_with("root"),
        "USER {user}"
    );
    assert!(dockerfile.contains("EXPOSE 9187"), "EXPOSE 9187");
    assert!(dockerfile.contains("OUTBOX_RELAY_HTTP_LISTEN=0.0.0.0:9187"));
    // Every path dependency Cargo.toml patches in is in the build context
    // before the first RUN (its `cargo fetch` reads them).
    let cargo_toml = std::fs::read_to_string(repo_path("Cargo.toml")).unwrap();
    let before_cargo: Vec<&str> = dockerfile
        .lines()
        .take_while(|l| !l.starts_with("RUN "))
        .filter(|l| l.starts_with("COPY "))
        .collect();
    let patched: Vec<&str> = cargo_toml
        .lines()
        .skip_while(|l| !l.starts_with("[patch."))
        .filter_map(|l| l.split_once("path = \"")?.1.split('"').next())
        .collect();
    assert!(!patched.is_empty() || !cargo_toml.contains("[patch."));
    for path in patched {
        let top = path.split('/').next().unwrap();
        assert!(
            before_cargo
                .iter()
                .any(|l| l.split_whitespace().nth(1) == Some(top)),
            "Cargo.toml patches in {path}, which the Dockerfile does not copy before cargo runs"
        );
    }
    for copied in dockerfile.lines().filter_map(|l| l.strip_prefix("COPY ")) {
        if copied.starts_with("--from") {
            continue;
        }
        let sources: Vec<&str> = copied.split_whitespace().collect();
        for src in &sources[..sources.len() - 1] {
            assert!(
                repo_path(src).exists(),
                "the Dockerfile copies {src}, which is not here"
            );
        }
    }

    // The manifest's config, as the relay reads it.
    let toml: String = manifest
        .lines()
        .skip_while(|l| !l.trim_start().starts_with("outbox-relay.toml: |"))
        .skip(1)
        .take_while(|l| l.starts_with("    ") || l.is_empty())
        .map(|l| format!("{}\n", l.strip_prefix("    ").unwrap_or(l)))
        .collect();
    let cfg = outbox_relay::config::Config::from_toml(&toml, "the manifest", std::iter::empty())
        .unwrap_or_else(|e| panic!("the manifest's config is refused: {e}\n{toml}"));
    let grace_line = manifest
        .lines()
        .find_map(|l| l.trim().strip_prefix("terminationGracePeriodSeconds: "))
        .expect("terminationGracePeriodSeconds");
    let period: u64 = grace_line.parse().unwrap();
    assert!(
        period >= cfg.rabbitmq.shutdown_grace.as_secs() + 10,
        "{period}s"
    );
    assert!(manifest.contains("containerPort: 9187"));
    assert!(manifest.contains("runAsNonRoot: true"));
    // Service links would put OUTBOX_RELAY_SERVICE_HOST (and more) into the
    // pod's environment, and the relay refuses unknown OUTBOX_RELAY_ keys.
    assert!(manifest.contains("enableServiceLinks: false"));
    let refused = outbox_relay::config::Config::from_toml(
        &toml,
        "the manifest",
        [(
            "OUTBOX_RELAY_SERVICE_HOST".to_owned(),
            "10.0.0.1".to_owned(),
        )],
    );
    assert!(refused.is_err(), "why enableServiceLinks must stay false");

    // Every probe path, asked of a relay running with the image's settings.
    let paths: Vec<&str> = manifest
        .lines()
        .filter_map(|l| l.split_once("path: ").map(|(_, p)| p))
        .map(|p| p.split([',', '}', ' ']).next().unwrap())
        .collect();
    assert!(
        paths.contains(&"/healthz") && paths.contains(&"/readyz"),
        "{paths:?}"
    );
    let fx = Fixture::new("container").await;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let listen = format!("0.0.0.0:{port}");
    let relay = fx.spawn_relay_env(&[
        ("OUTBOX_RELAY_HTTP_LISTEN", &listen),
        ("OUTBOX_RELAY_LOG_FORMAT", "json"),
    ]);
    let addr = format!("127.0.0.1:{port}");
    let end = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let mut answers = Vec::new();
    while std::time::Instant::now() < end {
        answers.clear();
        for p in &paths {
            let code = match tokio::net::TcpStream::connect(&addr).await {
                Ok(_) => http_get(&addr, p).await.0,
                Err(_) => 0,
            };
            answers.push((*p, code));
        }
        if answers.iter().all(|(_, c)| *c == 200) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    assert!(
        answers.iter().all(|(_, c)| *c == 200),
        "probes {answers:?}\n{}",
        relay.log_tail()
    );
    relay.stop_ok();
    fx.cleanup().await;
}

/// `make deb` packages the binary cargo built, wherever CARGO_TARGET_DIR
/// puts it (issue 25, D18): a dry run (`make -n`, which builds nothing)
/// shows the paths it would hand to `deploy/deb/build.sh`.
#[test]
fn make_deb_follows_cargo_target_dir() {
    let target = tempfile::tempdir().unwrap();
    let dir = target.path().display().to_string();
    let out = run(Command::new("make")
        .args(["-n", "deb"])
        .current_dir(repo_path(""))
        .env("CARGO_TARGET_DIR", target.path()));
    let said = text(&out);
    let package = said
        .lines()
        .find(|l| l.contains("deploy/deb/build.sh"))
        .unwrap_or_else(|| panic!("make -n deb runs no deploy/deb/build.sh:\n{said}"));
    assert!(
        package.ends_with(&format!(
            "deploy/deb/build.sh \"{dir}/release/outbox-relay\""
        )),
        "packages another binary than the one cargo builds into {dir}: {package}"
    );
    assert!(
        package.contains(&format!("{dir}/deb")),
        "writes the package outside {dir}: {package}"
    );
}
