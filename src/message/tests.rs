//! Rows to messages: mappings, undeliverable rows, dead letters.

use super::*;
use crate::config::{OutboxColumns, OutboxConfig, OutboxSource, RabbitmqConfig, Secret};
use crate::pgoutput::{Column, ColumnValue, Relation, TupleData};
use crate::template::Template;
use std::sync::Arc;
use std::time::Duration;

fn rabbit(exchange: &str, rk: &str) -> RabbitmqConfig {
    RabbitmqConfig {
        urls: vec![Secret::new("amqp://x")],
        shuffle: false,
        exchange: Some(Template::parse(exchange).unwrap()),
        fixed_exchanges: Vec::new(),
        exchange_pattern: None,
        routing_key: Template::parse(rk).unwrap(),
        window: 10,
        channels: 1,
        window_bytes: 32 << 20,
        confirm_timeout: Duration::from_secs(1),
        dead_letter_exchange: None,
        unroutable_attempts: 3,
        retry_backoff: Duration::from_millis(10),
        max_message_bytes: 1 << 20,
        shutdown_grace: Duration::from_secs(1),
        ca_file: None,
        client_cert: None,
    }
}

fn outbox(r: &RabbitmqConfig) -> OutboxConfig {
    let table = crate::config::parse_table_name_arg("public.outbox").unwrap();
    OutboxConfig::with_defaults(
        OutboxSource::Table(table),
        OutboxColumns::default_names(),
        r,
    )
}

fn relation(payload_oid: u32, with_headers: bool) -> Relation {
    let mut cols = vec![
        ("id", 2950),
        ("aggregate_type", 25),
        ("aggregate_id", 25),
        ("event_type", 25),
        ("payload", payload_oid),
    ];
    if with_headers {
        cols.push(("headers", 3802));
    }
    Relation {
        id: 1,
        namespace: "public".into(),
        name: "outbox".into(),
        replica_identity: b'd',
        columns: cols
            .into_iter()
            .map(|(n, t)| Column {
                flags: 0,
                name: n.into(),
                type_oid: t,
                type_modifier: -1,
            })
            .collect(),
    }
}

fn event(rel: &Relation, rk: &str, values: &[Option<&str>]) -> OutboxEvent {
    let m = Mapping::new(rel, &outbox(&rabbit("outbox", rk)));
    OutboxEvent {
        tuple: TupleData(
            values
                .iter()
                .map(|v| match v {
                    Some(s) => ColumnValue::Text(Bytes::copy_from_slice(s.as_bytes())),
                    None => ColumnValue::Null,
                })
                .collect(),
        ),
        mapping: m.map(Arc::new),
        commit_time_us: 1_700_000_000_123_456,
        outbox: 0,
    }
}

