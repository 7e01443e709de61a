//! Configuration: the TOML file, `OUTBOX_RELAY_<SECTION>_<KEY>` overrides from
//! the environment, and validation into a [`Config`] the rest of the relay
//! can trust.
//!
//! Parsing happens in two steps, as ripgrep does with its low- and high-level
//! arguments: serde reads raw sections that refuse unknown keys, then
//! [`RawConfig::validate`] checks every value once, in one place, and names
//! the key at fault.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::pgurl::PgTarget;
use crate::template::Template;
use crate::tls::SslMode;

/// The environment variable prefix for overrides.
pub const ENV_PREFIX: &str = "OUTBOX_RELAY_";

/// Variables under [`ENV_PREFIX`] that are not config keys (the CLI reads them).
const ENV_RESERVED: &[&str] = &[
    "OUTBOX_RELAY_CONFIG",
    "OUTBOX_RELAY_LOG",
    "OUTBOX_RELAY_LOG_FORMAT",
];

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

/// A value that must never be printed: passwords, and URLs that carry them.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// Wraps a secret value.
    pub fn new(s: impl Into<String>) -> Self {
        Secret(s.into())
    }
    /// The secret itself, for the one place that must send it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(****)")
    }
}

use crate::redact::query_has_password;
pub use crate::redact::redact_url;

// ---------------------------------------------------------------- raw layer

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    postgres: RawPostgres,
    #[serde(default)]
    outbox: RawOutbox,
    rabbitmq: RawRabbitmq,
    #[serde(default)]
    http: RawHttp,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPostgres {
    url: String,
    #[serde(default = "default_slot")]
    slot: String,
    #[serde(default = "default_publication")]
    publication: String,
    #[serde(default = "default_status_interval_ms", deserialize_with = "de_u64")]
    status_interval_ms: u64,
    #[serde(default, deserialize_with = "de_u64")]
    heartbeat_secs: u64,
    #[serde(default = "default_checkpoint_table")]
    checkpoint_table: String,
    #[serde(default)]
    sslmode: Option<String>,
    #[serde(default)]
    ca_file: Option<String>,
    #[serde(default)]
    password_file: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawOutbox {
    table: String,
    id: String,
    aggregate_type: String,
    aggregate_id: String,
    event_type: String,
    payload: String,
    headers: String,
    created_at: String,
}

impl Default for RawOutbox {
    fn default() -> Self {
        RawOutbox {
            table: "public.outbox".into(),
            id: "id".into(),
            aggregate_type: "aggregate_type".into(),
            aggregate_id: "aggregate_id".into(),
            event_type: "event_type".into(),
            payload: "payload".into(),
            headers: "headers".into(),
            created_at: "created_at".into(),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRabbitmq {
    url: String,
    exchange: String,
    #[serde(default = "default_routing_key")]
    routing_key: String,
    #[serde(default = "default_window", deserialize_with = "de_u64")]
    window: u64,
    #[serde(default = "default_window_bytes", deserialize_with = "de_u64")]
    window_bytes: u64,
    #[serde(default = "default_confirm_timeout_secs", deserialize_with = "de_u64")]
    confirm_timeout_secs: u64,
    #[serde(default)]
    dead_letter_exchange: Option<String>,
    #[serde(default = "default_unroutable_retries", deserialize_with = "de_u64")]
    unroutable_retries: u64,
    #[serde(default = "default_retry_backoff_ms", deserialize_with = "de_u64")]
    retry_backoff_ms: u64,
    #[serde(default = "default_max_message_bytes", deserialize_with = "de_u64")]
    max_message_bytes: u64,
    #[serde(default = "default_shutdown_grace_secs", deserialize_with = "de_u64")]
    shutdown_grace_secs: u64,
    #[serde(default)]
    ca_file: Option<String>,
    #[serde(default)]
    password_file: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawHttp {
    listen: String,
}

impl Default for RawHttp {
    fn default() -> Self {
        RawHttp {
            listen: "127.0.0.1:9187".into(),
        }
    }
}

fn default_slot() -> String {
    "outbox_relay".into()
}
fn default_publication() -> String {
    "outbox_pub".into()
}
fn default_status_interval_ms() -> u64 {
    1000
}
fn default_routing_key() -> String {
    "{aggregate_type}.{event_type}".into()
}
fn default_window() -> u64 {
    1024
}
/// Bytes of rows awaiting a confirm at once: with 1 MiB rows, 32 of them.
fn default_window_bytes() -> u64 {
    32 * 1024 * 1024
}
fn default_confirm_timeout_secs() -> u64 {
    30
}
fn default_checkpoint_table() -> String {
    "public.outbox_relay_checkpoint".into()
}
fn default_unroutable_retries() -> u64 {
    3
}
fn default_retry_backoff_ms() -> u64 {
    500
}
/// RabbitMQ 4's default `max_message_size` (16 MiB).
fn default_max_message_bytes() -> u64 {
    16 * 1024 * 1024
}
fn default_shutdown_grace_secs() -> u64 {
    10
}

/// Numbers may come from TOML integers or from environment overrides, which
/// are always strings.
fn de_u64<'de, D: serde::Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Num {
        Int(u64),
        Str(String),
    }
    match Num::deserialize(d)? {
        Num::Int(n) => Ok(n),
        Num::Str(s) => s.trim().parse().map_err(|_| {
            serde::de::Error::custom(format!("expected a non-negative integer, got {s:?}"))
        }),
    }
}

// ---------------------------------------------------------- validated layer

/// A table name split into schema and name, as PostgreSQL's catalogs hold it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableName {
    /// Schema, `public` when the config gave none.
    pub schema: String,
    /// Table.
    pub name: String,
}

impl TableName {
    /// The name quoted for SQL: `"schema"."name"`.
    pub fn quoted(&self) -> String {
        format!("{}.{}", quote_ident(&self.schema), quote_ident(&self.name))
    }
}

impl fmt::Display for TableName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.schema, self.name)
    }
}

