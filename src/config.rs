//! Configuration: the TOML file, `OUTBOX_RELAY_<SECTION>_<KEY>` overrides from
//! the environment, and validation into a [`Config`] the rest of the relay
//! can trust.
//!
//! Parsing happens in two steps, as ripgrep does with its low- and high-level
//! arguments: serde reads raw sections that refuse unknown keys, then
//! `RawConfig::validate` checks every value once, in one place, and names
//! the key at fault.

use std::fmt;

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::pgurl::PgTarget;
use crate::template::Template;

mod auth;
mod env;
mod outbox;
mod raw;
mod secrets;
mod trust;
mod types;
use crate::tls::SslMode;
pub use auth::{AuthMethod, AuthPolicy};
use env::{apply_env, syntax_message};
pub use outbox::{OutboxColumns, OutboxConfig, OutboxSource, RESERVED_PREFIX};
use raw::{RawConfig, RawUrls};
use secrets::PasswordFile;
pub use secrets::{Login, ROTATION_GRACE, Rotating};
use trust::{check_ca_file, postgres_trust};
pub use types::*;

/// The environment variable prefix for overrides.
pub const ENV_PREFIX: &str = "OUTBOX_RELAY_";

/// Variables under [`ENV_PREFIX`] that are not config keys (the CLI reads them).
const ENV_RESERVED: &[&str] = &[
    "OUTBOX_RELAY_CONFIG",
    "OUTBOX_RELAY_LOG",
    "OUTBOX_RELAY_LOG_FORMAT",
];

/// Most publishing channels (`rabbitmq.channels`): a connection each.
const MAX_CHANNELS: u64 = 16;

/// The `frame_max` `rabbitmq.url` may ask for: AMQP's least, to 1 MiB.
const FRAME_MAX_RANGE: std::ops::RangeInclusive<u32> = 4096..=1 << 20;

/// Sections of the file, in the order the README documents them.
const SECTIONS: &[&str] = &["postgres", "outbox", "rabbitmq", "http"];

/// Why the configuration was refused. Every variant names the key to fix.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Read {
        /// The file named on the command line.
        path: String,
        /// What the OS said.
        source: std::io::Error,
    },
    /// The file is not valid TOML.
    #[error("config file {path} is not valid TOML: {message}")]
    Syntax {
        /// The file.
        path: String,
        /// The parser's message, with line and column.
        message: String,
    },
    /// A key is unknown, missing, or of the wrong type.
    #[error("config key `{key}`: {message}")]
    Key {
        /// Dotted key, e.g. `rabbitmq.window`.
        key: String,
        /// What was expected.
        message: String,
    },
    /// An environment override names no known section.
    #[error(
        "environment variable {0} is not a known setting (expected {ENV_PREFIX}<SECTION>_<KEY> with SECTION one of postgres, outbox, rabbitmq, http)"
    )]
    UnknownEnv(String),
}

fn key_err(key: &str, message: impl Into<String>) -> ConfigError {
    ConfigError::Key {
        key: key.to_owned(),
        message: message.into(),
    }
}

/// A client certificate, `cert` and `key` (set by the settings `names`):
/// both or neither, readable, the key the certificate's. Unlike libpq,
/// there is no default file (`~/.postgresql/postgresql.crt`): a daemon's
/// home is no place for its secrets.
fn client_cert(
    names: [&str; 2],
    cert: Option<String>,
    key: Option<String>,
) -> Result<Option<crate::tls::ClientCert>, ConfigError> {
    let (cert_file, key_file) = match (cert, key) {
        (None, None) => return Ok(None),
        (Some(c), Some(k)) => (PathBuf::from(c), PathBuf::from(k)),
        (Some(_), None) => {
            return Err(key_err(
                names[0],
                format!("needs {} as well (its private key)", names[1]),
            ));
        }
        (None, Some(_)) => {
            return Err(key_err(
                names[1],
                format!("needs {} as well (its certificate)", names[0]),
            ));
        }
    };
    if let Some(warning) = secrets::password_file_warning(names[1], &key_file) {
        tracing::warn!("{warning}");
    }
    let cert = crate::tls::ClientCert::new(cert_file, key_file);
    cert.check().map_err(|e| key_err(names[0], e))?;
    Ok(Some(cert))
}

