//! Outbox event -> AMQP message: exchange, routing key, body, properties and
//! headers, as DESIGN.md "The message" specifies.

use amq_protocol::protocol::BasicProperties;
use amq_protocol::types::{AMQPValue, FieldTable, LongString, ShortString};
use bytes::Bytes;
use smallvec::SmallVec;

use crate::outbox::{Mapping, MappingError, OutboxEvent, PayloadKind, ResolvedPart};

pub(crate) mod guard;
mod routing_headers;

use crate::logtext::shown;

/// A message ready for `basic.publish`.
#[derive(Debug, Clone)]
pub struct Envelope {
    /// Exchange.
    pub exchange: ShortString,
    /// Routing key.
    pub routing_key: ShortString,
    /// Body: the payload bytes as stored.
    pub body: Bytes,
    /// Properties and headers; `message_id` is the event id.
    pub properties: BasicProperties,
}

/// The row cannot become a message. The event is undeliverable as it stands.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RenderError {
    /// The outbox table does not fit the configuration.
    #[error(transparent)]
    Mapping(#[from] MappingError),
    /// A mapped column is NULL (or, for a TOASTed value, absent).
    #[error("event {id}: column {column:?} is NULL")]
    Null {
        /// Event id, or `?` when the id itself is NULL.
        id: String,
        /// The column.
        column: String,
    },
    /// A value is not valid UTF-8 where text is needed.
    #[error("event {id}: column {column:?} is not valid UTF-8")]
    NotUtf8 {
        /// Event id.
        id: String,
        /// The column.
        column: String,
    },
    /// An AMQP short string (exchange, routing key, id, type) over 255 bytes.
    #[error("event {id}: {what} is {len} bytes; AMQP allows at most 255")]
    TooLong {
        /// Event id.
        id: String,
        /// Which field.
        what: &'static str,
        /// Its length.
        len: usize,
    },
    /// The headers column's text is so long that its headers could never
    /// fit in one frame: refused before it is parsed (parsing costs about
    /// ten times its size).
    #[error(
        "event {id}: the headers column is {bytes} bytes, which can never fit in one frame \
         (frame_max {frame_max}); it was not read. Shorten the headers"
    )]
    HeadersTooLong {
        /// Event id.
        id: String,
        /// The column's size.
        bytes: usize,
        /// The connection's frame_max.
        frame_max: u32,
    },
    /// The headers column is not a JSON object.
    #[error("event {id}: headers column is not a JSON object")]
    Headers {
        /// Event id.
        id: String,
    },
    /// A bytea payload's text form is neither `\x<hex>` nor the escape
    /// format.
    #[error("event {id}: bytea payload is in neither the hex nor the escape format")]
    Bytea {
        /// Event id.
        id: String,
    },
    /// A `CC` or `BCC` header (RabbitMQ's sender-selected distribution) that
    /// is not an array of strings: the broker would close the channel over
    /// it, again on every replay.
    #[error("event {id}: header {key:?} must be an array of strings (RabbitMQ routes on it)")]
    RoutingHeader {
        /// Event id.
        id: String,
        /// `CC` or `BCC`.
        key: String,
    },
    /// A templated exchange rendered to a name the relay does not publish
    /// to (see [`guard`]).
    #[error("event {id}: exchange {exchange:?} (rendered from {key}) is refused: {why}")]
    ExchangeRefused {
        /// Event id.
        id: String,
        /// The name as rendered.
        exchange: String,
        /// The template's config key.
        key: String,
        /// Why.
        why: String,
    },
    /// The properties and headers do not fit in one content-header frame
    /// (`frame_max`): the broker would close the connection over it.
    #[error(
        "event {id}: properties and headers take {bytes} bytes, more than the \
         negotiated frame_max ({frame_max}); shorten the headers, aggregate_type or aggregate_id"
    )]
    HeaderTooLarge {
        /// Event id.
        id: String,
        /// The content-header frame's encoded size.
        bytes: usize,
        /// The connection's frame_max.
        frame_max: u32,
    },
}

