//! Watching a test's deliveries and slot: collecting until ids arrive, draining, slot positions, diagnostics.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use outbox_relay::lsn::Lsn;
use tokio_postgres::Client;
use tokio_postgres::types::FromSqlOwned;

use super::{Fixture, Received, Relay, pg_connect_retry_to, wait_timeout};

impl Fixture {
    /// Writes one last event and collects (into `all`) until it arrives
    /// and 2 s more, long enough for a replay to show; returns the events
    /// of `sent` that arrived more than once.
    pub async fn sent_again(
        &mut self,
        pg: &Client,
        sent: &[String],
        all: &mut Vec<Received>,
        relay: &Relay,
    ) -> Vec<String> {
        let last = self
            .insert(pg, "r", "last", "e", &serde_json::json!({}))
            .await;
        all.extend(
            self.collect_until(
                std::slice::from_ref(&last),
                Duration::from_secs(60),
                Duration::from_secs(2),
                Some(relay),
            )
            .await,
        );
        let counts = count_by_id(all);
        sent.iter().filter(|id| counts[*id] > 1).cloned().collect()
    }

    /// Waits for the relay process to exit by itself; returns status and stderr.
    pub fn wait_exit(relay: &mut Relay, within: Duration) -> (std::process::ExitStatus, String) {
        let status = wait_timeout(&mut relay.child, within).unwrap_or_else(|| {
            panic!(
                "relay still running after {within:?}; log:\n{}",
                relay.log_tail()
            )
        });
        (
            status,
            std::fs::read_to_string(&relay.log).unwrap_or_default(),
        )
    }

    /// Starts the consumer and the relay, and waits for one event to go
    /// through: the relay is streaming. Returns the SQL connection and it.
    pub async fn streaming(&mut self) -> (Client, Relay) {
        self.start_consumer().await;
        let pg = pg_connect_retry_to(&self.pg_url).await;
        let relay = self.spawn_relay();
        // "ok": routed where the tests that route only some keys route.
        let warm = self
            .insert(&pg, "ok", "w", "e", &serde_json::json!({}))
            .await;
        self.expect_delivered(&[warm], &relay).await;
        (pg, relay)
    }

    /// [`Fixture::streaming`], then time for the checkpoint row to be
    /// written (at most once a second) and the relay stopped: a recovery
    /// has a window to start from. Returns the SQL connection.
    pub async fn checkpointed(&mut self) -> Client {
        let (pg, relay) = self.streaming().await;
        tokio::time::sleep(Duration::from_millis(1500)).await;
        relay.stop_ok();
        pg
    }

    /// [`Fixture::collect_until`] with the usual 30 s and no settling time.
    pub async fn expect_delivered(&mut self, ids: &[String], relay: &Relay) -> Vec<Received> {
        self.collect_until(ids, Duration::from_secs(30), Duration::ZERO, Some(relay))
            .await
    }