/// A value that must never be printed: passwords, and URLs that carry them.
/// A URL whose password comes from a `password_file` also knows that file,
/// and reads it again at every connect ([`Secret::current`]).
#[derive(Clone)]
pub struct Secret {
    value: String,
    file: Option<std::sync::Arc<secrets::PasswordFile>>,
}

impl PartialEq for Secret {
    fn eq(&self, other: &Self) -> bool {
        self.value == other.value
    }
}
impl Eq for Secret {}

impl Secret {
    /// Wraps a secret value.
    pub fn new(s: impl Into<String>) -> Self {
        Secret {
            value: s.into(),
            file: None,
        }
    }
    /// The secret as the config was loaded: for what the password does not
    /// change (hosts, user, database, the URL shown with it masked).
    pub fn expose(&self) -> &str {
        &self.value
    }
    /// The secret to connect with now: with a `password_file`, the URL
    /// with what the file holds now (a rotated password takes effect at
    /// the next connect); if it cannot be read, the password read last,
    /// with a warning naming the setting.
    pub fn current(&self) -> Secret {
        match &self.file {
            Some(file) => Secret::new(file.apply(&self.value)),
            None => self.clone(),
        }
    }
    /// The server refused the password (PostgreSQL 28P01, RabbitMQ's
    /// refused login): true when trying again may fix it, a password file
    /// being rotated, within [`ROTATION_GRACE`] of the first
    /// refusal in a row.
    pub fn login_refused(&self, login: Login) -> bool {
        self.file.as_ref().is_some_and(|f| f.refused(login))
    }
    /// `refusal`, the server's refusal of the password for `login`: made
    /// `rotating` (tried again) when the password comes from a file and
    /// [`Secret::login_refused`] says so, else as it is.
    pub fn refusal<E: std::error::Error + 'static>(
        &self,
        login: Login,
        refusal: E,
        rotating: impl FnOnce(Rotating<E>) -> E,
    ) -> E {
        match self.password_key() {
            Some(key) if self.login_refused(login) => rotating(Rotating {
                key,
                source: Box::new(refusal),
            }),
            _ => refusal,
        }
    }
    /// The server accepted the password: a later refusal starts a new
    /// grace period.
    pub fn login_accepted(&self, login: Login) {
        if let Some(f) = &self.file {
            f.accepted(login);
        }
    }
    /// The setting the password comes from, for messages.
    pub fn password_key(&self) -> Option<&'static str> {
        self.file.as_ref().map(|f| f.key())
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(****)")
    }
}

use crate::pgurl::query_has_password;
use crate::redact::NOT_A_URL;
pub use crate::redact::shown_url;

impl Config {
    /// Each outbox's dead-letter exchange, by index (what the publisher
    /// routes undeliverable events of each outbox to).
    pub fn dead_letters(&self) -> Vec<Option<String>> {
        (self.outboxes.iter())
            .map(|o| o.dead_letter_exchange.clone())
            .collect()
    }

    /// Reads `path`, applies environment overrides, validates.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_toml(&text, &path.display().to_string(), std::env::vars())
    }

    /// Parses `text` (named `origin` in errors) with the overrides in `env`.
    pub fn from_toml(
        text: &str,
        origin: &str,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Config, ConfigError> {
        let mut table: toml::Table =
            text.parse()
                .map_err(|e: toml::de::Error| ConfigError::Syntax {
                    path: origin.to_owned(),
                    message: syntax_message(text, &e),
                })?;
        let env: Vec<(String, String)> = env.into_iter().collect();
        // Where OpenSSL (and libpq's sslrootcert=system) finds the system's
        // CA bundle, read like the OUTBOX_RELAY_ overrides: from `env`.
        let ssl_cert_file = env
            .iter()
            .find(|(k, _)| k == "SSL_CERT_FILE")
            .map(|(_, v)| v.clone());
        apply_env(&mut table, env)?;
        let outbox = table.remove("outbox");
        let raw: RawConfig =
            serde_path_to_error::deserialize(toml::Value::Table(table)).map_err(|e| {
                let key = e.path().to_string();
                let message = e.into_inner().to_string();
                key_err(&key, message)
            })?;
        raw.validate(outbox, ssl_cert_file.as_deref())
    }
}

