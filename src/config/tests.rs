//! The configuration's unit tests: defaults, overrides, refusals, secrets.

use super::*;
use secrets::{
    PasswordFile, ROTATION_GRACE, credential_path, password_file_warning, with_password_file,
};
use std::path::PathBuf;

const MINIMAL: &str = r#"
[postgres]
url = "postgres://relay:s3cret@127.0.0.1:5432/app"
slot = "outbox_relay"
publication = "outbox_pub"

[outbox]
table = "public.outbox"

[rabbitmq]
url = "amqp://guest:guest@127.0.0.1:5672/%2f"
exchange = "outbox"
routing_key = "{aggregate_type}.{event_type}"

[http]
listen = "127.0.0.1:9187"
"#;

fn load(text: &str, env: &[(&str, &str)]) -> Result<Config, ConfigError> {
    Config::from_toml(
        text,
        "test.toml",
        env.iter().map(|(k, v)| (k.to_string(), v.to_string())),
    )
}

#[test]
fn minimal_file_gets_defaults() {
    let c = load(MINIMAL, &[]).unwrap();
    let o = &c.outboxes[0];
    assert_eq!(c.outboxes.len(), 1);
    assert_eq!(o.table().unwrap().schema, "public");
    assert_eq!(o.table().unwrap().name, "outbox");
    assert_eq!(o.columns.payload, "payload");
    assert_eq!(c.rabbitmq.window, 1024);
    assert_eq!(c.rabbitmq.confirm_timeout, Duration::from_secs(30));
    assert_eq!(c.postgres.status_interval, Duration::from_millis(100));
}

#[test]
fn environment_overrides_file_values() {
    let c = load(
        MINIMAL,
        &[
            ("OUTBOX_RELAY_RABBITMQ_WINDOW", "77"),
            ("OUTBOX_RELAY_POSTGRES_SLOT", "other_slot"),
            ("OUTBOX_RELAY_OUTBOX_AGGREGATE_TYPE", "kind"),
            ("OUTBOX_RELAY_CONFIG", "ignored.toml"),
            ("UNRELATED", "x"),
        ],
    )
    .unwrap();
    assert_eq!(c.rabbitmq.window, 77);
    assert_eq!(c.postgres.slot, "other_slot");
    assert_eq!(c.outboxes[0].columns.aggregate_type, "kind");
}

#[test]
fn unknown_keys_are_named() {
    let text = MINIMAL.replace("[http]", "[http]\nlisten_port = 1");
    let err = load(&text, &[]).unwrap_err().to_string();
    assert!(err.contains("listen_port"), "{err}");

    let err = load(MINIMAL, &[("OUTBOX_RELAY_RABBITMQ_WINDOWS", "5")])
        .unwrap_err()
        .to_string();
    assert!(err.contains("windows"), "{err}");

    let err = load(MINIMAL, &[("OUTBOX_RELAY_KAFKA_URL", "x")])
        .unwrap_err()
        .to_string();
    assert!(err.contains("OUTBOX_RELAY_KAFKA_URL"), "{err}");
}