/// Quotes an SQL identifier.
pub fn quote_ident(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "\"\""))
}

/// `[postgres]`.
#[derive(Debug, Clone)]
pub struct PostgresConfig {
    /// Connection URL (holds the password).
    pub url: Secret,
    /// Logical replication slot name.
    pub slot: String,
    /// Publication name.
    pub publication: String,
    /// How often the confirmed position is reported to the server.
    pub status_interval: Duration,
    /// Interval of the transactional heartbeat message; `None` = off.
    pub heartbeat: Option<Duration>,
    /// Table where the relay records its checkpoint.
    pub checkpoint_table: TableName,
    /// TLS for both connections: `postgres.sslmode`, else `sslmode=` in the
    /// URL, else `prefer`.
    pub sslmode: SslMode,
    /// CA to verify the server certificate with: `postgres.ca_file`, else
    /// `sslrootcert=` in the URL (`system`: the system's CA bundle). Its
    /// certificates are the only ones trusted; `None`: nothing is verified
    /// (only allowed with `disable`, `prefer` and `require`).
    pub ca_file: Option<PathBuf>,
    /// The one server both connections reach (read from `url`).
    pub target: PgTarget,
}

/// `[outbox]`: which table, and which of its columns play which role.
#[derive(Debug, Clone)]
pub struct OutboxConfig {
    /// The outbox table.
    pub table: TableName,
    /// Column names, by role.
    pub columns: OutboxColumns,
}

/// Column names of the outbox table, by the role each plays in the message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxColumns {
    /// Stable event id: the AMQP `message_id`.
    pub id: String,
    /// Header `aggregate_type`, and the default routing key's first part.
    pub aggregate_type: String,
    /// Header `aggregate_id`; ordering is per aggregate.
    pub aggregate_id: String,
    /// AMQP `type`.
    pub event_type: String,
    /// Message body, as stored.
    pub payload: String,
    /// Optional JSON object of extra headers.
    pub headers: String,
    /// Insert time; `recover` and `republish --since` select rows by it.
    pub created_at: String,
}

