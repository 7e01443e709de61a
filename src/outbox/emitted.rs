//! The table-less outbox: `pg_logical_emit_message(true, '<prefix>',
//! '<json>')` inside the business transaction writes the event to the WAL
//! only. Its JSON object's fields play the roles a row's columns play (the
//! same `id`, `aggregate_type`, ... keys name them), so the message is
//! built, checked and dead-lettered exactly like a row's: each message
//! becomes a row of a fixed, synthetic relation.

use std::borrow::Cow;
use std::sync::Arc;

use bytes::Bytes;
use serde_json::value::RawValue;

use super::{Mapping, MappingError};
use crate::config::OutboxConfig;
use crate::lsn::Lsn;
use crate::pgoutput::{Column, ColumnValue, Relation, TupleData};
use crate::template::Part;

const TEXT: u32 = 25;
const JSONB: u32 = 3802;

/// One table-less outbox, ready to turn messages into rows.
#[derive(Debug)]
pub struct Emitted {
    /// Its index in `Config::outboxes`.
    pub outbox: usize,
    /// The mapping of its synthetic relation.
    pub mapping: Result<Arc<Mapping>, MappingError>,
    /// The synthetic relation's column names, in order.
    names: Vec<String>,
}

/// The table-less outboxes of a config, by prefix.
#[derive(Debug, Default)]
pub struct Prefixes(Vec<(String, Emitted)>);

impl Prefixes {
    /// The table-less outboxes among `outboxes`.
    pub fn new(outboxes: &[OutboxConfig]) -> Self {
        Prefixes(
            outboxes
                .iter()
                .enumerate()
                .filter_map(|(i, o)| {
                    let prefix = o.prefix()?;
                    let rel = relation(o);
                    let emitted = Emitted {
                        outbox: i,
                        mapping: Mapping::new(&rel, o).map(Arc::new),
                        names: rel.columns.into_iter().map(|c| c.name).collect(),
                    };
                    Some((prefix.to_owned(), emitted))
                })
                .collect(),
        )
    }

    /// The table-less outbox of `prefix`, if it is one.
    pub fn get(&self, prefix: &str) -> Option<&Emitted> {
        self.0.iter().find(|(p, _)| p == prefix).map(|(_, e)| e)
    }
}

/// The synthetic relation: the role fields first (payload and headers as
/// jsonb), then every other field a template names, as text.
pub fn relation(o: &OutboxConfig) -> Relation {
    let c = &o.columns;
    let mut columns: Vec<Column> = [
        (&c.id, TEXT),
        (&c.aggregate_type, TEXT),
        (&c.aggregate_id, TEXT),
        (&c.event_type, TEXT),
        (&c.payload, JSONB),
        (&c.headers, JSONB),
    ]
    .into_iter()
    .map(|(name, type_oid)| column(name, type_oid))
    .collect();
    for part in o.exchange.parts().iter().chain(o.routing_key.parts()) {
        if let Part::Column(p) = part {
            let name = c.resolve(p);
            if !columns.iter().any(|col| col.name == name) {
                columns.push(column(name, TEXT));
            }
        }
    }
    Relation {
        id: 0,
        namespace: String::new(),
        name: format!("logical messages {:?}", o.prefix().unwrap_or_default()),
        replica_identity: b'n',
        columns,
    }
}

fn column(name: &str, type_oid: u32) -> Column {
    Column {
        flags: 0,
        name: name.to_owned(),
        type_oid,
        type_modifier: -1,
    }
}

/// A JSON object's fields that are among `names` (the last of a field
/// given twice), names compared without allocating unless escaped, values
/// as their raw text: memory in proportion to the mapped fields, whatever
/// else the object holds.
struct Fields<'n>(&'n [String]);

/// A field name.
struct Name<'a>(Cow<'a, str>);

impl<'de> serde::Deserialize<'de> for Name<'de> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Name<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a field name")
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Name<'de>, E> {
                Ok(Name(Cow::Borrowed(v)))
            }
            fn visit_str<E>(self, v: &str) -> Result<Name<'de>, E> {
                Ok(Name(Cow::Owned(v.to_owned())))
            }
        }
        d.deserialize_str(V)
    }
}

