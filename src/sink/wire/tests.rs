//! The client against brokers played in memory: buffer compaction, hand encoding against amq-protocol's, limit negotiation.

use super::connect::negotiate;
use super::*;
use crate::message::Name;
use amq_protocol::types::AMQPValue;
use proptest::prelude::*;
use std::task::Context;

/// A broker that reads more slowly than the relay publishes: the
/// written front of the buffer is dropped as it goes, so the buffer
/// stays within twice what is unwritten, and the bytes that arrive are
/// exactly the messages, in order.
#[test]
fn the_write_buffer_is_compacted_after_partial_writes() {
    use tokio::io::AsyncRead;
    // A runtime for the connection's timer; polled by hand, outside any
    // task (inside one, tokio's cooperative budget would make the pipe
    // pend after a while).
    let rt = tokio::runtime::Runtime::new().unwrap();
    let _in_runtime = rt.enter();
    let (client, mut broker) = tokio::io::duplex(8 * 1024);
    let mut w = Wire::over(Box::new(client));
    let waker = futures_util::task::noop_waker();
    let mut cx = Context::from_waker(&waker);
    let env = |i: usize| Envelope {
        exchange: "ex".into(),
        routing_key: format!("rk{i}").into(),
        body: bytes::Bytes::from(vec![(i % 251) as u8; 10_000]),
        properties: amq_protocol::protocol::BasicProperties::default(),
    };
    let mut expected = Vec::new();
    let mut got = Vec::new();
    let mut chunk = vec![0u8; 8 * 1024];
    let read = |broker: &mut tokio::io::DuplexStream, got: &mut Vec<u8>, chunk: &mut [u8]| {
        let mut cx = Context::from_waker(&waker);
        let mut rb = tokio::io::ReadBuf::new(chunk);
        if let Poll::Ready(Ok(())) = Pin::new(broker).poll_read(&mut cx, &mut rb) {
            got.extend_from_slice(rb.filled());
        }
    };
    for i in 0..200 {
        expected = encode_envelope(expected, w.frame_max, env(i)).unwrap();
        w.publish(env(i)).unwrap();
        w.poll_write(&mut cx).unwrap();
        let unwritten = w.wbuf.len() - w.written;
        assert!(
            w.wbuf.len() <= 2 * unwritten,
            "round {i}: {} bytes buffered for {unwritten} unwritten",
            w.wbuf.len()
        );
        read(&mut broker, &mut got, &mut chunk);
    }
    while w.written < w.wbuf.len() || got.len() < expected.len() {
        w.poll_write(&mut cx).unwrap();
        read(&mut broker, &mut got, &mut chunk);
    }
    assert_eq!(got.len(), expected.len());
    assert!(got == expected, "the bytes on the wire differ");
    // One huge message does not pin its size once it is written.
    let huge = Envelope {
        body: bytes::Bytes::from(vec![1u8; 3 << 20]),
        ..env(0)
    };
    w.publish(huge).unwrap();
    assert!(w.wbuf.capacity() > WRITE_KEEP);
    got.clear();
    while w.written < w.wbuf.len() || !w.wbuf.is_empty() {
        w.poll_write(&mut cx).unwrap();
        read(&mut broker, &mut got, &mut chunk);
    }
    assert!(w.wbuf.capacity() <= WRITE_KEEP, "{}", w.wbuf.capacity());
}

fn name(parts: &[String]) -> Name<'_> {
    parts.iter().fold(Name::literal(""), |n, p| n.join(p))
}

fn parts_within(max: usize) -> impl Strategy<Value = Vec<String>> {
    proptest::collection::vec("\\PC{0,20}", 0..4).prop_filter("short", move |p| {
        p.iter().map(String::len).sum::<usize>() <= max
    })
}