impl OutboxColumns {
    /// The default column names of `sql/outbox.sql`.
    pub fn default_names() -> Self {
        let r = RawOutbox::default();
        OutboxColumns {
            id: r.id,
            aggregate_type: r.aggregate_type,
            aggregate_id: r.aggregate_id,
            event_type: r.event_type,
            payload: r.payload,
            headers: r.headers,
            created_at: r.created_at,
        }
    }

    /// Maps a template placeholder to a column name: the role names above
    /// stand for whatever column plays that role; any other name is a column.
    pub fn resolve<'a>(&'a self, placeholder: &'a str) -> &'a str {
        match placeholder {
            "id" => &self.id,
            "aggregate_type" => &self.aggregate_type,
            "aggregate_id" => &self.aggregate_id,
            "event_type" => &self.event_type,
            "payload" => &self.payload,
            "headers" => &self.headers,
            other => other,
        }
    }
}

/// `[rabbitmq]`.
#[derive(Debug, Clone)]
pub struct RabbitmqConfig {
    /// AMQP URL (holds the password).
    pub url: Secret,
    /// Exchange template.
    pub exchange: Template,
    /// Routing key template.
    pub routing_key: Template,
    /// Most publishes awaiting a confirm at once.
    pub window: usize,
    /// Most bytes of rows awaiting a confirm at once (one message is always
    /// allowed, however large).
    pub window_bytes: usize,
    /// Messages wait and no confirm has come for this long (time blocked
    /// by a resource alarm not counted): the broker is hung.
    pub confirm_timeout: Duration,
    /// Where undeliverable events go; `None`: stop instead.
    pub dead_letter_exchange: Option<String>,
    /// Publishes of an unroutable message before it is dead-lettered.
    pub unroutable_attempts: u32,
    /// First delay before re-publishing a returned or nacked message.
    pub retry_backoff: Duration,
    /// Bodies larger than this are dead-lettered without being sent.
    pub max_message_bytes: usize,
    /// How long shutdown waits for outstanding confirms.
    pub shutdown_grace: Duration,
    /// The CAs `amqps://` trusts, and no others: `rabbitmq.ca_file`, else
    /// the system's CA bundle; `None` for `amqp://`.
    pub ca_file: Option<PathBuf>,
}

/// `[http]`.
#[derive(Debug, Clone)]
pub struct HttpConfig {
    /// Address of the metrics and health endpoint.
    pub listen: SocketAddr,
}

/// The validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// `[postgres]`
    pub postgres: PostgresConfig,
    /// `[outbox]`
    pub outbox: OutboxConfig,
    /// `[rabbitmq]`
    pub rabbitmq: RabbitmqConfig,
    /// `[http]`
    pub http: HttpConfig,
}

impl Config {
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
        let raw: RawConfig =
            serde_path_to_error::deserialize(toml::Value::Table(table)).map_err(|e| {
                let key = e.path().to_string();
                let message = e.into_inner().to_string();
                key_err(&key, message)
            })?;
        raw.validate(ssl_cert_file.as_deref())
    }
}

/// The parser's message with the line and column, but not the line
/// itself, which may hold a password.
fn syntax_message(text: &str, e: &toml::de::Error) -> String {
    match e.span() {
        Some(span) => {
            let before = &text[..span.start.min(text.len())];
            let line = before.matches('\n').count() + 1;
            let column = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
            format!("line {line}, column {column}: {}", e.message().trim_end())
        }
        None => e.message().trim_end().to_owned(),
    }
}

/// Writes `OUTBOX_RELAY_<SECTION>_<KEY>=value` into the table as strings.
fn apply_env(
    table: &mut toml::Table,
    env: impl IntoIterator<Item = (String, String)>,
) -> Result<(), ConfigError> {
    let overrides: BTreeMap<String, String> = env
        .into_iter()
        .filter(|(k, _)| k.starts_with(ENV_PREFIX) && !ENV_RESERVED.contains(&k.as_str()))
        .collect();
    for (var, value) in overrides {
        let rest = var[ENV_PREFIX.len()..].to_ascii_lowercase();
        let (section, key) = SECTIONS
            .iter()
            .find_map(|s| {
                rest.strip_prefix(s)
                    .and_then(|r| r.strip_prefix('_'))
                    .filter(|k| !k.is_empty())
                    .map(|k| (*s, k.to_owned()))
            })
            .ok_or_else(|| ConfigError::UnknownEnv(var.clone()))?;
        let entry = table
            .entry(section)
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        let toml::Value::Table(section_table) = entry else {
            return Err(key_err(section, "must be a table"));
        };
        section_table.insert(key, toml::Value::String(value));
    }
    Ok(())
}

