//! RabbitMQ side: topology, queue depth, the two ways of driving lapin, and a
//! consumer that stamps arrivals.

use std::future::Future;
use std::pin::Pin;
use std::task::Poll;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions,
    QueueBindOptions, QueueDeclareOptions, QueuePurgeOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{
    BasicProperties, Channel, Confirmation, Connection, ConnectionProperties, ExchangeKind,
};

use crate::workload::unix_us;

pub async fn connect(url: &str, name: &str) -> Result<Connection> {
    let props = ConnectionProperties::default().with_connection_name(name.into());
    Connection::connect(url, props)
        .await
        .context("connecting to RabbitMQ")
}

/// A channel in confirm mode.
pub async fn confirm_channel(conn: &Connection) -> Result<Channel> {
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    Ok(ch)
}

/// Durable topic exchange and a durable queue of `queue_type` bound to it
/// with `#` (the queue is deleted first, so it starts empty).
pub async fn declare(
    conn: &Connection,
    exchange: &str,
    queue: &str,
    queue_type: &str,
) -> Result<()> {
    let ch = conn.create_channel().await?;
    ch.exchange_declare(
        exchange.into(),
        ExchangeKind::Topic,
        ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await?;
    fresh_queue(&ch, queue, queue_type).await?;
    ch.queue_bind(
        queue.into(),
        exchange.into(),
        "#".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await?;
    let _ = ch.close(200, "ok".into()).await;
    Ok(())
}

/// A durable queue of `queue_type`, deleted first so that it starts empty
/// and bound to nothing.
async fn fresh_queue(ch: &Channel, queue: &str, queue_type: &str) -> Result<()> {
    ch.queue_delete(queue.into(), Default::default()).await?;
    let mut args = FieldTable::default();
    args.insert(
        ShortString::from("x-queue-type"),
        AMQPValue::LongString(LongString::from(queue_type)),
    );
    ch.queue_declare(
        queue.into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        args,
    )
    .await
    .with_context(|| format!("declaring {queue_type} queue {queue}"))?;
    Ok(())
}

/// The consistent-hash exchange `exchange` (plugin
/// `rabbitmq_consistent_hash_exchange`, hashing the `aggregate_id` header,
/// as README "Consuming in parallel" sets it up) with `queues` durable
/// queues of `queue_type` bound to it, each with weight 1. Exchange and
/// queues are deleted first, so they start empty and bound to nothing else.
pub async fn declare_partitions(
    conn: &Connection,
    exchange: &str,
    queues: &[String],
    queue_type: &str,
) -> Result<()> {
    let ch = conn.create_channel().await?;
    ch.exchange_delete(exchange.into(), Default::default())
        .await?;
    let mut args = FieldTable::default();
    args.insert(
        ShortString::from("hash-header"),
        AMQPValue::LongString(LongString::from("aggregate_id")),
    );
    ch.exchange_declare(
        exchange.into(),
        ExchangeKind::Custom("x-consistent-hash".into()),
        ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        },
        args,
    )
    .await
    .context("declaring a consistent-hash exchange (is plugin rabbitmq_consistent_hash_exchange enabled?)")?;
    for q in queues {
        fresh_queue(&ch, q, queue_type).await?;
        // The routing key of a consistent-hash binding is its weight.
        ch.queue_bind(
            q.as_str().into(),
            exchange.into(),
            "1".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
    }
    let _ = ch.close(200, "ok".into()).await;
    Ok(())
}

/// Deletes `queues` and `exchange` (what a round of the channels sweep
/// declared), so their messages free the broker's memory and disk.
pub async fn delete(conn: &Connection, exchange: &str, queues: &[String]) -> Result<()> {
    let ch = conn.create_channel().await?;
    for q in queues {
        ch.queue_delete(q.as_str().into(), Default::default())
            .await?;
    }
    ch.exchange_delete(exchange.into(), Default::default())
        .await?;
    let _ = ch.close(200, "ok".into()).await;
    Ok(())
}

/// Watches the depth of one or more queues with passive declares (no
/// consumer attached); the depth is their sum.
pub struct DepthProbe {
    conn: Connection,
    ch: Channel,
    queues: Vec<String>,
}

impl DepthProbe {
    pub async fn new(url: &str, queue: &str) -> Result<DepthProbe> {
        Self::over(url, vec![queue.to_owned()]).await
    }

    pub async fn over(url: &str, queues: Vec<String>) -> Result<DepthProbe> {
        let conn = connect(url, "relay-bench depth probe").await?;
        let ch = conn.create_channel().await?;
        Ok(DepthProbe { conn, ch, queues })
    }

    fn name(&self) -> String {
        self.queues.join("+")
    }

    pub async fn depth(&mut self) -> Result<u64> {
        let mut sum = 0;
        for queue in &self.queues {
            let q = self
                .ch
                .queue_declare(
                    queue.as_str().into(),
                    QueueDeclareOptions {
                        passive: true,
                        ..Default::default()
                    },
                    FieldTable::default(),
                )
                .await
                .with_context(|| format!("passive declare of {queue}"))?;
            sum += u64::from(q.message_count());
        }
        Ok(sum)
    }

    pub async fn purge(&mut self) -> Result<()> {
        for queue in &self.queues {
            self.ch
                .queue_purge(queue.as_str().into(), QueuePurgeOptions::default())
                .await?;
        }
        // A purge of a quorum queue is applied through its log: wait until
        // the queues read empty.
        let end = Instant::now() + Duration::from_secs(30);
        while self.depth().await? != 0 {
            if Instant::now() > end {
                bail!("queue {} not empty 30 s after a purge", self.name());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(())
    }

    /// Polls every `every` until the queue holds at least `n` messages.
    /// Returns when the first message was seen and when `n` were.
    pub async fn wait_for(
        &mut self,
        n: u64,
        every: Duration,
        timeout: Duration,
        mut alive: impl FnMut() -> Result<()>,
    ) -> Result<(Instant, Instant)> {
        let end = Instant::now() + timeout;
        let mut first = None;
        loop {
            let d = self.depth().await?;
            let now = Instant::now();
            if d > 0 && first.is_none() {
                first = Some(now);
            }
            if d >= n {
                return Ok((first.unwrap_or(now), now));
            }
            if now > end {
                bail!(
                    "queue {} holds {d} of {n} messages after {timeout:?}",
                    self.name()
                );
            }
            alive()?;
            tokio::time::sleep(every).await;
        }
    }

    pub async fn close(self) {
        let _ = self.conn.close(200, "bye".into()).await;
    }
}

/// How the broker answered a run of publishes.
#[derive(Debug, Default, Clone, Copy)]
pub struct Tally {
    pub acked: u64,
    pub nacked: u64,
    pub returned: u64,
}

impl Tally {
    fn add(&mut self, c: lapin::Result<Confirmation>) -> Result<()> {
        match c.context("waiting for a publisher confirm")? {
            Confirmation::Ack(None) | Confirmation::NotRequested => self.acked += 1,
            Confirmation::Ack(Some(_)) => self.returned += 1,
            Confirmation::Nack(_) => self.nacked += 1,
        }
        Ok(())
    }

    pub fn check(&self) -> Result<()> {
        if self.nacked > 0 || self.returned > 0 {
            bail!(
                "broker nacked {} and returned {} messages",
                self.nacked,
                self.returned
            );
        }
        Ok(())
    }
}

type Confirming = Pin<Box<dyn Future<Output = lapin::Result<Confirmation>> + Send>>;

/// The fast way to drive lapin: each publish future is polled once right
/// away — lapin queues the message's frames on that first poll, so they go
/// out in publish order — and the rest of it (the I/O loop writing the
/// frames, then the broker's confirm) is awaited concurrently with the next
/// publishes, at most `window` at a time.
pub async fn publish_pipelined(
    ch: &Channel,
    exchange: &str,
    routing_key: &str,
    window: usize,
    n: u64,
    mut msg: impl FnMut(u64) -> (Vec<u8>, BasicProperties),
) -> Result<Tally> {
    let mut tally = Tally::default();
    let mut pending: FuturesUnordered<Confirming> = FuturesUnordered::new();
    for i in 0..n {
        while pending.len() >= window {
            if let Some(c) = pending.next().await {
                tally.add(c)?;
            }
        }
        let (body, props) = msg(i);
        let ch = ch.clone();
        let exchange = ShortString::from(exchange);
        let routing_key = ShortString::from(routing_key);
        let mut fut: Confirming = Box::pin(async move {
            let confirm = ch
                .basic_publish(
                    exchange,
                    routing_key,
                    BasicPublishOptions {
                        mandatory: true,
                        ..Default::default()
                    },
                    &body,
                    props,
                )
                .await?;
            confirm.await
        });
        match futures_util::poll!(fut.as_mut()) {
            Poll::Ready(c) => tally.add(c)?,
            Poll::Pending => pending.push(fut),
        }
    }
    while let Some(c) = pending.next().await {
        tally.add(c)?;
    }
    Ok(tally)
}

/// The relay's own client (`outbox_relay::sink::wire`), connected.
pub async fn connect_wire(url: &str, name: &str) -> Result<outbox_relay::sink::wire::Wire> {
    let target = outbox_relay::sink::wire::Target {
        uri: url.parse().map_err(anyhow::Error::msg)?,
        tls: None,
        connection_name: name.into(),
    };
    Ok(outbox_relay::sink::wire::Wire::connect(&target).await?)
}

/// Publishes with the relay's client, driven as the relay drives it: a
/// batch of publishes queued into its write buffer, written in one go
/// while the answers are read; it waits for answers only when the window
/// is full or everything is out. The message's `message_id` must be
/// unique within the window (returns are matched by it).
pub async fn publish_wire(
    wire: &mut outbox_relay::sink::wire::Wire,
    exchange: &str,
    routing_key: &str,
    window: usize,
    n: u64,
    mut msg: impl FnMut(u64) -> (Vec<u8>, BasicProperties),
) -> Result<Tally> {
    use futures_util::FutureExt;
    use outbox_relay::message::Envelope;
    use outbox_relay::sink::{SinkError, Unconfirmed};

    let mut tally = Tally::default();
    let mut pending: Unconfirmed<Option<String>> = Unconfirmed::default();
    let mut settled = Vec::new();
    let mut i = 0;
    while i < n || !pending.is_empty() {
        for _ in 0..256 {
            if i == n || pending.len() >= window || wire.wants_flush() {
                break;
            }
            let (body, properties) = msg(i);
            i += 1;
            let id = properties.message_id().as_ref().map(|m| m.to_string());
            let env = Envelope {
                exchange: exchange.into(),
                routing_key: routing_key.into(),
                body: body.into(),
                properties,
            };
            pending.push(wire.publish(env)?, id);
        }
        // Room for more, and the write buffer not full: take the answers
        // that are there and publish on. Otherwise wait (for answers, or
        // for the buffer to drain: a full socket must be waited on, never
        // polled again at once, or the one-thread runtime never gets to
        // learn that the socket took more).
        let room = i < n && pending.len() < window && !wire.wants_flush();
        let ev = if room {
            match wire.event().now_or_never() {
                Some(ev) => ev?,
                None => continue,
            }
        } else {
            wire.event().await?
        };
        // One destination for every message: a return is matched by id.
        let destination = |_: &Option<String>| (String::new(), String::new());
        pending.apply(ev, Option::clone, destination, &mut settled)?;
        for (_, res) in settled.drain(..) {
            match res {
                Ok(()) => tally.acked += 1,
                Err(SinkError::Nacked { .. }) => tally.nacked += 1,
                Err(SinkError::Returned { .. }) => tally.returned += 1,
                Err(e) => return Err(e.into()),
            }
        }
    }
    Ok(tally)
}

/// The naive way: await each `basic_publish` (lapin's I/O loop writing the
/// frames) before issuing the next; confirms are still awaited concurrently
/// within the window.
pub async fn publish_awaiting_each(
    ch: &Channel,
    exchange: &str,
    routing_key: &str,
    window: usize,
    n: u64,
    mut msg: impl FnMut(u64) -> (Vec<u8>, BasicProperties),
) -> Result<Tally> {
    let mut tally = Tally::default();
    let mut pending = FuturesUnordered::new();
    for i in 0..n {
        while pending.len() >= window {
            if let Some(c) = pending.next().await {
                tally.add(c)?;
            }
        }
        let (body, props) = msg(i);
        let confirm = ch
            .basic_publish(
                exchange.into(),
                routing_key.into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..Default::default()
                },
                &body,
                props,
            )
            .await?;
        pending.push(confirm);
    }
    while let Some(c) = pending.next().await {
        tally.add(c)?;
    }
    Ok(tally)
}

/// Consumes `queue` (no-ack) and sends `(message_id, arrival µs)` for every
/// delivery.
pub async fn consume_stamped(
    conn: &Connection,
    queue: &str,
    tx: tokio::sync::mpsc::UnboundedSender<(String, i64)>,
) -> Result<Channel> {
    let ch = conn.create_channel().await?;
    let mut consumer = ch
        .basic_consume(
            queue.into(),
            "relay-bench-latency".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
    tokio::spawn(async move {
        while let Some(Ok(d)) = consumer.next().await {
            let at = unix_us();
            let id = d
                .properties
                .message_id()
                .as_ref()
                .map(|s| s.to_string())
                .unwrap_or_default();
            if tx.send((id, at)).is_err() {
                break;
            }
        }
    });
    Ok(ch)
}
