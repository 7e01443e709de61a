//! The sink's unit tests: URLs, the unconfirmed window, error dispositions.

#[test]
fn the_missing_exchange_is_read_from_the_404() {
    let closed = |code, text: &str| SinkError::Amqp {
        what: "publishing",
        url: String::new(),
        source: WireError::ChannelClosed {
            code,
            text: text.to_owned(),
        },
    };
    let e = closed(404, "NOT_FOUND - no exchange 'ex_it's' in vhost '/'");
    assert_eq!(e.missing_exchange().as_deref(), Some("ex_it's"));
    assert!(e.is_transient());
    // Cut short by the broker (255 bytes): not guessed at, so permanent.
    let e = closed(404, "NOT_FOUND - no exchange 'a-very-long-na...");
    assert_eq!(e.missing_exchange(), None);
    assert!(!e.is_transient());
    let e = closed(404, "NOT_FOUND - no queue 'q' in vhost '/'");
    assert_eq!(e.missing_exchange(), None);
    assert_eq!(
        closed(406, "no exchange 'x' in vhost '/'").missing_exchange(),
        None
    );
}

use super::wire::Returned;
use super::*;

#[allow(clippy::ptr_arg)] // the item type is String
fn some(m: &String) -> Option<String> {
    Some(m.clone())
}

fn ack(tag: u64, multiple: bool) -> Event {
    Event::Ack { tag, multiple }
}

fn returned(id: &str) -> Event {
    Event::Returned(Returned {
        reply_code: 312,
        reply_text: "NO_ROUTE".into(),
        exchange: "ex".into(),
        routing_key: "rk".into(),
        message_id: Some(id.into()),
    })
}

/// Messages "m1".."mN" published as tags 1..N.
fn published(n: u64) -> Unconfirmed<String> {
    let mut u = Unconfirmed::default();
    for tag in 1..=n {
        u.push(tag, format!("m{tag}"));
    }
    u
}

fn dest(_: &String) -> (String, String) {
    ("ex".into(), "rk".into())
}

fn apply(u: &mut Unconfirmed<String>, ev: Event) -> Vec<(String, Result<(), String>)> {
    let mut out = Vec::new();
    u.apply(ev, some, dest, &mut out).unwrap();
    out.into_iter()
        .map(|(m, r)| (m, r.map_err(|e| e.to_string())))
        .collect()
}

fn names(v: &[(String, Result<(), String>)]) -> Vec<&str> {
    v.iter().map(|(m, _)| m.as_str()).collect()
}

#[test]
fn single_and_multiple_acks_settle_in_tag_order_out_of_order_too() {
    let mut u = published(5);
    let got = apply(&mut u, ack(3, false));
    assert_eq!(names(&got), ["m3"]);
    assert!(got[0].1.is_ok());
    assert_eq!(u.oldest().map(String::as_str), Some("m1"));
    assert_eq!(u.len(), 4);
    let got = apply(&mut u, ack(4, true));
    assert_eq!(names(&got), ["m1", "m2", "m4"]);
    assert_eq!(u.oldest().map(String::as_str), Some("m5"));
    // A repeated or stale answer settles nothing twice.
    assert!(apply(&mut u, ack(4, true)).is_empty());
    assert!(apply(&mut u, ack(2, false)).is_empty());
    assert_eq!(names(&apply(&mut u, ack(5, false))), ["m5"]);
    assert!(u.is_empty());
    assert_eq!(u.oldest(), None);
    // Tags go on from where they were.
    u.push(6, "m6".into());
    assert_eq!(names(&apply(&mut u, ack(6, false))), ["m6"]);
}

#[test]
fn a_nack_is_never_delivered() {
    let mut u = published(3);
    let got = apply(
        &mut u,
        Event::Nack {
            tag: 2,
            multiple: true,
        },
    );
    assert_eq!(names(&got), ["m1", "m2"]);
    for (m, r) in &got {
        assert_eq!(r.as_ref().unwrap_err(), &format!("broker nacked event {m}"));
    }
    assert_eq!(u.len(), 1);
}