impl<'de> serde::de::DeserializeSeed<'de> for Fields<'_> {
    /// Each name's raw value, by position in `names`.
    type Value = Vec<Option<&'de RawValue>>;

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        struct V<'n>(&'n [String]);
        impl<'de> serde::de::Visitor<'de> for V<'_> {
            type Value = Vec<Option<&'de RawValue>>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A>(self, mut m: A) -> Result<Self::Value, A::Error>
            where
                A: serde::de::MapAccess<'de>,
            {
                let mut values = vec![None; self.0.len()];
                while let Some(Name(k)) = m.next_key::<Name<'de>>()? {
                    let v = m.next_value::<&'de RawValue>()?;
                    if let Some(i) = self.0.iter().position(|n| *n == k) {
                        values[i] = Some(v);
                    }
                }
                Ok(values)
            }
        }
        d.deserialize_map(V(self.0))
    }
}

/// Unmapped bytes a row may keep alive beyond its mapped values: past
/// this, the values are copied out, so the content (and whatever large
/// fields it has that nobody reads) is freed and the byte budget, which
/// counts mapped values, stays true.
const SLACK: usize = 1024;

/// One message's fields as a row of [`relation`]: strings unescaped,
/// other scalars as their JSON text, the payload and headers (and any
/// object or array) as the JSON text written, byte for byte. A content
/// that is not a JSON object becomes a row whose mapping says why (it is
/// dead-lettered, or stops the relay without a dead-letter exchange),
/// carrying the content as its only column. So does one without an id:
/// its dead letter's `message_id` is then its WAL position `at`, stable
/// on every replay (a shared placeholder would let a de-duplicating
/// consumer drop all such dead letters but one).
pub fn row(
    o: &OutboxConfig,
    e: &Emitted,
    content: Bytes,
    at: Lsn,
) -> (TupleData, Result<Arc<Mapping>, MappingError>) {
    let fields = std::str::from_utf8(&content)
        .map_err(|_| "its content is not UTF-8".to_owned())
        .and_then(|text| {
            use serde::de::DeserializeSeed;
            let mut d = serde_json::Deserializer::from_str(text);
            Fields(&e.names)
                .deserialize(&mut d)
                .and_then(|v| d.end().map(|()| v))
                .map_err(|e| format!("its content is not a JSON object: {e}"))
        });
    let fields = match (fields, &e.mapping) {
        (Ok(fields), Ok(m)) => match id_problem(fields[m.id]) {
            Some(problem) => Err(format!(
                "its {:?} field {problem}: an event needs an id (a string or a number)",
                e.names[m.id]
            )),
            None => Ok(fields),
        },
        (fields, _) => fields,
    };
    let (fields, mapping) = match (fields, e.mapping.clone()) {
        (Ok(fields), Ok(mapping)) => (fields, mapping),
        (Err(reason), _) => {
            let err = MappingError::Message {
                prefix: o.prefix().unwrap_or_default().to_owned(),
                at,
                key: o.key.clone(),
                reason,
            };
            return (TupleData::from(vec![ColumnValue::Text(content)]), Err(err));
        }
        (_, Err(e)) => return (TupleData::from(vec![ColumnValue::Text(content)]), Err(e)),
    };
    let mut values: Vec<ColumnValue> = (fields.iter().enumerate())
        .map(|(i, raw)| match raw {
            None => ColumnValue::Null,
            Some(raw) => value(
                &content,
                raw,
                i == mapping.payload || Some(i) == mapping.headers,
            ),
        })
        .collect();
    let mapped: usize = values
        .iter()
        .filter_map(|v| v.as_bytes())
        .map(Bytes::len)
        .sum();
    if content.len() > mapped + SLACK {
        for v in &mut values {
            if let ColumnValue::Text(b) = v {
                *b = Bytes::copy_from_slice(b);
            }
        }
    }
    (TupleData::from(values), Ok(mapping))
}

