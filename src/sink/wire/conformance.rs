//! The AMQP client against the scripted broker ([`super::scripted`]), one
//! script per test. Each test checks what the client reports (an event, an
//! error and its disposition) and what it sends back: a table of cases,
//! one per behaviour of the protocol. The handshake's are in
//! `conformance/handshake.rs`, closing cleanly in `conformance/closes.rs`.

use std::time::Duration;

use amq_protocol::frame::{AMQPContentHeader, AMQPFrame};
use amq_protocol::protocol::{AMQPClass, basic, channel, confirm, connection, exchange};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;

use super::scripted::{Peer, broker, connect, message, next_event};
use super::{Event, Found, Target, WireError, encode_frame};
use crate::sink::replies::Disposition;

mod closes;
mod handshake;

/// A broker that sends its heartbeats is never taken for a silent one,
/// however long the caller only waits.
#[tokio::test]
async fn a_broker_that_sends_heartbeats_is_alive() {
    let (t, broker) = broker("127.0.0.1", |mut p| async move {
        p.handshake_with(131_072, 1).await;
        for _ in 0..8 {
            tokio::time::sleep(Duration::from_millis(500)).await;
            p.send(AMQPFrame::Heartbeat).await;
        }
    })
    .await;
    let mut w = connect(&t).await.unwrap();
    // 3.5 s: more than three intervals of 1 s.
    let waited = tokio::time::timeout(Duration::from_millis(3500), w.event()).await;
    assert!(
        waited.is_err(),
        "ended while the broker sent heartbeats: {waited:?}"
    );
    broker.abort();
}

/// Frames read one byte at a time; a return then a `multiple` ack; a
/// `multiple` nack; blocked and unblocked.
#[tokio::test]
async fn answers_in_pieces_returns_acks_nacks_and_blocking() {
    let (t, broker) = broker("127.0.0.1", |mut p| async move {
        p.handshake(131_072).await;
        for _ in 0..3 {
            p.publish().await;
        }
        let frames = [
            AMQPFrame::Method(
                1,
                AMQPClass::Basic(basic::AMQPMethod::Return(basic::Return {
                    reply_code: 312,
                    reply_text: "NO_ROUTE".into(),
                    exchange: "ex".into(),
                    routing_key: "b".into(),
                })),
            ),
            AMQPFrame::Header(
                1,
                AMQPContentHeader {
                    class_id: 60,
                    body_size: 3,
                    properties: amq_protocol::protocol::BasicProperties::default()
                        .with_message_id("b".into()),
                },
            ),
            AMQPFrame::Body(1, vec![7, 7, 7]),
            AMQPFrame::Method(
                1,
                AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
                    delivery_tag: 2,
                    multiple: true,
                })),
            ),
            AMQPFrame::Method(
                1,
                AMQPClass::Basic(basic::AMQPMethod::Nack(basic::Nack {
                    delivery_tag: 3,
                    multiple: true,
                    requeue: false,
                })),
            ),
            AMQPFrame::Method(
                0,
                AMQPClass::Connection(connection::AMQPMethod::Blocked(connection::Blocked {
                    reason: "low on memory".into(),
                })),
            ),
            AMQPFrame::Method(
                0,
                AMQPClass::Connection(connection::AMQPMethod::Unblocked(connection::Unblocked {})),
            ),
        ];
        let mut bytes = Vec::new();
        for f in &frames {
            bytes = encode_frame(bytes, f).unwrap();
        }
        for b in bytes {
            p.s.write_all(&[b]).await.unwrap();
            p.s.flush().await.unwrap();
        }
        let _ = p.frame().await;
    })
    .await;
    let mut w = connect(&t).await.unwrap();
    for k in ["a", "b", "c"] {
        w.publish(message(k, 3)).unwrap();
    }
    let Event::Returned(r) = next_event(&mut w).await.unwrap() else {
        panic!("expected the return first");
    };
    assert_eq!((r.reply_code, r.message_id.as_deref()), (312, Some("b")));
    assert_eq!(
        next_event(&mut w).await.unwrap(),
        Event::Ack {
            tag: 2,
            multiple: true
        }
    );
    assert_eq!(
        next_event(&mut w).await.unwrap(),
        Event::Nack {
            tag: 3,
            multiple: true
        }
    );
    assert_eq!(next_event(&mut w).await.unwrap(), Event::Blocked(true));
    assert!(w.is_blocked());
    assert_eq!(next_event(&mut w).await.unwrap(), Event::Blocked(false));
    assert!(!w.is_blocked());
    broker.abort();
}

