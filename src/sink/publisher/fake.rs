//! The publishing policy in process, against a recording fake of the
//! broker ([`Broker`]): what it publishes, in which order, and what it
//! reports, for answers and faults the test scripts. What only the wire can
//! show (frames, the handshake, closes) stays with the scripted TCP broker
//! (`wire/scripted.rs`).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use crate::checkpoint::Progress;
use crate::config::Config;
use crate::handoff::{ByteBudget, Item};
use crate::lsn::Lsn;
use crate::message::{Envelope, MessageView};
use crate::outbox::{Mapping, OutboxEvent};
use crate::pgoutput::{Column, ColumnValue, Relation, TupleData};
use crate::sink::publisher::{self, Publishing};
use crate::sink::refusals::Refusals;
use crate::sink::wire::{Event, Returned};
use crate::sink::{Broker, SinkError};

/// What the fake answers one publish with. The script sees each publish:
/// its message id, the exchange it goes to, and how many times that id was
/// published before.
type Script = Box<dyn FnMut(&str, &str, usize) -> Answer + Send>;

/// The fake's answer to one publish.
enum Answer {
    Ack,
    Nack,
    /// `basic.return` (312 NO_ROUTE), then its ack, as the broker does.
    Return,
    /// No answer (yet): the window stays taken.
    Silent,
    /// The connection is lost once the answers before it are read.
    Lose,
}

/// Records every publish; answers as the script says.
struct Fake {
    /// Message ids in the order published (a retry appears again).
    published: Vec<String>,
    /// The exchange of each, in the same order.
    exchanges: Vec<String>,
    answers: VecDeque<Result<Event, SinkError>>,
    /// When each of `answers` arrives, with a [`Fake::latency`]: the
    /// channel's waker is woken then, as a socket's would be.
    arrives: VecDeque<tokio::time::Instant>,
    /// Zero: each answer is there at once, without a wake.
    latency: Duration,
    /// Set to when the next answer arrives. The fake's own, as a
    /// connection's socket and heartbeat timer are: what it registered
    /// stays when an answer's future is dropped.
    timer: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
    script: Script,
    next_tag: u64,
}

impl Fake {
    fn new(script: Script) -> Fake {
        Fake {
            published: Vec::new(),
            exchanges: Vec::new(),
            answers: VecDeque::new(),
            arrives: VecDeque::new(),
            latency: Duration::ZERO,
            timer: None,
            script,
            next_tag: 1,
        }
    }

    /// Answers that arrive `latency` after their publish, each announced
    /// by a wake (a timer's), as the broker's come.
    fn late(script: Script, latency: Duration) -> Fake {
        Fake {
            latency,
            timer: Some(Box::pin(tokio::time::sleep(Duration::ZERO))),
            ..Fake::new(script)
        }
    }

    fn record(&mut self, id: &str, exchange: String, routing_key: String) -> u64 {
        let before = self.published.iter().filter(|p| *p == id).count();
        self.published.push(id.to_owned());
        let tag = self.next_tag;
        self.next_tag += 1;
        let answered = self.answers.len();
        let ack = Event::Ack {
            tag,
            multiple: false,
        };
        match (self.script)(id, &exchange, before) {
            Answer::Ack => self.answers.push_back(Ok(ack)),
            Answer::Nack => self.answers.push_back(Ok(Event::Nack {
                tag,
                multiple: false,
            })),
            Answer::Return => {
                self.answers.push_back(Ok(Event::Returned(Returned {
                    reply_code: 312,
                    reply_text: "NO_ROUTE".into(),
                    exchange: exchange.clone(),
                    routing_key,
                    message_id: Some(id.to_owned()),
                })));
                self.answers.push_back(Ok(ack));
            }
            Answer::Silent => {}
            Answer::Lose => self.answers.push_back(Err(SinkError::Disconnected)),
        }
        let at = tokio::time::Instant::now() + self.latency;
        (self.arrives).extend((answered..self.answers.len()).map(|_| at));
        self.exchanges.push(exchange);
        tag
    }

    /// The exchanges `id` was published to, in order.
    fn sent_to(&self, id: &str) -> Vec<&str> {
        (self.published.iter().zip(&self.exchanges))
            .filter(|(p, _)| *p == id)
            .map(|(_, x)| x.as_str())
            .collect()
    }
}