impl RawConfig {
    fn validate(
        self,
        outbox: Option<toml::Value>,
        ssl_cert_file: Option<&str>,
    ) -> Result<Config, ConfigError> {
        let mut p = self.postgres;
        let pg_password_file = match non_empty(p.password_file.take()) {
            Some(file) => Some(PasswordFile::open("postgres.password_file", &file)?),
            None => None,
        };
        if let Some(file) = &pg_password_file {
            p.url = file.first(&p.url)?;
        }
        if !(p.url.starts_with("postgres://") || p.url.starts_with("postgresql://")) {
            return Err(key_err(
                "postgres.url",
                "expected a URL of the form postgres://user:password@host:port/database",
            ));
        }
        // libpq's TLS parameters are ours to read: tokio-postgres knows
        // neither verify-ca/verify-full nor sslrootcert.
        let url_tls = crate::pgurl::split_pg_url(&p.url);
        let parsed = url_tls
            .url
            .parse::<tokio_postgres::Config>()
            .map_err(|_| key_err("postgres.url", format!("is {NOT_A_URL}")))?;
        let targets = PgTarget::all(&parsed).map_err(|e| key_err("postgres.url", e))?;
        let read_write = parsed.get_target_session_attrs()
            == tokio_postgres::config::TargetSessionAttrs::ReadWrite;
        if targets.len() > 1 && !read_write {
            return Err(key_err(
                "postgres.url",
                "lists several hosts without target_session_attrs=read-write: the relay needs \
                 the primary (its slot, its writes), and would take the first host that answers, \
                 a standby too; add ?target_session_attrs=read-write",
            ));
        }
        // verify-ca/verify-full need a CA file as soon as one host is TCP.
        let tls_target = targets
            .iter()
            .find(|t| matches!(t, PgTarget::Tcp { .. }))
            .unwrap_or(&targets[0])
            .clone();
        PgTarget::check_parameters(&parsed).map_err(|e| key_err("postgres.url", e))?;
        if pg_password_file.is_some() && query_has_password(&url_tls.url) {
            return Err(key_err(
                "postgres.url",
                "has a password= parameter, which would win over postgres.password_file; \
                 remove it",
            ));
        }
        let explicit_mode = match (non_empty(p.sslmode), url_tls.sslmode) {
            (Some(s), _) => Some(SslMode::parse(&s).ok_or_else(|| {
                key_err(
                    "postgres.sslmode",
                    format!("expected one of {}, got {s:?}", SslMode::CHOICES),
                )
            })?),
            (None, Some(s)) => Some(SslMode::parse(&s).ok_or_else(|| {
                key_err(
                    "postgres.url",
                    format!("sslmode={s} is not one of {}", SslMode::CHOICES),
                )
            })?),
            (None, None) => None,
        };
        let pg_client_cert = match (non_empty(p.cert_file), non_empty(p.key_file)) {
            (None, None) => client_cert(
                ["sslcert= in postgres.url", "sslkey= in postgres.url"],
                url_tls.sslcert.clone(),
                url_tls.sslkey.clone(),
            )?,
            (cert, key) => client_cert(["postgres.cert_file", "postgres.key_file"], cert, key)?,
        };
        let (sslmode, pg_ca_file) = postgres_trust(
            explicit_mode,
            non_empty(p.ca_file),
            non_empty(url_tls.sslrootcert),
            &tls_target,
            ssl_cert_file,
        )?;
        // Who gets the password: a server that proved who it is (or one
        // behind a Unix socket), or only what does not reveal it.
        let verified = matches!(sslmode, SslMode::VerifyCa | SslMode::VerifyFull)
            || targets.iter().all(|t| matches!(t, PgTarget::Unix { .. }));
        let (auth_key, auth_written) = match (non_empty(p.require_auth), url_tls.require_auth) {
            (Some(w), _) => ("postgres.require_auth", Some(w)),
            (None, Some(w)) => ("postgres.url", Some(w)),
            (None, None) => ("postgres.require_auth", None),
        };
        let require_auth = AuthPolicy::parse(auth_written.as_deref(), verified)
            .map_err(|e| key_err(auth_key, format!("require_auth {e}")))?;
        check_identifier("postgres.slot", &p.slot)?;
        if !p
            .slot
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
        {
            return Err(key_err(
                "postgres.slot",
                "replication slot names may contain only lower-case letters, digits and underscores",
            ));
        }
        check_identifier("postgres.publication", &p.publication)?;
        if !(10..=60_000).contains(&p.status_interval_ms) {
            return Err(key_err(
                "postgres.status_interval_ms",
                "expected milliseconds between 10 and 60000",
            ));
        }

        let mut r = self.rabbitmq;
        let mut urls = std::mem::replace(&mut r.url, RawUrls::Many(Vec::new())).into_vec();
        if urls.is_empty() || urls.iter().any(|u| u.is_empty()) {
            return Err(key_err(
                "rabbitmq.url",
                "expected a URL of the form amqp://user:password@host:port/vhost, or a list of them",
            ));
        }
        let password_file = match non_empty(r.password_file.take()) {
            Some(file) => Some(PasswordFile::open("rabbitmq.password_file", &file)?),
            None => None,
        };
        for url in &mut urls {
            if let Some(file) = &password_file {
                *url = file.first(url)?;
            }
            if !(url.starts_with("amqp://") || url.starts_with("amqps://")) {
                return Err(key_err(
                    "rabbitmq.url",
                    "expected a URL of the form amqp://user:password@host:port/vhost",
                ));
            }
            let uri = crate::amqpurl::parse_amqp_url(url)
                .map_err(|_| key_err("rabbitmq.url", format!("is {NOT_A_URL}")))?;
            // Ours is the bound on what the broker may send in one frame
            // (and what the reader reserves for it). 0, "no limit" to
            // RabbitMQ, would let the broker choose up to 4 GiB: it means
            // the default here.
            if let Some(f) = uri.query.frame_max
                && f != 0
                && !(FRAME_MAX_RANGE).contains(&f)
            {
                return Err(key_err(
                    "rabbitmq.url",
                    format!(
                        "asks for frame_max={f}: use {} to {} (or leave it out, or 0: 131072)",
                        FRAME_MAX_RANGE.start(),
                        FRAME_MAX_RANGE.end()
                    ),
                ));
            }
        }
        let any_amqps = urls.iter().any(|u| u.starts_with("amqps://"));
        let amqp_client_cert = client_cert(
            ["rabbitmq.cert_file", "rabbitmq.key_file"],
            non_empty(r.cert_file),
            non_empty(r.key_file),
        )?;
        if amqp_client_cert.is_some() && !any_amqps {
            return Err(key_err(
                "rabbitmq.cert_file",
                "a client certificate needs TLS: use amqps:// in rabbitmq.url",
            ));
        }
        for url in &urls {
            let external = crate::amqpurl::parse_amqp_url(url).is_ok_and(|u| {
                u.query.auth_mechanism == Some(amq_protocol::uri::SASLMechanism::External)
            });
            if external && !url.starts_with("amqps://") {
                return Err(key_err(
                    "rabbitmq.url",
                    "auth_mechanism=external logs in with the TLS client certificate: it needs \
                     amqps://",
                ));
            }
            if external && amqp_client_cert.is_none() {
                return Err(key_err(
                    "rabbitmq.cert_file",
                    "rabbitmq.url asks for auth_mechanism=external, which logs in with a client \
                     certificate: set rabbitmq.cert_file and rabbitmq.key_file",
                ));
            }
        }
        // amqps:// trusts the configured CA alone (a private CA pins the
        // broker), else the system's CA bundle; never both.
        let amqp_ca_file = match non_empty(r.ca_file) {
            Some(f) => Some(check_ca_file("rabbitmq.ca_file", &f)?),
            None if any_amqps => {
                let bundle = crate::tls::system_ca_bundle(ssl_cert_file).ok_or_else(|| {
                    key_err(
                        "rabbitmq.ca_file",
                        "amqps:// needs a CA to verify the broker with, and no system CA bundle \
                         was found (SSL_CERT_FILE, /etc/ssl/certs/ca-certificates.crt...): set \
                         rabbitmq.ca_file to the CA that signed the broker's certificate, or \
                         install the system's CA certificates",
                    )
                })?;
                Some(check_ca_file(
                    "rabbitmq.ca_file (the system CA bundle)",
                    &bundle.display().to_string(),
                )?)
            }
            None => None,
        };
        let exchange = (r.exchange.as_deref())
            .map(|x| Template::parse(x).map_err(|e| key_err("rabbitmq.exchange", e)))
            .transpose()?;
        let exchange_pattern = match non_empty(r.exchange_pattern) {
            None => None,
            Some(p) => Some(regex::Regex::new(&format!("^(?:{p})$")).map_err(|e| {
                key_err(
                    "rabbitmq.exchange_pattern",
                    format!("not a valid regular expression: {e}"),
                )
            })?),
        };
        let routing_key =
            Template::parse(&r.routing_key).map_err(|e| key_err("rabbitmq.routing_key", e))?;
        if routing_key.is_empty() {
            return Err(key_err("rabbitmq.routing_key", "must not be empty"));
        }
        if !(1..=65_535).contains(&r.window) {
            return Err(key_err(
                "rabbitmq.window",
                "expected an integer between 1 and 65535",
            ));
        }
        if !(1..=MAX_CHANNELS).contains(&r.channels) {
            return Err(key_err(
                "rabbitmq.channels",
                format!("expected an integer between 1 and {MAX_CHANNELS}"),
            ));
        }
        if !((64 * 1024)..=(16 * 1024 * 1024 * 1024)).contains(&r.window_bytes) {
            return Err(key_err(
                "rabbitmq.window_bytes",
                "expected bytes between 65536 and 17179869184 (16 GiB)",
            ));
        }
        if !(1..=3600).contains(&r.confirm_timeout_secs) {
            return Err(key_err(
                "rabbitmq.confirm_timeout_secs",
                "expected seconds between 1 and 3600",
            ));
        }

        let dead_letter_exchange = match r.dead_letter_exchange {
            Some(x) if x.is_empty() => None,
            Some(x) if x.len() > 255 => {
                return Err(key_err(
                    "rabbitmq.dead_letter_exchange",
                    "at most 255 bytes",
                ));
            }
            other => other,
        };
        if !(1..=1000).contains(&r.unroutable_retries) {
            return Err(key_err(
                "rabbitmq.unroutable_retries",
                "expected publishes of an unroutable message before dead-lettering, 1 to 1000",
            ));
        }
        if !(1..=60_000).contains(&r.retry_backoff_ms) {
            return Err(key_err(
                "rabbitmq.retry_backoff_ms",
                "expected milliseconds between 1 and 60000",
            ));
        }
        if !(1024..=(512 * 1024 * 1024)).contains(&r.max_message_bytes) {
            return Err(key_err(
                "rabbitmq.max_message_bytes",
                "expected bytes between 1024 and 536870912 (RabbitMQ's limit)",
            ));
        }
        if r.shutdown_grace_secs > 3600 {
            return Err(key_err(
                "rabbitmq.shutdown_grace_secs",
                "expected seconds between 0 and 3600",
            ));
        }
        if p.heartbeat_secs > 86_400 {
            return Err(key_err(
                "postgres.heartbeat_secs",
                "expected seconds, 0 (off) to 86400",
            ));
        }
        let checkpoint_table =
            parse_table_name_at("postgres.checkpoint_table", &p.checkpoint_table)?;
        let on_slot_lost = match non_empty(p.on_slot_lost).as_deref() {
            None | Some("stop") => OnSlotLost::Stop,
            Some("recover") => OnSlotLost::Recover,
            Some(other) => {
                return Err(key_err(
                    "postgres.on_slot_lost",
                    format!("expected \"stop\" or \"recover\", got {other:?}"),
                ));
            }
        };

        let outboxes = outbox::parse(
            outbox,
            &outbox::Defaults {
                exchange: exchange.as_ref(),
                exchange_pattern: exchange_pattern.as_ref(),
                routing_key: &routing_key,
                dead_letter_exchange: &dead_letter_exchange,
            },
        )?;

        let fixed_exchanges = fixed_exchanges(&outboxes);
        let listen = self
            .http
            .listen
            .parse()
            .map_err(|_| key_err("http.listen", "expected host:port, e.g. 127.0.0.1:9187"))?;

        Ok(Config {
            postgres: PostgresConfig {
                url: Secret::with_file(p.url, pg_password_file.as_ref()),
                slot: p.slot,
                publication: p.publication,
                status_interval: Duration::from_millis(p.status_interval_ms),
                heartbeat: (p.heartbeat_secs > 0).then(|| Duration::from_secs(p.heartbeat_secs)),
                checkpoint_table,
                targets,
                read_write,
                on_slot_lost,
                sslmode,
                ca_file: pg_ca_file,
                client_cert: pg_client_cert,
                require_auth,
            },
            outboxes,
            rabbitmq: RabbitmqConfig {
                urls: (urls.into_iter())
                    .map(|u| Secret::with_file(u, password_file.as_ref()))
                    .collect(),
                shuffle: r.shuffle,
                exchange,
                fixed_exchanges,
                exchange_pattern,
                routing_key,
                window: r.window as usize,
                channels: r.channels as usize,
                window_bytes: r.window_bytes as usize,
                confirm_timeout: Duration::from_secs(r.confirm_timeout_secs),
                dead_letter_exchange,
                unroutable_attempts: r.unroutable_retries as u32,
                retry_backoff: Duration::from_millis(r.retry_backoff_ms),
                max_message_bytes: r.max_message_bytes as usize,
                shutdown_grace: Duration::from_secs(r.shutdown_grace_secs),
                ca_file: amqp_ca_file,
                client_cert: amqp_client_cert,
            },
            http: HttpConfig { listen },
        })
    }
}