impl RawConfig {
    fn validate(self, ssl_cert_file: Option<&str>) -> Result<Config, ConfigError> {
        let mut p = self.postgres;
        let pg_password_file = non_empty(p.password_file.take());
        if let Some(file) = &pg_password_file {
            p.url = with_password_file(&p.url, "postgres.password_file", file)?;
        }
        let pg_password_file = pg_password_file.is_some();
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
            .map_err(|e| key_err("postgres.url", format!("not a valid PostgreSQL URL: {e}")))?;
        let target = PgTarget::of(&parsed).map_err(|e| key_err("postgres.url", e))?;
        PgTarget::check_parameters(&parsed).map_err(|e| key_err("postgres.url", e))?;
        if pg_password_file && query_has_password(&url_tls.url) {
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
        let (sslmode, pg_ca_file) = postgres_trust(
            explicit_mode,
            non_empty(p.ca_file),
            non_empty(url_tls.sslrootcert),
            &target,
            ssl_cert_file,
        )?;
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

        let o = self.outbox;
        let table = parse_table_name(&o.table)?;
        let columns = OutboxColumns {
            id: o.id,
            aggregate_type: o.aggregate_type,
            aggregate_id: o.aggregate_id,
            event_type: o.event_type,
            payload: o.payload,
            headers: o.headers,
            created_at: o.created_at,
        };
        for (key, v) in [
            ("outbox.id", &columns.id),
            ("outbox.aggregate_type", &columns.aggregate_type),
            ("outbox.aggregate_id", &columns.aggregate_id),
            ("outbox.event_type", &columns.event_type),
            ("outbox.payload", &columns.payload),
            ("outbox.headers", &columns.headers),
            ("outbox.created_at", &columns.created_at),
        ] {
            check_identifier(key, v)?;
        }

        let mut r = self.rabbitmq;
        if let Some(file) = non_empty(r.password_file.take()) {
            r.url = with_password_file(&r.url, "rabbitmq.password_file", &file)?;
        }
        if !(r.url.starts_with("amqp://") || r.url.starts_with("amqps://")) {
            return Err(key_err(
                "rabbitmq.url",
                "expected a URL of the form amqp://user:password@host:port/vhost",
            ));
        }
        r.url
            .parse::<lapin::uri::AMQPUri>()
            .map_err(|e| key_err("rabbitmq.url", format!("not a valid AMQP URL: {e}")))?;
        // amqps:// trusts the configured CA alone (a private CA pins the
        // broker), else the system's CA bundle; never both.
        let amqp_ca_file = match non_empty(r.ca_file) {
            Some(f) => Some(check_ca_file("rabbitmq.ca_file", &f)?),
            None if r.url.starts_with("amqps://") => {
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
        let exchange = Template::parse(&r.exchange).map_err(|e| key_err("rabbitmq.exchange", e))?;
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

        let listen = self
            .http
            .listen
            .parse()
            .map_err(|_| key_err("http.listen", "expected host:port, e.g. 127.0.0.1:9187"))?;

        Ok(Config {
            postgres: PostgresConfig {
                url: Secret::new(p.url),
                slot: p.slot,
                publication: p.publication,
                status_interval: Duration::from_millis(p.status_interval_ms),
                heartbeat: (p.heartbeat_secs > 0).then(|| Duration::from_secs(p.heartbeat_secs)),
                checkpoint_table,
                target,
                sslmode,
                ca_file: pg_ca_file,
            },
            outbox: OutboxConfig { table, columns },
            rabbitmq: RabbitmqConfig {
                url: Secret::new(r.url),
                exchange,
                routing_key,
                window: r.window as usize,
                window_bytes: r.window_bytes as usize,
                confirm_timeout: Duration::from_secs(r.confirm_timeout_secs),
                dead_letter_exchange,
                unroutable_attempts: r.unroutable_retries as u32,
                retry_backoff: Duration::from_millis(r.retry_backoff_ms),
                max_message_bytes: r.max_message_bytes as usize,
                shutdown_grace: Duration::from_secs(r.shutdown_grace_secs),
                ca_file: amqp_ca_file,
            },
            http: HttpConfig { listen },
        })
    }
}

/// Puts the password read from `file` into `url` (percent-encoded), in place
/// of any password the URL had: secrets can live in a file only root and the
/// relay can read (e.g. a Kubernetes or systemd credential).
///
/// As libpq does with `.pgpass`: a file others may read or write draws a
/// warning; the file holds the password alone, every byte of it (spaces
/// too), and at most one line ending (`\n` or `\r\n`) after it.
fn with_password_file(url: &str, key: &str, file: &str) -> Result<String, ConfigError> {
    let text = std::fs::read_to_string(file)
        .map_err(|e| key_err(key, format!("cannot read {file}: {e}")))?;
    if let Some(warning) = password_file_warning(key, Path::new(file)) {
        tracing::warn!("{warning}");
    }
    let password = match text.strip_suffix('\n') {
        Some(line) => line.strip_suffix('\r').unwrap_or(line),
        None => &text,
    };
    if password.is_empty() {
        return Err(key_err(key, format!("{file} is empty")));
    }
    if password.contains(['\n', '\r']) {
        return Err(key_err(
            key,
            format!("{file} holds more than one line; it must hold only the password"),
        ));
    }
    let encoded: String =
        percent_encoding::utf8_percent_encode(password, percent_encoding::NON_ALPHANUMERIC)
            .collect();
    let (scheme, rest) = url
        .split_once("://")
        .ok_or_else(|| key_err(key, "the URL it applies to has no scheme"))?;
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    let Some(at) = authority.rfind('@') else {
        return Err(key_err(
            key,
            "the URL it applies to names no user (user@host) to give the password to",
        ));
    };
    let user = authority[..at].split(':').next().unwrap_or_default();
    Ok(format!(
        "{scheme}://{user}:{encoded}{}{tail}",
        &authority[at..]
    ))
}

/// The warning for a password file that group or others may read or write
/// (libpq ignores such a `.pgpass`; we only warn).
fn password_file_warning(key: &str, path: &Path) -> Option<String> {
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(path).ok()?.permissions().mode();
    (mode & 0o077 != 0).then(|| {
        format!(
            "{key}: {} is accessible by group or others (mode {:03o}); restrict it with `chmod 600`",
            path.display(),
            mode & 0o777
        )
    })
}

/// An empty string (e.g. an environment override) means "not set".
fn non_empty(v: Option<String>) -> Option<String> {
    v.filter(|s| !s.trim().is_empty())
}

/// libpq's rules for `sslmode` and `sslrootcert` (`ca_file`): the mode and
/// the CA file both connections verify with.
///
/// - `sslrootcert=system` means the system's CA bundle, makes `verify-full`
///   the default, and refuses any weaker mode: a public CA signs a
///   certificate for anyone's domain, so only the host name check makes it
///   mean anything.
/// - `verify-ca` and `verify-full` need a CA file; there is no fallback to
///   public roots (over a Unix socket, where there is no TLS, they are
///   accepted, as libpq does).
fn postgres_trust(
    mode: Option<SslMode>,
    ca_file: Option<String>,
    sslrootcert: Option<String>,
    target: &PgTarget,
    ssl_cert_file: Option<&str>,
) -> Result<(SslMode, Option<PathBuf>), ConfigError> {
    let (key, root) = match (ca_file, sslrootcert) {
        (Some(f), Some(u)) if u == "system" && f != "system" => {
            return Err(key_err(
                "postgres.ca_file",
                "is set, and postgres.url says sslrootcert=system: keep one of the two",
            ));
        }
        (Some(f), _) => ("postgres.ca_file", Some(f)),
        (None, Some(f)) => ("postgres.url", Some(f)),
        (None, None) => ("postgres.ca_file", None),
    };
    let system = root.as_deref() == Some("system");
    let mode = match mode {
        Some(m) => m,
        None if system => SslMode::VerifyFull,
        None => SslMode::default(),
    };
    if system && mode != SslMode::VerifyFull {
        return Err(key_err(
            "postgres.sslmode",
            format!(
                "sslrootcert=system trusts every public CA, so it is allowed only with \
                 sslmode = \"verify-full\" (as libpq), which also checks the host name; got \
                 {mode}. Use verify-full, or set postgres.ca_file to your own CA"
            ),
        ));
    }
    let ca = match root {
        Some(_) if system => {
            let bundle = crate::tls::system_ca_bundle(ssl_cert_file).ok_or_else(|| {
                key_err(
                    key,
                    "sslrootcert=system: no system CA bundle found (SSL_CERT_FILE, \
                     /etc/ssl/certs/ca-certificates.crt...); install the system's CA \
                     certificates or set postgres.ca_file",
                )
            })?;
            Some(check_ca_file(key, &bundle.display().to_string())?)
        }
        Some(f) if key == "postgres.url" => {
            let path = PathBuf::from(f);
            crate::tls::load_ca_file(&path)
                .map_err(|e| key_err(key, format!("sslrootcert: {e}")))?;
            Some(path)
        }
        Some(f) => Some(check_ca_file(key, &f)?),
        None => None,
    };
    let verifies = matches!(mode, SslMode::VerifyCa | SslMode::VerifyFull);
    if verifies && ca.is_none() && matches!(target, PgTarget::Tcp { .. }) {
        return Err(key_err(
            "postgres.ca_file",
            format!(
                "sslmode = \"{mode}\" verifies the server's certificate, which needs the CA \
                 that signed it: set postgres.ca_file (or sslrootcert= in postgres.url). As \
                 libpq, the relay does not fall back to the public CAs, which sign a \
                 certificate for anyone's domain; for a server with a public certificate use \
                 sslmode = \"verify-full\" with sslrootcert=system"
            ),
        ));
    }
    Ok((mode, ca))
}

/// The CA file must be readable and hold a certificate now, not at the
/// first connection.
fn check_ca_file(key: &str, path: &str) -> Result<PathBuf, ConfigError> {
    let path = PathBuf::from(path);
    crate::tls::load_ca_file(&path).map_err(|e| key_err(key, e))?;
    Ok(path)
}

fn check_identifier(key: &str, v: &str) -> Result<(), ConfigError> {
    if v.is_empty() || v.len() > 63 || v.contains('\0') {
        return Err(key_err(key, "expected a name of 1 to 63 characters"));
    }
    Ok(())
}

fn parse_table_name(s: &str) -> Result<TableName, ConfigError> {
    parse_table_name_at("outbox.table", s)
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
mod tests {
    use super::*;

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
        assert_eq!(c.outbox.table.schema, "public");
        assert_eq!(c.outbox.table.name, "outbox");
        assert_eq!(c.outbox.columns.payload, "payload");
        assert_eq!(c.rabbitmq.window, 1024);
        assert_eq!(c.rabbitmq.confirm_timeout, Duration::from_secs(30));
        assert_eq!(c.postgres.status_interval, Duration::from_secs(1));
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
        assert_eq!(c.outbox.columns.aggregate_type, "kind");
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
        ];
        for (var, value, key) in cases {
            let err = load(MINIMAL, &[(var, value)]).unwrap_err().to_string();
            assert!(err.contains(key), "{var}={value}: {err}");
        }
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
            "postgres://relay@h1:5432,h2:5433/app",
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
            c.postgres.target,
            PgTarget::Tcp {
                name: "db.example".into(),
                addr: "10.0.0.1".into(),
                port: 5432
            }
        );
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
            c.rabbitmq.url.expose(),
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

    /// The URL `with_password_file` makes from a private file holding `content`.
    fn url_from_password_file(content: &str) -> Result<String, String> {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("pw");
        std::fs::write(&f, content).unwrap();
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o600)).unwrap();
        let f = f.display().to_string();
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
}