/// What makes a message's id unusable as a `message_id`, if anything:
/// missing or null, not a string or a number, an invalid string (a lone
/// surrogate), empty (a de-duplicating consumer would take every such
/// event for one), or over AMQP's 255 bytes.
fn id_problem(raw: Option<&RawValue>) -> Option<&'static str> {
    let text = match raw.map(RawValue::get) {
        None | Some("null") => return Some("is missing or null"),
        Some(text) => text,
    };
    let len = match text.as_bytes()[0] {
        // Without escapes, the raw text (valid JSON) is the string quoted:
        // no allocation per message for the common id.
        b'"' if !text.contains('\\') => text.len() - 2,
        b'"' => match serde_json::from_str::<String>(text) {
            Ok(s) => s.len(),
            Err(_) => return Some("is not a valid JSON string"),
        },
        b'-' | b'0'..=b'9' => text.len(),
        _ => return Some("is not a string or a number"),
    };
    match len {
        0 => Some("is empty"),
        256.. => Some("is longer than 255 bytes"),
        _ => None,
    }
}

fn value(content: &Bytes, raw: &RawValue, json: bool) -> ColumnValue {
    let text = raw.get();
    if !json && text == "null" {
        return ColumnValue::Null;
    }
    if !json && text.starts_with('"') {
        // A JSON string: the value is the unescaped text.
        return match serde_json::from_str::<String>(text) {
            Ok(s) => ColumnValue::Text(Bytes::from(s)),
            Err(_) => ColumnValue::Null,
        };
    }
    // Zero-copy: the raw value is a slice of the content.
    ColumnValue::Text(content.slice_ref(text.as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::message::{RenderError, view};
    use crate::outbox::OutboxEvent;

    fn outbox(extra: &str) -> OutboxConfig {
        let text = format!(
            "[postgres]\nurl = \"postgres://u@h/db\"\n[[outbox]]\nsource = \"message\"\n\
             prefix = \"orders\"\n{extra}\n[rabbitmq]\nurl = \"amqp://h\"\nexchange = \"x\"\n"
        );
        Config::from_toml(&text, "test.toml", Vec::new())
            .unwrap()
            .outboxes
            .remove(0)
    }

    fn event(o: &OutboxConfig, content: &str) -> OutboxEvent {
        let prefixes = Prefixes::new(std::slice::from_ref(o));
        let m = prefixes.get("orders").unwrap();
        let (tuple, mapping) = row(o, m, Bytes::from(content.to_owned()), Lsn(0x16B3748));
        OutboxEvent {
            tuple,
            mapping,
            commit_time_us: 1_700_000_000_000_000,
            outbox: 0,
        }
    }

    #[test]
    fn a_message_maps_like_a_row() {
        let o = outbox("routing_key = \"{aggregate_type}.{tenant}\"");
        let ev = event(
            &o,
            r#"{"id": "e-1", "aggregate_type": "order", "aggregate_id": 42, "event_type":
               "created", "tenant": "acme", "payload": {"b": 1, "a": [1, 2]},
               "headers": {"trace": "t\"1"}}"#,
        );
        let m = view(&ev).unwrap();
        assert_eq!(m.message_id, "e-1");
        assert_eq!(m.aggregate_id, "42");
        assert_eq!(m.routing_key.parts().concat(), "order.acme");
        // The payload byte for byte, not re-serialized (key order kept).
        assert_eq!(&m.body[..], br#"{"b": 1, "a": [1, 2]}"#);
        assert_eq!(m.content_type, "application/json");
        let h = m.header_table();
        let trace = h.inner().get("trace").cloned();
        assert_eq!(
            trace,
            Some(amq_protocol::types::AMQPValue::LongString("t\"1".into()))
        );
    }

    #[test]
    fn escaped_and_repeated_field_names() {
        let o = outbox("");
        let ev = event(
            &o,
            r#"{"i\u0064": "first", "id": "second", "aggregate_type": "a", "aggregate_id": "1",
               "event_type": "e", "payload": null}"#,
        );
        assert_eq!(view(&ev).unwrap().message_id, "second");
        assert_eq!(&view(&ev).unwrap().body[..], b"null");
        // A number is an id too, as its text.
        let ev = event(
            &o,
            r#"{"id": 7, "aggregate_type": "a", "aggregate_id": "1", "event_type": "e", "payload": 1}"#,
        );
        assert_eq!(view(&ev).unwrap().message_id, "7");
    }

    #[test]
    fn unmapped_bulk_is_not_kept_alive() {
        let o = outbox("");
        let big = "x".repeat(100_000);
        let content = Bytes::from(format!(
            r#"{{"id": "1", "aggregate_type": "a", "aggregate_id": "1", "event_type": "e",
                "payload": {{"k": 1}}, "junk": "{big}"}}"#
        ));
        let prefixes = Prefixes::new(std::slice::from_ref(&o));
        let e = prefixes.get("orders").unwrap();
        let start = content.as_ptr() as usize;
        let range = start..start + content.len();
        let (tuple, mapping) = row(&o, e, content.clone(), Lsn(1));
        assert!(mapping.is_ok());
        for v in tuple.0.iter().filter_map(|v| v.as_bytes()) {
            assert!(
                !range.contains(&(v.as_ptr() as usize)),
                "a slice of the content"
            );
        }
        // Small contents stay zero-copy.
        let small = Bytes::from_static(
            br#"{"id": "1", "aggregate_type": "a", "aggregate_id": "1", "event_type": "e", "payload": 1}"#,
        );
        let start = small.as_ptr() as usize;
        let (tuple, _) = row(&o, e, small.clone(), Lsn(1));
        let payload = tuple.0[4].as_bytes().unwrap();
        assert!((start..start + small.len()).contains(&(payload.as_ptr() as usize)));
    }

    #[test]
    fn bad_messages_say_why() {
        let o = outbox("");
        for (content, says) in [
            ("not json", "not a JSON object"),
            ("[1, 2]", "not a JSON object"),
            ("\u{0}", "not a JSON object"),
        ] {
            let ev = event(&o, content);
            let e = view(&ev).unwrap_err();
            assert!(e.to_string().contains(says), "{content}: {e}");
            assert!(e.to_string().contains("\"orders\""), "{e}");
        }
        let ev = event(
            &o,
            r#"{"aggregate_type": "a", "aggregate_id": "1", "event_type": "e", "payload": {}}"#,
        );
        // No id: unmappable, and named by its WAL position (its dead
        // letter's message_id), never by a placeholder shared with others.
        let e = view(&ev).unwrap_err();
        assert!(e.to_string().contains("\"id\" field is missing"), "{e}");
        assert_eq!(crate::message::event_id(&ev), "lsn-0/16B3748");
        let long = format!(r#"{{"id": "{}", "payload": 1}}"#, "x".repeat(256));
        for content in [
            "not json",
            r#"{"id": null, "payload": 1}"#,
            r#"{"id": "", "payload": 1}"#,
            r#"{"id": "\ud800", "payload": 1}"#,
            r#"{"id": true, "payload": 1}"#,
            r#"{"id": {"a": 1}, "payload": 1}"#,
            long.as_str(),
        ] {
            let ev = event(&o, content);
            assert!(view(&ev).is_err(), "{content}");
            assert_eq!(crate::message::event_id(&ev), "lsn-0/16B3748", "{content}");
        }
        let ev = event(
            &o,
            r#"{"id": "1", "aggregate_type": "a", "aggregate_id": "1", "event_type": "e"}"#,
        );
        assert!(matches!(view(&ev), Err(RenderError::Null { column, .. }) if column == "payload"));
        let ev = event(
            &o,
            r#"{"id": "1", "aggregate_type": "a", "aggregate_id": "1", "event_type": "e", "payload": 1, "headers": [1]}"#,
        );
        assert!(matches!(view(&ev), Err(RenderError::Headers { .. })));
        // Not valid UTF-8 at all.
        let prefixes = Prefixes::new(std::slice::from_ref(&o));
        let m = prefixes.get("orders").unwrap();
        let (_, mapping) = row(&o, m, Bytes::from_static(b"{\"id\": \"\xff\"}"), Lsn(1));
        assert!(mapping.unwrap_err().to_string().contains("UTF-8"));
    }
}