#[test]
fn bad_values_are_named_with_what_was_expected() {
    let cases: &[(&str, &str, &str)] = &[
        ("OUTBOX_RELAY_RABBITMQ_WINDOW", "0", "rabbitmq.window"),
        ("OUTBOX_RELAY_RABBITMQ_WINDOW", "lots", "rabbitmq.window"),
        ("OUTBOX_RELAY_RABBITMQ_CHANNELS", "0", "rabbitmq.channels"),
        ("OUTBOX_RELAY_RABBITMQ_CHANNELS", "17", "between 1 and 16"),
        ("OUTBOX_RELAY_POSTGRES_URL", "mysql://x", "postgres.url"),
        ("OUTBOX_RELAY_RABBITMQ_URL", "http://x", "rabbitmq.url"),
        ("OUTBOX_RELAY_HTTP_LISTEN", "nowhere", "http.listen"),
        ("OUTBOX_RELAY_POSTGRES_SLOT", "Bad-Slot", "postgres.slot"),
        (
            "OUTBOX_RELAY_RABBITMQ_ROUTING_KEY",
            "{unclosed",
            "rabbitmq.routing_key",
        ),
        ("OUTBOX_RELAY_OUTBOX_TABLE", "a.b.c", "outbox.table"),
        (
            "OUTBOX_RELAY_RABBITMQ_URL",
            "amqp://u:p@h/v?frame_max=1024",
            "frame_max=1024: use 4096 to 1048576",
        ),
        (
            "OUTBOX_RELAY_RABBITMQ_URL",
            "amqp://u:p@h/v?frame_max=4194304",
            "rabbitmq.url",
        ),
    ];
    for (var, value, key) in cases {
        let err = load(MINIMAL, &[(var, value)]).unwrap_err().to_string();
        assert!(err.contains(key), "{var}={value}: {err}");
    }
    // 0 ("no limit" to RabbitMQ, the broker's choice up to 4 GiB) means
    // the default (see `sink::wire::connect`).
    for url in [
        "amqp://u:p@h/v?frame_max=1048576",
        "amqp://u:p@h/v?frame_max=0",
    ] {
        load(MINIMAL, &[("OUTBOX_RELAY_RABBITMQ_URL", url)]).unwrap();
    }
    let four = load(MINIMAL, &[("OUTBOX_RELAY_RABBITMQ_CHANNELS", "4")]).unwrap();
    assert_eq!(four.rabbitmq.channels, 4);
    assert_eq!(load(MINIMAL, &[]).unwrap().rabbitmq.channels, 1);
    let text = MINIMAL.replace("exchange = \"outbox\"", "");
    let err = load(&text, &[]).unwrap_err().to_string();
    assert!(err.contains("exchange"), "{err}");
}

/// A self-signed CA certificate in a temporary file.
fn ca_pem() -> (tempfile::TempDir, String) {
    let dir = tempfile::tempdir().unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let cert = params.self_signed(&key).unwrap();
    let path = dir.path().join("ca.pem");
    std::fs::write(&path, cert.pem()).unwrap();
    let path = path.display().to_string();
    (dir, path)
}

#[test]
fn tls_settings_default_to_prefer_without_a_ca() {
    let c = load(MINIMAL, &[]).unwrap();
    assert_eq!(c.postgres.sslmode, SslMode::Prefer);
    assert_eq!(c.postgres.ca_file, None);
    assert_eq!(c.rabbitmq.ca_file, None);
}

#[test]
fn sslmode_comes_from_the_url_unless_the_config_sets_it() {
    let (_dir, ca) = ca_pem();
    let url = format!(
        "postgres://relay:s3cret@db.example:5432/app?sslmode=verify-full&sslrootcert={}",
        ca.replace('/', "%2F")
    );
    let c = load(MINIMAL, &[("OUTBOX_RELAY_POSTGRES_URL", url.as_str())]).unwrap();
    assert_eq!(c.postgres.sslmode, SslMode::VerifyFull);
    assert_eq!(c.postgres.ca_file, Some(PathBuf::from(&ca)));

    let text = MINIMAL.replace(
        "slot = \"outbox_relay\"",
        &format!("slot = \"outbox_relay\"\nsslmode = \"verify-ca\"\nca_file = \"{ca}\""),
    );
    let c = load(
        &text,
        &[(
            "OUTBOX_RELAY_POSTGRES_URL",
            "postgres://relay@db/app?sslmode=disable&sslrootcert=/nonexistent.pem",
        )],
    )
    .unwrap();
    assert_eq!(c.postgres.sslmode, SslMode::VerifyCa);
    assert_eq!(c.postgres.ca_file, Some(PathBuf::from(&ca)));

    let c = load(MINIMAL, &[("OUTBOX_RELAY_POSTGRES_SSLMODE", "require")]).unwrap();
    assert_eq!(c.postgres.sslmode, SslMode::Require);
}

