//! Fuzzing the AMQP client: arbitrary and mutated byte streams, as the
//! broker's side of a connection, fed to the handshake and to the frame
//! parser and state machine of an open connection. Never a panic, a hang
//! or an allocation the input does not pay for; every outcome an error or
//! a valid event.

use std::time::Duration;

use amq_protocol::frame::{AMQPContentHeader, AMQPFrame};
use amq_protocol::protocol::{AMQPClass, basic, channel, confirm, connection};
use amq_protocol::types::FieldTable;
use proptest::prelude::*;
use tokio::io::AsyncWriteExt;

use super::{Target, Wire, WireError, encode_frame};

/// Frames a broker may send the publishing side, valid.
fn valid_stream() -> Vec<u8> {
    let frames = [
        AMQPFrame::Method(
            1,
            AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
                delivery_tag: 1,
                multiple: true,
            })),
        ),
        AMQPFrame::Method(
            1,
            AMQPClass::Basic(basic::AMQPMethod::Return(basic::Return {
                reply_code: 312,
                reply_text: "NO_ROUTE".into(),
                exchange: "ex".into(),
                routing_key: "rk".into(),
            })),
        ),
        AMQPFrame::Header(
            1,
            AMQPContentHeader {
                class_id: 60,
                body_size: 5,
                properties: amq_protocol::protocol::BasicProperties::default()
                    .with_message_id("m".into()),
            },
        ),
        AMQPFrame::Body(1, b"hello".to_vec()),
        AMQPFrame::Heartbeat,
        AMQPFrame::Method(
            1,
            AMQPClass::Basic(basic::AMQPMethod::Nack(basic::Nack {
                delivery_tag: 2,
                multiple: false,
                requeue: true,
            })),
        ),
        AMQPFrame::Method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Blocked(connection::Blocked {
                reason: "r".into(),
            })),
        ),
    ];
    encode(&frames)
}

fn encode(frames: &[AMQPFrame]) -> Vec<u8> {
    let mut bytes = Vec::new();
    for f in frames {
        bytes = encode_frame(bytes, f).unwrap();
    }
    bytes
}

/// A broker's whole side of a handshake (start, tune, open-ok, the
/// channel's open-ok, confirm mode), then the publishing frames.
fn valid_handshake() -> Vec<u8> {
    let conn = |m| AMQPFrame::Method(0, AMQPClass::Connection(m));
    let mut bytes = encode(&[
        conn(connection::AMQPMethod::Start(connection::Start {
            version_major: 0,
            version_minor: 9,
            server_properties: FieldTable::default(),
            mechanisms: "PLAIN AMQPLAIN".into(),
            locales: "en_US".into(),
        })),
        conn(connection::AMQPMethod::Tune(connection::Tune {
            channel_max: 2047,
            frame_max: 131_072,
            heartbeat: 60,
        })),
        conn(connection::AMQPMethod::OpenOk(connection::OpenOk {})),
        AMQPFrame::Method(
            1,
            AMQPClass::Channel(channel::AMQPMethod::OpenOk(channel::OpenOk {})),
        ),
        AMQPFrame::Method(
            1,
            AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(confirm::SelectOk {})),
        ),
    ]);
    bytes.extend(valid_stream());
    bytes
}

/// How the fed stream ends.
#[derive(Clone, Copy, PartialEq)]
enum End {
    /// EOF after the last byte.
    Eof,
    /// Nothing more, ever, and the socket stays open: a broker gone
    /// silent. Time is paused and jumps to the next timer whenever the
    /// client waits, so the heartbeat timer fires (two intervals of
    /// silence, up to 65,535 s each, take no real time).
    Silent,
}

