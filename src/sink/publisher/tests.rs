//! The publisher's pieces: retry delays, the confirm clock, dead letters that fit.

/// A dead letter too big for a frame keeps only its x-outbox-* headers,
/// cut short; one with a body over the limit goes without it.
#[test]
fn dead_letters_are_made_to_fit() {
    use amq_protocol::protocol::BasicProperties;
    use amq_protocol::types::{AMQPValue, FieldTable};
    let mut headers = FieldTable::default();
    headers.insert(
        "pad".into(),
        AMQPValue::LongString("p".repeat(200_000).into()),
    );
    let env = Envelope {
        exchange: "ex".into(),
        routing_key: "rk".into(),
        body: bytes::Bytes::from(vec![b'x'; 5000]),
        properties: BasicProperties::default()
            .with_message_id("id".into())
            .with_headers(headers),
    };
    let dl = env.dead_letter("dlx", &"why ".repeat(1000), 1);
    let fitted = fit_dead_letter(dl, 131_072, 4096);
    assert!(super::super::wire::header_frame_len(&fitted.properties) <= 131_072);
    assert!(fitted.body.is_empty());
    let h = fitted.properties.headers().clone().unwrap();
    assert!(h.inner().get("pad").is_none());
    assert!(matches!(
        h.inner().get("x-outbox-headers-dropped"),
        Some(AMQPValue::Boolean(true))
    ));
    assert!(matches!(
        h.inner().get("x-outbox-body-bytes"),
        Some(AMQPValue::LongLongInt(5000))
    ));
    match h.inner().get("x-outbox-error") {
        Some(AMQPValue::LongString(s)) => {
            assert!(s.as_bytes().len() <= DEAD_LETTER_TEXT_MAX + 3)
        }
        other => panic!("{other:?}"),
    }
    // A small one is left as it is.
    let small = Envelope {
        exchange: "ex".into(),
        routing_key: "rk".into(),
        body: bytes::Bytes::from_static(b"{}"),
        properties: BasicProperties::default(),
    }
    .dead_letter("dlx", "why", 1);
    let same = fit_dead_letter(small.clone(), 131_072, 4096);
    assert_eq!(same.properties, small.properties);
    assert_eq!(same.body, small.body);
}
use super::inflight::DEAD_LETTER_TEXT_MAX;
use super::*;

#[tokio::test(start_paused = true)]
async fn the_oldest_waiting_message_times_out() {
    let timeout = Duration::from_secs(5);
    let mut c = ConfirmClock::new();
    let first = Instant::now();
    for _ in 0..5 {
        tokio::time::advance(Duration::from_millis(900)).await;
        assert!(!c.overdue(Some(first), false, timeout));
    }
    // It has waited 4.5 s; at 5.4 s it is overdue.
    tokio::time::advance(Duration::from_millis(900)).await;
    assert!(c.overdue(Some(first), false, timeout));
    assert!(!c.overdue(None, false, timeout), "nothing waits");
}

#[tokio::test(start_paused = true)]
async fn alarm_and_stall_time_do_not_count() {
    let timeout = Duration::from_secs(5);
    let mut c = ConfirmClock::new();
    let first = Instant::now();
    for _ in 0..10 {
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(!c.overdue(Some(first), true, timeout), "blocked");
    }
    for _ in 0..4 {
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(!c.overdue(Some(first), false, timeout));
    }
    tokio::time::advance(Duration::from_secs(1)).await;
    assert!(c.overdue(Some(first), false, timeout), "5 s unblocked");

    // A process stall longer than a few checks restarts the count.
    let mut c = ConfirmClock::new();
    let first = Instant::now();
    tokio::time::advance(Duration::from_secs(60)).await;
    assert!(
        !c.overdue(Some(first), false, timeout),
        "first check after a stall"
    );
    for _ in 0..4 {
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(!c.overdue(Some(first), false, timeout));
    }
    tokio::time::advance(Duration::from_secs(1)).await;
    assert!(
        c.overdue(Some(first), false, timeout),
        "5 s counted since the stall"
    );
}

#[test]
fn retry_delay_doubles_and_caps() {
    let b = Duration::from_millis(100);
    assert_eq!(retry_delay(b, 1), Duration::from_millis(100));
    assert_eq!(retry_delay(b, 2), Duration::from_millis(200));
    assert_eq!(retry_delay(b, 4), Duration::from_millis(800));
    assert_eq!(retry_delay(b, 40), Duration::from_secs(30));
}
