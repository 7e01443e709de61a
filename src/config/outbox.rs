//! `[outbox]` / `[[outbox]]`: which tables (or logical-message prefixes) are
//! outboxes, how each one's columns or fields map to the message, and where
//! its messages go.

use serde::Deserialize;

use super::{ConfigError, TableName, check_identifier, key_err, non_empty, parse_table_name_at};
use crate::template::Template;

/// Prefixes the relay writes itself (heartbeats, liveness probes): never an
/// outbox's.
pub const RESERVED_PREFIX: &str = "outbox-relay";

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawOutbox {
    source: Option<String>,
    table: Option<String>,
    prefix: Option<String>,
    id: Option<String>,
    aggregate_type: Option<String>,
    aggregate_id: Option<String>,
    event_type: Option<String>,
    payload: Option<String>,
    headers: Option<String>,
    created_at: Option<String>,
    sequence: Option<String>,
    exchange: Option<String>,
    routing_key: Option<String>,
    dead_letter_exchange: Option<String>,
    routing_headers: Option<bool>,
}

/// Where an outbox's events come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OutboxSource {
    /// INSERTs into a table (the publication lists it).
    Table(TableName),
    /// Transactional logical messages with this prefix
    /// (`pg_logical_emit_message(true, prefix, json)`): nothing stored.
    Message {
        /// The prefix.
        prefix: String,
    },
}

/// One outbox: its source, which column (or JSON field) plays which role,
/// and where its messages go.
#[derive(Debug, Clone)]
pub struct OutboxConfig {
    /// The config key it was read from (`outbox`, or `outbox[1]`), for
    /// messages that name a key to fix.
    pub key: String,
    /// Table or logical-message prefix.
    pub source: OutboxSource,
    /// Column (or, for messages, JSON field) names, by role.
    pub columns: OutboxColumns,
    /// Exchange template (`rabbitmq.exchange` unless the outbox sets one).
    pub exchange: Template,
    /// `rabbitmq.exchange_pattern`: what the exchange template must render
    /// to (a literal exchange is the operator's and not held to it).
    pub exchange_pattern: Option<regex::Regex>,
    /// Routing key template (`rabbitmq.routing_key` unless set here).
    pub routing_key: Template,
    /// The config keys the two templates come from, for messages.
    pub template_keys: (String, String),
    /// Dead-letter exchange (`rabbitmq.dead_letter_exchange` unless set here).
    pub dead_letter_exchange: Option<String>,
    /// `routing_headers`: the row's `CC` and `BCC` headers (RabbitMQ's
    /// sender-selected distribution) are sent; off, they are dropped.
    pub routing_headers: bool,
}

impl OutboxConfig {
    /// The single `[outbox]` over `source` with `columns`, sending where
    /// `rabbitmq` says.
    pub fn with_defaults(
        source: OutboxSource,
        columns: OutboxColumns,
        rabbitmq: &super::RabbitmqConfig,
    ) -> Self {
        OutboxConfig {
            key: "outbox".into(),
            source,
            columns,
            exchange: rabbitmq.exchange.clone().unwrap_or_default(),
            exchange_pattern: rabbitmq.exchange_pattern.clone(),
            routing_key: rabbitmq.routing_key.clone(),
            template_keys: ("rabbitmq.exchange".into(), "rabbitmq.routing_key".into()),
            dead_letter_exchange: rabbitmq.dead_letter_exchange.clone(),
            routing_headers: false,
        }
    }

    /// The table, for a table outbox.
    pub fn table(&self) -> Option<&TableName> {
        match &self.source {
            OutboxSource::Table(t) => Some(t),
            OutboxSource::Message { .. } => None,
        }
    }

    /// The logical-message prefix, for a table-less outbox.
    pub fn prefix(&self) -> Option<&str> {
        match &self.source {
            OutboxSource::Message { prefix } => Some(prefix),
            OutboxSource::Table(_) => None,
        }
    }

    /// `<key>.<field>`, e.g. `outbox[1].payload`.
    pub fn key_of(&self, field: &str) -> String {
        format!("{}.{field}", self.key)
    }
}

impl std::fmt::Display for OutboxSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            OutboxSource::Table(t) => write!(f, "{t}"),
            OutboxSource::Message { prefix } => write!(f, "logical messages {prefix:?}"),
        }
    }
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
    /// A column whose values increase in the order rows are written (an
    /// identity or `bigserial` column), if the table has one: `recover` and
    /// `republish` re-read rows in its order. Without it they use
    /// `(created_at, ctid)`, where a transaction's rows can come out of the
    /// order they were written (the heap reuses freed space).
    pub sequence: Option<String>,
}