fn text<'a>(
    ev: &'a OutboxEvent,
    index: usize,
    column: &str,
    id: &str,
) -> Result<&'a str, RenderError> {
    let v = ev.value(index).ok_or_else(|| RenderError::Null {
        id: shown(id),
        column: column.to_owned(),
    })?;
    std::str::from_utf8(v).map_err(|_| RenderError::NotUtf8 {
        id: shown(id),
        column: column.to_owned(),
    })
}

/// AMQP short strings (ids, names) hold at most 255 bytes.
fn check_short(len: usize, what: &'static str, id: &str) -> Result<(), RenderError> {
    if len > 255 {
        return Err(RenderError::TooLong {
            id: shown(id),
            what,
            len,
        });
    }
    Ok(())
}

/// An exchange or routing key: template parts, concatenated when encoded.
/// Checked: at most 255 bytes together.
#[derive(Debug, Clone)]
pub struct Name<'a> {
    parts: SmallVec<[&'a str; 4]>,
    len: usize,
}

impl<'a> Name<'a> {
    fn render(
        ev: &'a OutboxEvent,
        parts: &'a [ResolvedPart],
        what: &'static str,
        id: &str,
    ) -> Result<Name<'a>, RenderError> {
        let mut name = Name {
            parts: SmallVec::new(),
            len: 0,
        };
        for p in parts {
            let s = match p {
                ResolvedPart::Literal(s) => s.as_str(),
                ResolvedPart::Column { index, name } => text(ev, *index, name, id)?,
            };
            name.len += s.len();
            name.parts.push(s);
        }
        check_short(name.len, what, id)?;
        Ok(name)
    }

    /// A name of one piece.
    #[cfg(test)]
    pub(crate) fn literal(s: &'a str) -> Name<'a> {
        Name {
            parts: SmallVec::from_slice(&[s]),
            len: s.len(),
        }
    }

    /// This name followed by `s` (no length check).
    #[cfg(test)]
    pub(crate) fn join(mut self, s: &'a str) -> Name<'a> {
        self.parts.push(s);
        self.len += s.len();
        self
    }

    /// Its pieces, in order.
    pub fn parts(&self) -> &[&'a str] {
        &self.parts
    }

    fn to_short_string(&self) -> ShortString {
        ShortString::from(self.parts.concat())
    }
}

/// An event's message as borrowed pieces of its row: what [`render`] builds,
/// after the same checks, without building it. The publishing client
/// encodes it straight into its frames, so a row becomes a message without
/// an allocation (unless the row has a headers column to merge).
#[derive(Debug, Clone)]
pub struct MessageView<'a> {
    /// Exchange.
    pub exchange: Name<'a>,
    /// Routing key.
    pub routing_key: Name<'a>,
    /// Body: the payload bytes as stored (a decoded copy for bytea).
    pub body: Bytes,
    /// `message_id`: the event id (at most 255 bytes).
    pub message_id: &'a str,
    /// `type`: the event type (at most 255 bytes).
    pub event_type: &'a str,
    /// `content_type`, by payload column type.
    pub content_type: &'static str,
    /// `timestamp`: commit time, seconds since the Unix epoch.
    pub timestamp: u64,
    /// Header `aggregate_type`.
    pub aggregate_type: &'a str,
    /// Header `aggregate_id`.
    pub aggregate_id: &'a str,
    /// The row's headers column, converted; the two aggregate headers are
    /// added to it (and win). `None`: the row has none.
    pub headers: Option<FieldTable>,
}

impl MessageView<'_> {
    /// The headers table as published.
    pub fn header_table(&self) -> FieldTable {
        let mut headers = self.headers.clone().unwrap_or_default();
        headers.insert(
            "aggregate_type".into(),
            AMQPValue::LongString(LongString::from(self.aggregate_type)),
        );
        headers.insert(
            "aggregate_id".into(),
            AMQPValue::LongString(LongString::from(self.aggregate_id)),
        );
        headers
    }

    /// The properties as published.
    pub fn properties(&self) -> BasicProperties {
        BasicProperties::default()
            .with_message_id(ShortString::from(self.message_id))
            .with_type(ShortString::from(self.event_type))
            .with_content_type(ShortString::from(self.content_type))
            .with_delivery_mode(2)
            .with_timestamp(self.timestamp)
            .with_headers(self.header_table())
    }

    /// The owned message.
    pub fn to_envelope(&self) -> Envelope {
        Envelope {
            exchange: self.exchange.to_short_string(),
            routing_key: self.routing_key.to_short_string(),
            body: self.body.clone(),
            properties: self.properties(),
        }
    }
}