/// Feeds `bytes` as the broker's side of a connection, then `end`: from
/// the protocol header on if `handshake`, else to an open connection.
/// Reads events until an error; returns how many there were and the
/// error (`None`: the handshake failed, or after a silent broker's
/// truncated handshake, waits for the caller's deadline; `Eof` for a
/// silent broker with heartbeats off, which waits for TCP keepalive).
fn feed_from(bytes: Vec<u8>, handshake: bool, end: End) -> Option<(usize, WireError)> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(end == End::Silent)
        .build()
        .unwrap();
    rt.block_on(async move {
        // Room for everything the client writes: the broker never reads.
        let (ours, mut theirs) = tokio::io::duplex(bytes.len() + 64 * 1024);
        theirs.write_all(&bytes).await.unwrap();
        // Longer than two of the longest heartbeat intervals: a silent
        // broker's heartbeat deadline always comes first. In paused time
        // this takes no real time; a busy loop would never reach it.
        let step = match end {
            End::Eof => {
                // EOF for the client's reads; its writes still land.
                theirs.shutdown().await.unwrap();
                Duration::from_secs(5)
            }
            End::Silent => Duration::from_secs(3 * 65_536),
        };
        let mut w = if handshake {
            let target = Target {
                uri: crate::amqpurl::parse_amqp_url("amqp://u:p@fuzz/v").unwrap(),
                tls: None,
                connection_name: "fuzz".into(),
            };
            match tokio::time::timeout(step, Wire::handshake_over(ours, &target)).await {
                Ok(Ok(w)) => w,
                Ok(Err(_)) => return None,
                // No heartbeats before tune: `Wire::connect`'s caller
                // sets the handshake's deadline.
                Err(_) if end == End::Silent => return None,
                Err(_) => panic!("handshake hung on {} bytes", bytes.len()),
            }
        } else {
            Wire::after_handshake(ours)
        };
        // Two messages out, as the stream's answers assume (an answer for
        // a tag never published is a protocol error).
        for key in ["a", "b"] {
            if w.publish(super::scripted::message(key, 5)).is_err() {
                return None;
            }
        }
        let mut events = 0;
        loop {
            match tokio::time::timeout(step, w.event()).await {
                Ok(Ok(_)) => events += 1,
                Ok(Err(e)) => {
                    // No EOF was sent: a protocol error or the missed
                    // heartbeat ends it, never an EOF.
                    assert!(
                        end == End::Eof || !matches!(e, WireError::Eof),
                        "EOF from a silent broker"
                    );
                    return Some((events, e));
                }
                // Heartbeats off: nothing to notice a silent broker with
                // but TCP keepalive (on a real socket).
                Err(_) if end == End::Silent && w.heartbeat().is_none() => {
                    return Some((events, WireError::Eof));
                }
                Err(_) => panic!(
                    "hung on {} bytes (heartbeat {:?})",
                    bytes.len(),
                    w.heartbeat()
                ),
            }
            // Every event consumed at least one whole frame (8 bytes).
            assert!(
                events * 8 <= bytes.len(),
                "{events} events from {} bytes",
                bytes.len()
            );
        }
    })
}

fn feed(bytes: Vec<u8>) -> usize {
    feed_from(bytes, false, End::Eof)
        .expect("no handshake to fail")
        .0
}

/// `bytes` with bytes replaced at `flips`, then cut at `cut`.
fn mutate(
    mut bytes: Vec<u8>,
    flips: Vec<(prop::sample::Index, u8)>,
    cut: prop::sample::Index,
) -> Vec<u8> {
    for (at, b) in flips {
        let i = at.index(bytes.len());
        bytes[i] = b;
    }
    let end = cut.index(bytes.len() + 1);
    bytes.truncate(end.max(1));
    bytes
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// Arbitrary bytes: never a panic or a hang, always an error at
    /// the end (the stream ends in EOF).
    #[test]
    fn arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..4096)) {
        feed(bytes);
    }

    /// A valid stream with bytes flipped, cut or inserted.
    #[test]
    fn mutated_valid_streams(
        flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..6),
        cut in any::<prop::sample::Index>(),
    ) {
        feed(mutate(valid_stream(), flips, cut));
    }

    /// Arbitrary bytes from the first: the handshake fails, never
    /// panics or hangs.
    #[test]
    fn arbitrary_handshakes(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
        feed_from(bytes, true, End::Eof);
    }

    /// A valid handshake and stream with bytes flipped, cut or inserted:
    /// whatever the tune values and frames come to.
    #[test]
    fn mutated_handshakes(
        flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..6),
        cut in any::<prop::sample::Index>(),
    ) {
        feed_from(mutate(valid_handshake(), flips, cut), true, End::Eof);
    }

    /// The same, from a broker that then goes silent with the socket
    /// open: whatever heartbeat the mutated tune negotiates, its timer
    /// fires and a dead broker is noticed.
    #[test]
    fn mutated_handshakes_then_silence(
        flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..6),
        cut in any::<prop::sample::Index>(),
    ) {
        feed_from(mutate(valid_handshake(), flips, cut), true, End::Silent);
    }
}

/// Unmutated, every frame is an event except the heartbeat and the
/// parts of the return (header, body), which make one.
#[test]
fn the_valid_stream_is_read_whole() {
    assert_eq!(feed(valid_stream()), 4);
}

/// And after a whole handshake, the same.
#[test]
fn the_valid_handshake_is_read_whole() {
    let (events, e) = feed_from(valid_handshake(), true, End::Eof).unwrap();
    assert_eq!(events, 4);
    assert!(matches!(e, WireError::Eof), "{e}");
}

/// A valid handshake (heartbeat 60 s), the frames, then silence: read
/// whole, then two intervals without a byte end it.
#[test]
fn a_silent_broker_after_a_valid_handshake_is_noticed_by_its_heartbeat() {
    let (events, e) = feed_from(valid_handshake(), true, End::Silent).unwrap();
    assert_eq!(events, 4);
    assert!(matches!(e, WireError::HeartbeatMissed(120)), "{e}");
}