impl OutboxColumns {
    /// The default column names of `sql/outbox.sql`.
    pub fn default_names() -> Self {
        OutboxColumns {
            id: "id".into(),
            aggregate_type: "aggregate_type".into(),
            aggregate_id: "aggregate_id".into(),
            event_type: "event_type".into(),
            payload: "payload".into(),
            headers: "headers".into(),
            created_at: "created_at".into(),
            sequence: None,
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

/// What every outbox inherits from `[rabbitmq]`.
pub(super) struct Defaults<'a> {
    /// `None`: every outbox must set its own.
    pub exchange: Option<&'a Template>,
    pub exchange_pattern: Option<&'a regex::Regex>,
    pub routing_key: &'a Template,
    pub dead_letter_exchange: &'a Option<String>,
}

/// The `outbox` value of the file: absent (the default table), one table
/// (`[outbox]`) or a list (`[[outbox]]`).
pub(super) fn parse(
    value: Option<toml::Value>,
    defaults: &Defaults<'_>,
) -> Result<Vec<OutboxConfig>, ConfigError> {
    let raws: Vec<(String, toml::Value)> = match value {
        None => vec![("outbox".into(), toml::Value::Table(toml::Table::new()))],
        Some(t @ toml::Value::Table(_)) => vec![("outbox".into(), t)],
        Some(toml::Value::Array(list)) if !list.is_empty() => list
            .into_iter()
            .enumerate()
            .map(|(i, v)| (format!("outbox[{i}]"), v))
            .collect(),
        Some(_) => {
            return Err(key_err(
                "outbox",
                "expected a table ([outbox]) or a non-empty list of tables ([[outbox]])",
            ));
        }
    };
    let mut outboxes: Vec<OutboxConfig> = Vec::with_capacity(raws.len());
    for (key, value) in raws {
        let raw: RawOutbox = serde_path_to_error::deserialize(value).map_err(|e| {
            let at = e.path().to_string();
            let message = e.into_inner().to_string();
            key_err(
                &if at == "." {
                    key.clone()
                } else {
                    format!("{key}.{at}")
                },
                message,
            )
        })?;
        let o = validate(raw, key, defaults)?;
        if let Some(same) = outboxes.iter().find(|p| p.source == o.source) {
            return Err(key_err(
                &o.key,
                format!(
                    "{} is already the outbox of {}: list each once",
                    o.source, same.key
                ),
            ));
        }
        outboxes.push(o);
    }
    Ok(outboxes)
}

fn validate(r: RawOutbox, key: String, d: &Defaults<'_>) -> Result<OutboxConfig, ConfigError> {
    let at = |field: &str| format!("{key}.{field}");
    let source = match non_empty(r.source).as_deref() {
        None | Some("table") => {
            if r.prefix.is_some() {
                return Err(key_err(&at("prefix"), "only for source = \"message\""));
            }
            let table = r.table.unwrap_or_else(|| "public.outbox".into());
            OutboxSource::Table(parse_table_name_at(&at("table"), &table)?)
        }
        Some("message") => {
            if r.table.is_some() || r.created_at.is_some() || r.sequence.is_some() {
                return Err(key_err(
                    &at(if r.table.is_some() {
                        "table"
                    } else if r.created_at.is_some() {
                        "created_at"
                    } else {
                        "sequence"
                    }),
                    "a table-less outbox (source = \"message\") has no table",
                ));
            }
            let prefix = non_empty(r.prefix).ok_or_else(|| {
                key_err(
                    &at("prefix"),
                    "source = \"message\" needs the logical message prefix its events are \
                     written with (pg_logical_emit_message(true, '<prefix>', '<json>'))",
                )
            })?;
            if prefix.starts_with(RESERVED_PREFIX) {
                return Err(key_err(
                    &at("prefix"),
                    format!("prefixes starting with {RESERVED_PREFIX:?} are the relay's own"),
                ));
            }
            OutboxSource::Message { prefix }
        }
        Some(other) => {
            return Err(key_err(
                &at("source"),
                format!("expected \"table\" or \"message\", got {other:?}"),
            ));
        }
    };
    let names = OutboxColumns::default_names();
    let columns = OutboxColumns {
        id: r.id.unwrap_or(names.id),
        aggregate_type: r.aggregate_type.unwrap_or(names.aggregate_type),
        aggregate_id: r.aggregate_id.unwrap_or(names.aggregate_id),
        event_type: r.event_type.unwrap_or(names.event_type),
        payload: r.payload.unwrap_or(names.payload),
        headers: r.headers.unwrap_or(names.headers),
        created_at: r.created_at.unwrap_or(names.created_at),
        sequence: non_empty(r.sequence),
    };
    for (field, v) in [
        ("id", &columns.id),
        ("aggregate_type", &columns.aggregate_type),
        ("aggregate_id", &columns.aggregate_id),
        ("event_type", &columns.event_type),
        ("payload", &columns.payload),
        ("headers", &columns.headers),
        ("created_at", &columns.created_at),
    ] {
        check_identifier(&at(field), v)?;
    }
    if let Some(v) = &columns.sequence {
        check_identifier(&at("sequence"), v)?;
    }
    let template_keys = (
        if r.exchange.is_some() {
            at("exchange")
        } else {
            "rabbitmq.exchange".into()
        },
        if r.routing_key.is_some() {
            at("routing_key")
        } else {
            "rabbitmq.routing_key".into()
        },
    );
    let exchange = match r.exchange {
        Some(x) => Template::parse(&x).map_err(|e| key_err(&at("exchange"), e))?,
        None => d.exchange.cloned().ok_or_else(|| {
            key_err(
                "rabbitmq.exchange",
                format!(
                    "missing: {key} sets no exchange of its own; set rabbitmq.exchange, or \
                     {key}.exchange"
                ),
            )
        })?,
    };
    let routing_key = match r.routing_key {
        Some(x) => {
            let t = Template::parse(&x).map_err(|e| key_err(&at("routing_key"), e))?;
            if t.is_empty() {
                return Err(key_err(&at("routing_key"), "must not be empty"));
            }
            t
        }
        None => d.routing_key.clone(),
    };
    let dead_letter_exchange = match r.dead_letter_exchange {
        Some(x) if x.is_empty() => None,
        Some(x) if x.len() > 255 => {
            return Err(key_err(&at("dead_letter_exchange"), "at most 255 bytes"));
        }
        Some(x) => Some(x),
        None => d.dead_letter_exchange.clone(),
    };
    Ok(OutboxConfig {
        key,
        source,
        columns,
        exchange,
        exchange_pattern: d.exchange_pattern.cloned(),
        routing_key,
        template_keys,
        dead_letter_exchange,
        routing_headers: r.routing_headers.unwrap_or(false),
    })
}

#[cfg(test)]
mod tests {
    use crate::config::{Config, ConfigError};

    const HEAD: &str = "[postgres]\nurl = \"postgres://u@h/db\"\n\
                        [rabbitmq]\nurl = \"amqp://h\"\nexchange = \"ex\"\n\
                        dead_letter_exchange = \"dlx\"\n";

    fn load(outboxes: &str, env: &[(&str, &str)]) -> Result<Config, ConfigError> {
        let env = env.iter().map(|(k, v)| (k.to_string(), v.to_string()));
        Config::from_toml(&format!("{HEAD}{outboxes}"), "test.toml", env)
    }

    fn err(outboxes: &str) -> String {
        load(outboxes, &[]).unwrap_err().to_string()
    }

    #[test]
    fn several_outboxes_each_with_their_own_routes() {
        let c = load(
            "[[outbox]]\ntable = \"orders.outbox\"\n\
             [[outbox]]\ntable = \"billing.outbox\"\nexchange = \"billing\"\n\
             routing_key = \"{event_type}\"\ndead_letter_exchange = \"\"\n\
             [[outbox]]\nsource = \"message\"\nprefix = \"audit\"\nid = \"event_id\"\n",
            &[],
        )
        .unwrap();
        let [a, b, m] = &c.outboxes[..] else {
            panic!("three outboxes")
        };
        assert_eq!((a.key.as_str(), b.key.as_str()), ("outbox[0]", "outbox[1]"));
        assert_eq!(a.table().unwrap().to_string(), "orders.outbox");
        assert_eq!(a.exchange.as_literal(), Some("ex"), "inherited");
        assert_eq!(a.dead_letter_exchange.as_deref(), Some("dlx"), "inherited");
        assert_eq!(b.exchange.as_literal(), Some("billing"));
        assert_eq!(b.dead_letter_exchange, None, "\"\" turns it off");
        assert_eq!(b.template_keys.1, "outbox[1].routing_key");
        assert_eq!(m.prefix(), Some("audit"));
        assert_eq!(m.columns.id, "event_id");
        assert_eq!(
            c.dead_letters(),
            vec![Some("dlx".into()), None, Some("dlx".into())]
        );
        // The single form and no form at all both mean public.outbox.
        for text in ["", "[outbox]\n"] {
            let c = load(text, &[]).unwrap();
            assert_eq!(c.outboxes.len(), 1);
            assert_eq!(c.outboxes[0].key, "outbox");
            assert_eq!(c.outboxes[0].table().unwrap().to_string(), "public.outbox");
        }
    }

    #[test]
    fn refused_outboxes_name_the_key() {
        for (text, says) in [
            (
                "[[outbox]]\ntable = \"a\"\n[[outbox]]\ntable = \"public.a\"\n",
                "outbox[1]",
            ),
            ("[[outbox]]\nsource = \"message\"\n", "outbox[0].prefix"),
            (
                "[[outbox]]\nsource = \"message\"\nprefix = \"outbox-relay-heartbeat\"\n",
                "outbox[0].prefix",
            ),
            (
                "[[outbox]]\nsource = \"message\"\nprefix = \"p\"\ntable = \"t\"\n",
                "outbox[0].table",
            ),
            ("[[outbox]]\nprefix = \"p\"\n", "outbox[0].prefix"),
            ("[[outbox]]\nsource = \"kafka\"\n", "outbox[0].source"),
            ("[[outbox]]\ntable = \"t\"\ncolour = \"red\"\n", "outbox[0]"),
            ("[[outbox]]\nrouting_key = \"\"\n", "outbox[0].routing_key"),
            ("[[outbox]]\nexchange = \"{a\"\n", "outbox[0].exchange"),
            ("outbox = 3\n", "outbox"),
            (
                "[[outbox]]\nsource = \"message\"\nprefix = \"p\"\n\
                 [[outbox]]\nsource = \"message\"\nprefix = \"p\"\n",
                "outbox[1]",
            ),
        ] {
            let e = err(text);
            assert!(e.contains(says), "{text}: {e}");
        }
    }

    /// `rabbitmq.exchange` is needed only by outboxes without their own:
    /// three that each set one load without it; one that does not is
    /// refused, naming both keys. Every literal exchange is checked on
    /// connecting, each once.
    #[test]
    fn the_global_exchange_is_needed_only_by_outboxes_without_their_own() {
        let head = "[postgres]\nurl = \"postgres://u@h/db\"\n[rabbitmq]\nurl = \"amqp://h\"\n";
        let each = "[[outbox]]\ntable = \"a\"\nexchange = \"xa\"\n\
                    [[outbox]]\ntable = \"b\"\nexchange = \"xb\"\n\
                    [[outbox]]\ntable = \"c\"\nexchange = \"{aggregate_type}\"\n";
        let c = Config::from_toml(&format!("{head}{each}"), "t.toml", Vec::new()).unwrap();
        assert!(c.rabbitmq.exchange.is_none());
        assert_eq!(c.rabbitmq.fixed_exchanges, ["xa", "xb"]);
        let lacking = format!("{head}{each}[[outbox]]\ntable = \"d\"\n");
        let e = Config::from_toml(&lacking, "t.toml", Vec::new())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("rabbitmq.exchange") && e.contains("outbox[3].exchange"),
            "{e}"
        );
        let c = load(
            "[[outbox]]\ntable = \"a\"\n[[outbox]]\ntable = \"b\"\nexchange = \"\"\n",
            &[],
        )
        .unwrap();
        assert_eq!(
            c.rabbitmq.fixed_exchanges,
            ["ex"],
            "once; not the default exchange"
        );
    }

    /// `rabbitmq.exchange_pattern` is checked when the config loads,
    /// naming the key, and anchored: it must match a whole name.
    #[test]
    fn the_exchange_pattern_is_validated_and_anchored() {
        let text = |p: &str| {
            format!(
                "[postgres]\nurl = \"postgres://u@h/db\"\n[rabbitmq]\nurl = \"amqp://h\"\n\
                 exchange = \"{{aggregate_type}}\"\nexchange_pattern = {p:?}\n"
            )
        };
        let e = Config::from_toml(&text("app.(["), "t.toml", Vec::new())
            .unwrap_err()
            .to_string();
        assert!(e.contains("rabbitmq.exchange_pattern"), "{e}");
        let c = Config::from_toml(&text("app|web"), "t.toml", Vec::new()).unwrap();
        let p = c.outboxes[0].exchange_pattern.as_ref().unwrap();
        assert!(p.is_match("app") && p.is_match("web"));
        assert!(!p.is_match("apps") && !p.is_match("xweb"));
    }

    #[test]
    fn environment_overrides_reach_one_outbox_only() {
        let one = "[[outbox]]\ntable = \"a\"\n";
        let c = load(one, &[("OUTBOX_RELAY_OUTBOX_TABLE", "b")]).unwrap();
        assert_eq!(c.outboxes[0].table().unwrap().name, "b");
        let two = "[[outbox]]\ntable = \"a\"\n[[outbox]]\ntable = \"b\"\n";
        let e = load(two, &[("OUTBOX_RELAY_OUTBOX_TABLE", "c")])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("OUTBOX_RELAY_OUTBOX_TABLE") && e.contains("2"),
            "{e}"
        );
    }
}
