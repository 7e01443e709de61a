//! The independent consumer: reads the main queue, the dead-letter queue
//! and the victim queue (which nothing may reach) through broker restarts,
//! acking each delivery once recorded. While paused it stops acking the
//! main queue, which (bounded, with a prefetch) then fills and nacks.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::{AMQPValue, FieldTable};

use crate::common::amqp_url;

/// Which queue a delivery came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum From {
    Main,
    Dead,
    Victim,
}

#[derive(Debug, Clone)]
pub struct Delivery {
    pub from: From,
    pub id: String,
    pub at: Instant,
    /// A row-forged `x-outbox-*` header came through.
    pub forged: bool,
    /// The dead letter's stated reason.
    pub reason: Option<String>,
}

#[derive(Clone, Default)]
pub struct Consumer {
    pub got: Arc<Mutex<Vec<Delivery>>>,
    pub paused: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
}

impl Consumer {
    pub fn start(queues: [(String, From); 3]) -> Consumer {
        let c = Consumer::default();
        for (q, from) in queues {
            let c = c.clone();
            tokio::spawn(async move { c.consume(q, from).await });
        }
        c
    }

    pub fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
    }

    pub fn snapshot(&self) -> Vec<Delivery> {
        self.got.lock().unwrap().clone()
    }

    async fn consume(&self, queue: String, from: From) {
        let mut seen = std::collections::HashSet::new();
        while !self.stop.load(Ordering::SeqCst) {
            let Ok(Ok(conn)) = tokio::time::timeout(
                Duration::from_secs(5),
                lapin::Connection::connect(&amqp_url(), lapin::ConnectionProperties::default()),
            )
            .await
            else {
                tokio::time::sleep(Duration::from_millis(300)).await;
                continue;
            };
            // Each step bounded: a broker restarting under the consumer can
            // leave a channel or a subscription without an answer, and a
            // consumer stuck there would look like events lost.
            let subscribed = tokio::time::timeout(Duration::from_secs(10), async {
                let ch = conn.create_channel().await?;
                let _ = ch.basic_qos(100, BasicQosOptions::default()).await;
                ch.basic_consume(
                    queue.as_str().into(),
                    "checker".into(),
                    BasicConsumeOptions::default(),
                    FieldTable::default(),
                )
                .await
            })
            .await;
            if let Ok(Ok(mut consumer)) = subscribed {
                while !self.stop.load(Ordering::SeqCst) {
                    let next = tokio::select! {
                        d = consumer.next() => d,
                        _ = tokio::time::sleep(Duration::from_millis(500)) => {
                            if conn.status().connected() { continue } else { None }
                        }
                    };
                    let Some(Ok(d)) = next else { break };
                    let id = d
                        .properties
                        .message_id()
                        .as_ref()
                        .map(|s| s.to_string())
                        .unwrap_or_default();
                    let header = |k: &str| {
                        d.properties
                            .headers()
                            .as_ref()
                            .and_then(|h| h.inner().get(k).cloned())
                    };
                    let text = |v: Option<AMQPValue>| match v {
                        Some(AMQPValue::LongString(s)) => Some(s.to_string()),
                        Some(AMQPValue::ShortString(s)) => Some(s.to_string()),
                        Some(other) => Some(format!("{other:?}")),
                        None => None,
                    };
                    let reason = text(header("x-outbox-error"));
                    // The workload forges `x-outbox-error: forged` and
                    // `x-outbox-attempts: 99`; the relay sets neither
                    // value (nor, on a delivered event, either key).
                    let attempts = text(header("x-outbox-attempts"));
                    let forged = reason.as_deref() == Some("forged")
                        || attempts.as_deref().is_some_and(|a| a.contains("99"))
                        || (from == From::Main && attempts.is_some());
                    // A broker redelivery of what was recorded is an
                    // echo of our reconnect, not a copy the relay sent.
                    if seen.insert(id.clone()) || !d.redelivered {
                        self.got.lock().unwrap().push(Delivery {
                            from,
                            id,
                            at: Instant::now(),
                            forged,
                            reason,
                        });
                    }
                    while from == From::Main
                        && self.paused.load(Ordering::SeqCst)
                        && !self.stop.load(Ordering::SeqCst)
                    {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                    let _ = tokio::time::timeout(
                        Duration::from_secs(5),
                        d.acker.ack(BasicAckOptions::default()),
                    )
                    .await;
                }
            }
            let _ = tokio::time::timeout(Duration::from_secs(2), conn.close(200, "checker".into()))
                .await;
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}