/// Builds the message for `ev`.
pub fn render(ev: &OutboxEvent) -> Result<Envelope, RenderError> {
    view(ev).map(|v| v.to_envelope())
}

/// The message for `ev`, borrowed from it: every check of [`render`], no
/// allocation unless the row has headers to merge.
pub fn view(ev: &OutboxEvent) -> Result<MessageView<'_>, RenderError> {
    view_within(ev, u32::MAX)
}

/// Bytes of a headers column's JSON text per byte of its AMQP encoding,
/// at most: an escape (`\u001f`) is six bytes for one. A column longer
/// than this many frames can never fit in one, whatever it holds.
const HEADER_TEXT_PER_BYTE: usize = 6;

/// As [`view`] on a connection with `frame_max`: the work per row is
/// bounded by its raw size before anything is parsed. An id over AMQP's
/// 255 bytes, or a headers column too long to ever fit in a frame, is
/// refused without being read further.
pub fn view_within(ev: &OutboxEvent, frame_max: u32) -> Result<MessageView<'_>, RenderError> {
    let m: &Mapping = ev
        .mapping
        .as_ref()
        .map_err(|e| RenderError::Mapping(e.clone()))?;
    if let Some(raw) = ev.value(m.id).filter(|v| v.len() > 255) {
        return Err(RenderError::TooLong {
            id: crate::logtext::shown_bytes(raw),
            what: "id",
            len: raw.len(),
        });
    }
    let id = text(ev, m.id, "id", "?")?;
    let aggregate_type = text(ev, m.aggregate_type, "aggregate_type", id)?;
    let aggregate_id = text(ev, m.aggregate_id, "aggregate_id", id)?;
    let event_type = text(ev, m.event_type, "event_type", id)?;
    let raw_payload = ev.value(m.payload).ok_or_else(|| RenderError::Null {
        id: shown(id),
        column: "payload".into(),
    })?;
    let (body, content_type) = match m.payload_kind {
        PayloadKind::Json => (raw_payload.clone(), "application/json"),
        PayloadKind::Text => (raw_payload.clone(), "text/plain; charset=utf-8"),
        PayloadKind::Bytea => (
            decode_bytea(raw_payload).ok_or_else(|| RenderError::Bytea { id: shown(id) })?,
            "application/octet-stream",
        ),
    };

    let mut headers = None;
    if let Some(h) = m.headers.and_then(|i| ev.value(i)) {
        if h.len() / HEADER_TEXT_PER_BYTE > frame_max as usize {
            return Err(RenderError::HeadersTooLong {
                id: shown(id),
                bytes: h.len(),
                frame_max,
            });
        }
        let obj: serde_json::Map<String, serde_json::Value> =
            serde_json::from_slice(h).map_err(|_| RenderError::Headers { id: shown(id) })?;
        let mut table = FieldTable::default();
        for (k, v) in obj {
            if k.len() > 255 {
                return Err(RenderError::TooLong {
                    id: shown(id),
                    what: "header name",
                    len: k.len(),
                });
            }
            // The relay's own headers (what a dead letter says) are never
            // the row's to set.
            if is_reserved(&k) {
                continue;
            }
            // RabbitMQ routes on CC and BCC: an array of long strings, or
            // it closes the channel (nested values are JSON text otherwise).
            // Only an outbox that opts in lets its rows route themselves.
            if matches!(k.as_str(), "CC" | "BCC") && !m.routing_headers {
                routing_headers::dropped(id, &k);
                continue;
            }
            if matches!(k.as_str(), "CC" | "BCC") {
                let keys = v.as_array().and_then(|a| {
                    a.iter()
                        .map(|x| x.as_str().map(|s| AMQPValue::LongString(s.into())))
                        .collect::<Option<Vec<_>>>()
                });
                let Some(keys) = keys else {
                    return Err(RenderError::RoutingHeader {
                        id: shown(id),
                        key: k,
                    });
                };
                table.insert(ShortString::from(k), AMQPValue::FieldArray(keys.into()));
                continue;
            }
            table.insert(ShortString::from(k), json_to_amqp(v));
        }
        headers = Some(table);
    }
    check_short(id.len(), "id", id)?;
    check_short(event_type.len(), "event type", id)?;
    let exchange = Name::render(ev, &m.exchange, "exchange", id)?;
    if let Some(guard) = &m.exchange_guard {
        guard.check(&exchange, id)?;
    }
    Ok(MessageView {
        exchange,
        routing_key: Name::render(ev, &m.routing_key, "routing key", id)?,
        body,
        message_id: id,
        event_type,
        content_type,
        timestamp: u64::try_from(ev.commit_time_us / 1_000_000).unwrap_or(0),
        aggregate_type,
        aggregate_id,
        headers,
    })
}