/// libpq's rules: no verification without a CA of one's own, and the
/// public CAs (`sslrootcert=system`) only with the host name checked.
#[test]
fn verifying_modes_need_a_ca_and_system_roots_need_verify_full() {
    let (_dir, ca) = ca_pem();
    let url = |q: &str| format!("postgres://relay@db.example/app{q}");
    let system = [("SSL_CERT_FILE", ca.as_str())];
    // sslrootcert=system: the system bundle, verify-full by default.
    let u = url("?sslrootcert=system");
    let env = [("OUTBOX_RELAY_POSTGRES_URL", u.as_str()), system[0]];
    let c = load(MINIMAL, &env).unwrap();
    assert_eq!(c.postgres.sslmode, SslMode::VerifyFull);
    assert_eq!(c.postgres.ca_file, Some(PathBuf::from(&ca)));
    // ... and refused with any weaker mode, from the URL or the file.
    for q in [
        "?sslrootcert=system&sslmode=require",
        "?sslrootcert=system&sslmode=verify-ca",
    ] {
        let u = url(q);
        let env = [("OUTBOX_RELAY_POSTGRES_URL", u.as_str()), system[0]];
        let err = load(MINIMAL, &env).unwrap_err().to_string();
        assert!(
            err.contains("postgres.sslmode") && err.contains("verify-full"),
            "{q}: {err}"
        );
    }
    let env = [
        ("OUTBOX_RELAY_POSTGRES_CA_FILE", "system"),
        ("OUTBOX_RELAY_POSTGRES_SSLMODE", "prefer"),
        system[0],
    ];
    let err = load(MINIMAL, &env).unwrap_err().to_string();
    assert!(err.contains("postgres.sslmode"), "{err}");

    // verify-ca and verify-full without a CA file: refused at start.
    for mode in ["verify-ca", "verify-full"] {
        let u = url(&format!("?sslmode={mode}"));
        for env in [
            vec![("OUTBOX_RELAY_POSTGRES_URL", u.as_str())],
            vec![("OUTBOX_RELAY_POSTGRES_SSLMODE", mode)],
        ] {
            let err = load(MINIMAL, &env).unwrap_err().to_string();
            assert!(
                err.contains("postgres.ca_file") && err.contains("sslrootcert=system"),
                "{mode}: {err}"
            );
        }
    }
    // Over a Unix socket there is no TLS: libpq accepts the mode there.
    let u = "postgres://relay@%2Fvar%2Frun%2Fpostgresql/app?sslmode=verify-full";
    let c = load(MINIMAL, &[("OUTBOX_RELAY_POSTGRES_URL", u)]).unwrap();
    assert_eq!(c.postgres.ca_file, None);

    // amqps: the configured CA alone, else the system bundle.
    let amqps = [("OUTBOX_RELAY_RABBITMQ_URL", "amqps://u:p@mq.example/%2f")];
    let c = load(MINIMAL, &[amqps[0], system[0]]).unwrap();
    assert_eq!(c.rabbitmq.ca_file, Some(PathBuf::from(&ca)));
    let (_dir2, own) = ca_pem();
    let env = [
        amqps[0],
        system[0],
        ("OUTBOX_RELAY_RABBITMQ_CA_FILE", own.as_str()),
    ];
    let c = load(MINIMAL, &env).unwrap();
    assert_eq!(c.rabbitmq.ca_file, Some(PathBuf::from(&own)));
    let env = [amqps[0], ("SSL_CERT_FILE", "/nonexistent/bundle.pem")];
    let err = load(MINIMAL, &env).unwrap_err().to_string();
    assert!(err.contains("rabbitmq.ca_file"), "{err}");
}