impl Broker for Fake {
    fn publish(&mut self, env: Envelope) -> Result<u64, SinkError> {
        let id = env.properties.message_id().clone().map(|s| s.to_string());
        let (exchange, key) = (env.exchange.to_string(), env.routing_key.to_string());
        Ok(self.record(&id.unwrap_or_default(), exchange, key))
    }
    fn publish_view(&mut self, m: &MessageView<'_>) -> Result<u64, SinkError> {
        let exchange = m.exchange.parts().concat();
        let key = m.routing_key.parts().concat();
        Ok(self.record(m.message_id, exchange, key))
    }
    fn look_for(&mut self, _exchange: &str) -> Result<(), SinkError> {
        unreachable!("the tests' exchange is literal")
    }
    async fn answer(&mut self) -> Result<Event, SinkError> {
        if let (Some(timer), Some(&at)) = (&mut self.timer, self.arrives.front()) {
            if timer.deadline() != at {
                timer.as_mut().reset(at);
            }
            // Cancel-safe: taken only once it is due.
            timer.as_mut().await;
        }
        self.arrives.pop_front();
        match self.answers.pop_front() {
            Some(ev) => ev,
            None => std::future::pending().await,
        }
    }
    async fn reopen(&mut self) -> Result<(), SinkError> {
        Ok(())
    }
    fn is_blocked(&self) -> bool {
        false
    }
    fn publishing_open(&self) -> bool {
        true
    }
    fn wants_flush(&self) -> bool {
        false
    }
    fn frame_max(&self) -> u32 {
        131_072
    }
}

fn config(window: usize) -> Config {
    config_with(window, "")
}

/// [`config`], with more `[rabbitmq]` settings.
fn config_with(window: usize, rabbitmq: &str) -> Config {
    let toml = format!(
        "[postgres]\nurl = \"postgres://u@h/db\"\n[outbox]\ntable = \"public.outbox\"\n\
         [rabbitmq]\nurl = \"amqp://u:p@127.0.0.1:1/v\"\nexchange = \"ex\"\nwindow = {window}\n\
         {rabbitmq}"
    );
    Config::from_toml(&toml, "test.toml", Vec::new()).unwrap()
}

/// One transaction of `ids`, ending at LSN 100, all of one aggregate.
fn transaction(cfg: &Config, ids: &[&str]) -> Vec<Item> {
    let events: Vec<(&str, &str)> = ids.iter().map(|id| (*id, "1")).collect();
    transaction_of(cfg, &events, 100)
}

/// One transaction of `(id, aggregate_id)` events, ending at `end`.
fn transaction_of(cfg: &Config, events: &[(&str, &str)], end: u64) -> Vec<Item> {
    let columns = [
        "id",
        "aggregate_type",
        "aggregate_id",
        "event_type",
        "payload",
    ];
    let rel = Relation {
        id: 1,
        namespace: "public".into(),
        name: "outbox".into(),
        replica_identity: b'd',
        columns: (columns.iter())
            .map(|n| Column {
                flags: 0,
                name: (*n).into(),
                type_oid: 25,
                type_modifier: -1,
            })
            .collect(),
    };
    let mapping = Mapping::new(&rel, &cfg.outboxes[0]).map(Arc::new);
    let text = |v: &str| ColumnValue::Text(bytes::Bytes::from(v.to_owned()));
    let mut items = vec![Item::Begin { commit_time_us: 0 }];
    for (id, aggregate) in events {
        items.push(Item::Event(OutboxEvent {
            tuple: TupleData(
                vec![text(id), text("a"), text(aggregate), text("e"), text("{}")].into(),
            ),
            mapping: mapping.clone(),
            commit_time_us: 0,
            outbox: 0,
        }));
    }
    items.push(Item::Commit { end_lsn: Lsn(end) });
    items
}

/// Runs the publisher over `items` against `fake` until the input is
/// drained (or `within` passes); the fake, the position reported, and
/// how the run ended (`None`: it had not by `within`).
async fn publish(
    cfg: &Config,
    items: Vec<Item>,
    fake: Fake,
    within: Duration,
) -> (Fake, Lsn, Option<Result<(), publisher::Failed>>) {
    publish_learnt(cfg, items, fake, within, Refusals::default()).await
}

