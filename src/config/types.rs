//! The validated configuration the rest of the relay reads.

use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use super::{AuthPolicy, OutboxConfig, Secret};
use crate::pgurl::PgTarget;
use crate::template::Template;
use crate::tls::SslMode;

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
    /// The client certificate both connections present when the server
    /// asks for one (`cert` authentication): `postgres.cert_file` and
    /// `key_file`, else `sslcert=` and `sslkey=` in the URL.
    pub client_cert: Option<crate::tls::ClientCert>,
    /// The authentication requests both connections answer:
    /// `postgres.require_auth` (or `require_auth=` in the URL), never a
    /// cleartext or MD5 password to a server nobody verified.
    pub require_auth: AuthPolicy,
    /// The servers of `url`, in order: the connections go to the first
    /// that answers (and is the primary, with `read_write`).
    pub targets: Vec<PgTarget>,
    /// `target_session_attrs=read-write`: only a primary will do.
    pub read_write: bool,
    /// What `run` does when the slot is missing or invalidated.
    pub on_slot_lost: OnSlotLost,
}

/// `postgres.on_slot_lost`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnSlotLost {
    /// Refuse to run, naming `outbox-relay recover` (the default).
    Stop,
    /// Recreate the slot and re-publish the outbox rows since the last
    /// checkpoint, as `outbox-relay recover` does, then stream.
    Recover,
}

/// `[rabbitmq]`.
#[derive(Debug, Clone)]
pub struct RabbitmqConfig {
    /// AMQP URLs (holding the password): one, or a cluster's nodes, tried
    /// in order.
    pub urls: Vec<Secret>,
    /// Try the nodes in a random order (chosen once per process).
    pub shuffle: bool,
    /// Exchange template: what outboxes without their own use (`None`:
    /// every outbox sets one).
    pub exchange: Option<Template>,
    /// The exchanges outboxes name literally (the default one aside), each
    /// once: checked to exist on connecting.
    pub fixed_exchanges: Vec<String>,
    /// `rabbitmq.exchange_pattern`, anchored: what a templated exchange
    /// must render to in full (`None`: any name but `""` and `amq.*`).
    pub exchange_pattern: Option<regex::Regex>,
    /// Routing key template.
    pub routing_key: Template,
    /// Most publishes awaiting a confirm at once, on each channel.
    pub window: usize,
    /// Publishing channels (a connection each); an event's aggregate picks
    /// its channel.
    pub channels: usize,
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
    /// The client certificate `amqps://` presents when the broker asks:
    /// `rabbitmq.cert_file` and `key_file` (with `auth_mechanism=external`
    /// in the URL, it is also who logs in).
    pub client_cert: Option<crate::tls::ClientCert>,
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
    /// `[outbox]` or `[[outbox]]`: one outbox or several, in file order.
    pub outboxes: Vec<OutboxConfig>,
    /// `[rabbitmq]`
    pub rabbitmq: RabbitmqConfig,
    /// `[http]`
    pub http: HttpConfig,
}
