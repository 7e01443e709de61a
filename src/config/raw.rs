//! The raw layer of the config: what serde reads from the TOML file (and
//! the environment's overrides), every section refusing unknown keys, with
//! the defaults. [`super::RawConfig::validate`] turns it into a `Config`.

use serde::Deserialize;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawConfig {
    pub(super) postgres: RawPostgres,
    pub(super) rabbitmq: RawRabbitmq,
    #[serde(default)]
    pub(super) http: RawHttp,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawPostgres {
    pub(super) url: String,
    #[serde(default = "default_slot")]
    pub(super) slot: String,
    #[serde(default = "default_publication")]
    pub(super) publication: String,
    #[serde(default = "default_status_interval_ms", deserialize_with = "de_u64")]
    pub(super) status_interval_ms: u64,
    #[serde(default, deserialize_with = "de_u64")]
    pub(super) heartbeat_secs: u64,
    #[serde(default = "default_checkpoint_table")]
    pub(super) checkpoint_table: String,
    #[serde(default)]
    pub(super) sslmode: Option<String>,
    #[serde(default)]
    pub(super) require_auth: Option<String>,
    #[serde(default)]
    pub(super) ca_file: Option<String>,
    #[serde(default)]
    pub(super) cert_file: Option<String>,
    #[serde(default)]
    pub(super) key_file: Option<String>,
    #[serde(default)]
    pub(super) password_file: Option<String>,
    #[serde(default)]
    pub(super) on_slot_lost: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRabbitmq {
    pub(super) url: RawUrls,
    #[serde(default)]
    pub(super) cert_file: Option<String>,
    #[serde(default)]
    pub(super) key_file: Option<String>,
    #[serde(default)]
    pub(super) shuffle: bool,
    #[serde(default)]
    pub(super) exchange: Option<String>,
    #[serde(default)]
    pub(super) exchange_pattern: Option<String>,
    #[serde(default = "default_routing_key")]
    pub(super) routing_key: String,
    #[serde(default = "default_window", deserialize_with = "de_u64")]
    pub(super) window: u64,
    #[serde(default = "default_channels", deserialize_with = "de_u64")]
    pub(super) channels: u64,
    #[serde(default = "default_window_bytes", deserialize_with = "de_u64")]
    pub(super) window_bytes: u64,
    #[serde(default = "default_confirm_timeout_secs", deserialize_with = "de_u64")]
    pub(super) confirm_timeout_secs: u64,
    #[serde(default)]
    pub(super) dead_letter_exchange: Option<String>,
    #[serde(default = "default_unroutable_retries", deserialize_with = "de_u64")]
    pub(super) unroutable_retries: u64,
    #[serde(default = "default_retry_backoff_ms", deserialize_with = "de_u64")]
    pub(super) retry_backoff_ms: u64,
    #[serde(default = "default_max_message_bytes", deserialize_with = "de_u64")]
    pub(super) max_message_bytes: u64,
    #[serde(default = "default_shutdown_grace_secs", deserialize_with = "de_u64")]
    pub(super) shutdown_grace_secs: u64,
    #[serde(default)]
    pub(super) ca_file: Option<String>,
    #[serde(default)]
    pub(super) password_file: Option<String>,
}

/// `rabbitmq.url`: one URL, or a list of a cluster's nodes (an array, or
/// one string with the URLs separated by commas, as an environment
/// override gives it).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(super) enum RawUrls {
    One(String),
    Many(Vec<String>),
}

impl RawUrls {
    pub(super) fn into_vec(self) -> Vec<String> {
        match self {
            RawUrls::Many(v) => v,
            RawUrls::One(s) => split_urls(&s),
        }
    }
}

/// Splits `amqp://a,amqps://b` at each comma that starts another URL (a
/// comma inside a password stays).
pub(super) fn split_urls(s: &str) -> Vec<String> {
    let starts_url = |t: &str| {
        let t = t.trim_start();
        t.starts_with("amqp://") || t.starts_with("amqps://")
    };
    let mut out = Vec::new();
    let mut from = 0;
    for (i, _) in s.match_indices(',') {
        if starts_url(&s[i + 1..]) {
            out.push(s[from..i].trim().to_owned());
            from = i + 1;
        }
    }
    out.push(s[from..].trim().to_owned());
    out
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawHttp {
    pub(super) listen: String,
}

impl Default for RawHttp {
    fn default() -> Self {
        RawHttp {
            listen: "127.0.0.1:9187".into(),
        }
    }
}

pub(super) fn default_slot() -> String {
    "outbox_relay".into()
}
pub(super) fn default_publication() -> String {
    "outbox_pub".into()
}
/// The confirmed position goes to PostgreSQL this soon after it moves
/// (coalesced, at once when the last report is older): a `kill -9`
/// replays about this much traffic.
pub(super) fn default_status_interval_ms() -> u64 {
    100
}
pub(super) fn default_routing_key() -> String {
    "{aggregate_type}.{event_type}".into()
}
pub(super) fn default_window() -> u64 {
    1024
}
pub(super) fn default_channels() -> u64 {
    1
}
/// Bytes of rows awaiting a confirm at once: with 1 MiB rows, 32 of them.
pub(super) fn default_window_bytes() -> u64 {
    32 * 1024 * 1024
}
pub(super) fn default_confirm_timeout_secs() -> u64 {
    30
}
pub(super) fn default_checkpoint_table() -> String {
    "public.outbox_relay_checkpoint".into()
}
pub(super) fn default_unroutable_retries() -> u64 {
    3
}
pub(super) fn default_retry_backoff_ms() -> u64 {
    500
}
/// RabbitMQ 4's default `max_message_size` (16 MiB).
pub(super) fn default_max_message_bytes() -> u64 {
    16 * 1024 * 1024
}
pub(super) fn default_shutdown_grace_secs() -> u64 {
    10
}

/// Numbers may come from TOML integers or from environment overrides, which
/// are always strings.
pub(super) fn de_u64<'de, D: serde::Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
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
