//! An idempotent consumer: the other half of the outbox pattern, and the
//! reference for README's "Consuming".
//!
//! The relay delivers every event at least once, with the outbox row's id
//! as the AMQP `message_id`. This consumer turns that into exactly one
//! business effect: for each message it opens a transaction, inserts the
//! inbox row (`sql/inbox.sql`: consumer + event id, unique), applies the
//! business change, commits, and only then acks. A redelivered message
//! fails the inbox insert with a unique violation: it was handled, so it is
//! acked without being applied again (and counted as a duplicate). Because
//! the inbox row and the change commit together, no crash can leave one
//! without the other.
//!
//! Manual acks, a bounded prefetch, messages it cannot use (no message id,
//! a JSON body that does not parse) rejected without requeue (to the queue's
//! dead-letter exchange, if it has one), and reconnects to the broker and
//! the database. `GET /metrics` on `--metrics` gives the counters.
//!
//! ```sh
//! cargo run --example consumer -- --amqp amqp://guest:guest@127.0.0.1:5672/%2f \
//!     --queue orders --pg postgres://app@127.0.0.1/app --consumer billing
//! ```
//!
//! **N workers, each aggregate in order** (README, "Consuming in
//! parallel"): `--partitions N --exchange E` declares a consistent-hash
//! exchange `<queue>.partitions` (plugin `rabbitmq_consistent_hash_exchange`)
//! bound to the relay's exchange `E` with `--binding-key` (default `#`),
//! hashing on the `aggregate_id` header, and N queues `<queue>.0` ..
//! `<queue>.<N-1>` bound to it with weight 1, each with
//! `x-single-active-consumer`; then runs one worker per queue. One
//! aggregate's events all go to one queue, read by one consumer at a time:
//! a second process started the same way stands by and takes a queue over
//! only when the active one goes. Across queues, nothing is ordered.
//! Changing N moves aggregates between queues, and a smaller N leaves the
//! queues above it bound with nobody reading them: stop the relay's flow,
//! drain every queue, delete `<queue>.partitions` and the queues, then
//! start with the new N.
//!
//! The business change here is an insert into `consumer_effects`
//! (`examples/consumer_effects.sql`, made if missing), one row per applied
//! event, numbered in the order applied: the tests read those rows.
//! `CONSUMER_EXIT_AFTER=apply|commit` with `CONSUMER_EXIT_EVENT=<id>` makes
//! the process die at that point of that event (abort: no ack, no commit
//! unless done), for the crash-window tests.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures_util::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions, BasicRejectOptions};
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_postgres::NoTls;

#[derive(Default)]
struct Counters {
    applied: AtomicU64,
    duplicates: AtomicU64,
    rejected: AtomicU64,
    reconnects: AtomicU64,
}

struct Args {
    amqp: String,
    queue: String,
    pg: String,
    consumer: String,
    prefetch: u16,
    metrics: Option<String>,
    /// Workers, each on a queue of its own (0: one worker on `queue`).
    partitions: u16,
    exchange: String,
    binding_key: String,
}