impl MessageView<'_> {
    /// The content-header frame's encoded size, exactly (frame overhead
    /// included): what must fit in `frame_max`. Counted from the pieces,
    /// cheap enough for every event; a proptest holds it to the encoder.
    pub fn header_bytes(&self) -> usize {
        // Frame type, channel, size and end octet; class, weight, body
        // size, property flags; the delivery mode and the timestamp.
        const FIXED: usize = 8 + 14 + 1 + 8;
        let shorts = [self.message_id, self.event_type, self.content_type]
            .iter()
            .map(|s| 1 + s.len())
            .sum::<usize>();
        let aggregate = [
            ("aggregate_type", self.aggregate_type),
            ("aggregate_id", self.aggregate_id),
        ]
        .iter()
        .map(|(k, v)| 1 + k.len() + 1 + 4 + v.len())
        .sum::<usize>();
        // The row's own headers, less the two the aggregate ones replace.
        let user = self.headers.as_ref().map_or(0, |h| {
            h.inner()
                .iter()
                .filter(|(k, _)| !matches!(k.as_str(), "aggregate_type" | "aggregate_id"))
                .map(|(k, v)| 1 + k.as_str().len() + amqp_value_len(v))
                .sum()
        });
        FIXED + shorts + 4 + aggregate + user
    }
}

/// A field value's encoded size: its type octet and its bytes.
fn amqp_value_len(v: &AMQPValue) -> usize {
    1 + match v {
        AMQPValue::Void => 0,
        AMQPValue::Boolean(_) | AMQPValue::ShortShortInt(_) | AMQPValue::ShortShortUInt(_) => 1,
        AMQPValue::ShortInt(_) | AMQPValue::ShortUInt(_) => 2,
        AMQPValue::LongInt(_) | AMQPValue::LongUInt(_) | AMQPValue::Float(_) => 4,
        AMQPValue::DecimalValue(_) => 5,
        AMQPValue::LongLongInt(_) | AMQPValue::Double(_) | AMQPValue::Timestamp(_) => 8,
        AMQPValue::ShortString(s) => 1 + s.as_str().len(),
        AMQPValue::LongString(s) => 4 + s.as_bytes().len(),
        AMQPValue::ByteArray(b) => 4 + b.as_slice().len(),
        AMQPValue::FieldArray(a) => 4 + a.as_slice().iter().map(amqp_value_len).sum::<usize>(),
        AMQPValue::FieldTable(t) => {
            4 + t
                .inner()
                .iter()
                .map(|(k, v)| 1 + k.as_str().len() + amqp_value_len(v))
                .sum::<usize>()
        }
    }
}

/// A header name of the relay's own (`x-outbox-*`, in any case): a row's
/// is dropped, so that what a dead letter says comes from the relay alone.
fn is_reserved(key: &str) -> bool {
    key.len() >= dead_letter_headers::PREFIX.len()
        && key.as_bytes()[..dead_letter_headers::PREFIX.len()]
            .eq_ignore_ascii_case(dead_letter_headers::PREFIX.as_bytes())
}