#[test]
fn maps_a_default_outbox_row() {
    let rel = relation(3802, true);
    let ev = event(
        &rel,
        "{aggregate_type}.{event_type}",
        &[
            Some("7d0c2f43-53c3-4a3e-9e36-0c4cbd5e9b11"),
            Some("order"),
            Some("42"),
            Some("created"),
            Some(r#"{"total": 10}"#),
            Some(r#"{"tenant": "acme", "n": 3, "ok": true, "nested": {"a": 1}}"#),
        ],
    );
    let e = render(&ev).unwrap();
    assert_eq!(e.exchange.as_str(), "outbox");
    assert_eq!(e.routing_key.as_str(), "order.created");
    assert_eq!(&e.body[..], br#"{"total": 10}"#);
    let p = &e.properties;
    assert_eq!(
        p.message_id().as_ref().unwrap().as_str(),
        "7d0c2f43-53c3-4a3e-9e36-0c4cbd5e9b11"
    );
    assert_eq!(p.kind().as_ref().unwrap().as_str(), "created");
    assert_eq!(
        p.content_type().as_ref().unwrap().as_str(),
        "application/json"
    );
    assert_eq!(*p.delivery_mode(), Some(2));
    assert_eq!(*p.timestamp(), Some(1_700_000_000));
    let h = p.headers().as_ref().unwrap().inner();
    assert_eq!(
        h.get("aggregate_id"),
        Some(&AMQPValue::LongString("42".into()))
    );
    assert_eq!(
        h.get("aggregate_type"),
        Some(&AMQPValue::LongString("order".into()))
    );
    assert_eq!(h.get("tenant"), Some(&AMQPValue::LongString("acme".into())));
    assert_eq!(h.get("n"), Some(&AMQPValue::LongLongInt(3)));
    assert_eq!(h.get("ok"), Some(&AMQPValue::Boolean(true)));
    assert_eq!(
        h.get("nested"),
        Some(&AMQPValue::LongString(r#"{"a":1}"#.into()))
    );
}

#[test]
fn bytea_payload_is_raw_bytes_and_headers_are_optional() {
    let rel = relation(17, false);
    let ev = event(
        &rel,
        "fixed.{aggregate_id}",
        &[
            Some("1"),
            Some("t"),
            Some("a1"),
            Some("e"),
            Some("\\x00ff10"),
        ],
    );
    let e = render(&ev).unwrap();
    assert_eq!(&e.body[..], &[0x00, 0xff, 0x10]);
    assert_eq!(e.routing_key.as_str(), "fixed.a1");
    assert_eq!(
        e.properties.content_type().as_ref().unwrap().as_str(),
        "application/octet-stream"
    );
}

#[test]
fn undeliverable_rows_say_why() {
    let rel = relation(3802, true);
    let null_type = event(
        &rel,
        "{aggregate_type}",
        &[Some("id1"), None, Some("a"), Some("e"), Some("{}"), None],
    );
    assert!(matches!(render(&null_type), Err(RenderError::Null { ref id, .. }) if id == "id1"));
    let bad_headers = event(
        &rel,
        "{aggregate_type}",
        &[
            Some("id2"),
            Some("t"),
            Some("a"),
            Some("e"),
            Some("{}"),
            Some("[1]"),
        ],
    );
    assert!(matches!(
        render(&bad_headers),
        Err(RenderError::Headers { .. })
    ));
    let long = "x".repeat(300);
    let too_long = event(
        &rel,
        "{aggregate_type}",
        &[
            Some("id3"),
            Some(&long),
            Some("a"),
            Some("e"),
            Some("{}"),
            None,
        ],
    );
    assert!(matches!(
        render(&too_long),
        Err(RenderError::TooLong { .. })
    ));
    let unsupported = Mapping::new(&relation(23, false), &outbox(&rabbit("x", "y")));
    assert!(matches!(unsupported, Err(MappingError::PayloadType { .. })));
    let missing = Mapping::new(&relation(3802, false), &outbox(&rabbit("x", "{no_such}")));
    assert!(
        matches!(missing, Err(MappingError::MissingColumn { ref key, .. }) if key == "rabbitmq.routing_key")
    );
}

#[test]
fn dead_letters_say_why_and_where() {
    let rel = relation(3802, true);
    let ev = event(
        &rel,
        "{aggregate_type}.{event_type}",
        &[
            Some("id9"),
            Some("t"),
            Some("a"),
            Some("e"),
            Some("{\"k\":1}"),
            Some("{\"h\":\"v\"}"),
        ],
    );
    let env = render(&ev).unwrap();
    let dl = env.dead_letter("dlx", "unroutable", 4);
    assert_eq!(dl.exchange.as_str(), "dlx");
    assert_eq!(dl.routing_key.as_str(), "t.e");
    assert_eq!(dl.body, env.body);
    let h = dl.properties.headers().as_ref().unwrap().inner();
    assert_eq!(
        h.get("x-outbox-error"),
        Some(&AMQPValue::LongString("unroutable".into()))
    );
    assert_eq!(
        h.get("x-outbox-original-exchange"),
        Some(&AMQPValue::LongString("outbox".into()))
    );
    assert_eq!(h.get("x-outbox-attempts"), Some(&AMQPValue::LongLongInt(4)));
    assert_eq!(
        h.get("h"),
        Some(&AMQPValue::LongString("v".into())),
        "original headers kept"
    );
    assert_eq!(dl.properties.message_id(), env.properties.message_id());

    let big = env.dead_letter_oversized("dlx", 3);
    assert!(big.body.is_empty());
    let h = big.properties.headers().as_ref().unwrap().inner();
    assert_eq!(
        h.get("x-outbox-body-bytes"),
        Some(&AMQPValue::LongLongInt(7))
    );

    let null_type = event(
        &rel,
        "{aggregate_type}",
        &[Some("id10"), None, Some("a"), Some("e"), Some("{}"), None],
    );
    let err = render(&null_type).unwrap_err();
    let dl = dead_letter_unrenderable(&null_type, &err, "dlx");
    assert_eq!(dl.id(), "id10");
    assert_eq!(&dl.body[..], b"{}");
    let h = dl.properties.headers().as_ref().unwrap().inner();
    assert!(
        matches!(h.get("x-outbox-error"), Some(AMQPValue::LongString(s)) if String::from_utf8_lossy(s.as_bytes()).contains("NULL"))
    );
}

#[test]
fn bytea_hex_and_escape_decoding() {
    assert_eq!(decode_bytea(b"\\x").unwrap().len(), 0);
    assert_eq!(&decode_bytea(b"\\x00ff5c").unwrap()[..], b"\x00\xff\\");
    assert!(decode_bytea(b"\\x0").is_none());
    assert!(decode_bytea(b"\\xzz").is_none());
    // bytea_output = escape: SELECT '\x00ff5c78'::bytea gives \000\377\\x
    assert_eq!(
        &decode_bytea(b"\\000\\377\\\\x").unwrap()[..],
        b"\x00\xff\\x"
    );
    assert_eq!(&decode_bytea(b"00").unwrap()[..], b"00");
    assert_eq!(decode_bytea(b"").unwrap().len(), 0);
    assert!(decode_bytea(b"\\").is_none());
    assert!(decode_bytea(b"\\400").is_none());
    assert!(decode_bytea(b"\\12").is_none());
}

/// A row's `CC`/`BCC` are sent only when its outbox opts in
/// (`routing_headers`); its `x-outbox-*` headers, in any case, never.
#[test]
fn routing_headers_are_opt_in_and_the_relays_own_headers_are_stripped() {
    let rel = relation(3802, true);
    let mut ev = event(
        &rel,
        "{aggregate_type}",
        &[
            Some("1"),
            Some("order"),
            Some("42"),
            Some("created"),
            Some("{}"),
            Some(
                r#"{"CC": ["victim"], "BCC": ["other"], "x-outbox-error": "forged",
                    "X-Outbox-Attempts": 9, "x-outboxed": "kept", "tenant": "acme"}"#,
            ),
        ],
    );
    let headers = |ev: &OutboxEvent| render(ev).unwrap().properties.headers().clone().unwrap();
    let h = headers(&ev);
    for gone in ["CC", "BCC", "x-outbox-error", "X-Outbox-Attempts"] {
        assert!(!h.inner().contains_key(gone), "{gone} sent");
    }
    assert!(h.inner().contains_key("x-outboxed") && h.inner().contains_key("tenant"));
    Arc::get_mut(ev.mapping.as_mut().unwrap())
        .unwrap()
        .routing_headers = true;
    let h = headers(&ev);
    assert_eq!(
        h.inner().get("CC"),
        Some(&AMQPValue::FieldArray(
            vec![AMQPValue::LongString("victim".into())].into()
        ))
    );
    assert!(h.inner().contains_key("BCC"));
    assert!(!h.inner().contains_key("x-outbox-error"));
}