/// `frame_max` 4096: a body is cut into frames of at most 4096 bytes
/// (4088 of payload), and arrives whole; the boundary case too.
#[tokio::test]
async fn bodies_are_split_at_the_negotiated_frame_max() {
    let (t, broker) = broker("127.0.0.1", |mut p| async move {
        p.handshake(4096).await;
        for want in [10_000usize, 4088, 4089, 0] {
            let (_, m) = p.method().await;
            assert!(matches!(m, AMQPClass::Basic(basic::AMQPMethod::Publish(_))));
            let Some(AMQPFrame::Header(_, h)) = p.frame().await else {
                panic!("header");
            };
            assert_eq!(h.body_size, want as u64);
            let mut got = 0;
            while got < want {
                let Some(AMQPFrame::Body(_, b)) = p.frame().await else {
                    panic!("body");
                };
                assert!(b.len() <= 4088, "a body frame of {} bytes", b.len());
                got += b.len();
            }
            assert_eq!(got, want);
        }
    })
    .await;
    let mut w = connect(&t).await.unwrap();
    assert_eq!(w.frame_max(), 4096);
    for n in [10_000, 4088, 4089, 0] {
        w.publish(message("k", n)).unwrap();
    }
    // Written while waiting for an answer that never comes.
    let _ = tokio::time::timeout(Duration::from_millis(500), w.event()).await;
    broker.await.unwrap();
}

/// Bad frames from the broker end the connection with an error, never a
/// panic or a made-up event: a wrong frame-end octet, a frame larger than
/// frame_max, EOF in the middle of a frame.
#[tokio::test]
async fn malformed_frames_are_errors() {
    let ack = encode_frame(
        Vec::new(),
        &AMQPFrame::Method(
            1,
            AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
                delivery_tag: 1,
                multiple: false,
            })),
        ),
    )
    .unwrap();
    let mut bad_end = ack.clone();
    *bad_end.last_mut().unwrap() = 0x00;
    let mut oversized = vec![1u8, 0, 1];
    oversized.extend_from_slice(&(10_000_000u32).to_be_bytes());
    let cut = ack[..ack.len() - 3].to_vec();
    for (bytes, eof) in [(bad_end, false), (oversized, false), (cut, true)] {
        let (t, broker) = broker("127.0.0.1", move |mut p| async move {
            p.handshake(131_072).await;
            p.publish().await;
            p.s.write_all(&bytes).await.unwrap();
            if eof {
                p.s.shutdown().await.unwrap();
            }
            let _ = p.frame().await;
        })
        .await;
        let mut w = connect(&t).await.unwrap();
        w.publish(message("a", 1)).unwrap();
        let e = next_event(&mut w).await.unwrap_err();
        if eof {
            assert!(matches!(e, WireError::Eof), "{e}");
        } else {
            assert!(matches!(e, WireError::Protocol(_)), "{e}");
        }
        assert!(e.is_transient());
        broker.abort();
    }
}

/// Heartbeats run from the connection itself: while the caller only waits
/// for an answer, the client sends heartbeats, and a broker silent for two
/// intervals ends the connection.
#[tokio::test]
async fn heartbeats_are_sent_and_a_silent_broker_is_noticed() {
    let (t, broker) = broker("127.0.0.1", |mut p| async move {
        p.handshake_with(131_072, 1).await;
        // Silent from here on; count the client's heartbeats.
        let mut beats = 0;
        while let Some(f) = p.frame().await {
            if f == AMQPFrame::Heartbeat {
                beats += 1;
            }
        }
        assert!(beats >= 1, "no heartbeat from the client");
    })
    .await;
    let mut w = connect(&t).await.unwrap();
    let started = std::time::Instant::now();
    let e = tokio::time::timeout(Duration::from_secs(10), w.event())
        .await
        .expect("a silent broker was not noticed")
        .unwrap_err();
    assert!(matches!(e, WireError::HeartbeatMissed(_)), "{e}");
    assert!(
        started.elapsed() >= Duration::from_millis(1500),
        "{:?}",
        started.elapsed()
    );
    drop(w);
    broker.await.unwrap();
}