#[test]
fn urls_that_could_reach_two_servers_are_refused() {
    for u in [
        "postgres://relay@/app",
        "postgres://relay@db/app?hostaddr=10.0.0.1,10.0.0.2",
    ] {
        let err = load(MINIMAL, &[("OUTBOX_RELAY_POSTGRES_URL", u)])
            .unwrap_err()
            .to_string();
        assert!(err.contains("postgres.url"), "{u}: {err}");
    }
    let u = "postgres://relay@db.example/app?hostaddr=10.0.0.1";
    let c = load(MINIMAL, &[("OUTBOX_RELAY_POSTGRES_URL", u)]).unwrap();
    assert_eq!(
        c.postgres.targets,
        [PgTarget::Tcp {
            name: "db.example".into(),
            addr: "10.0.0.1".into(),
            port: 5432
        }]
    );
    assert!(!c.postgres.read_write);
    let u = "postgres://relay@db1:5432,db2:5433/app?target_session_attrs=read-write";
    let c = load(MINIMAL, &[("OUTBOX_RELAY_POSTGRES_URL", u)]).unwrap();
    assert_eq!(c.postgres.targets.len(), 2);
    assert!(c.postgres.read_write);
}

#[test]
fn bad_tls_settings_name_the_key() {
    let (_dir, ca) = ca_pem();
    let cases: &[(&str, &str, &str)] = &[
        (
            "OUTBOX_RELAY_POSTGRES_SSLMODE",
            "verify",
            "postgres.sslmode",
        ),
        (
            "OUTBOX_RELAY_POSTGRES_URL",
            "postgres://u@h/db?sslmode=sometimes",
            "postgres.url",
        ),
        (
            "OUTBOX_RELAY_POSTGRES_CA_FILE",
            "/nonexistent/ca.pem",
            "postgres.ca_file",
        ),
        (
            "OUTBOX_RELAY_POSTGRES_URL",
            "postgres://u@h/db?sslmode=verify-ca&sslrootcert=/nonexistent/ca.pem",
            "postgres.url",
        ),
        (
            "OUTBOX_RELAY_RABBITMQ_CA_FILE",
            "/nonexistent/ca.pem",
            "rabbitmq.ca_file",
        ),
        (
            "OUTBOX_RELAY_RABBITMQ_CA_FILE",
            "Cargo.toml",
            "rabbitmq.ca_file",
        ),
    ];
    for (var, value, key) in cases {
        let err = load(MINIMAL, &[(var, value)]).unwrap_err().to_string();
        assert!(err.contains(key), "{var}={value}: {err}");
    }
    let err = load(
        MINIMAL,
        &[("OUTBOX_RELAY_RABBITMQ_CA_FILE", "/nonexistent/ca.pem")],
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("/nonexistent/ca.pem"), "{err}");

    let c = load(
        MINIMAL,
        &[
            ("OUTBOX_RELAY_RABBITMQ_URL", "amqps://u:p@broker/%2f"),
            ("OUTBOX_RELAY_RABBITMQ_CA_FILE", ca.as_str()),
        ],
    )
    .unwrap();
    assert_eq!(c.rabbitmq.ca_file, Some(PathBuf::from(&ca)));
    // An empty override unsets the key.
    let c = load(MINIMAL, &[("OUTBOX_RELAY_POSTGRES_CA_FILE", "")]).unwrap();
    assert_eq!(c.postgres.ca_file, None);
}

#[test]
fn password_file_fills_in_the_url() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("pw");
    std::fs::write(&f, "p@ss/w:rd\n").unwrap();
    let f = f.display().to_string();
    let text = MINIMAL
        .replace(
            "slot = \"outbox_relay\"",
            &format!("slot = \"outbox_relay\"\npassword_file = \"{f}\""),
        )
        .replace(
            "exchange = \"outbox\"",
            &format!("exchange = \"outbox\"\npassword_file = \"{f}\""),
        );
    let c = load(&text, &[]).unwrap();
    assert_eq!(
        c.postgres.url.expose(),
        "postgres://relay:p%40ss%2Fw%3Ard@127.0.0.1:5432/app"
    );
    assert_eq!(
        c.rabbitmq.urls[0].expose(),
        "amqp://guest:p%40ss%2Fw%3Ard@127.0.0.1:5672/%2f"
    );
    let pg: tokio_postgres::Config = c.postgres.url.expose().parse().unwrap();
    assert_eq!(pg.get_password(), Some(&b"p@ss/w:rd"[..]));
    let err = load(
        &MINIMAL.replace(
            "slot = \"outbox_relay\"",
            "password_file = \"/no/such/file\"",
        ),
        &[],
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("postgres.password_file"), "{err}");
}