    /// Collects deliveries until `ids` have all been seen at least once (then
    /// for `settle` more), or panics after `timeout` naming what is missing.
    pub async fn collect_until(
        &mut self,
        ids: &[String],
        timeout: Duration,
        settle: Duration,
        relay: Option<&Relay>,
    ) -> Vec<Received> {
        let rx = self.consumer.as_mut().expect("start_consumer first");
        let mut want: std::collections::HashSet<&String> = ids.iter().collect();
        let mut got = Vec::new();
        let deadline = Instant::now() + timeout;
        while !want.is_empty() {
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, rx.recv()).await {
                Ok(Some(r)) => {
                    want.remove(&r.message_id());
                    got.push(r);
                }
                _ => {
                    let log = relay.map(|r| r.log_tail()).unwrap_or_default();
                    let missing = want.len();
                    let diag = self.diagnostics().await;
                    panic!(
                        "{missing} of {} events missing after {timeout:?}; {diag}\nrelay log:\n{log}",
                        ids.len()
                    );
                }
            }
        }
        let settle_end = Instant::now() + settle;
        while let Ok(Some(r)) = tokio::time::timeout(
            settle_end.saturating_duration_since(Instant::now()),
            rx.recv(),
        )
        .await
        {
            got.push(r);
        }
        got
    }

    /// Slot position and queue depth, for failure messages.
    pub async fn diagnostics(&self) -> String {
        let pg = pg_connect_retry_to(&self.pg_url).await;
        let slot = pg
            .query_one(
                "SELECT format('slot active_pid=%s confirmed_flush_lsn=%s current=%s', active_pid, confirmed_flush_lsn, pg_current_wal_lsn()) FROM pg_replication_slots WHERE slot_name = $1",
                &[&self.slot],
            )
            .await
            .map(|r| r.get::<_, String>(0))
            .unwrap_or_else(|e| e.to_string());
        let depth = match self.amqp.create_channel().await {
            Ok(ch) => ch
                .queue_declare(
                    self.queue.as_str().into(),
                    QueueDeclareOptions {
                        passive: true,
                        ..Default::default()
                    },
                    FieldTable::default(),
                )
                .await
                .map(|q| {
                    format!(
                        "queue depth {} consumers {}",
                        q.message_count(),
                        q.consumer_count()
                    )
                })
                .unwrap_or_else(|e| e.to_string()),
            Err(e) => e.to_string(),
        };
        let consumer = self
            .consumer_state
            .as_ref()
            .map(|s| format!("; {}", s.lock().unwrap()))
            .unwrap_or_default();
        format!("{slot}; {depth}{consumer}")
    }

    /// Everything delivered within `wait`.
    pub async fn drain_for(&mut self, wait: Duration) -> Vec<Received> {
        let rx = self.consumer.as_mut().expect("start_consumer first");
        let mut got = Vec::new();
        let end = Instant::now() + wait;
        while let Ok(Some(r)) =
            tokio::time::timeout(end.saturating_duration_since(Instant::now()), rx.recv()).await
        {
            got.push(r);
        }
        got
    }

    /// One column of the fixture's slot in `pg_replication_slots`; panics
    /// when the slot is gone or the query fails.
    pub async fn slot_column<T: FromSqlOwned>(&self, pg: &Client, column: &str) -> T {
        pg.query_one(
            &format!("SELECT {column} FROM pg_replication_slots WHERE slot_name = $1"),
            &[&self.slot],
        )
        .await
        .unwrap_or_else(|e| panic!("reading {column} of slot {}: {e}", self.slot))
        .get(0)
    }

    /// One column of the fixture's row in `outbox_relay_checkpoint`.
    pub async fn checkpoint_column<T: FromSqlOwned>(&self, pg: &Client, column: &str) -> T {
        pg.query_one(
            &format!("SELECT {column} FROM outbox_relay_checkpoint WHERE slot_name = $1"),
            &[&self.slot],
        )
        .await
        .unwrap_or_else(|e| panic!("reading the checkpoint's {column}: {e}"))
        .get(0)
    }

    /// The slot's `confirmed_flush_lsn`.
    pub async fn confirmed_flush_lsn(&self, pg: &Client) -> Lsn {
        let s: String = self.slot_column(pg, "confirmed_flush_lsn::text").await;
        s.parse().unwrap()
    }

    /// Waits until the slot is no longer held by a walsender.
    pub async fn wait_slot_inactive(&self, pg: &Client) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.slot_column::<bool>(pg, "active").await {
            assert!(Instant::now() < deadline, "slot {} still active", self.slot);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// Counts deliveries per message id.
pub fn count_by_id(got: &[Received]) -> HashMap<String, usize> {
    let mut m = HashMap::new();
    for r in got {
        *m.entry(r.message_id()).or_insert(0) += 1;
    }
    m
}

/// Creates the logical slot `name` (pgoutput): an observer that tells
/// the exact end of the transactions written after it (see
/// [`first_commit_end`]). The caller drops it.
pub async fn create_observer_slot(pg: &Client, name: &str) {
    pg.query_one(
        "SELECT 1 FROM pg_create_logical_replication_slot($1, 'pgoutput')",
        &[&name],
    )
    .await
    .unwrap();
}

/// End LSN of the first transaction the observer slot `slot` has decoded
/// (peeked, not consumed). Retries for up to 5 s: with
/// `synchronous_commit = off` decoding sees a commit only once the WAL
/// writer has flushed it.
pub async fn first_commit_end(pg: &Client, slot: &str, publication: &str) -> Lsn {
    for _ in 0..50 {
        if let Some(lsn) = peek_first_commit_end(pg, slot, publication).await {
            return lsn;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("observer slot saw no commit");
}

async fn peek_first_commit_end(pg: &Client, slot: &str, publication: &str) -> Option<Lsn> {
    let rows = pg
        .query(
            "SELECT data FROM pg_logical_slot_peek_binary_changes($1, NULL, NULL, \
             'proto_version', '1', 'publication_names', $2)",
            &[&slot, &publication],
        )
        .await
        .unwrap();
    for row in rows {
        let data: Vec<u8> = row.get(0);
        if let Ok(outbox_relay::pgoutput::LogicalMessage::Commit(c)) =
            outbox_relay::pgoutput::decode(bytes::Bytes::from(data))
        {
            return Some(Lsn(c.end_lsn));
        }
    }
    None
}