fn args() -> Result<Args, String> {
    let mut a = Args {
        amqp: String::new(),
        queue: String::new(),
        pg: String::new(),
        consumer: "consumer".into(),
        prefetch: 32,
        metrics: None,
        partitions: 0,
        exchange: String::new(),
        binding_key: "#".into(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut v = || it.next().ok_or_else(|| format!("{k} needs a value"));
        match k.as_str() {
            "--amqp" => a.amqp = v()?,
            "--queue" => a.queue = v()?,
            "--pg" => a.pg = v()?,
            "--consumer" => a.consumer = v()?,
            "--prefetch" => a.prefetch = v()?.parse().map_err(|e| format!("--prefetch: {e}"))?,
            "--metrics" => a.metrics = Some(v()?),
            "--partitions" => {
                a.partitions = v()?.parse().map_err(|e| format!("--partitions: {e}"))?
            }
            "--exchange" => a.exchange = v()?,
            "--binding-key" => a.binding_key = v()?,
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if a.amqp.is_empty() || a.queue.is_empty() || a.pg.is_empty() {
        return Err(
            "usage: consumer --amqp URL --queue Q --pg URL [--consumer NAME] \
                    [--prefetch N] [--metrics HOST:PORT] \
                    [--partitions N --exchange E [--binding-key K]]"
                .into(),
        );
    }
    if a.partitions > 0 && a.exchange.is_empty() {
        return Err("--partitions needs --exchange (the relay's exchange)".into());
    }
    Ok(a)
}

#[tokio::main]
async fn main() {
    let a = match args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("consumer: {e}");
            std::process::exit(2);
        }
    };
    let counters = Arc::new(Counters::default());
    if let Some(addr) = a.metrics.clone() {
        tokio::spawn(serve_metrics(addr, Arc::clone(&counters)));
    }
    let queues: Vec<String> = if a.partitions == 0 {
        vec![a.queue.clone()]
    } else {
        loop {
            match declare_partitions(&a).await {
                Ok(queues) => break queues,
                Err(e) => eprintln!(
                    "consumer: declaring the partitions: {}; again",
                    redacted(&a, &e)
                ),
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    };
    let a = Arc::new(a);
    let workers: Vec<_> = queues
        .into_iter()
        .map(|queue| {
            let (a, counters) = (Arc::clone(&a), Arc::clone(&counters));
            tokio::spawn(async move {
                loop {
                    if let Err(e) = consume(&a, &queue, &counters).await {
                        eprintln!("consumer: {queue}: {}; reconnecting", redacted(&a, &e));
                    }
                    counters.reconnects.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            })
        })
        .collect();
    futures_util::future::join_all(workers).await;
}

/// `msg` without the URLs' passwords (a client's error may quote a URL it
/// could not parse whole).
fn redacted(a: &Args, msg: &str) -> String {
    let mut m = msg.to_owned();
    for (url, name) in [(&a.amqp, "<--amqp URL>"), (&a.pg, "<--pg URL>")] {
        if !url.is_empty() {
            m = m.replace(url.as_str(), name);
        }
        // However the URL is written: between the last ':' before '@', and '@'.
        let password = (url.rsplit_once('@'))
            .and_then(|(userinfo, _)| userinfo.rsplit_once(':'))
            .map(|(_, p)| p)
            .filter(|p| !p.is_empty() && !p.starts_with('/'));
        if let Some(p) = password {
            m = m.replace(p, "***");
        }
    }
    m
}

/// The consistent-hash exchange and its N single-active-consumer queues
/// (see the top of this file); returns the queues' names.
async fn declare_partitions(a: &Args) -> Result<Vec<String>, String> {
    use lapin::options::QueueDeclareOptions;
    use lapin::options::{ExchangeBindOptions, ExchangeDeclareOptions, QueueBindOptions};
    use lapin::types::AMQPValue;
    let mq = Connection::connect(&a.amqp, ConnectionProperties::default())
        .await
        .map_err(|e| format!("RabbitMQ: {e}"))?;
    let ch = mq.create_channel().await.map_err(|e| e.to_string())?;
    let hash = format!("{}.partitions", a.queue);
    let mut args = FieldTable::default();
    args.insert(
        "hash-header".into(),
        AMQPValue::LongString("aggregate_id".into()),
    );
    let durable = ExchangeDeclareOptions {
        durable: true,
        ..Default::default()
    };
    ch.exchange_declare(
        hash.as_str().into(),
        lapin::ExchangeKind::Custom("x-consistent-hash".into()),
        durable,
        args,
    )
    .await
    .map_err(|e| format!("{e} (is plugin rabbitmq_consistent_hash_exchange enabled?)"))?;
    ch.exchange_bind(
        hash.as_str().into(),
        a.exchange.as_str().into(),
        a.binding_key.as_str().into(),
        ExchangeBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .map_err(|e| e.to_string())?;
    let mut queues = Vec::new();
    for i in 0..a.partitions {
        let q = format!("{}.{i}", a.queue);
        let mut args = FieldTable::default();
        args.insert("x-single-active-consumer".into(), AMQPValue::Boolean(true));
        let durable = QueueDeclareOptions {
            durable: true,
            ..Default::default()
        };
        ch.queue_declare(q.as_str().into(), durable, args)
            .await
            .map_err(|e| e.to_string())?;
        // The routing key of a consistent-hash binding is its weight.
        ch.queue_bind(
            q.as_str().into(),
            hash.as_str().into(),
            "1".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(|e| e.to_string())?;
        queues.push(q);
    }
    let _ = mq.close(200, "declared".into()).await;
    Ok(queues)
}

/// One connection to each server, consuming `queue` until either fails.
async fn consume(a: &Args, queue: &str, c: &Counters) -> Result<(), String> {
    let (mut db, conn) = tokio_postgres::connect(&a.pg, NoTls)
        .await
        .map_err(|e| format!("PostgreSQL: {e}"))?;
    tokio::spawn(conn);
    db.batch_execute(include_str!("consumer_effects.sql"))
        .await
        .map_err(|e| format!("PostgreSQL: {e}"))?;
    let mq = Connection::connect(&a.amqp, ConnectionProperties::default())
        .await
        .map_err(|e| format!("RabbitMQ: {e}"))?;
    let ch = mq.create_channel().await.map_err(|e| e.to_string())?;
    // At most this many unacked messages: memory and redeliveries bounded.
    ch.basic_qos(a.prefetch, BasicQosOptions::default())
        .await
        .map_err(|e| e.to_string())?;
    let mut deliveries = ch
        .basic_consume(
            queue.into(),
            a.consumer.as_str().into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(|e| e.to_string())?;
    eprintln!("consumer: consuming {queue}");
    while let Some(d) = deliveries.next().await {
        let d = d.map_err(|e| format!("RabbitMQ: {e}"))?;
        let id = d.properties.message_id().as_ref().map(|s| s.to_string());
        // A JSON payload must parse; text and bytea payloads are taken as
        // they come.
        let json = d
            .properties
            .content_type()
            .as_ref()
            .is_some_and(|t| t.as_str() == "application/json");
        let usable = !json || serde_json::from_slice::<serde_json::Value>(&d.data).is_ok();
        let (Some(id), true) = (id, usable) else {
            // Cannot be handled, now or ever: not requeued.
            c.rejected.fetch_add(1, Ordering::Relaxed);
            d.acker
                .reject(BasicRejectOptions { requeue: false })
                .await
                .map_err(|e| e.to_string())?;
            continue;
        };
        let aggregate = d
            .properties
            .headers()
            .as_ref()
            .and_then(|h| h.inner().get("aggregate_id").cloned())
            .map(|v| match v {
                lapin::types::AMQPValue::LongString(s) => s.to_string(),
                other => format!("{other:?}"),
            });
        let tx = db
            .transaction()
            .await
            .map_err(|e| format!("PostgreSQL: {e}"))?;
        let inbox = tx
            .execute(
                "INSERT INTO consumed_events (consumer, event_id) VALUES ($1, $2)",
                &[&a.consumer, &id],
            )
            .await;
        match inbox {
            Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::UNIQUE_VIOLATION) => {
                // Handled before (the broker or the relay sent it again).
                drop(tx);
                c.duplicates.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => return Err(format!("PostgreSQL: {e}")),
            Ok(_) => {
                tx.execute(
                    "INSERT INTO consumer_effects (event_id, aggregate_id, queue) VALUES ($1, $2, $3)",
                    &[&id, &aggregate, &queue],
                )
                .await
                .map_err(|e| format!("PostgreSQL: {e}"))?;
                exit_here("apply", &id);
                tx.commit().await.map_err(|e| format!("PostgreSQL: {e}"))?;
                c.applied.fetch_add(1, Ordering::Relaxed);
                exit_here("commit", &id);
            }
        }
        // Only now: a crash before this point gets the message redelivered.
        d.acker
            .ack(BasicAckOptions::default())
            .await
            .map_err(|e| format!("RabbitMQ: {e}"))?;
    }
    Err("the consumer was cancelled".into())
}

/// For the crash-window tests: dies (no ack, nothing more committed) after
/// `point` of the event the environment names.
fn exit_here(point: &str, id: &str) {
    let at = std::env::var("CONSUMER_EXIT_AFTER").unwrap_or_default();
    let event = std::env::var("CONSUMER_EXIT_EVENT").unwrap_or_default();
    if at == point && event == id {
        eprintln!("consumer: dying after {point} of {id}");
        std::process::abort();
    }
}

/// `GET /metrics`: the counters in Prometheus text format.
async fn serve_metrics(addr: String, c: Arc<Counters>) {
    let listener = match tokio::net::TcpListener::bind(&addr).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("consumer: --metrics {addr}: {e}");
            return;
        }
    };
    while let Ok((mut s, _)) = listener.accept().await {
        let mut buf = [0u8; 1024];
        let _ = tokio::time::timeout(Duration::from_secs(2), s.read(&mut buf)).await;
        let body = format!(
            "# TYPE consumer_applied_total counter\nconsumer_applied_total {}\n\
             # TYPE consumer_duplicates_total counter\nconsumer_duplicates_total {}\n\
             # TYPE consumer_rejected_total counter\nconsumer_rejected_total {}\n\
             # TYPE consumer_reconnects_total counter\nconsumer_reconnects_total {}\n",
            c.applied.load(Ordering::Relaxed),
            c.duplicates.load(Ordering::Relaxed),
            c.rejected.load(Ordering::Relaxed),
            c.reconnects.load(Ordering::Relaxed),
        );
        let reply = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: text/plain; version=0.0.4\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        );
        let _ = s.write_all(reply.as_bytes()).await;
    }
}
