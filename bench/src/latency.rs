//! Latency under load: producers commit small transactions at a fixed rate,
//! a consumer stamps arrivals, for the relay and for the polling dispatcher.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde::Serialize;

use crate::Settings;
use crate::polling::{DispatchArgs, Dispatcher};
use crate::relay::{RelayConfig, metric_value};
use crate::stats::{Histogram, Percentiles, percentiles};
use crate::workload::{AGGREGATE_TYPE, EVENT_TYPE, aggregate_id, event_id, payload, unix_us};

/// Producer connections (transactions run concurrently on them).
const PRODUCER_CONNECTIONS: usize = 4;

/// What the producers did.
pub struct Produced {
    /// event id -> µs since the epoch right after its COMMIT returned.
    pub commits: Vec<(String, i64)>,
    pub transactions: u64,
    pub seconds: f64,
    /// Worst lateness of a transaction against its schedule.
    pub max_behind_ms: f64,
}

struct Job {
    first: u64,
    rows: u64,
    due: Instant,
}

/// Commits `rate` events/s for `seconds` into `table`, in transactions of
/// 1–10 rows, scheduled evenly and spread over a few connections.
pub async fn produce(
    pg_url: &str,
    table: &str,
    rate: u64,
    seconds: u64,
    tag: u32,
) -> Result<Produced> {
    let total = rate * seconds;
    let (tx, rx) = tokio::sync::mpsc::channel::<Job>(100_000);
    let rx = Arc::new(tokio::sync::Mutex::new(rx));
    let mut workers = Vec::new();
    for _ in 0..PRODUCER_CONNECTIONS {
        let pg = crate::pg::connect(pg_url).await?;
        let rx = rx.clone();
        let table = table.to_owned();
        workers.push(tokio::spawn(async move {
            let mut commits = Vec::new();
            let mut behind = Duration::ZERO;
            loop {
                let job = { rx.lock().await.recv().await };
                let Some(job) = job else { break };
                behind = behind.max(job.due.elapsed());
                let mut sql = format!(
                    "BEGIN; INSERT INTO {table} (id, aggregate_type, aggregate_id, event_type, payload) VALUES "
                );
                let ids: Vec<String> = (job.first..job.first + job.rows)
                    .map(|i| event_id(tag, i))
                    .collect();
                for (k, i) in (job.first..job.first + job.rows).enumerate() {
                    if k > 0 {
                        sql.push(',');
                    }
                    sql.push_str(&format!(
                        "('{}', '{AGGREGATE_TYPE}', '{}', '{EVENT_TYPE}', '{}')",
                        ids[k],
                        aggregate_id(i),
                        payload(i)
                    ));
                }
                sql.push_str("; COMMIT;");
                pg.simple_query(&sql).await.context("producer transaction")?;
                let at = unix_us();
                commits.extend(ids.into_iter().map(|id| (id, at)));
            }
            Ok::<_, anyhow::Error>((commits, behind))
        }));
    }
    // A small deterministic generator for the transaction sizes.
    let mut rng: u64 = 0x9e37_79b9_7f4a_7c15 ^ u64::from(tag);
    let mut next_size = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        1 + rng % 10
    };
    let start = Instant::now() + Duration::from_millis(20);
    let mut sent = 0;
    let mut transactions = 0;
    while sent < total {
        let rows = next_size().min(total - sent);
        let due = start + Duration::from_secs_f64(sent as f64 / rate as f64);
        tokio::time::sleep_until(due.into()).await;
        tx.send(Job {
            first: 1 + sent,
            rows,
            due,
        })
        .await
        .ok()
        .context("producers gone")?;
        sent += rows;
        transactions += 1;
    }
    drop(tx);
    let mut commits = Vec::with_capacity(total as usize);
    let mut behind = Duration::ZERO;
    for w in workers {
        let (c, b) = w.await??;
        commits.extend(c);
        behind = behind.max(b);
    }
    Ok(Produced {
        commits,
        transactions,
        seconds: start.elapsed().as_secs_f64(),
        max_behind_ms: behind.as_secs_f64() * 1000.0,
    })
}

/// Arrivals seen by the consumer: id -> first arrival (µs since the epoch).
#[derive(Clone, Default)]
pub struct Arrivals(Arc<Mutex<HashMap<String, i64>>>);

