//! The AMQP client against a broker that breaks the rules or the client's
//! resources: frames nested deep enough to overflow a recursive parser,
//! a return interleaved with acks, a close while our send buffer is full,
//! the socket options that notice a dead peer. Scripted like
//! `conformance`, whose broker and helpers it uses.

use std::time::Duration;

use amq_protocol::frame::AMQPFrame;
use amq_protocol::protocol::{AMQPClass, basic, connection};
use tokio::io::AsyncWriteExt;

use super::scripted::{Peer, broker, connect, message, next_event};
use super::{Target, Wire, WireError, nesting, watch_peer};

/// A field table `{x: [[[...]]]}` whose array nests `depth` levels deep
/// (5 bytes a level), with its length: a recursive parser needs a stack
/// frame or more for each level.
fn nested_table(depth: usize) -> Vec<u8> {
    // The innermost array is empty; each level wraps the one inside.
    let mut value = vec![b'A', 0, 0, 0, 0];
    for _ in 1..depth {
        let mut outer = Vec::with_capacity(value.len() + 5);
        outer.push(b'A');
        outer.extend_from_slice(&(value.len() as u32).to_be_bytes());
        outer.extend_from_slice(&value);
        value = outer;
    }
    let mut table = vec![1, b'x'];
    table.extend_from_slice(&value);
    let mut out = (table.len() as u32).to_be_bytes().to_vec();
    out.extend_from_slice(&table);
    out
}

/// A method frame on channel 0 with these arguments.
fn method_frame(args: &[u8]) -> Vec<u8> {
    let mut frame = vec![1, 0, 0];
    frame.extend_from_slice(&(args.len() as u32).to_be_bytes());
    frame.extend_from_slice(args);
    frame.push(0xCE);
    frame
}

/// A `connection.start` whose server properties nest `depth` levels deep.
fn nested_start(depth: usize) -> Vec<u8> {
    let mut args = vec![0, 10, 0, 10, 0, 9];
    args.extend_from_slice(&nested_table(depth));
    for text in ["PLAIN", "en_US"] {
        args.extend_from_slice(&(text.len() as u32).to_be_bytes());
        args.extend_from_slice(text.as_bytes());
    }
    method_frame(&args)
}

/// An `exchange.declare` (a client's method) whose arguments nest `depth`
/// levels deep.
fn nested_exchange_declare(depth: usize) -> Vec<u8> {
    let mut args = vec![0, 40, 0, 10, 0, 0, 1, b'x', 6];
    args.extend_from_slice(b"direct");
    args.push(0);
    args.extend_from_slice(&nested_table(depth));
    method_frame(&args)
}

/// Runs `client` against a broker that sends `frame` and closes, on a
/// thread with a 2 MiB stack: small enough that a deep value on it would
/// overflow it; returns the handshake's error.
fn handshake_after(frame: Vec<u8>) -> WireError {
    let run = move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let (ours, mut theirs) = tokio::io::duplex(1 << 20);
            theirs.write_all(&frame).await.unwrap();
            theirs.shutdown().await.unwrap();
            let target = Target {
                uri: crate::amqpurl::parse_amqp_url("amqp://u:p@deep/v").unwrap(),
                tls: None,
                connection_name: "deep".into(),
            };
            let e = Wire::handshake_over(ours, &target).await.unwrap_err();
            drop(theirs);
            e
        })
    };
    std::thread::Builder::new()
        .stack_size(2 << 20)
        .spawn(run)
        .unwrap()
        .join()
        .expect("the handshake thread failed")
}

/// 25,000 levels fit in one 128 KiB frame and overflow an 8 MiB stack
/// when parsed recursively on it: the handshake goes on (or fails), the
/// process does not abort. Run on a small stack to make the point.
#[test]
fn a_deeply_nested_frame_does_not_overflow_the_stack() {
    let frame = nested_start(25_000);
    assert!(frame.len() < 131_072, "{} bytes", frame.len());
    // The start parses; the stream then ends before a tune.
    let e = handshake_after(frame);
    assert!(matches!(e, WireError::Eof | WireError::Io(_)), "{e}");
}

/// Not only `connection.start`: any method whose arguments hold a table
/// (here `exchange.declare`, which only a client sends) nested 25,000
/// levels deep is refused without its value reaching the caller's stack.
#[test]
fn a_deeply_nested_table_in_any_method_does_not_overflow_the_stack() {
    let frame = nested_exchange_declare(25_000);
    assert!(frame.len() < 131_072, "{} bytes", frame.len());
    let e = handshake_after(frame);
    assert!(
        matches!(&e, WireError::Protocol(m) if m.contains("client's method")),
        "{e}"
    );
    // Shallow, the same method is just unexpected.
    let e = handshake_after(nested_exchange_declare(3));
    assert!(!e.to_string().contains("client's method"), "{e}");
}

/// A body frame's payload is opaque bytes: its `F`s are no tables, so a
/// returned body full of them parses on the caller's stack, not on a thread
/// with a stack sized for thousands of levels. Method frames still count.
#[test]
fn only_frames_that_hold_tables_count_as_nested() {
    let mut body = vec![3u8, 0, 1];
    body.extend_from_slice(&4096u32.to_be_bytes());
    body.extend(std::iter::repeat_n(b'F', 4096));
    body.push(0xCE);
    assert_eq!(nesting(&body), 0);
    assert!(nesting(&nested_start(100)) >= 100);
}

