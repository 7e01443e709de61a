//! Producers that outlive PostgreSQL, a seeded PRNG for their schedules, and checking deliveries against them.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering;
use std::time::Duration;

use outbox_relay::lsn::Lsn;
use tokio_postgres::Client;

use super::{Fixture, Received, Relay, count_by_id, pg_connect_retry_to};

/// Small deterministic PRNG (xorshift64*), so a seed replays a schedule.
#[derive(Debug, Clone)]
pub struct XorShift(u64);

impl XorShift {
    pub fn new(seed: u64) -> Self {
        // splitmix64 of the seed: any seed, 0 included, gives a good state.
        let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        XorShift((z ^ (z >> 31)) | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
    /// Uniform duration in `lo_ms..hi_ms` milliseconds.
    pub fn millis(&mut self, lo_ms: u64, hi_ms: u64) -> Duration {
        Duration::from_millis(lo_ms + self.below(hi_ms - lo_ms))
    }
}

/// An outbox event as its producer knows it.
#[derive(Debug, Clone)]
pub struct Produced {
    pub id: String,
    pub aggregate: String,
    /// Per-aggregate sequence number (also in the payload as `seq`).
    pub seq: u64,
}

/// What a producer did.
#[derive(Debug, Default)]
pub struct ProducerReport {
    /// Events of transactions whose COMMIT returned Ok, in commit order.
    pub committed: Vec<Produced>,
    /// Events of transactions that certainly did not commit: rolled back on
    /// purpose, or cut off before COMMIT was sent.
    pub rolled_back: Vec<String>,
    /// Events of transactions whose COMMIT was sent but did not return Ok
    /// (connection lost): they may or may not have committed.
    pub in_doubt: Vec<Produced>,
    pub committed_txs: usize,
    pub rolled_back_txs: usize,
    pub failed_txs: usize,
    /// Connections found broken (by any statement, a transaction's or the
    /// position query after a COMMIT) and made anew.
    pub lost_connections: usize,
    /// `pg_current_wal_insert_lsn()` right after the last COMMIT that
    /// returned Ok; `None` if there was none, or if that query failed (then
    /// the caller must use a later position).
    pub last_commit_lsn: Option<Lsn>,
}

/// How a producer behaves.
#[derive(Debug, Clone)]
pub struct ProducerSpec {
    /// Aggregate ids are `{name}-{k}` for `k` in `0..aggregates`. No other
    /// producer writes them and a producer's transactions are sequential, so
    /// per aggregate, sequence order is commit order.
    pub name: String,
    pub aggregates: u64,
    /// Events per transaction: uniform in `1..=max_events_per_tx`.
    pub max_events_per_tx: u64,
    /// Roll back about one transaction in this many (0: never).
    pub rollback_one_in: u64,
    /// Pause between transactions.
    pub pause: Duration,
    pub seed: u64,
}

impl ProducerSpec {
    pub fn new(name: &str, seed: u64) -> Self {
        ProducerSpec {
            name: name.to_owned(),
            aggregates: 4,
            max_events_per_tx: 3,
            rollback_one_in: 0,
            pause: Duration::from_millis(10),
            seed,
        }
    }
}

/// Commits transactions into the outbox until `stop` is set, reconnecting
/// whenever PostgreSQL goes away. A transaction counts as committed only
/// when COMMIT returned Ok. `synchronous_commit = on` for these sessions
/// (the harness turns it off server-wide): a COMMIT that returned Ok is then
/// in the WAL on disk and survives even an immediate shutdown, so a missing
/// event is the relay's fault, not an asynchronous commit the crash ate.
pub fn spawn_producer(
    fx: &Fixture,
    spec: ProducerSpec,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<ProducerReport> {
    const OP_TIMEOUT: Duration = Duration::from_secs(20);
    let sql = fx.insert_sql();
    let url = fx.pg_url.clone();
    tokio::spawn(async move {
        let mut rng = XorShift::new(spec.seed);
        let mut report = ProducerReport::default();
        let mut seqs = vec![0u64; spec.aggregates as usize];
        let mut conn: Option<(Client, tokio_postgres::Statement)> = None;
        while !stop.load(Ordering::SeqCst) {
            let (pg, stmt) = match &conn {
                Some(c) => c,
                None => {
                    let pg = pg_connect_retry_to(&url).await;
                    let prepared = async {
                        pg.batch_execute("SET synchronous_commit = on").await?;
                        pg.prepare(&sql).await
                    }
                    .await;
                    match prepared {
                        Ok(stmt) => conn.insert((pg, stmt)),
                        Err(_) => {
                            tokio::time::sleep(Duration::from_millis(200)).await;
                            continue;
                        }
                    }
                }
            };
            let n = 1 + rng.below(spec.max_events_per_tx);
            let mut events: Vec<Produced> = (0..n)
                .map(|_| {
                    let k = rng.below(spec.aggregates) as usize;
                    seqs[k] += 1;
                    Produced {
                        id: String::new(),
                        aggregate: format!("{}-{k}", spec.name),
                        seq: seqs[k],
                    }
                })
                .collect();
            let rollback = spec.rollback_one_in > 0 && rng.below(spec.rollback_one_in) == 0;

            // BEGIN and the INSERTs. A failure here means COMMIT was never
            // sent: the transaction cannot have committed.
            let body = tokio::time::timeout(OP_TIMEOUT, async {
                pg.batch_execute("BEGIN").await?;
                for e in events.iter_mut() {
                    let payload = serde_json::json!({
                        "producer": spec.name, "aggregate": e.aggregate, "seq": e.seq,
                    });
                    let row = pg
                        .query_one(
                            stmt,
                            &[&"order", &e.aggregate, &"placed", &payload.to_string()],
                        )
                        .await?;
                    e.id = row.get(0);
                }
                Ok::<_, tokio_postgres::Error>(())
            })
            .await;
            let ids = || {
                events
                    .iter()
                    .filter(|e| !e.id.is_empty())
                    .map(|e| e.id.clone())
            };
            if !matches!(body, Ok(Ok(()))) {
                report.rolled_back.extend(ids());
                report.failed_txs += 1;
                conn = None;
                report.lost_connections += 1;
                continue;
            }
            if rollback {
                report.rolled_back.extend(ids());
                report.rolled_back_txs += 1;
                if !matches!(
                    tokio::time::timeout(OP_TIMEOUT, pg.batch_execute("ROLLBACK")).await,
                    Ok(Ok(()))
                ) {
                    conn = None;
                    report.lost_connections += 1;
                }
            } else {
                match tokio::time::timeout(OP_TIMEOUT, pg.batch_execute("COMMIT")).await {
                    Ok(Ok(())) => {
                        report.committed.extend(events);
                        report.committed_txs += 1;
                        report.last_commit_lsn = match tokio::time::timeout(
                            OP_TIMEOUT,
                            pg.query_one("SELECT pg_current_wal_insert_lsn()::text", &[]),
                        )
                        .await
                        {
                            Ok(Ok(row)) => Some(row.get::<_, String>(0).parse().unwrap()),
                            _ => {
                                conn = None;
                                report.lost_connections += 1;
                                None
                            }
                        };
                    }
                    _ => {
                        report.in_doubt.extend(events);
                        report.failed_txs += 1;
                        conn = None;
                        report.lost_connections += 1;
                    }
                }
            }
            tokio::time::sleep(spec.pause).await;
        }
        report
    })
}

/// Producers committing in the background while a test injects its
/// faults, stopped together.
pub struct Load {
    stop: Arc<AtomicBool>,
    producers: Vec<tokio::task::JoinHandle<ProducerReport>>,
}

impl Load {
    /// Starts one producer per spec ([`spawn_producer`]).
    pub fn start(fx: &Fixture, specs: impl IntoIterator<Item = ProducerSpec>) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let producers = specs
            .into_iter()
            .map(|spec| spawn_producer(fx, spec, Arc::clone(&stop)))
            .collect();
        Load { stop, producers }
    }

    /// Stops the producers; their reports, in the order of their specs.
    pub async fn stop(self) -> Vec<ProducerReport> {
        self.stop.store(true, Ordering::SeqCst);
        let mut reports = Vec::new();
        for p in self.producers {
            reports.push(p.await.expect("a producer panicked"));
        }
        reports
    }

    /// [`Load::stop`] of a load of one producer: its report.
    pub async fn stop_one(self) -> ProducerReport {
        let mut reports = self.stop().await;
        assert_eq!(reports.len(), 1, "a load of one producer");
        reports.remove(0)
    }
}

impl Fixture {
    /// Collects into `all` until every event `reports` say committed has
    /// arrived (then for `settle` more), checks the deliveries against the
    /// reports ([`check_deliveries`]) and returns the duplicate count.
    pub async fn committed_arrive(
        &mut self,
        all: &mut Vec<Received>,
        reports: &[&ProducerReport],
        timeout: Duration,
        settle: Duration,
        relay: Option<&Relay>,
    ) -> usize {
        let ids: Vec<String> = reports
            .iter()
            .flat_map(|r| r.committed.iter().map(|e| e.id.clone()))
            .collect();
        self.collect_rest(all, &ids, timeout, settle, relay).await;
        check_deliveries(reports, all)
    }
}

/// Per aggregate, first deliveries in commit order: the sequence numbers
/// (one producer per aggregate, so sequence order is commit order) of
/// first deliveries increase, and each payload is the one inserted; except
/// an event the broker itself refused (`refused`, see [`refused_ids`]):
/// RabbitMQ confirms each message on its own, so while a queue is
/// unavailable it may refuse one and take the next, and the refused one,
/// published again, arrives after. Deliveries of events no report knows
/// are left to [`check_deliveries`].
pub fn first_deliveries_in_commit_order(
    reports: &[&ProducerReport],
    all: &[Received],
    refused: &HashSet<String>,
) {
    let by_id: HashMap<&str, &Produced> = reports
        .iter()
        .flat_map(|r| r.committed.iter().chain(&r.in_doubt))
        .map(|e| (e.id.as_str(), e))
        .collect();
    let mut first_seen = HashSet::new();
    let mut last_seq: HashMap<&str, u64> = HashMap::new();
    let mut out_of_order = Vec::new();
    for (i, r) in all.iter().enumerate() {
        let id = r.message_id();
        let Some(e) = by_id.get(id.as_str()) else {
            continue;
        };
        if !first_seen.insert(id.clone()) {
            continue;
        }
        assert_eq!(
            r.json()["seq"].as_u64(),
            Some(e.seq),
            "payload of {id} does not match what was inserted"
        );
        let prev = last_seq.get(e.aggregate.as_str()).copied();
        if let Some(prev) = prev.filter(|&p| e.seq <= p) {
            if !refused.contains(&id) {
                out_of_order.push(format!(
                    "delivery #{i}: {} seq {} after seq {prev}",
                    e.aggregate, e.seq
                ));
            }
            continue;
        }
        last_seq.insert(&e.aggregate, e.seq);
    }
    assert!(
        out_of_order.is_empty(),
        "{} first deliveries out of commit order (the broker refused {} events), e.g. {:?}",
        out_of_order.len(),
        refused.len(),
        &out_of_order[..out_of_order.len().min(5)]
    );
}

/// The events the relays' logs say the broker refused and that were
/// published again (see [`first_deliveries_in_commit_order`]).
pub fn refused_ids(relays: &[&Relay]) -> HashSet<String> {
    let mut ids = HashSet::new();
    for r in relays {
        for l in r
            .log_text()
            .lines()
            .filter(|l| l.contains("will publish again"))
        {
            if let Some(id) = l
                .split("event_id=")
                .nth(1)
                .and_then(|t| t.split_whitespace().next())
            {
                ids.insert(id.trim_matches('"').to_owned());
            }
        }
    }
    ids
}

/// Checks deliveries against what producers did: every committed event
/// delivered, nothing rolled back delivered, nothing unknown delivered
/// (in-doubt events may or may not arrive). Returns the duplicate count.
pub fn check_deliveries(reports: &[&ProducerReport], got: &[Received]) -> usize {
    let counts = count_by_id(got);
    let committed: Vec<&Produced> = reports.iter().flat_map(|r| &r.committed).collect();
    let missing: Vec<&str> = committed
        .iter()
        .filter(|e| !counts.contains_key(&e.id))
        .map(|e| e.id.as_str())
        .collect();
    assert!(
        missing.is_empty(),
        "{} of {} committed events never arrived, e.g. {:?}",
        missing.len(),
        committed.len(),
        &missing[..missing.len().min(5)]
    );
    let rolled_back: HashSet<&String> = reports.iter().flat_map(|r| &r.rolled_back).collect();
    let leaked: Vec<&String> = counts
        .keys()
        .filter(|id| rolled_back.contains(id))
        .collect();
    assert!(
        leaked.is_empty(),
        "{} events of transactions that never committed were delivered, e.g. {:?}",
        leaked.len(),
        &leaked[..leaked.len().min(5)]
    );
    let known: HashSet<&String> = reports
        .iter()
        .flat_map(|r| r.committed.iter().chain(&r.in_doubt))
        .map(|e| &e.id)
        .collect();
    let unknown: Vec<&String> = counts.keys().filter(|id| !known.contains(id)).collect();
    assert!(
        unknown.is_empty(),
        "{} deliveries of events no producer wrote, e.g. {:?}",
        unknown.len(),
        &unknown[..unknown.len().min(5)]
    );
    counts.values().map(|c| c - 1).sum()
}