/// TCP keepalive is on, so a dead peer is noticed with heartbeats off and
/// nothing to send: the kernel shows the keepalive timer on the client's
/// socket (`/proc/net/tcp`, timer 2).
#[tokio::test]
async fn the_connection_has_tcp_keepalive() {
    let listener = TcpListener::bind(("127.0.0.1", 0)).await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let task = tokio::spawn(async move {
        let (s, peer) = listener.accept().await.unwrap();
        let mut p = Peer::new(s);
        p.handshake(131_072).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        let want = format!("0100007F:{:04X}", peer.port());
        let table = std::fs::read_to_string("/proc/net/tcp").unwrap();
        let line = table
            .lines()
            .find(|l| l.split_whitespace().nth(1) == Some(want.as_str()))
            .unwrap_or_else(|| panic!("no socket {want} in /proc/net/tcp"))
            .to_owned();
        // Column 6 is "tr:tm->when": the active timer; 2 is keepalive.
        let timer = line
            .split_whitespace()
            .nth(5)
            .unwrap()
            .split(':')
            .next()
            .unwrap()
            .to_owned();
        assert_eq!(timer, "02", "{line}");
    });
    let uri = crate::amqpurl::parse_amqp_url(&format!("amqp://u:p@127.0.0.1:{port}/v")).unwrap();
    let t = Target {
        uri,
        tls: None,
        connection_name: "keepalive".into(),
    };
    let _w = connect(&t).await.unwrap();
    task.await.unwrap();
}

/// Limits from the broker: `frame_max` 0 (none: ours, 131,072, is used),
/// `channel_max` 1 (the relay needs two channels: a clear refusal).
#[tokio::test]
async fn the_brokers_limits_are_negotiated_or_refused() {
    let (t, first) = broker("127.0.0.1", |mut p| async move {
        p.handshake(0).await;
    })
    .await;
    let w = connect(&t).await.unwrap();
    assert_eq!(w.frame_max(), 131_072);
    first.await.unwrap();

    let (t, broker) = broker("127.0.0.1", |mut p| async move {
        p.greet().await;
        p.tune(1, 131_072, 0).await;
        let _ = p.frame().await;
    })
    .await;
    let e = connect(&t).await.unwrap_err();
    assert!(e.to_string().contains("channel_max"), "{e}");
    assert_eq!(e.disposition(), Disposition::Stop);
    broker.abort();
}

/// `channel.flow` pauses the publishing channel like a blocked
/// connection, and is answered with flow-ok.
#[tokio::test]
async fn channel_flow_is_answered_and_pauses_publishing() {
    let (t, broker) = broker("127.0.0.1", |mut p| async move {
        p.handshake(131_072).await;
        for active in [false, true] {
            p.send_method(
                1,
                AMQPClass::Channel(channel::AMQPMethod::Flow(channel::Flow { active })),
            )
            .await;
            let (ch, m) = p.method().await;
            assert_eq!(ch, 1);
            assert_eq!(
                m,
                AMQPClass::Channel(channel::AMQPMethod::FlowOk(channel::FlowOk { active }))
            );
        }
    })
    .await;
    let mut w = connect(&t).await.unwrap();
    assert_eq!(next_event(&mut w).await.unwrap(), Event::Blocked(true));
    assert!(w.is_blocked());
    assert_eq!(next_event(&mut w).await.unwrap(), Event::Blocked(false));
    assert!(!w.is_blocked());
    broker.await.unwrap();
}

/// The client's `channel.open` on channel 2, answered, then its passive
/// `exchange.declare` there.
async fn expect_declare(p: &mut Peer) {
    let (ch, m) = p.method().await;
    assert_eq!(ch, 2);
    assert!(
        matches!(m, AMQPClass::Channel(channel::AMQPMethod::Open(_))),
        "{m:?}"
    );
    p.send_method(
        2,
        AMQPClass::Channel(channel::AMQPMethod::OpenOk(channel::OpenOk {})),
    )
    .await;
    let (ch, m) = p.method().await;
    assert_eq!(ch, 2);
    assert!(
        matches!(m, AMQPClass::Exchange(exchange::AMQPMethod::Declare(ref d)) if d.passive),
        "{m:?}"
    );
}

/// The client's passive `exchange.declare` on the open channel 2.
async fn expect_declare_again(p: &mut Peer) {
    let (ch, m) = p.method().await;
    assert_eq!(ch, 2);
    assert!(
        matches!(m, AMQPClass::Exchange(exchange::AMQPMethod::Declare(ref d)) if d.passive),
        "{m:?}"
    );
}

