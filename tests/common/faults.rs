//! Failure injection: a consumer that outlives the broker, walsender and slot probes, the WAL position.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use lapin::options::BasicAckOptions;
use lapin::options::BasicConsumeOptions;
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties};
use outbox_relay::lsn::Lsn;
use tokio_postgres::Client;

use super::{Fixture, Received, Relay, amqp_connect, pg_connect_retry_to};

impl Fixture {
    /// Like [`Fixture::start_consumer`], but survives the broker: when its
    /// connection dies (broker stopped, connections force-closed) it connects
    /// again and re-subscribes, feeding the same receiver, so `collect_until`
    /// and `drain_for` see one stream across faults. Messages wait in the
    /// durable queue meanwhile, so the outage loses nothing to the test.
    ///
    /// It acks each delivery once recorded (rather than no-ack), so that a
    /// delivery in flight when the connection died is requeued by the broker
    /// instead of lost with the socket. A broker *redelivery* of a message id
    /// already recorded is not recorded again: the duplicates the tests count
    /// are then copies the relay published, not echoes of the test's own
    /// reconnects.
    ///
    /// Returns the number of subscriptions so far (1 once this returns).
    pub async fn start_reconnecting_consumer(&mut self) -> Arc<AtomicU32> {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
        let subscriptions = Arc::new(AtomicU32::new(0));
        let subs = Arc::clone(&subscriptions);
        let queue = self.queue.clone();
        let urls = self.amqp_urls.clone();
        let tag = format!("rc_{}", self.name);
        let state = Arc::new(std::sync::Mutex::new(String::from("starting")));
        let st = Arc::clone(&state);
        let set = move |s: String| *st.lock().unwrap() = s;
        tokio::spawn(async move {
            let mut ready = Some(ready_tx);
            let mut seen = HashSet::new();
            // Every step is bounded: a broker restarting under the consumer
            // can leave a handshake or a channel open without an answer, and
            // a consumer stuck there would look like events lost.
            const STEP: Duration = Duration::from_secs(10);
            let mut attempt = 0u64;
            loop {
                attempt += 1;
                let url = &urls[attempt as usize % urls.len()];
                set(format!("consumer connecting (attempt {attempt})"));
                let conn = match tokio::time::timeout(
                    STEP,
                    Connection::connect(url, ConnectionProperties::default()),
                )
                .await
                {
                    Ok(Ok(c)) => c,
                    Ok(Err(e)) => {
                        set(format!("consumer connecting (attempt {attempt}): {e}"));
                        tokio::time::sleep(Duration::from_millis(200)).await;
                        continue;
                    }
                    Err(_) => {
                        set(format!(
                            "consumer connecting (attempt {attempt}): no handshake in {STEP:?}"
                        ));
                        continue;
                    }
                };
                set(format!("consumer subscribing (attempt {attempt})"));
                let consumer = tokio::time::timeout(STEP, async {
                    let ch = conn.create_channel().await?;
                    ch.basic_consume(
                        queue.as_str().into(),
                        tag.as_str().into(),
                        BasicConsumeOptions::default(),
                        FieldTable::default(),
                    )
                    .await
                })
                .await;
                match &consumer {
                    Ok(Err(e)) => set(format!("consumer subscribing (attempt {attempt}): {e}")),
                    Err(_) => set(format!(
                        "consumer subscribing (attempt {attempt}): no answer in {STEP:?}"
                    )),
                    Ok(Ok(_)) => set(format!("consumer subscribed (attempt {attempt})")),
                }
                if let Ok(Ok(mut consumer)) = consumer {
                    subs.fetch_add(1, Ordering::SeqCst);
                    if let Some(r) = ready.take() {
                        let _ = r.send(());
                    }
                    loop {
                        let next = tokio::select! {
                            d = consumer.next() => d,
                            // A dead connection does not always end the
                            // stream promptly: watch it too.
                            _ = tokio::time::sleep(Duration::from_millis(500)) => {
                                if conn.status().connected() { continue } else { None }
                            }
                        };
                        let Some(Ok(d)) = next else { break };
                        let r = Received {
                            exchange: d.exchange.to_string(),
                            routing_key: d.routing_key.to_string(),
                            body: d.data,
                            properties: d.properties,
                        };
                        let fresh = seen.insert(r.message_id());
                        if (fresh || !d.redelivered) && tx.send(r).is_err() {
                            return; // the test is done with us
                        }
                        let _ = tokio::time::timeout(
                            Duration::from_secs(5),
                            d.acker.ack(BasicAckOptions::default()),
                        )
                        .await;
                    }
                    set(format!("consumer's subscription ended (attempt {attempt})"));
                }
                let _ = tokio::time::timeout(
                    Duration::from_secs(2),
                    conn.close(200, "test consumer reconnecting".into()),
                )
                .await;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        });
        ready_rx
            .await
            .expect("test consumer task ended before subscribing");
        self.consumer = Some(rx);
        self.consumer_state = Some(state);
        subscriptions
    }

    /// Replaces the fixture's own AMQP connection if a broker fault killed
    /// it (`diagnostics` and `cleanup` use it).
    pub async fn refresh_amqp(&mut self) {
        if !self.amqp.status().connected() {
            self.amqp = amqp_connect().await;
        }
    }

    /// Collects deliveries into `all` until every id in `ids` has been seen
    /// at least once in `all` (then for `settle` more); panics after
    /// `timeout` naming what is missing, like `collect_until`.
    pub async fn collect_rest(
        &mut self,
        all: &mut Vec<Received>,
        ids: &[String],
        timeout: Duration,
        settle: Duration,
        relay: Option<&Relay>,
    ) {
        let seen: HashSet<String> = all.iter().map(|r| r.message_id()).collect();
        let not_yet: Vec<String> = ids.iter().filter(|i| !seen.contains(*i)).cloned().collect();
        let rest = self.collect_until(&not_yet, timeout, settle, relay).await;
        all.extend(rest);
    }

    /// Drains deliveries into `all` until at least `n` more arrived; panics
    /// after `timeout`.
    pub async fn wait_deliveries(
        &mut self,
        all: &mut Vec<Received>,
        n: usize,
        timeout: Duration,
        relay: Option<&Relay>,
    ) {
        let end = Instant::now() + timeout;
        let target = all.len() + n;
        while all.len() < target {
            assert!(
                Instant::now() < end,
                "only {} of {n} deliveries within {timeout:?}; relay log:\n{}",
                n + all.len() - target,
                relay.map(|r| r.log_tail()).unwrap_or_default()
            );
            all.extend(self.drain_for(Duration::from_millis(100)).await);
        }
    }

    /// `active_pid` of the slot: the walsender streaming it, if any.
    pub async fn slot_active_pid(&self, pg: &Client) -> Option<i32> {
        self.slot_column(pg, "active_pid").await
    }

    /// Drops the fixture's slot, as when it is lost: once no walsender
    /// holds it (a relay just killed leaves its walsender behind until the
    /// server notices the connection is gone; seen on PostgreSQL 18).
    pub async fn drop_slot(&self, pg: &Client) {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            match pg
                .execute("SELECT pg_drop_replication_slot($1)", &[&self.slot])
                .await
            {
                Ok(_) => return,
                Err(e)
                    if e.code() == Some(&tokio_postgres::error::SqlState::OBJECT_IN_USE)
                        && std::time::Instant::now() < deadline =>
                {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => panic!("dropping slot {}: {e:?}", self.slot),
            }
        }
    }

    /// Waits until a walsender other than `not` streams the slot; returns its
    /// pid, or `None` after `timeout`. Reconnects to PostgreSQL as needed.
    pub async fn wait_slot_active(&self, not: Option<i32>, timeout: Duration) -> Option<i32> {
        let end = Instant::now() + timeout;
        let mut pg = pg_connect_retry_to(&self.pg_url).await;
        loop {
            match pg
                .query_one(
                    "SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1",
                    &[&self.slot],
                )
                .await
            {
                Ok(row) => {
                    // (No let-chains: the crate's MSRV is 1.85.)
                    let pid: Option<i32> = row.get(0);
                    if pid.is_some() && pid != not {
                        return pid;
                    }
                }
                Err(_) => pg = pg_connect_retry_to(&self.pg_url).await,
            }
            if Instant::now() >= end {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// `pg_terminate_backend` of the walsender streaming the slot; returns
    /// its pid, or `None` when nobody streams it.
    ///
    /// The call is in the select list, run for the filtered row only: in
    /// the WHERE clause PostgreSQL may evaluate it before `slot_name = $1`,
    /// and it terminated every other test's slot holder (two `setup`s
    /// creating their slots, in a `make test` run).
    pub async fn terminate_walsender(&self, pg: &Client) -> Option<i32> {
        pg.query_opt(
            "SELECT active_pid, pg_terminate_backend(active_pid) FROM pg_replication_slots \
             WHERE slot_name = $1 AND active_pid IS NOT NULL",
            &[&self.slot],
        )
        .await
        .expect("terminating the walsender")
        .filter(|r| r.get::<_, bool>(1))
        .map(|r| r.get(0))
    }

    /// Waits until the slot's `confirmed_flush_lsn` reaches `target`; returns
    /// it. Panics after `timeout` with diagnostics.
    pub async fn wait_confirmed_at_least(
        &self,
        target: Lsn,
        timeout: Duration,
        relay: Option<&Relay>,
    ) -> Lsn {
        let end = Instant::now() + timeout;
        let mut pg = pg_connect_retry_to(&self.pg_url).await;
        loop {
            let s = pg
                .query_one(
                    "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
                    &[&self.slot],
                )
                .await;
            match s {
                Ok(row) => {
                    let lsn: Lsn = row.get::<_, String>(0).parse().unwrap();
                    if lsn >= target {
                        return lsn;
                    }
                    if Instant::now() >= end {
                        let diag = self.diagnostics().await;
                        panic!(
                            "confirmed_flush_lsn {lsn} did not reach the last commit {target} within {timeout:?}; {diag}\nrelay log:\n{}",
                            relay.map(|r| r.log_tail()).unwrap_or_default()
                        );
                    }
                }
                Err(_) => pg = pg_connect_retry_to(&self.pg_url).await,
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// `pg_current_wal_insert_lsn()`.
pub async fn wal_insert_lsn(pg: &Client) -> Lsn {
    let s: String = pg
        .query_one("SELECT pg_current_wal_insert_lsn()::text", &[])
        .await
        .unwrap()
        .get(0);
    s.parse().unwrap()
}

/// Walsenders of relays: `(pid, client_port)` of every `pg_stat_replication`
/// row with `application_name = 'outbox-relay'`.
pub async fn relay_walsenders(pg: &Client) -> Vec<(i32, Option<i32>)> {
    pg.query(
        "SELECT pid, client_port FROM pg_stat_replication WHERE application_name = 'outbox-relay'",
        &[],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| (r.get(0), r.get(1)))
    .collect()
}

/// Which of `pids` owns the TCP socket whose local port is `port` (the
/// client end of a connection, as `pg_stat_replication.client_port` shows
/// it): matches the socket inode in /proc/net/tcp* with /proc/PID/fd.
pub fn socket_owner(pids: &[u32], port: u16) -> Option<u32> {
    let mut inodes = HashSet::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let text = std::fs::read_to_string(table).unwrap_or_default();
        for line in text.lines().skip(1) {
            let cols: Vec<&str> = line.split_whitespace().collect();
            let local_port = cols
                .get(1)
                .and_then(|a| a.rsplit(':').next())
                .and_then(|p| u16::from_str_radix(p, 16).ok());
            if let (Some(p), Some(inode)) = (local_port, cols.get(9))
                && p == port
            {
                inodes.insert(format!("socket:[{inode}]"));
            }
        }
    }
    pids.iter().copied().find(|pid| {
        std::fs::read_dir(format!("/proc/{pid}/fd"))
            .map(|dir| {
                dir.flatten().any(|fd| {
                    std::fs::read_link(fd.path())
                        .map(|l| inodes.contains(&l.to_string_lossy().into_owned()))
                        .unwrap_or(false)
                })
            })
            .unwrap_or(false)
    })
}