/// systemd's credentials (`LoadCredential=`): a password file in the
/// directory it names in CREDENTIALS_DIRECTORY.
#[test]
fn password_file_may_name_the_credentials_directory() {
    let key = "postgres.password_file";
    for file in [
        "$CREDENTIALS_DIRECTORY/pg",
        "${CREDENTIALS_DIRECTORY}/pg",
        "%d/pg",
    ] {
        assert_eq!(
            credential_path(key, file, Some("/run/credentials/outbox-relay.service/")).unwrap(),
            "/run/credentials/outbox-relay.service/pg",
            "{file}"
        );
        let err = credential_path(key, file, None).unwrap_err().to_string();
        assert!(
            err.contains(key) && err.contains("CREDENTIALS_DIRECTORY is not set"),
            "{err}"
        );
    }
    for file in ["/etc/pg", "%dir/pg", "$CREDENTIALS_DIRECTORYX/pg"] {
        assert_eq!(credential_path(key, file, Some("/run/c")).unwrap(), file);
    }
}

/// `dir/pw`, holding `content`, readable by its owner only.
fn private_file(dir: &std::path::Path, content: &str) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let f = dir.join("pw");
    std::fs::write(&f, content).unwrap();
    std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o600)).unwrap();
    f
}

/// The URL `with_password_file` makes from a private file holding `content`.
fn url_from_password_file(content: &str) -> Result<String, String> {
    let dir = tempfile::tempdir().unwrap();
    let f = private_file(dir.path(), content).display().to_string();
    with_password_file("postgres://relay@db/app", "postgres.password_file", &f)
        .map_err(|e| e.to_string())
}

#[test]
fn password_file_trims_one_line_ending_only() {
    assert_eq!(
        url_from_password_file("pw").unwrap(),
        "postgres://relay:pw@db/app"
    );
    assert_eq!(
        url_from_password_file("pw\n").unwrap(),
        "postgres://relay:pw@db/app"
    );
    assert_eq!(
        url_from_password_file("pw\r\n").unwrap(),
        "postgres://relay:pw@db/app"
    );
    // Spaces are part of the password.
    assert_eq!(
        url_from_password_file(" pw \n").unwrap(),
        "postgres://relay:%20pw%20@db/app"
    );
}

#[test]
fn password_file_must_hold_one_line() {
    for content in ["pw\n\n", "a\nb", "a\nb\n", "pw\r\n\r\n", "\n\n"] {
        let err = url_from_password_file(content).unwrap_err();
        assert!(err.contains("postgres.password_file"), "{content:?}: {err}");
        assert!(err.contains("only the password"), "{content:?}: {err}");
    }
    for content in ["", "\n", "\r\n"] {
        let err = url_from_password_file(content).unwrap_err();
        assert!(err.contains("is empty"), "{content:?}: {err}");
    }
}

#[test]
fn password_file_readable_by_others_is_warned_about() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("pw");
    std::fs::write(&f, "s3cret").unwrap();
    let key = "rabbitmq.password_file";
    for mode in [0o644, 0o640, 0o604, 0o620] {
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(mode)).unwrap();
        let warning = password_file_warning(key, &f).expect("a warning");
        assert!(warning.contains(key), "{warning}");
        assert!(warning.contains(&f.display().to_string()), "{warning}");
        assert!(warning.contains("chmod 600"), "{warning}");
        assert!(!warning.contains("s3cret"), "{warning}");
    }
    for mode in [0o600, 0o400] {
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(mode)).unwrap();
        assert_eq!(password_file_warning(key, &f), None, "{mode:o}");
    }
}

#[test]
fn secrets_do_not_print() {
    let c = load(MINIMAL, &[]).unwrap();
    let shown = format!("{c:?}");
    assert!(!shown.contains("s3cret"), "{shown}");
    assert!(!format!("{:?}", c.rabbitmq).contains("guest:guest"));
}