/// A passive declare mid-session (a templated exchange looked for before
/// its first event) is answered among the acks, in the order the broker
/// sent them: nothing waits for it. A 404 on the control channel is the
/// answer "no such exchange" and leaves the publishing channel open; a 403
/// there is "forbidden"; a 404 closing the publishing channel meanwhile is
/// not the declare's answer, which still comes once the channel is
/// reopened; after an answer that does not close it, the control channel
/// stays open for the next declare.
#[tokio::test]
async fn a_passive_declare_mid_session_is_answered_among_the_acks() {
    let (t, broker) = broker("127.0.0.1", |mut p| async move {
        p.handshake(131_072).await;
        let close = |code: u16| {
            AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
                reply_code: code,
                reply_text: "NOT_FOUND - no exchange 'gone' in vhost 'v'".into(),
                class_id: 40,
                method_id: 10,
            }))
        };
        let ack = |tag| {
            AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
                delivery_tag: tag,
                multiple: false,
            }))
        };
        let declare_ok =
            AMQPClass::Exchange(exchange::AMQPMethod::DeclareOk(exchange::DeclareOk {}));
        let expect_close_ok = |ch: u16, (got, m): (u16, AMQPClass)| {
            assert_eq!(got, ch);
            assert!(
                matches!(m, AMQPClass::Channel(channel::AMQPMethod::CloseOk(_))),
                "{m:?}"
            );
        };
        p.publish().await;
        p.publish().await;
        p.send_method(1, ack(1)).await;
        expect_declare(&mut p).await;
        p.send_method(1, ack(2)).await;
        p.send_method(2, close(404)).await;
        expect_close_ok(2, p.method().await);
        // Publishing goes on on channel 1.
        p.publish().await;
        p.send_method(1, ack(3)).await;
        // The publishing channel closes while a declare is out, after an
        // ack; then the declare's answer comes.
        p.publish().await;
        expect_declare(&mut p).await;
        p.send_method(1, ack(4)).await;
        p.send_method(1, close(404)).await;
        expect_close_ok(1, p.method().await);
        p.send_method(2, declare_ok.clone()).await;
        // The publishing channel reopened (confirm mode again).
        let (ch, m) = p.method().await;
        assert_eq!(ch, 1);
        assert!(
            matches!(m, AMQPClass::Channel(channel::AMQPMethod::Open(_))),
            "{m:?}"
        );
        p.send_method(
            1,
            AMQPClass::Channel(channel::AMQPMethod::OpenOk(channel::OpenOk {})),
        )
        .await;
        let (_, m) = p.method().await;
        assert!(
            matches!(m, AMQPClass::Confirm(confirm::AMQPMethod::Select(_))),
            "{m:?}"
        );
        p.send_method(
            1,
            AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(confirm::SelectOk {})),
        )
        .await;
        p.publish().await;
        p.send_method(1, ack(1)).await;
        // The control channel is still open: the next declare comes
        // without a channel.open; a 403 refuses it.
        expect_declare_again(&mut p).await;
        p.send_method(
            2,
            AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
                reply_code: 403,
                reply_text: "ACCESS_REFUSED - access to exchange 'secret' in vhost 'v' refused"
                    .into(),
                class_id: 40,
                method_id: 10,
            })),
        )
        .await;
        expect_close_ok(2, p.method().await);
        // An unrequested close of the control channel is no answer.
        expect_declare(&mut p).await;
        p.send_method(2, declare_ok).await;
        expect_declare_again(&mut p).await;
        p.send_method(2, close(406)).await;
        expect_close_ok(2, p.method().await);
    })
    .await;
    let mut w = connect(&t).await.unwrap();
    let ack = |tag| Event::Ack {
        tag,
        multiple: false,
    };
    let found = |name: &str, found: Found| Event::Exchange {
        name: name.into(),
        found,
    };
    w.publish(message("a", 10)).unwrap();
    w.publish(message("b", 10)).unwrap();
    w.look_for("gone").unwrap();
    assert!(w.look_for("two").is_err(), "one declare at a time");
    assert_eq!(next_event(&mut w).await.unwrap(), ack(1));
    assert_eq!(next_event(&mut w).await.unwrap(), ack(2));
    assert_eq!(
        next_event(&mut w).await.unwrap(),
        found("gone", Found::Missing),
        "404 on the control channel: none such"
    );
    assert!(w.publishing_open());
    assert_eq!(w.publish(message("c", 10)).unwrap(), 3);
    assert_eq!(next_event(&mut w).await.unwrap(), ack(3));
    w.publish(message("d", 10)).unwrap();
    w.look_for("other").unwrap();
    assert_eq!(next_event(&mut w).await.unwrap(), ack(4));
    match next_event(&mut w).await {
        Err(WireError::ChannelClosed { code: 404, .. }) => {}
        other => panic!("the publishing channel's close not reported after its ack: {other:?}"),
    }
    assert!(!w.publishing_open());
    assert!(w.publish(message("e", 10)).is_err(), "channel 1 is closed");
    tokio::time::timeout(Duration::from_secs(10), w.reopen_publishing())
        .await
        .expect("reopen hung")
        .unwrap();
    assert_eq!(
        next_event(&mut w).await.unwrap(),
        found("other", Found::Exists),
        "the declare's answer, read while reopening, kept"
    );
    assert_eq!(w.publish(message("e", 10)).unwrap(), 1);
    assert_eq!(next_event(&mut w).await.unwrap(), ack(1));
    w.look_for("secret").unwrap();
    match next_event(&mut w).await.unwrap() {
        Event::Exchange {
            name,
            found: Found::Forbidden(text),
        } => {
            assert_eq!(name, "secret");
            assert!(text.starts_with("ACCESS_REFUSED"), "{text}");
        }
        other => panic!("403 on the control channel is forbidden: {other:?}"),
    }
    w.look_for("x").unwrap();
    assert_eq!(next_event(&mut w).await.unwrap(), found("x", Found::Exists));
    w.look_for("y").unwrap();
    match next_event(&mut w).await {
        Err(WireError::Protocol(text)) => assert!(text.contains("406"), "{text}"),
        other => panic!("a 406 on the control channel is no answer: {other:?}"),
    }
    broker.await.unwrap();
}