/// [`publish`], after earlier sessions learnt `refusals`.
async fn publish_learnt(
    cfg: &Config,
    items: Vec<Item>,
    fake: Fake,
    within: Duration,
    refusals: Refusals,
) -> (Fake, Lsn, Option<Result<(), publisher::Failed>>) {
    let (mut fakes, lsn, r) = publish_on(cfg, items, vec![fake], within, refusals).await;
    (fakes.remove(0), lsn, r)
}

/// [`publish_learnt`] on several publishing channels, one fake each.
async fn publish_on(
    cfg: &Config,
    items: Vec<Item>,
    mut fakes: Vec<Fake>,
    within: Duration,
    mut refusals: Refusals,
) -> (Vec<Fake>, Lsn, Option<Result<(), publisher::Failed>>) {
    let (tx, rx) = mpsc::channel(items.len().max(1));
    for item in items {
        tx.try_send(item).unwrap();
    }
    drop(tx);
    let (wm, wm_rx) = watch::channel(Progress {
        lsn: Lsn(1),
        commit_time_us: None,
    });
    let budget = ByteBudget::default();
    let metrics = crate::metrics::Metrics::new();
    let stop = CancellationToken::new();
    let dead_letters = cfg.dead_letters();
    let run = publisher::run(
        &mut fakes,
        rx,
        &wm,
        Publishing {
            cfg: &cfg.rabbitmq,
            dead_letters: &dead_letters,
            refusals: &mut refusals,
            budget: &budget,
            start: Lsn(1),
            metrics: &metrics,
        },
        &stop,
    );
    let r = tokio::time::timeout(within, run).await.ok();
    let lsn = wm_rx.borrow().lsn;
    (fakes, lsn, r)
}

/// The run ended by itself, without an error.
fn finished_ok(r: Option<Result<(), publisher::Failed>>) {
    match r {
        Some(Ok(())) => {}
        Some(Err(f)) => panic!("the run failed: {}", f.error),
        None => panic!("the run had not ended"),
    }
}

/// A nacked message is published again (after its delay), and the
/// transaction is reported only once every message of it is confirmed.
#[tokio::test(start_paused = true)]
async fn a_nacked_message_is_published_again_and_its_transaction_waits_for_it() {
    let cfg = config(16);
    let fake = Fake::new(Box::new(|id, _, before| match (id, before) {
        ("m1", 0) => Answer::Nack,
        _ => Answer::Ack,
    }));
    let items = transaction(&cfg, &["m0", "m1", "m2"]);
    let (fake, lsn, r) = publish(&cfg, items, fake, Duration::from_secs(60)).await;
    finished_ok(r);
    assert_eq!(fake.published, ["m0", "m1", "m2", "m1"]);
    assert_eq!(lsn, Lsn(100), "the transaction is confirmed");

    // Nacked for ever: dead-lettered at last? No dead-letter exchange is
    // configured, so the relay stops naming the setting, and reports
    // nothing of the transaction.
    let fake = Fake::new(Box::new(|id, _, _| match id {
        "m1" => Answer::Nack,
        _ => Answer::Ack,
    }));
    let items = transaction(&cfg, &["m0", "m1", "m2"]);
    let (fake, lsn, r) = publish(&cfg, items, fake, Duration::from_secs(3600)).await;
    let e = r
        .expect("the run ends")
        .expect_err("a message nacked for ever stops the publisher")
        .error;
    assert!(e.to_string().contains("dead_letter_exchange"), "{e}");
    assert!(fake.published.iter().filter(|p| *p == "m1").count() > 1);
    assert_eq!(lsn, Lsn(1), "nothing of the transaction is reported");
}

/// No more than `window` messages wait for an answer: a broker that does
/// not answer gets no more, and nothing is reported.
#[tokio::test(start_paused = true)]
async fn the_window_bounds_what_waits_for_an_answer() {
    let cfg = config(2);
    let fake = Fake::new(Box::new(|_, _, _| Answer::Silent));
    let items = transaction(&cfg, &["m0", "m1", "m2", "m3"]);
    let (fake, lsn, r) = publish(&cfg, items, fake, Duration::from_millis(500)).await;
    assert!(r.is_none(), "the run waits for answers");
    assert_eq!(fake.published, ["m0", "m1"]);
    assert_eq!(lsn, Lsn(1));
}