/// Headers a dead-lettered message carries, saying why and where it was going.
pub mod dead_letter_headers {
    /// What every one of them starts with; a row's own are dropped.
    pub const PREFIX: &str = "x-outbox-";
    /// Why the event could not be delivered.
    pub const ERROR: &str = "x-outbox-error";
    /// The exchange it was published to (or its template, if unrenderable).
    pub const ORIGINAL_EXCHANGE: &str = "x-outbox-original-exchange";
    /// The routing key it was published with (empty if unrenderable).
    pub const ORIGINAL_ROUTING_KEY: &str = "x-outbox-original-routing-key";
    /// How many times it was published before giving up.
    pub const ATTEMPTS: &str = "x-outbox-attempts";
    /// Size of a body too large to send (the dead letter then has none).
    pub const BODY_BYTES: &str = "x-outbox-body-bytes";
}

impl Envelope {
    /// The event id (its `message_id`), for logs; `?` if it has none (an
    /// unrenderable row whose id is too long for AMQP).
    pub fn id(&self) -> &str {
        self.properties
            .message_id()
            .as_ref()
            .map_or("?", |s| s.as_str())
    }

    /// The copy that goes to `dlx`: same body, properties and headers, plus
    /// `x-outbox-*` headers that say why and where it was going. Routed with
    /// the original routing key, so a dead-letter queue can still filter.
    pub fn dead_letter(&self, dlx: &str, reason: &str, attempts: u32) -> Envelope {
        let mut headers = self.properties.headers().clone().unwrap_or_default();
        headers.insert(
            dead_letter_headers::ERROR.into(),
            AMQPValue::LongString(reason.into()),
        );
        headers.insert(
            dead_letter_headers::ORIGINAL_EXCHANGE.into(),
            AMQPValue::LongString(self.exchange.as_str().into()),
        );
        headers.insert(
            dead_letter_headers::ORIGINAL_ROUTING_KEY.into(),
            AMQPValue::LongString(self.routing_key.as_str().into()),
        );
        headers.insert(
            dead_letter_headers::ATTEMPTS.into(),
            AMQPValue::LongLongInt(i64::from(attempts)),
        );
        Envelope {
            exchange: ShortString::from(dlx),
            routing_key: self.routing_key.clone(),
            body: self.body.clone(),
            properties: self.properties.clone().with_headers(headers),
        }
    }

    /// As [`Envelope::dead_letter`] for a body over the broker's size limit:
    /// the dead letter carries the headers and the size, not the body.
    pub fn dead_letter_oversized(&self, dlx: &str, limit: usize) -> Envelope {
        let reason = format!(
            "body of {} bytes exceeds rabbitmq.max_message_bytes ({limit})",
            self.body.len()
        );
        self.dead_letter(dlx, &reason, 0).without_body()
    }

    /// This dead letter without its body (too large to send): the size is
    /// kept in `x-outbox-body-bytes`.
    pub fn without_body(mut self) -> Envelope {
        let mut headers = self.properties.headers().clone().unwrap_or_default();
        headers.insert(
            dead_letter_headers::BODY_BYTES.into(),
            AMQPValue::LongLongInt(self.body.len() as i64),
        );
        self.properties = self.properties.with_headers(headers);
        self.body = Bytes::new();
        self
    }
}

/// The event's id as text, whatever state the row is in, for logs, errors
/// and dead letters: a logical message that could not be mapped is named
/// by its WAL position (`lsn-0/16B3748`); `?` for a row without one.
pub fn event_id(ev: &OutboxEvent) -> String {
    if let Err(MappingError::Message { at, .. }) = &ev.mapping {
        return format!("lsn-{at}");
    }
    ev.mapping
        .as_ref()
        .ok()
        .and_then(|m| ev.value(m.id))
        .map_or_else(
            || "?".to_owned(),
            // One too long to be a message_id is only ever shown: capped.
            |v| match v.len() {
                ..=255 => String::from_utf8_lossy(v).into_owned(),
                _ => crate::logtext::shown_bytes(v),
            },
        )
}

