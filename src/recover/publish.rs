//! Publishing rows read back from the table through the stream's own
//! publisher ([`publisher::run`]): the same confirm window (count and
//! bytes), retries of returned and nacked messages, dead letters, and
//! refusals.
//!
//! Each row travels as a one-event transaction whose "LSN" is its position
//! in the read (1, 2, ...), so the publisher's watermark is the number of
//! rows confirmed in order, and the key of that row is where a re-run
//! resumes.

use std::collections::VecDeque;
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::info;

use super::rows::{Key, Rows};
use crate::checkpoint::Progress;
use crate::config::Config;
use crate::error::RelayError;
use crate::handoff::ByteBudget;
use crate::handoff::Item;
use crate::lsn::Lsn;
use crate::metrics::Metrics;
use crate::sink::AmqpSink;
use crate::sink::publisher;
use crate::sink::refusals::{Head, Refusals};

/// Items queued for the publisher.
const QUEUE: usize = 512;
/// Progress is logged this often.
const LOG_EVERY: Duration = Duration::from_secs(5);
/// How often the caller is told the confirmed position.
const SAVE_EVERY: Duration = Duration::from_secs(1);

/// How far a publish got.
#[derive(Debug, Default, Clone)]
pub struct Published {
    /// Rows read and handed to the publisher.
    pub sent: u64,
    /// Rows confirmed in order (or dead-lettered).
    pub confirmed: u64,
    /// The key of the last row confirmed in order.
    pub last: Option<Key>,
    /// Every row was read and confirmed.
    pub complete: bool,
}

/// How a call of [`publish_rows`] ended.
pub struct Pass {
    /// What it confirmed.
    pub done: Published,
    /// Why it ended early, if it did.
    pub failed: Option<RelayError>,
    /// The publisher's oldest unconfirmed row when it failed (see
    /// [`crate::sink::refusals::learn`]).
    pub head: Option<Head>,
}

/// Publishes the rows of `rows` in order, until they are all confirmed,
/// `stop` is cancelled (then outstanding confirms get the shutdown grace
/// period), or a failure. `save` is called about once a second with what is
/// confirmed so far (to record it), and at the end.
pub async fn publish_rows<S, F>(
    cfg: &Config,
    rows: &mut Rows<'_>,
    total: Option<i64>,
    refusals: &mut Refusals,
    stop: &CancellationToken,
    mut save: S,
) -> Pass
where
    S: FnMut(Published) -> F,
    F: Future<Output = ()>,
{
    let mut sink = match AmqpSink::connect(
        &cfg.rabbitmq,
        &format!("outbox-relay recover (slot {})", cfg.postgres.slot),
        &crate::sink::nodes::Nodes::new(&cfg.rabbitmq),
    )
    .await
    {
        Ok(sink) => sink,
        Err(e) => {
            return Pass {
                done: Published::default(),
                failed: Some(e.into()),
                head: None,
            };
        }
    };
    let (tx, rx) = mpsc::channel(QUEUE);
    let (wm_tx, mut wm_rx) = watch::channel(Progress {
        lsn: Lsn(0),
        commit_time_us: None,
    });
    let budget = ByteBudget::default();
    let metrics = Metrics::new();
    let halt = stop.child_token();
    // Keys of rows sent and not yet confirmed, by position.
    let keys = std::sync::Mutex::new(VecDeque::<(u64, Key)>::new());
    let mut read_err = None;

    let read = async {
        let mut sent = 0u64;
        'rows: loop {
            let batch = tokio::select! {
                biased;
                _ = halt.cancelled() => break,
                b = rows.next_batch() => b,
            };
            let batch = match batch {
                Ok(b) if b.is_empty() => break,
                Ok(b) => b,
                Err(e) => {
                    read_err = Some(e);
                    break;
                }
            };
            for (ev, key) in batch {
                sent += 1;
                keys.lock().expect("not poisoned").push_back((sent, key));
                let commit_time_us = ev.commit_time_us;
                let item = Item::Event(ev);
                let cost = ByteBudget::cost(&item);
                let items = [
                    Item::Begin { commit_time_us },
                    item,
                    Item::Commit { end_lsn: Lsn(sent) },
                ];
                tokio::select! {
                    biased;
                    _ = halt.cancelled() => break 'rows,
                    _ = budget.take(cost) => {}
                }
                for item in items {
                    let sent = tokio::select! {
                        biased;
                        _ = halt.cancelled() => break 'rows,
                        r = tx.send(item) => r,
                    };
                    if sent.is_err() {
                        break 'rows; // the publisher ended
                    }
                }
            }
        }
        drop(tx);
        sent
    };
    let publish = async {
        let r = publisher::run(
            std::slice::from_mut(&mut sink),
            rx,
            &wm_tx,
            publisher::Publishing {
                cfg: &cfg.rabbitmq,
                dead_letters: &cfg.dead_letters(),
                refusals,
                budget: &budget,
                start: Lsn(0),
                metrics: &metrics,
            },
            stop,
        )
        .await;
        halt.cancel();
        r
    };
    let track = async {
        let mut done = Published::default();
        let mut logged = Instant::now();
        let mut saved = Instant::now();
        loop {
            let going = tokio::select! {
                _ = halt.cancelled() => false,
                _ = wm_rx.changed() => true,
                _ = tokio::time::sleep(SAVE_EVERY) => true,
            };
            advance(&keys, wm_rx.borrow_and_update().lsn.0, &mut done);
            if logged.elapsed() >= LOG_EVERY {
                match total {
                    Some(t) => info!(confirmed = done.confirmed, of = t, "re-publishing"),
                    None => info!(confirmed = done.confirmed, "re-publishing"),
                }
                logged = Instant::now();
            }
            if saved.elapsed() >= SAVE_EVERY && done.last.is_some() {
                save(done.clone()).await;
                saved = Instant::now();
            }
            if !going {
                break done; // the publisher ended
            }
        }
    };
    let (sent, published, mut done) = tokio::join!(read, publish, track);
    drop(wm_tx);
    sink.close().await;
    done.sent = sent;
    advance(&keys, wm_rx.borrow().lsn.0, &mut done);
    // What was confirmed is recorded whatever ended the publish.
    done.complete =
        published.is_ok() && read_err.is_none() && !stop.is_cancelled() && done.confirmed == sent;
    save(done.clone()).await;
    let (failed, head) = match published {
        Ok(()) => (read_err.map(RelayError::from), None),
        Err(publisher::Failed { error, head, .. }) => (Some(error.into()), head),
    };
    Pass { done, failed, head }
}

/// Rows up to `confirmed` are confirmed: the last one's key is the position.
fn advance(keys: &std::sync::Mutex<VecDeque<(u64, Key)>>, confirmed: u64, done: &mut Published) {
    if confirmed > done.confirmed {
        let mut keys = keys.lock().expect("not poisoned");
        while keys.front().is_some_and(|(n, _)| *n <= confirmed) {
            done.last = keys.pop_front().map(|(_, k)| k);
        }
        done.confirmed = confirmed;
    }
}