#[test]
fn a_returned_message_is_matched_by_id_and_its_ack_is_a_failure() {
    let mut u = published(3);
    assert!(apply(&mut u, returned("m2")).is_empty());
    let got = apply(&mut u, ack(3, true));
    assert_eq!(names(&got), ["m1", "m2", "m3"]);
    assert!(got[0].1.is_ok() && got[2].1.is_ok());
    let err = got[1].1.as_ref().unwrap_err();
    assert!(err.contains("event m2 is unroutable"), "{err}");
    assert!(err.contains("NO_ROUTE"), "{err}");
}

#[test]
fn a_return_for_no_waiting_message_ends_the_session() {
    let mut u = published(2);
    let mut out = Vec::new();
    let e = u.apply(returned("m9"), some, dest, &mut out).unwrap_err();
    assert!(e.is_transient(), "{e}");
    assert!(e.to_string().contains("m9"), "{e}");
}

#[test]
fn a_return_marks_every_copy_it_may_be_for() {
    // Two copies of one message to the same place, one returned: which
    // one is unknown, so both count as returned (the routed one is
    // published again: a duplicate, never a loss).
    let mut u = Unconfirmed::default();
    for (tag, m) in [(1, "a"), (2, "dup"), (3, "dup")] {
        u.push(tag, m.to_owned());
    }
    assert!(apply(&mut u, returned("dup")).is_empty());
    let got = apply(&mut u, ack(3, true));
    assert_eq!(names(&got), ["a", "dup", "dup"]);
    assert!(
        got[0].1.is_ok() && got[1].1.is_err() && got[2].1.is_err(),
        "{got:?}"
    );
    // A return for an id whose messages are all returned: nothing new.
    let mut u = published(1);
    assert!(apply(&mut u, returned("m1")).is_empty());
    assert!(apply(&mut u, returned("m1")).is_empty());
}

/// A routable message sharing its id with an unroutable one (another
/// routing key) is not taken for the returned one.
#[test]
fn a_routable_copy_with_the_same_id_is_not_returned() {
    let mut u: Unconfirmed<(String, String)> = Unconfirmed::default();
    u.push(1, ("dup".into(), "ok.key".into()));
    u.push(2, ("dup".into(), "lost.key".into()));
    let mut ret = returned("dup");
    if let Event::Returned(r) = &mut ret {
        r.routing_key = "lost.key".into();
    }
    let id = |m: &(String, String)| Some(m.0.clone());
    let to = |m: &(String, String)| ("ex".to_owned(), m.1.clone());
    let mut out = Vec::new();
    u.apply(ret, id, to, &mut out).unwrap();
    u.apply(ack(2, true), id, to, &mut out).unwrap();
    assert!(out[0].1.is_ok(), "the routable copy: {:?}", out[0].1);
    assert!(
        matches!(out[1].1, Err(SinkError::Returned { .. })),
        "{:?}",
        out[1].1
    );
}

#[test]
fn a_return_without_message_id_matches_messages_without_one() {
    let mut u: Unconfirmed<Option<String>> = Unconfirmed::default();
    u.push(1, Some("a".into()));
    u.push(2, None);
    let mut ret = returned("x");
    if let Event::Returned(r) = &mut ret {
        r.message_id = None;
    }
    let mut out = Vec::new();
    let to = |_: &Option<String>| ("ex".to_owned(), "rk".to_owned());
    u.apply(ret, Option::clone, to, &mut out).unwrap();
    u.apply(ack(2, true), Option::clone, to, &mut out).unwrap();
    assert!(out[0].1.is_ok());
    assert!(
        matches!(out[1].1, Err(SinkError::Returned { .. })),
        "{:?}",
        out[1].1
    );
}

#[test]
fn an_answer_for_a_tag_never_published_ends_the_session() {
    for multiple in [false, true] {
        let mut u = published(3);
        let mut out = Vec::new();
        let e = u.apply(ack(9, multiple), some, dest, &mut out).unwrap_err();
        assert!(e.to_string().contains("delivery tag 9"), "{e}");
        assert!(out.is_empty(), "nothing settled");
        assert_eq!(u.len(), 3);
    }
    // tag 0 with `multiple`: everything published so far.
    let mut u = published(3);
    assert_eq!(names(&apply(&mut u, ack(0, true))), ["m1", "m2", "m3"]);
}