/// A TOML error names the line and column, not the line's text: the
/// line may hold a password.
#[test]
fn syntax_errors_do_not_echo_the_line() {
    let text = MINIMAL.replace(
        "url = \"postgres://relay:s3cret@127.0.0.1:5432/app\"",
        "url = \"postgres://relay:s3cret@127.0.0.1:5432/app",
    );
    let err = load(&text, &[]).unwrap_err().to_string();
    assert!(!err.contains("s3cret"), "{err}");
    assert!(err.contains("line 3"), "{err}");
}

/// `password=` in the query would silently win over the password file.
#[test]
fn a_query_password_beside_password_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("pw");
    std::fs::write(&f, "from-file\n").unwrap();
    let f = f.display().to_string();
    let env = [
        (
            "OUTBOX_RELAY_POSTGRES_URL",
            "postgres://relay@db/app?password=other",
        ),
        ("OUTBOX_RELAY_POSTGRES_PASSWORD_FILE", f.as_str()),
    ];
    let err = load(MINIMAL, &env).unwrap_err().to_string();
    assert!(
        err.contains("postgres.url") && err.contains("password_file"),
        "{err}"
    );
    assert!(
        !err.contains("other") && !err.contains("from-file"),
        "{err}"
    );
}

#[test]
fn rabbitmq_url_takes_a_list_of_nodes() {
    let nodes = |c: &Config| -> Vec<String> {
        c.rabbitmq
            .urls
            .iter()
            .map(|u| u.expose().to_owned())
            .collect()
    };
    let text = MINIMAL.replace(
        "url = \"amqp://guest:guest@127.0.0.1:5672/%2f\"",
        "url = [\"amqp://u:p@h1:5672/v\", \"amqps://u:p@h2:5671/v\"]\nshuffle = true",
    );
    let c = load(&text, &[]).unwrap();
    assert_eq!(nodes(&c), ["amqp://u:p@h1:5672/v", "amqps://u:p@h2:5671/v"]);
    assert!(c.rabbitmq.shuffle);
    // One amqps:// node is enough to need a CA.
    assert!(c.rabbitmq.ca_file.is_some());
    // A comma-separated override; a comma inside a password stays.
    let c = load(
        MINIMAL,
        &[(
            "OUTBOX_RELAY_RABBITMQ_URL",
            "amqp://u:a,b@h1/v, amqp://u:p@h2/v,amqp://u:p@h3/v",
        )],
    )
    .unwrap();
    assert_eq!(
        nodes(&c),
        ["amqp://u:a,b@h1/v", "amqp://u:p@h2/v", "amqp://u:p@h3/v"]
    );
    assert!(!c.rabbitmq.shuffle);
    // Each URL is checked, and named without its password.
    let err = load(
        MINIMAL,
        &[(
            "OUTBOX_RELAY_RABBITMQ_URL",
            "amqp://u:sekrit@h1/v,amqp://u:sekrit@h2:x/v",
        )],
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("rabbitmq.url") && !err.contains("sekrit"),
        "{err}"
    );
    let err = load(
        &MINIMAL.replace(
            "url = \"amqp://guest:guest@127.0.0.1:5672/%2f\"",
            "url = []",
        ),
        &[],
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("rabbitmq.url"), "{err}");
}