proptest! {
    /// The direct encoder writes exactly what amq-protocol writes for
    /// the same message: frames, properties, header table, body chunks.
    #[test]
    fn encode_view_matches_amq_protocol(
        exchange in parts_within(255),
        routing_key in parts_within(255),
        message_id in "\\PC{0,60}",
        event_type in "\\PC{0,60}",
        aggregate_type in "\\PC{0,80}",
        aggregate_id in "\\PC{0,300}",
        timestamp in any::<u64>(),
        body in proptest::collection::vec(any::<u8>(), 0..9000),
        content_type in prop::sample::select(vec![
            "application/json",
            "text/plain; charset=utf-8",
            "application/octet-stream",
        ]),
        frame_max in prop::sample::select(vec![4096u32, 131_072]),
    ) {
        prop_assume!(message_id.len() <= 255 && event_type.len() <= 255);
        let m = MessageView {
            exchange: name(&exchange),
            routing_key: name(&routing_key),
            body: body.into(),
            message_id: &message_id,
            event_type: &event_type,
            content_type,
            timestamp,
            aggregate_type: &aggregate_type,
            aggregate_id: &aggregate_id,
            headers: None,
        };
        let mut direct = b"before".to_vec();
        encode_view(&mut direct, frame_max, &m);
        let reference = encode_envelope(b"before".to_vec(), frame_max, m.to_envelope()).unwrap();
        prop_assert_eq!(direct, reference);
        // The size the publisher checks against frame_max is exact.
        prop_assert_eq!(m.header_bytes(), header_frame_len(&m.to_envelope().properties));
    }

    /// With a headers column (every kind of field value, nested arrays and
    /// tables, and keys the aggregate headers replace), the size is still
    /// exact.
    #[test]
    fn header_bytes_is_the_header_frames_size(
        keys in proptest::collection::vec(
            prop_oneof![
                "[a-zA-Z_-]{1,40}",
                Just("aggregate_id".to_owned()),
                Just("aggregate_type".to_owned()),
            ], 0..16),
        texts in proptest::collection::vec("\\PC{0,200}", 16),
        aggregate_id in "\\PC{0,300}",
    ) {
        let mut headers = FieldTable::default();
        for (i, k) in keys.iter().enumerate() {
            let text = texts[i].as_str();
            let v = match i % 16 {
                0 => AMQPValue::LongString(text.into()),
                1 => AMQPValue::LongLongInt(i as i64),
                2 => AMQPValue::Double(i as f64 / 3.0),
                3 => AMQPValue::Boolean(i % 2 == 0),
                4 => AMQPValue::FieldArray(vec![AMQPValue::LongString(text.into())].into()),
                5 => AMQPValue::Void,
                6 => AMQPValue::ShortString(k.as_str().into()),
                7 => AMQPValue::ShortInt(-3),
                8 => AMQPValue::LongUInt(7),
                9 => AMQPValue::Float(0.5),
                10 => AMQPValue::Timestamp(9),
                11 => AMQPValue::ShortShortUInt(1),
                12 => AMQPValue::ByteArray(text.as_bytes().to_vec().into()),
                13 => AMQPValue::DecimalValue(amq_protocol::types::DecimalValue { scale: 2, value: 5 }),
                14 => {
                    let mut inner = FieldTable::default();
                    inner.insert(k.as_str().into(), AMQPValue::LongString(text.into()));
                    inner.insert("n".into(), AMQPValue::LongInt(1));
                    AMQPValue::FieldTable(inner)
                }
                _ => AMQPValue::FieldArray(vec![AMQPValue::Void, AMQPValue::ShortUInt(2)].into()),
            };
            headers.insert(k.as_str().into(), v);
        }
        let m = MessageView {
            exchange: Name::literal("ex"),
            routing_key: Name::literal("rk"),
            body: bytes::Bytes::new(),
            message_id: "id",
            event_type: "type",
            content_type: "application/json",
            timestamp: 1,
            aggregate_type: "order",
            aggregate_id: &aggregate_id,
            headers: Some(headers),
        };
        prop_assert_eq!(m.header_bytes(), header_frame_len(&m.to_envelope().properties));
    }
}

#[test]
fn limits_are_the_smaller_unless_one_side_has_none() {
    assert_eq!(negotiate(131_072u32, 65_536), 65_536);
    assert_eq!(negotiate(4_096u32, 131_072), 4_096);
    assert_eq!(negotiate(0u16, 60), 60, "no heartbeat asked: the broker's");
    assert_eq!(negotiate(10u16, 60), 10);
    assert_eq!(negotiate(10u16, 0), 10, "the broker has none: ours");
    assert_eq!(negotiate(0u16, 0), 0);
}