/// A message the broker returns (no queue bound) is published again until
/// `rabbitmq.unroutable_retries` attempts, then to the dead-letter
/// exchange; its transaction is reported once the dead letter is
/// confirmed, and the messages around it go once each.
#[tokio::test(start_paused = true)]
async fn a_returned_message_is_published_again_then_dead_lettered() {
    let cfg = config_with(
        16,
        "dead_letter_exchange = \"dlx\"\nunroutable_retries = 3\n",
    );
    let fake = Fake::new(Box::new(|id, exchange, _| match (id, exchange) {
        ("m1", "ex") => Answer::Return,
        _ => Answer::Ack,
    }));
    let items = transaction(&cfg, &["m0", "m1", "m2"]);
    let (fake, lsn, r) = publish(&cfg, items, fake, Duration::from_secs(600)).await;
    finished_ok(r);
    assert_eq!(fake.sent_to("m1"), ["ex", "ex", "ex", "dlx"]);
    assert_eq!(fake.sent_to("m0"), ["ex"]);
    assert_eq!(fake.sent_to("m2"), ["ex"]);
    assert_eq!(lsn, Lsn(100), "the transaction is confirmed");

    // Its dead letter returned too: the relay stops rather than lose it,
    // and reports nothing of the transaction.
    let fake = Fake::new(Box::new(|id, _, _| match id {
        "m1" => Answer::Return,
        _ => Answer::Ack,
    }));
    let items = transaction(&cfg, &["m0", "m1", "m2"]);
    let (fake, lsn, r) = publish(&cfg, items, fake, Duration::from_secs(600)).await;
    let e = r
        .expect("the run ends")
        .expect_err("a returned dead letter stops the publisher")
        .error;
    assert!(
        matches!(
            &e,
            publisher::PublishError::Sink(SinkError::DeadLetterRefused { .. })
        ),
        "{e}"
    );
    assert_eq!(fake.sent_to("m1").last(), Some(&"dlx"));
    assert_eq!(lsn, Lsn(1), "nothing of the transaction is reported");
}

/// A dead letter nacked (its queue full, `x-overflow = reject-publish`)
/// as often as a message is before it is dead-lettered, and more: it is
/// published again until the broker takes it, with the transaction
/// reported only then; the relay does not stop.
#[tokio::test(start_paused = true)]
async fn a_nacked_dead_letter_waits_for_its_queue() {
    let cfg = config_with(16, "dead_letter_exchange = \"dlx\"\n");
    let mut dead_letter_nacks = 0;
    let fake = Fake::new(Box::new(move |id, exchange, _| match (id, exchange) {
        ("m1", "ex") => Answer::Nack,
        ("m1", "dlx") if dead_letter_nacks < 25 => {
            dead_letter_nacks += 1;
            Answer::Nack
        }
        _ => Answer::Ack,
    }));
    let items = transaction(&cfg, &["m0", "m1", "m2"]);
    let (fake, lsn, r) = publish(&cfg, items, fake, Duration::from_secs(3600)).await;
    finished_ok(r);
    let to = fake.sent_to("m1");
    assert_eq!(to.iter().filter(|e| **e == "dlx").count(), 26, "{to:?}");
    assert_eq!(lsn, Lsn(100), "the transaction is confirmed");
}

/// An event earlier sessions learnt the broker refuses (poison) goes
/// straight to the dead-letter exchange, never to its own; without one the
/// relay stops naming the setting, before publishing it anywhere.
#[tokio::test(start_paused = true)]
async fn a_learnt_poison_event_is_dead_lettered_at_once() {
    let poisoned = || {
        let mut r = Refusals::default();
        r.poison.insert("m1".into(), "refused by the broker".into());
        r
    };
    let cfg = config_with(16, "dead_letter_exchange = \"dlx\"\n");
    let fake = Fake::new(Box::new(|_, _, _| Answer::Ack));
    let items = transaction(&cfg, &["m0", "m1", "m2"]);
    let (fake, lsn, r) =
        publish_learnt(&cfg, items, fake, Duration::from_secs(60), poisoned()).await;
    finished_ok(r);
    assert_eq!(fake.sent_to("m1"), ["dlx"]);
    assert_eq!(fake.published, ["m0", "m1", "m2"]);
    assert_eq!(lsn, Lsn(100));

    let cfg = config(16);
    let fake = Fake::new(Box::new(|_, _, _| Answer::Ack));
    let items = transaction(&cfg, &["m0", "m1", "m2"]);
    let (fake, lsn, r) =
        publish_learnt(&cfg, items, fake, Duration::from_secs(60), poisoned()).await;
    let e = r
        .expect("the run ends")
        .expect_err("poison without a dead-letter exchange stops")
        .error;
    assert!(e.to_string().contains("dead_letter_exchange"), "{e}");
    assert!(fake.sent_to("m1").is_empty(), "{:?}", fake.published);
    assert_eq!(lsn, Lsn(1));
}