/// A broker that never confirms, reading everything (then only
/// `rabbitmq.window_bytes` bounds what is in flight) or nothing (then the
/// full write buffer does, too): the publisher stops taking work at 1 MiB
/// of 100 KiB rows, whatever the window's count (1000) allows, and the
/// confirm deadline ends the session; nothing is reported confirmed.
#[tokio::test]
async fn a_broker_that_never_confirms_bounds_the_publisher_and_times_out() {
    for mode in ["reads", "silent"] {
        never_confirms(mode).await;
    }
}

/// The broker confirms every message but the first: the tags kept from the
/// oldest unconfirmed one stay within four windows (not one per publish
/// until the deadline), and the confirm deadline ends the session.
#[tokio::test]
async fn one_message_left_unconfirmed_bounds_what_is_kept() {
    never_confirms("all-but-first").await;
}

/// An ack for a delivery tag never published ends the session; nothing is
/// taken for confirmed.
#[tokio::test]
async fn an_ack_for_a_tag_never_published_confirms_nothing() {
    never_confirms("bogus-ack").await;
}

async fn never_confirms(mode: &'static str) {
    use crate::checkpoint::Progress;
    use crate::config::Config;
    use crate::handoff::ByteBudget;
    use crate::handoff::Item;
    use crate::lsn::Lsn;
    use crate::outbox::{Mapping, OutboxEvent};
    use crate::pgoutput::{Column, ColumnValue, Relation, TupleData};
    use crate::sink::publisher;
    use crate::sink::refusals::Refusals;
    use std::sync::Arc;

    let listener = TcpListener::bind(("127.0.0.1", 0)).await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let published = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = Arc::clone(&published);
    let broker = tokio::spawn(async move {
        let (s, _) = listener.accept().await.unwrap();
        let mut p = Peer::new(s);
        p.handshake(131_072).await;
        // Confirms every message but the first, each on its own.
        if mode == "all-but-first" {
            for tag in 1.. {
                p.publish().await;
                count.store(tag as usize, std::sync::atomic::Ordering::SeqCst);
                if tag > 1 {
                    p.send_method(
                        1,
                        AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
                            delivery_tag: tag,
                            multiple: false,
                        })),
                    )
                    .await;
                }
            }
        }
        // Never confirms; reads everything, or nothing, or acks a tag
        // that was never published.
        if mode == "bogus-ack" {
            p.publish().await;
            p.send_method(
                1,
                AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
                    delivery_tag: 999,
                    multiple: false,
                })),
            )
            .await;
        }
        if mode != "silent" {
            while p.read_more().await {
                p.buf.clear();
            }
        }
        tokio::time::sleep(Duration::from_secs(30)).await;
    });
    let window = if mode == "all-but-first" { 10 } else { 1000 };
    let toml = format!(
        "[postgres]\nurl = \"postgres://u@h/db\"\n[outbox]\ntable = \"public.outbox\"\n\
         [rabbitmq]\nurl = \"amqp://u:p@127.0.0.1:{port}/v\"\nexchange = \"{{aggregate_type}}\"\n\
         window = {window}\nwindow_bytes = 1048576\nconfirm_timeout_secs = 2\n"
    );
    let cfg = Config::from_toml(&toml, "test.toml", Vec::new()).unwrap();
    let mut sink = crate::sink::AmqpSink::connect(
        &cfg.rabbitmq,
        "conformance",
        &crate::sink::nodes::Nodes::new(&cfg.rabbitmq),
    )
    .await
    .unwrap();

    let columns = [
        ("id", 25),
        ("aggregate_type", 25),
        ("aggregate_id", 25),
        ("event_type", 25),
        ("payload", 25),
    ];
    let rel = Relation {
        id: 1,
        namespace: "public".into(),
        name: "outbox".into(),
        replica_identity: b'd',
        columns: columns
            .iter()
            .map(|(n, t)| Column {
                flags: 0,
                name: (*n).into(),
                type_oid: *t,
                type_modifier: -1,
            })
            .collect(),
    };
    let mapping = Mapping::new(&rel, &cfg.outboxes[0]).map(Arc::new);
    let payload = bytes::Bytes::from(vec![b'x'; 100 * 1024]);
    let (tx, rx) = tokio::sync::mpsc::channel(300);
    tx.try_send(Item::Begin { commit_time_us: 0 }).unwrap();
    for i in 0..200 {
        let text = |v: String| ColumnValue::Text(bytes::Bytes::from(v));
        let ev = OutboxEvent {
            tuple: TupleData(
                vec![
                    text(format!("id-{i}")),
                    text("a".into()),
                    text("1".into()),
                    text("e".into()),
                    ColumnValue::Text(payload.clone()),
                ]
                .into(),
            ),
            mapping: mapping.clone(),
            commit_time_us: 0,
            outbox: 0,
        };
        tx.try_send(Item::Event(ev)).unwrap();
    }
    tx.try_send(Item::Commit { end_lsn: Lsn(100) }).unwrap();
    let (wm, wm_rx) = tokio::sync::watch::channel(Progress {
        lsn: Lsn(1),
        commit_time_us: None,
    });
    let (mut refusals, budget) = (Refusals::default(), ByteBudget::default());
    let metrics = crate::metrics::Metrics::new();
    let stop = tokio_util::sync::CancellationToken::new();
    let dead_letters = cfg.dead_letters();
    let run = publisher::run(
        std::slice::from_mut(&mut sink),
        rx,
        &wm,
        publisher::Publishing {
            cfg: &cfg.rabbitmq,
            dead_letters: &dead_letters,
            refusals: &mut refusals,
            budget: &budget,
            start: Lsn(1),
            metrics: &metrics,
        },
        &stop,
    );
    let r = tokio::time::timeout(Duration::from_secs(20), run)
        .await
        .expect("the confirm deadline did not fire");
    let e = r.unwrap_err().error;
    assert_eq!(wm_rx.borrow().lsn, Lsn(1), "nothing is confirmed ({mode})");
    if mode == "all-but-first" {
        // One message left unanswered while the rest are confirmed: the
        // list of tags stops at four windows, and the deadline ends it.
        let n = published.load(std::sync::atomic::Ordering::SeqCst);
        assert!((10..=41).contains(&n), "{n} published past one unconfirmed");
        assert!(e.to_string().contains("no publisher confirm"), "{e}");
        broker.abort();
        return;
    }
    if mode == "bogus-ack" {
        assert!(e.to_string().contains("delivery tag 999"), "{e}");
        assert!(e.is_transient(), "{e}");
        broker.abort();
        return;
    }
    assert!(e.to_string().contains("no publisher confirm"), "{e}");
    // Published and unconfirmed when the deadline fired (the gauge is set
    // each second): at most what 1 MiB of window holds, not the 200 the
    // count would allow.
    let in_flight = metrics.in_flight.get();
    assert!(
        (1..=11).contains(&in_flight),
        "{in_flight} messages in flight to a broker that never confirms ({mode})"
    );
    broker.abort();
}