/// The exchanges outboxes name literally (not the default one), each once:
/// what must exist before publishing.
fn fixed_exchanges(outboxes: &[OutboxConfig]) -> Vec<String> {
    let mut names: Vec<String> = Vec::new();
    for x in outboxes.iter().filter_map(|o| o.exchange.as_literal()) {
        if !x.is_empty() && !names.iter().any(|n| n == x) {
            names.push(x.to_owned());
        }
    }
    names
}

/// An empty string (e.g. an environment override) means "not set".
fn non_empty(v: Option<String>) -> Option<String> {
    v.filter(|s| !s.trim().is_empty())
}

fn check_identifier(key: &str, v: &str) -> Result<(), ConfigError> {
    if v.is_empty() || v.len() > 63 || v.contains('\0') {
        return Err(key_err(key, "expected a name of 1 to 63 characters"));
    }
    Ok(())
}

/// A table name given on the command line (`table` or `schema.table`).
pub fn parse_table_name_arg(s: &str) -> Result<TableName, ConfigError> {
    parse_table_name_at("--table", s)
}

fn parse_table_name_at(key: &str, s: &str) -> Result<TableName, ConfigError> {
    let (schema, name) = match s.split_once('.') {
        Some((schema, name)) => (schema, name),
        None => ("public", s),
    };
    check_identifier(key, schema)?;
    check_identifier(key, name)?;
    if name.contains('.') {
        return Err(key_err(key, "expected `table` or `schema.table`"));
    }
    Ok(TableName {
        schema: schema.to_owned(),
        name: name.to_owned(),
    })
}

#[cfg(test)]
mod tests;