/// After a session ended on a refusal it could not pin on one message,
/// the next publishes its first `careful_for` messages each with nothing
/// else unanswered, so that a refusal names the right one; then the full
/// window again.
#[tokio::test(start_paused = true)]
async fn after_an_unexplained_refusal_messages_go_one_at_a_time() {
    let cfg = config(16);
    let ids = ["m0", "m1", "m2", "m3", "m4"];
    // Answers the first `acked` messages; the rest stay unanswered.
    let run = |acked: usize| {
        let cfg = &cfg;
        async move {
            let fake = Fake::new(Box::new(move |id, _, _| {
                if ids[..acked].contains(&id) {
                    Answer::Ack
                } else {
                    Answer::Silent
                }
            }));
            let careful = Refusals {
                careful_for: 3,
                ..Refusals::default()
            };
            let items = transaction(cfg, &ids);
            let (fake, _, r) =
                publish_learnt(cfg, items, fake, Duration::from_millis(500), careful).await;
            assert!(r.is_none(), "the run waits for answers");
            fake.published
        }
    };
    assert_eq!(run(0).await, ["m0"], "one at a time while careful");
    assert_eq!(run(1).await, ["m0", "m1"]);
    assert_eq!(
        run(2).await,
        ["m0", "m1", "m2", "m3", "m4"],
        "careful for three"
    );
}

/// A session that fails returns, with its error, the oldest message still
/// unconfirmed (what the next session blames if the failure comes back),
/// and reports nothing past it.
#[tokio::test(start_paused = true)]
async fn a_failed_session_names_its_oldest_unconfirmed_message() {
    let cfg = config(16);
    let fake = Fake::new(Box::new(|id, _, _| match id {
        "m0" => Answer::Ack,
        "m1" => Answer::Silent,
        _ => Answer::Lose,
    }));
    let mut items = transaction(&cfg, &["m0"]);
    items.extend(transaction(&cfg, &["m1", "m2"]));
    if let Some(Item::Commit { end_lsn }) = items.get_mut(2) {
        *end_lsn = Lsn(50);
    }
    let (_, lsn, r) = publish(&cfg, items, fake, Duration::from_secs(60)).await;
    let failed = r
        .expect("the run ends")
        .expect_err("a lost connection ends the session");
    assert!(matches!(
        failed.error,
        publisher::PublishError::Sink(SinkError::Disconnected)
    ));
    let head = failed.head.expect("the oldest unconfirmed message");
    assert_eq!(head.id, "m1");
    assert!(!head.alone, "published with others");
    assert_eq!(lsn, Lsn(50), "the first transaction only");
}

/// Aggregate ids that land on channels 0 and 1 of two (`lane_of` is a
/// stable hash: found once, the same in every run).
fn two_lanes(cfg: &Config) -> (String, String) {
    let mut found: [Option<String>; 2] = [None, None];
    for i in 0.. {
        let agg = format!("agg-{i}");
        let items = transaction_of(cfg, &[("x", &agg)], 1);
        let Item::Event(ev) = &items[1] else {
            unreachable!()
        };
        let lane = super::lane_of(ev, 2);
        found[lane].get_or_insert(agg);
        if let [Some(a), Some(b)] = &found {
            return (a.clone(), b.clone());
        }
    }
    unreachable!()
}