#[test]
fn require_auth_comes_from_the_config_or_the_url() {
    use crate::config::AuthMethod;
    let c = load(MINIMAL, &[]).unwrap();
    assert!(!c.postgres.require_auth.allows(AuthMethod::Password));
    assert!(!c.postgres.require_auth.allows(AuthMethod::Md5));
    assert!(c.postgres.require_auth.allows(AuthMethod::ScramSha256));
    let url = "postgres://relay:s3cret@127.0.0.1:5432/app?require_auth=scram-sha-256";
    let c = load(MINIMAL, &[("OUTBOX_RELAY_POSTGRES_URL", url)]).unwrap();
    assert!(!c.postgres.require_auth.allows(AuthMethod::None));
    let c = load(
        MINIMAL,
        &[
            ("OUTBOX_RELAY_POSTGRES_URL", url),
            ("OUTBOX_RELAY_POSTGRES_REQUIRE_AUTH", "none"),
        ],
    )
    .unwrap();
    assert!(c.postgres.require_auth.allows(AuthMethod::None));
    assert!(!c.postgres.require_auth.allows(AuthMethod::ScramSha256));
    // Password or MD5 to a server nobody verified: refused, naming the key.
    let e = load(MINIMAL, &[("OUTBOX_RELAY_POSTGRES_REQUIRE_AUTH", "md5")]).unwrap_err();
    assert!(e.to_string().contains("postgres.require_auth"), "{e}");
    assert!(e.to_string().contains("verify-full"), "{e}");
    // Over a Unix socket only, the socket's directory vouches for the server.
    let c = load(
        MINIMAL,
        &[(
            "OUTBOX_RELAY_POSTGRES_URL",
            "postgres://relay@%2Frun%2Fpostgresql/app",
        )],
    )
    .unwrap();
    assert!(c.postgres.require_auth.allows(AuthMethod::Md5));
}

/// A password file replaced by a pipe (or a device) after load: the next
/// connect goes on with the password read before, at once, instead of
/// waiting forever for a writer on the runtime's one thread; named so at
/// load, it is refused with the setting's name.
#[test]
fn a_password_file_that_becomes_a_pipe_does_not_hang_a_connect() {
    let dir = tempfile::tempdir().unwrap();
    let f = private_file(dir.path(), "one\n");
    let file = PasswordFile::open("postgres.password_file", f.to_str().unwrap()).unwrap();
    std::fs::remove_file(&f).unwrap();
    let status = std::process::Command::new("mkfifo")
        .arg(&f)
        .status()
        .unwrap();
    assert!(status.success());
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || tx.send(file.apply("postgres://relay@db/app")));
    let url = rx
        .recv_timeout(std::time::Duration::from_secs(10))
        .expect("apply returns without waiting on the pipe");
    assert_eq!(url, "postgres://relay:one@db/app");

    let err = PasswordFile::open("postgres.password_file", f.to_str().unwrap()).unwrap_err();
    let err = err.to_string();
    assert!(
        err.contains("postgres.password_file") && err.contains("is a pipe, not a regular file"),
        "{err}"
    );
    let err = PasswordFile::open("rabbitmq.password_file", "/dev/zero").unwrap_err();
    assert!(err.to_string().contains("character device"), "{err}");
}

/// A password file is read again at every connect; a bad read keeps the
/// password read last; refusals are retried for `ROTATION_GRACE` after
/// the first in a row, and a login the server took starts over.
#[test]
fn a_password_file_is_read_again_and_refusals_have_a_grace() {
    let dir = tempfile::tempdir().unwrap();
    let f = private_file(dir.path(), "one\n");
    let file = PasswordFile::open("rabbitmq.password_file", f.to_str().unwrap()).unwrap();
    let url = "amqp://relay@mq:5672/%2f";
    assert_eq!(file.first(url).unwrap(), "amqp://relay:one@mq:5672/%2f");
    std::fs::write(&f, "two\n").unwrap();
    assert_eq!(file.apply(url), "amqp://relay:two@mq:5672/%2f");
    std::fs::write(&f, "").unwrap();
    assert_eq!(file.apply(url), "amqp://relay:two@mq:5672/%2f");
    std::fs::remove_file(&f).unwrap();
    assert_eq!(file.apply(url), "amqp://relay:two@mq:5672/%2f");

    let t0 = std::time::Instant::now();
    let (sql, repl) = (Login::Sql, Login::Replication);
    assert!(file.refused_at(repl, t0));
    assert!(file.refused_at(
        repl,
        t0 + ROTATION_GRACE - std::time::Duration::from_secs(1)
    ));
    // The SQL login succeeding does not renew the replication's grace.
    file.accepted(sql);
    assert!(!file.refused_at(repl, t0 + ROTATION_GRACE));
    assert!(file.refused_at(sql, t0 + ROTATION_GRACE));
    file.accepted(repl);
    assert!(file.refused_at(repl, t0 + ROTATION_GRACE * 2));
}
