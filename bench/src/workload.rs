//! The one event shape every scenario uses: a 300-byte JSON payload, routed
//! `order.OrderPlaced`, with the properties the relay sets.

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};

/// `aggregate_type` of every event.
pub const AGGREGATE_TYPE: &str = "order";
/// `event_type` of every event (AMQP `type`).
pub const EVENT_TYPE: &str = "OrderPlaced";
/// The relay's routing key template `{aggregate_type}.{event_type}`, rendered.
pub const ROUTING_KEY: &str = "order.OrderPlaced";
/// Size of every message body.
pub const BODY_BYTES: usize = 300;

fn payload_with_pad(i: u64, pad: usize) -> String {
    // Keys in jsonb's own order (shorter first, then bytewise) and jsonb's
    // spacing, so that `payload::text` — what the relay publishes — is this
    // exact string.
    format!(
        "{{\"pad\": \"{}\", \"qty\": {}, \"sku\": \"SKU-{:06}\", \"customer\": \"c-{:09}\", \"order_id\": \"{:09}\"}}",
        "x".repeat(pad),
        1 + i % 9,
        i % 1_000_000,
        i,
        i
    )
}

/// Padding that makes a payload [`BODY_BYTES`] long (fields are fixed-width
/// for every `i` below 10⁹).
pub fn pad_len() -> usize {
    BODY_BYTES - payload_with_pad(1, 0).len()
}

/// Payload of event number `i`.
pub fn payload(i: u64) -> String {
    payload_with_pad(i, pad_len())
}

/// SQL expression (jsonb) equal to `payload(<i_expr>)`.
pub fn payload_sql(i: &str) -> String {
    format!(
        "format('{{\"pad\": \"%s\", \"qty\": %s, \"sku\": \"SKU-%s\", \"customer\": \"c-%s\", \"order_id\": \"%s\"}}', \
         repeat('x', {pad}), 1 + ({i}) % 9, lpad((({i}) % 1000000)::text, 6, '0'), lpad(({i})::text, 9, '0'), lpad(({i})::text, 9, '0'))::jsonb",
        pad = pad_len()
    )
}

/// `aggregate_id` of event number `i`.
pub fn aggregate_id(i: u64) -> String {
    format!("order-{i:09}")
}

/// SQL expression equal to `aggregate_id(<i_expr>)`.
pub fn aggregate_id_sql(i: &str) -> String {
    format!("'order-' || lpad(({i})::text, 9, '0')")
}

/// A UUID-shaped event id: `tag` tells runs apart, `i` events within one.
pub fn event_id(tag: u32, i: u64) -> String {
    format!("{tag:08x}-0000-4000-8000-{i:012x}")
}

/// What the relay sets on every message (see README "The message"):
/// persistent, message_id, type, content_type, timestamp and the two
/// headers it adds for a row whose `headers` column is NULL.
pub fn properties(id: &str, aggregate_id: &str, timestamp: u64) -> BasicProperties {
    let mut headers = FieldTable::default();
    headers.insert(
        ShortString::from("aggregate_type"),
        AMQPValue::LongString(LongString::from(AGGREGATE_TYPE)),
    );
    headers.insert(
        ShortString::from("aggregate_id"),
        AMQPValue::LongString(LongString::from(aggregate_id)),
    );
    BasicProperties::default()
        .with_message_id(ShortString::from(id))
        .with_type(ShortString::from(EVENT_TYPE))
        .with_content_type(ShortString::from("application/json"))
        .with_delivery_mode(2)
        .with_timestamp(timestamp)
        .with_headers(headers)
}

/// Seconds since the Unix epoch.
pub fn unix_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Microseconds since the Unix epoch: the one clock every process of a
/// latency run stamps with.
pub fn unix_us() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payload_is_300_bytes() {
        for i in [1, 9, 10, 999_999, 1_000_000, 123_456_789] {
            assert_eq!(payload(i).len(), BODY_BYTES, "{}", payload(i));
        }
    }
}