/// With two channels, each aggregate's events go out on one channel, in
/// commit order, and the events of both are confirmed and reported.
#[tokio::test(start_paused = true)]
async fn two_channels_keep_each_aggregate_on_one_in_commit_order() {
    let cfg = config_with(16, "channels = 2\n");
    let (a, b) = two_lanes(&cfg);
    let mut items = transaction_of(&cfg, &[("a0", &a), ("b0", &b), ("a1", &a)], 100);
    items.extend(transaction_of(
        &cfg,
        &[("b1", &b), ("a2", &a), ("b2", &b)],
        200,
    ));
    let fakes = vec![
        Fake::new(Box::new(|_, _, _| Answer::Ack)),
        Fake::new(Box::new(|_, _, _| Answer::Ack)),
    ];
    let (fakes, lsn, r) = publish_on(
        &cfg,
        items,
        fakes,
        Duration::from_secs(60),
        Refusals::default(),
    )
    .await;
    finished_ok(r);
    assert_eq!(fakes[0].published, ["a0", "a1", "a2"]);
    assert_eq!(fakes[1].published, ["b0", "b1", "b2"]);
    assert_eq!(lsn, Lsn(200));
}

/// Answers that come later, each announced by a wake of its own channel
/// only (a timer's, as a socket's would be): with four channels, every
/// event is confirmed and reported, each channel's in commit order. (The
/// loop looks only at the channels woken or written to: one written to
/// and not looked at again would never be woken, and the run would not
/// end.)
#[tokio::test(start_paused = true)]
async fn answers_that_come_later_wake_their_own_channel() {
    let cfg = config_with(8, "channels = 4\n");
    let mut items = Vec::new();
    let ids: Vec<String> = (0..64).map(|i| format!("e{i}")).collect();
    let aggregates: Vec<String> = (0..64).map(|i| format!("agg-{}", i % 11)).collect();
    for t in 0..16 {
        let events: Vec<(&str, &str)> = (4 * t..4 * t + 4)
            .map(|i| (ids[i].as_str(), aggregates[i].as_str()))
            .collect();
        items.extend(transaction_of(&cfg, &events, 100 * (t as u64 + 1)));
    }
    let mut expected: Vec<Vec<String>> = vec![Vec::new(); 4];
    for item in &items {
        if let Item::Event(ev) = item {
            let id = std::str::from_utf8(ev.value(0).unwrap())
                .unwrap()
                .to_owned();
            expected[super::lane_of(ev, 4)].push(id);
        }
    }
    assert!(
        expected.iter().all(|e| !e.is_empty()),
        "every channel has events: {expected:?}"
    );
    let fakes = (0..4u64)
        .map(|i| {
            let latency = Duration::from_millis(1 + 3 * i);
            Fake::late(Box::new(|_, _, _| Answer::Ack), latency)
        })
        .collect();
    let (fakes, lsn, r) = publish_on(
        &cfg,
        items,
        fakes,
        Duration::from_secs(60),
        Refusals::default(),
    )
    .await;
    finished_ok(r);
    for (fake, expected) in fakes.iter().zip(&expected) {
        assert_eq!(&fake.published, expected);
    }
    assert_eq!(lsn, Lsn(1600));
}

/// One watermark: a channel that does not answer holds the position back
/// at the last transaction before its first unconfirmed message, however
/// much the other channel confirms; a nack on one channel is retried on
/// that channel while the other runs on.
#[tokio::test(start_paused = true)]
async fn a_silent_channel_holds_the_watermark_back() {
    let cfg = config_with(16, "channels = 2\n");
    let (a, b) = two_lanes(&cfg);
    let mut items = transaction_of(&cfg, &[("a0", &a), ("b0", &b)], 100);
    items.extend(transaction_of(&cfg, &[("a1", &a), ("b1", &b)], 200));
    items.extend(transaction_of(&cfg, &[("a2", &a)], 300));
    let fakes = vec![
        Fake::new(Box::new(|_, _, _| Answer::Ack)),
        Fake::new(Box::new(|id, _, before| match (id, before) {
            ("b0", 0) => Answer::Nack,
            ("b1", _) => Answer::Silent,
            _ => Answer::Ack,
        })),
    ];
    let (fakes, lsn, r) = publish_on(
        &cfg,
        items,
        fakes,
        Duration::from_secs(10),
        Refusals::default(),
    )
    .await;
    assert!(r.is_none(), "the run waits for b1's answer");
    assert_eq!(fakes[0].published, ["a0", "a1", "a2"]);
    assert_eq!(
        fakes[1].published,
        ["b0", "b1", "b0"],
        "b0 retried on its channel"
    );
    assert_eq!(lsn, Lsn(100), "not past the transaction of the silent b1");
}
