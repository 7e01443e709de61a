//! Watching a test's deliveries and slot: collecting until ids arrive, draining, slot positions, diagnostics.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use outbox_relay::lsn::Lsn;
use tokio_postgres::Client;

use super::*;

impl Fixture {
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
        format!("{slot}; {depth}")
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

    /// The slot's `confirmed_flush_lsn`.
    pub async fn confirmed_flush_lsn(&self, pg: &Client) -> Lsn {
        let s: String = pg
            .query_one(
                "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
                &[&self.slot],
            )
            .await
            .unwrap()
            .get(0);
        s.parse().unwrap()
    }

    /// Waits until the slot is no longer held by a walsender.
    pub async fn wait_slot_inactive(&self, pg: &Client) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let active: bool = pg
                .query_one(
                    "SELECT active FROM pg_replication_slots WHERE slot_name = $1",
                    &[&self.slot],
                )
                .await
                .unwrap()
                .get(0);
            if !active {
                return;
            }
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