impl Arrivals {
    /// Consumes `queue` into a new [`Arrivals`].
    pub async fn start(
        conn: &lapin::Connection,
        queue: &str,
    ) -> Result<(Arrivals, lapin::Channel)> {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let ch = crate::amqp::consume_stamped(conn, queue, tx).await?;
        let a = Arrivals::default();
        let map = a.0.clone();
        tokio::spawn(async move {
            while let Some((id, at)) = rx.recv().await {
                map.lock().unwrap().entry(id).or_insert(at);
            }
        });
        Ok((a, ch))
    }

    /// Waits until every id of `p` has arrived; returns how many are missing.
    pub async fn wait_all(&self, p: &Produced, timeout: Duration) -> usize {
        let end = Instant::now() + timeout;
        loop {
            let missing = {
                let m = self.0.lock().unwrap();
                p.commits
                    .iter()
                    .filter(|(id, _)| !m.contains_key(id))
                    .count()
            };
            if missing == 0 || Instant::now() > end {
                return missing;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    fn latencies(&self, p: &Produced) -> Vec<i64> {
        let m = self.0.lock().unwrap();
        p.commits
            .iter()
            .filter_map(|(id, c)| m.get(id).map(|a| a - c))
            .collect()
    }
}

/// Quantiles of the relay's publish→confirm histogram over one run.
#[derive(Debug, Clone, Serialize)]
pub struct ConfirmHistogram {
    pub count: f64,
    pub mean_ms: f64,
    /// Interpolated inside the bucket, as histogram_quantile does.
    pub p50_ms: f64,
    pub p99_ms: f64,
    /// Upper bound of the bucket holding the quantile.
    pub p50_bucket_le_ms: f64,
    pub p99_bucket_le_ms: f64,
    pub raw: Histogram,
}

impl ConfirmHistogram {
    fn from(h: Histogram) -> Option<ConfirmHistogram> {
        Some(ConfirmHistogram {
            count: h.count,
            mean_ms: if h.count > 0.0 {
                h.sum / h.count * 1000.0
            } else {
                0.0
            },
            p50_ms: h.quantile(0.5)? * 1000.0,
            p99_ms: h.quantile(0.99)? * 1000.0,
            p50_bucket_le_ms: h.quantile_upper(0.5)? * 1000.0,
            p99_bucket_le_ms: h.quantile_upper(0.99)? * 1000.0,
            raw: h,
        })
    }
}

/// One design at one rate.
#[derive(Debug, Clone, Serialize)]
pub struct LatencyRun {
    pub design: String,
    pub queue_type: String,
    pub target_rate: u64,
    pub events: u64,
    pub transactions: u64,
    pub achieved_rate: f64,
    pub producer_max_behind_ms: f64,
    pub missing: u64,
    /// Producer's COMMIT returned → consumer received the message.
    pub commit_to_consume: Percentiles,
    /// Polling: COMMIT returned → the dispatcher's mark-published UPDATE
    /// returned (measured per event). Relay: estimated, see `confirm_note`.
    pub commit_to_confirm: Percentiles,
    pub commit_to_confirm_measured: bool,
    pub confirm_note: String,
    /// Relay only: its `outbox_relay_confirm_latency_seconds` over the run.
    pub publish_to_confirm: Option<ConfirmHistogram>,
    /// CPU seconds of the relay / the dispatcher process during the run.
    pub process_cpu_seconds: f64,
}

fn summarize(
    design: &str,
    s: &Settings,
    rate: u64,
    p: &Produced,
    missing: usize,
    consume: Percentiles,
) -> LatencyRun {
    LatencyRun {
        design: design.into(),
        queue_type: s.latency_queue_type.clone(),
        target_rate: rate,
        events: p.commits.len() as u64,
        transactions: p.transactions,
        achieved_rate: p.commits.len() as f64 / p.seconds,
        producer_max_behind_ms: p.max_behind_ms,
        missing: missing as u64,
        commit_to_consume: consume,
        commit_to_confirm: Percentiles::default(),
        commit_to_confirm_measured: false,
        confirm_note: String::new(),
        publish_to_confirm: None,
        process_cpu_seconds: 0.0,
    }
}

const CONFIRM_HIST: &str = "outbox_relay_confirm_latency_seconds";
/// Measured by the relay for every event: the transaction's commit
/// timestamp (from the WAL) to the broker's confirm.
const COMMIT_TO_CONFIRM_HIST: &str = "outbox_relay_commit_to_confirm_seconds";

/// The relay, streaming (started before the producers), one run per rate.
pub async fn relay_runs(
    s: &Settings,
    cfg: &RelayConfig,
    slot: &str,
    table: &str,
    queue: &str,
    amqp: &lapin::Connection,
) -> Result<Vec<LatencyRun>> {
    let mut probe = crate::amqp::DepthProbe::new(&s.amqp_url, queue).await?;
    probe.purge().await?;
    let (arrivals, consumer_ch) = Arrivals::start(amqp, queue).await?;
    let mut child = cfg.spawn("latency")?;
    let pid = child.id().to_string();
    let res = async {
        cfg.wait_ready(&mut child, Duration::from_secs(60)).await?;
        // The slot still has to go through the WAL written since the drain
        // (the polling table's backlog: decoded, filtered out): wait until
        // the relay has reported the current position, so that the runs
        // measure a relay that is caught up, as in steady operation.
        let t = Instant::now();
        catch_up(&s.pg_url, slot, Duration::from_secs(300)).await?;
        eprintln!(
            "  relay caught up with the WAL written since its drain in {:.1} s",
            t.elapsed().as_secs_f64()
        );
        let mut runs = Vec::new();
        for (k, &rate) in s.rates.iter().enumerate() {
            let text = cfg.metrics().await?;
            let before = Histogram::parse(&text, CONFIRM_HIST).unwrap_or_default();
            let before_c2c = Histogram::parse(&text, COMMIT_TO_CONFIRM_HIST).unwrap_or_default();
            let published_before = published_total(&text);
            let cpu_before = crate::procs::cpu_seconds(&pid)?;
            eprintln!("  relay at {rate} events/s for {} s ...", s.seconds);
            let p = produce(&s.pg_url, table, rate, s.seconds, 0x1a00 + k as u32).await?;
            let missing = arrivals.wait_all(&p, Duration::from_secs(60)).await;
            // Confirms may come after the deliveries: wait for the counter.
            let want = published_before + p.commits.len() as f64;
            let end = Instant::now() + Duration::from_secs(30);
            let mut text = cfg.metrics().await?;
            while published_total(&text) < want && Instant::now() < end {
                tokio::time::sleep(Duration::from_millis(50)).await;
                text = cfg.metrics().await?;
            }
            let hist = Histogram::parse(&text, CONFIRM_HIST)
                .unwrap_or_default()
                .minus(&before);
            let c2c = Histogram::parse(&text, COMMIT_TO_CONFIRM_HIST)
                .context("the relay exports no outbox_relay_commit_to_confirm_seconds")?
                .minus(&before_c2c);
            let consume = percentiles(arrivals.latencies(&p));
            let mut run = summarize("relay", s, rate, &p, missing, consume);
            run.process_cpu_seconds = crate::procs::cpu_seconds(&pid)? - cpu_before;
            run.publish_to_confirm = ConfirmHistogram::from(hist);
            let q = |x: f64| c2c.quantile(x).map_or(f64::NAN, |v| v * 1000.0);
            run.commit_to_confirm = Percentiles {
                count: c2c.count as u64,
                mean_ms: if c2c.count > 0.0 {
                    c2c.sum / c2c.count * 1000.0
                } else {
                    f64::NAN
                },
                p50_ms: q(0.5),
                p90_ms: q(0.9),
                p99_ms: q(0.99),
                p999_ms: q(0.999),
                // A histogram has no maximum: the upper bound of the
                // highest bucket that holds an observation.
                max_ms: c2c.quantile_upper(1.0).map_or(f64::NAN, |v| v * 1000.0),
            };
            run.commit_to_confirm_measured = true;
            run.confirm_note = "measured by the relay per event: outbox_relay_commit_to_confirm_seconds (WAL commit timestamp → broker confirm), quantiles interpolated inside its buckets; max is the upper bound of the highest bucket used".into();
            runs.push(run);
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        Ok::<_, anyhow::Error>(runs)
    }
    .await;
    let stop = crate::procs::terminate(&mut child, Duration::from_secs(30)).await;
    let _ = consumer_ch.close(200, "bye".into()).await;
    probe.close().await;
    let runs = res.map_err(|e| {
        e.context(format!(
            "relay latency run; relay log:\n{}",
            cfg.log_tail("latency")
        ))
    })?;
    stop?;
    Ok(runs)
}

/// Waits until `slot`'s confirmed_flush_lsn reaches the current WAL position.
async fn catch_up(pg_url: &str, slot: &str, timeout: Duration) -> Result<()> {
    let pg = crate::pg::connect(pg_url).await?;
    let target = crate::pg::wal_lsn(&pg).await?;
    let end = Instant::now() + timeout;
    loop {
        let c: Option<String> = pg
            .query_one(
                "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
                &[&slot],
            )
            .await?
            .get(0);
        let c = c
            .map(|c| crate::pg::parse_lsn(&c))
            .transpose()?
            .unwrap_or(0);
        if c >= target {
            return Ok(());
        }
        if Instant::now() > end {
            bail!(
                "slot {slot} at {} has not reached {} after {timeout:?}",
                crate::pg::fmt_lsn(c),
                crate::pg::fmt_lsn(target)
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn published_total(metrics: &str) -> f64 {
    metric_value(metrics, "outbox_relay_events_total{outcome=\"published\"}").unwrap_or(0.0)
}

/// The polling dispatcher, running (idle poll interval `poll_interval_ms`),
/// one run per rate.
pub async fn polling_runs(
    s: &Settings,
    table: &str,
    exchange: &str,
    queue: &str,
    amqp: &lapin::Connection,
) -> Result<Vec<LatencyRun>> {
    let mut probe = crate::amqp::DepthProbe::new(&s.amqp_url, queue).await?;
    probe.purge().await?;
    let (arrivals, consumer_ch) = Arrivals::start(amqp, queue).await?;
    let work = std::path::Path::new(&s.out_dir).join("work");
    let log = work.join("dispatcher-latency.log");
    let d = Dispatcher::spawn(
        DispatchArgs {
            table: table.into(),
            exchange: exchange.into(),
            window: s.window as usize,
            batch: s.poll_batch,
            poll_ms: s.poll_interval_ms,
            drain: false,
            record: true,
            result: work.join("dispatcher-latency.json").display().to_string(),
            worker: String::new(),
        },
        &log,
    )?;
    let pid = d.child.id().to_string();
    let mut produced = Vec::new();
    let res = async {
        for (k, &rate) in s.rates.iter().enumerate() {
            let cpu_before = crate::procs::cpu_seconds(&pid)?;
            eprintln!(
                "  polling dispatcher at {rate} events/s for {} s ...",
                s.seconds
            );
            let p = produce(&s.pg_url, table, rate, s.seconds, 0x2a00 + k as u32).await?;
            let missing = arrivals.wait_all(&p, Duration::from_secs(60)).await;
            // Let the last batch be marked published.
            tokio::time::sleep(Duration::from_millis(500)).await;
            let cpu = crate::procs::cpu_seconds(&pid)? - cpu_before;
            produced.push((rate, p, missing, cpu));
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        Ok::<_, anyhow::Error>(())
    }
    .await;
    let result = d.finish(&log).await;
    let _ = consumer_ch.close(200, "bye".into()).await;
    probe.close().await;
    res?;
    let result = result?;
    let marked: HashMap<&str, i64> = result
        .published
        .iter()
        .map(|(id, at)| (id.as_str(), *at))
        .collect();
    let mut runs = Vec::new();
    for (rate, p, missing, cpu) in produced {
        let consume = percentiles(arrivals.latencies(&p));
        let mut run = summarize("polling", s, rate, &p, missing, consume);
        let confirm: Vec<i64> = p
            .commits
            .iter()
            .filter_map(|(id, c)| marked.get(id.as_str()).map(|m| m - c))
            .collect();
        if confirm.len() != p.commits.len() {
            bail!(
                "the dispatcher marked {} of {} events of the {rate}/s run published",
                confirm.len(),
                p.commits.len()
            );
        }
        run.commit_to_confirm = percentiles(confirm);
        run.commit_to_confirm_measured = true;
        run.confirm_note = "measured: producer's COMMIT returned → the dispatcher's mark-published UPDATE returned (after the broker's confirms)".into();
        run.process_cpu_seconds = cpu;
        runs.push(run);
    }
    Ok(runs)
}