/// Bytes of a row beyond its payload that its dead letter may keep alive.
const ROW_SLACK: usize = 4096;

/// The dead letter for a row that could not become a message at all: what is
/// known of it (id, payload bytes) and why.
pub fn dead_letter_unrenderable(ev: &OutboxEvent, err: &RenderError, dlx: &str) -> Envelope {
    let id = event_id(ev);
    let body = match &ev.mapping {
        Ok(m) => ev.value(m.payload),
        // A table-less outbox's message that is no JSON object: its
        // content, as written, is the row's one column.
        Err(MappingError::Message { .. }) => ev.value(0),
        Err(_) => None,
    }
    .cloned()
    .unwrap_or_default();
    // The body is a slice of the row: copied out when the row is much
    // larger (a huge headers column), so that the dead letter does not
    // keep the whole row alive while it waits for its confirm.
    let body = if ev.bytes() > body.len() + ROW_SLACK {
        Bytes::copy_from_slice(&body)
    } else {
        body
    };
    let mut properties = BasicProperties::default().with_delivery_mode(2);
    if id.len() <= 255 {
        properties = properties.with_message_id(ShortString::from(id.as_str()));
    }
    let original = Envelope {
        exchange: ShortString::from(""),
        routing_key: ShortString::from(""),
        body,
        properties: properties
            .with_timestamp(u64::try_from(ev.commit_time_us / 1_000_000).unwrap_or(0)),
    };
    original.dead_letter(dlx, &err.to_string(), 0)
}

fn json_to_amqp(v: serde_json::Value) -> AMQPValue {
    use serde_json::Value;
    match v {
        Value::Null => AMQPValue::Void,
        Value::Bool(b) => AMQPValue::Boolean(b),
        Value::Number(n) => match n.as_i64() {
            Some(i) => AMQPValue::LongLongInt(i),
            None => AMQPValue::Double(n.as_f64().unwrap_or(f64::NAN)),
        },
        Value::String(s) => AMQPValue::LongString(LongString::from(s)),
        // Nested structures travel as their JSON text: AMQP tables cannot
        // hold every JSON shape faithfully (e.g. arrays of mixed types).
        other => AMQPValue::LongString(LongString::from(other.to_string())),
    }
}

/// The text form of bytea, as the server's `bytea_output` makes it (in the
/// walsender's session as in any other: `ALTER DATABASE ... SET
/// bytea_output = escape` reaches both): `\x` followed by hex digits
/// (`hex`, the default), or the `escape` format, where a backslash is
/// `\\`, a byte outside printable ASCII `\ooo` (octal), and every other
/// byte itself. Escape output never starts with `\x`: the two cannot be
/// mistaken for one another.
fn decode_bytea(v: &[u8]) -> Option<Bytes> {
    match v.strip_prefix(b"\\x") {
        Some(hex) => decode_bytea_hex(hex),
        None => decode_bytea_escape(v),
    }
}

fn decode_bytea_escape(v: &[u8]) -> Option<Bytes> {
    let mut out = Vec::with_capacity(v.len());
    let mut rest = v;
    while let Some((&b, tail)) = rest.split_first() {
        if b != b'\\' {
            out.push(b);
            rest = tail;
            continue;
        }
        match tail {
            [b'\\', more @ ..] => {
                out.push(b'\\');
                rest = more;
            }
            [a @ b'0'..=b'3', b @ b'0'..=b'7', c @ b'0'..=b'7', more @ ..] => {
                out.push((a - b'0') << 6 | (b - b'0') << 3 | (c - b'0'));
                rest = more;
            }
            _ => return None,
        }
    }
    Some(Bytes::from(out))
}

/// The digits after `\x`.
fn decode_bytea_hex(hex: &[u8]) -> Option<Bytes> {
    if !hex.len().is_multiple_of(2) {
        return None;
    }
    let digit = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    hex.chunks_exact(2)
        .map(|p| Some(digit(p[0])? << 4 | digit(p[1])?))
        .collect::<Option<Vec<u8>>>()
        .map(Bytes::from)
}

#[cfg(test)]
mod tests;