/// A broker that answers `connection.open` with a flood of confirms on
/// the publishing channel before its `open-ok`: kept for later, they would fill memory for as long as
/// the call's deadline (gigabytes at LAN speed). An ack of a tag never
/// published is a protocol error; acks of "every tag" (0, multiple), which
/// nothing can owe either, are kept only up to a small bound.
#[tokio::test]
async fn a_flood_of_confirms_while_connecting_is_refused() {
    for tag in [7, 0] {
        let (t, broker) = broker("127.0.0.1", move |mut p: Peer| async move {
            p.start(131_072, 0).await;
            let _open = p.method().await;
            let ack = super::encode_frame(
                Vec::new(),
                &AMQPFrame::Method(
                    1,
                    AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
                        delivery_tag: tag,
                        multiple: true,
                    })),
                ),
            )
            .unwrap();
            // A million, written until the client hangs up.
            let flood = ack.repeat(1 << 14);
            for _ in 0..64 {
                if p.s.write_all(&flood).await.is_err() {
                    return;
                }
            }
        })
        .await;
        let e = connect(&t).await.unwrap_err();
        let said = e.to_string();
        let expected = if tag == 0 {
            "more than 0 publishes can be owed"
        } else {
            "basic.ack for delivery tag 7, never published"
        };
        assert!(said.contains(expected), "tag {tag}: {said}");
        broker.await.unwrap();
    }
}

/// An ack between a return and its content header would settle a message
/// the broker just said it could not route: a protocol error, and nothing
/// acked.
#[tokio::test]
async fn an_ack_inside_a_returned_message_is_a_protocol_error() {
    let (t, broker) = broker("127.0.0.1", |mut p: Peer| async move {
        p.handshake(131_072).await;
        p.publish().await;
        p.send_method(
            1,
            AMQPClass::Basic(basic::AMQPMethod::Return(basic::Return {
                reply_code: 312,
                reply_text: "NO_ROUTE".into(),
                exchange: "ex".into(),
                routing_key: "k".into(),
            })),
        )
        .await;
        p.send_method(
            1,
            AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
                delivery_tag: 1,
                multiple: false,
            })),
        )
        .await;
        tokio::time::sleep(Duration::from_secs(2)).await;
    })
    .await;
    let mut w = connect(&t).await.unwrap();
    w.publish(message("k", 10)).unwrap();
    let e = next_event(&mut w).await.unwrap_err();
    assert!(
        matches!(&e, WireError::Protocol(m) if m.contains("middle of a returned message")),
        "{e}"
    );
    broker.abort();
}

/// The broker stops reading, our send buffer fills, and then it closes the
/// connection: the close is read and reported at once (the unwritten
/// publishes are not waited for), and closing the connection then still
/// delivers our close-ok behind them, then a FIN.
#[tokio::test]
async fn a_close_while_our_send_buffer_is_full_is_answered() {
    let (t, broker) = broker("127.0.0.1", |mut p: Peer| async move {
        p.handshake(131_072).await;
        // Not reading: let the client fill the socket buffers.
        tokio::time::sleep(Duration::from_millis(500)).await;
        p.close_connection(320, "CONNECTION_FORCED - broker forced connection closure")
            .await;
        // As RabbitMQ does: discard everything until close-ok.
        loop {
            match p.frame().await {
                Some(AMQPFrame::Method(
                    0,
                    AMQPClass::Connection(connection::AMQPMethod::CloseOk(_)),
                )) => break,
                Some(_) => {}
                None => panic!("EOF before close-ok"),
            }
        }
        assert!(p.frame().await.is_none(), "expected EOF after close-ok");
    })
    .await;
    let mut w = connect(&t).await.unwrap();
    for i in 0..64 {
        w.publish(message(&format!("m{i}"), 1 << 20)).unwrap();
    }
    let e = next_event(&mut w).await.unwrap_err();
    assert!(
        matches!(e, WireError::ConnectionClosed { code: 320, .. }),
        "{e}"
    );
    assert!(e.is_transient());
    tokio::time::timeout(Duration::from_secs(20), w.close())
        .await
        .expect("close hung")
        .unwrap();
    tokio::time::timeout(Duration::from_secs(20), broker)
        .await
        .expect("the broker never saw close-ok")
        .unwrap();
}

/// The socket notices a dead peer with heartbeats off: keepalive when
/// idle, and a user timeout when our data stays unacknowledged (a broker
/// host gone while it blocked us; window probes to a live one are
/// answered, so a long alarm does not end the connection).
#[tokio::test]
async fn the_socket_gives_up_on_a_dead_peer() {
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0))
        .await
        .unwrap();
    let tcp = tokio::net::TcpStream::connect(listener.local_addr().unwrap())
        .await
        .unwrap();
    watch_peer(&tcp).unwrap();
    let sock = socket2::SockRef::from(&tcp);
    assert!(sock.keepalive().unwrap());
    assert_eq!(
        sock.tcp_user_timeout().unwrap(),
        Some(Duration::from_secs(60))
    );
}
