//! One run: set the world up, start the relay, the consumer, the
//! producers and the nemesis together; when the faults are over and the
//! producers done, wait for the backlog to drain; then judge.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use outbox_relay::lsn::Lsn;
use tokio_util::sync::CancellationToken;

use crate::common::{ctl_async, pg_connect_retry, rabbitmq_ctl};
use crate::consumer::{Consumer, From};
use crate::nemesis::{Supervisor, inflict, supervise};
use crate::oracle::{self, Committed};
use crate::schedule::Schedule;
use crate::workload::{Produced, Producer};
use crate::world::World;

/// Once the faults stop and the producers are done, everything committed
/// must be delivered, and the slot past the last commit, within this plus
/// the time PostgreSQL takes to decode the run's WAL (measured by the
/// observer slot reading its record meanwhile): a run with millions of
/// unpublished rows waits on the walsender's decoding, which no relay can
/// go past, and two lanes on two cores decode slower still.
pub const DRAIN_BOUND: Duration = Duration::from_secs(90);
/// The relay's peak resident memory may not pass this (the Kubernetes
/// manifest's limit).
pub const RSS_BOUND: u64 = 256 << 20;
/// Events written in a run, about, beyond its first round.
const EVENT_CAP: u64 = 40_000;

#[derive(Debug, Default)]
pub struct Report {
    pub seed: u64,
    pub schedule: String,
    pub failures: Vec<String>,
    pub faults: BTreeMap<String, usize>,
    pub duplicates_by_fault: BTreeMap<String, usize>,
    pub events: usize,
    pub deliveries: usize,
    pub duplicates: usize,
    pub dead_lettered: usize,
    pub latencies_ms: Vec<f64>,
    pub peak_rss: u64,
    /// From the end of the faults and producers until everything was
    /// delivered and the slot past the last commit (or until the bound).
    pub drain_secs: f64,
    /// Of which: waiting for the run's last statements, and reading the
    /// record (the observer slot's decoding).
    pub drain_phases: (f64, f64),
    pub wall_secs: f64,
    pub relay_starts: usize,
    pub remedies: Vec<String>,
    pub produced: (usize, usize, usize),
}

impl Report {
    pub fn failed(&self) -> bool {
        !self.failures.is_empty()
    }
}

/// Longest a run may take, all phases: past it, the run failed (a hang).
/// What it left on the servers is swept by the next run.
const RUN_BOUND: Duration = Duration::from_secs(900);

/// [`run`], failed when it passes [`RUN_BOUND`].
pub async fn bounded(s: &Schedule) -> Report {
    let mut running = Box::pin(run(s));
    match tokio::time::timeout(RUN_BOUND, &mut running).await {
        Ok(r) => r,
        Err(_) => {
            // The relay's logs, before the run (and its directory) goes.
            // Not its configuration: it holds the servers' passwords.
            let taken = crate::world::CURRENT.lock().unwrap().take();
            if let Some((dir, p)) = taken {
                let kept = crate::out_dir().join(format!("run-{}-{p}-hang", s.seed));
                let _ = std::fs::create_dir_all(&kept);
                for f in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
                    if f.path().extension().is_some_and(|x| x == "toml") {
                        continue;
                    }
                    let _ = std::fs::copy(f.path(), kept.join(f.file_name()));
                }
                println!("checker: the relay's logs are in {}", kept.display());
            }
            drop(running);
            // Not left in force for the next run.
            crate::nemesis::let_go().await;
            Report {
                seed: s.seed,
                schedule: s.to_string(),
                failures: vec![format!("HANG: the run did not end within {RUN_BOUND:?}")],
                ..Report::default()
            }
        }
    }
}

async fn run(s: &Schedule) -> Report {
    let started = Instant::now();
    // The relay logs wall-clock times; the checker's clock is monotonic.
    let clock = (std::time::SystemTime::now(), started);
    let mut report = Report {
        seed: s.seed,
        schedule: s.to_string(),
        ..Report::default()
    };
    let admin = pg_connect_retry().await;
    let w = World::create(s, &admin).await;
    let consumer = Consumer::start([
        (w.queue.clone(), From::Main),
        (w.dlq.clone(), From::Dead),
        (w.victim.clone(), From::Victim),
    ]);
    let sup = Supervisor::new(&w);
    let done = CancellationToken::new();
    let faults_done = Arc::new(AtomicBool::new(false));
    let mut timeline: Vec<(Instant, String)> = Vec::new();
    let nemesis = async {
        let mut failures = Vec::new();
        for (gap, f) in &s.faults {
            tokio::time::sleep(Duration::from_millis(u64::from(*gap))).await;
            timeline.push((Instant::now(), f.kind()));
            // Where a run that hangs got to.
            println!("checker: +{:.1}s {f}", started.elapsed().as_secs_f64());
            // A bounded queue fills whenever the consumer lags; a nack
            // the relay never heard (its connection cut, the relay killed
            // or restarted) leaves no log line, yet its replay comes after
            // later events: in such runs order is owed until the first
            // fault only.
            if s.setup.bounded_queue {
                crate::nemesis::order_broken(&sup);
            }
            if let Err(e) = inflict(&w, &sup, &consumer, f).await {
                failures.push(format!("{f}: {e}"));
            }
            println!(
                "checker: +{:.1}s {f}: over",
                started.elapsed().as_secs_f64()
            );
        }
        faults_done.store(true, std::sync::atomic::Ordering::SeqCst);
        failures
    };
    // Producers go round their lists until the faults are over (once at
    // least), so that faults meet a stream.
    // Past EVENT_CAP events in all, they stop after the first round: the
    // backlog stays within what the relay drains in DRAIN_BOUND.
    let written = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let producers =
        futures_util::future::join_all(s.producers.iter().enumerate().map(|(i, txs)| {
            let (w, faults_done, written) = (&w, Arc::clone(&faults_done), Arc::clone(&written));
            async move {
                let mut all = Vec::new();
                let mut round = 0u64;
                loop {
                    let p = Producer::new(w, i, s.seed.wrapping_add(round << 32));
                    all.push(
                        p.run(txs, Arc::clone(&written), EVENT_CAP, round == 0)
                            .await,
                    );
                    round += 1;
                    let capped = written.load(std::sync::atomic::Ordering::SeqCst) >= EVENT_CAP;
                    if faults_done.load(std::sync::atomic::Ordering::SeqCst)
                        || txs.is_empty()
                        || capped
                    {
                        break all;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }));
    // The supervisor watches until the producers are done too, and the
    // faults: a relay that stops meanwhile gets its remedy then,
    // not only at the drain, when every transaction has ended (which would
    // hide a remedy that misses one still open).
    let producers_done = Arc::new(AtomicBool::new(false));
    let producers = async {
        let r = producers.await;
        // Producers past EVENT_CAP may end before the faults do.
        while !faults_done.load(std::sync::atomic::Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        producers_done.store(true, std::sync::atomic::Ordering::SeqCst);
        r
    };
    let (fault_failures, produced, ()) = tokio::join!(
        nemesis,
        producers,
        async {
            supervise(&w, &sup, &done).await;
        }
        .with_cancel_on(&done, Arc::clone(&producers_done))
    );
    report.failures.extend(fault_failures);
    let produced: Vec<Produced> = produced.into_iter().flatten().collect();
    for p in &produced {
        report.produced.0 += p.committed_txs;
        report.produced.1 += p.rolled_back_txs;
        report.produced.2 += p.failed_txs;
    }

    // Drain: the supervisor still restarts a relay that stops.
    println!(
        "checker: +{:.1}s faults and writers done; draining",
        started.elapsed().as_secs_f64()
    );
    let drain = Instant::now();
    let sup_done = CancellationToken::new();
    let d = tokio::join!(
        async {
            let r = drain_until_complete(&w, &consumer, &sup).await;
            sup_done.cancel();
            r
        },
        supervise(&w, &sup, &sup_done)
    )
    .0;
    println!(
        "checker: +{:.1}s drain over",
        started.elapsed().as_secs_f64()
    );
    report.drain_secs = d.drained.unwrap_or_else(|| drain.elapsed()).as_secs_f64();
    report.drain_phases = (d.writers.as_secs_f64(), d.read.as_secs_f64());
    let (record, confirmed) = (d.record, d.confirmed);
    // Only a lost slot starts a recovery, which a SIGTERM may stop half
    // way: a slot the nemesis did drop, not one it meant to.
    let slot_lost = sup.lock().unwrap().dropped > 0;
    let record = match record {
        Ok(r) => r,
        Err(e) => {
            // No record, no verdict: the run counts as failed, for that.
            report.failures.push(format!("no verdict: {e}"));
            sup.lock().unwrap().stop(slot_lost);
            consumer.stop();
            w.cleanup().await;
            report.wall_secs = started.elapsed().as_secs_f64();
            return report;
        }
    };
    let last_commit = record.iter().map(|c| c.commit).max().unwrap_or(Lsn(0));
    let bound = format!(
        "{:.0}s ({DRAIN_BOUND:?}, plus the {:.1}s the observer slot took to decode the run's WAL, \
         plus {:.1}s of the operator's remedies)",
        d.bound.as_secs_f64(),
        d.read.as_secs_f64(),
        d.remedy.as_secs_f64()
    );
    if d.drained.is_none() {
        report.failures.push(format!(
            "STALL: the backlog was not drained (every committed event delivered, the slot past \
             the last commit) within {bound} after the faults stopped"
        ));
    }
    if confirmed < last_commit {
        report.failures.push(format!(
            "STALL: the slot's confirmed position {confirmed} is still before the last commit {last_commit} \
             {bound} after the faults stopped"
        ));
    }
    // Late stray deliveries (a rolled-back event, a duplicate) show here.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let got = consumer.snapshot();
    // First deliveries keep commit order per aggregate until the first
    // moment the README says they may not: the supervisor's
    // `order_broken` (a re-publication goes by created_at), or the first
    // nack a relay logged (its retry comes after later events; a bounded
    // queue nacks whenever the consumer lags), less a margin for the
    // deliveries that passed the nacked message before the relay heard.
    let nacked = first_nack(w.dir.path()).map(|t| {
        let since = t.duration_since(clock.0).unwrap_or_default();
        (clock.1 + since)
            .checked_sub(NACK_MARGIN)
            .unwrap_or(clock.1)
    });
    let order = Some(
        [sup.lock().unwrap().order_broken, nacked]
            .into_iter()
            .flatten()
            .min()
            .unwrap_or_else(|| Instant::now() + Duration::from_secs(86_400)),
    );
    // Read again: a statement given up on may have committed meanwhile.
    let mut record =
        match oracle::committed(&pg_connect_retry().await, &w.observer, &w.record).await {
            Ok(again) if again.len() >= record.len() => again,
            _ => record,
        };
    if s.setup.channels == 1 {
        oracle::by_id_alone(&mut record);
    }
    // A documented stop must have a cause among the faults: the relay
    // asking for `recover` or `republish` after a plain restart would be a
    // defect the remedy hides. A slot lost before the relay recorded any
    // checkpoint cannot be recovered from one: the relay then names
    // `republish --since` (README, "Recovery from LSN checkpoints"), which
    // only such a drop explains.
    // A re-created table explains the stops naming `republish` of the
    // relays started before its remedy ended; each dropped slot, one
    // recovery the relay starts by itself.
    {
        let sv = sup.lock().unwrap();
        let mut unrecorded = sv.dropped_unrecorded;
        let take = |n: &mut usize| {
            let explained = *n > 0;
            *n = n.saturating_sub(1);
            explained
        };
        for remedy in &sv.remedies {
            // What the relay said, not what the operator's commands did.
            let said = remedy.text.split("; operator:").next().unwrap_or_default();
            let ok = if said.contains("no checkpoint recorded for slot") {
                take(&mut unrecorded)
            } else if said.contains("outbox-relay republish") {
                sv.republish_explained(remedy.started, remedy.stopped)
            } else if said.contains("the recovery ended with") {
                // A pass that ended unfinished by itself: the relay says so
                // only once confirms are overdue past confirm_timeout_secs
                // (30 s), which only a fault that long explains.
                sv.dropped > 0 && holds_confirms(s)
            } else if said.contains("outbox-relay recover") {
                sv.dropped > 0
            } else {
                true
            };
            if !ok {
                report.failures.push(format!(
                    "a documented stop no fault of this run explains: {}",
                    remedy.text
                ));
            }
        }
        let started = recoveries_started(w.dir.path());
        if started > sv.dropped {
            report.failures.push(format!(
                "the relay started {started} recoveries of a lost slot, but the slot was dropped \
                 {} times",
                sv.dropped
            ));
        }
    }
    let hostile: std::collections::HashSet<String> = produced
        .iter()
        .flat_map(|p| p.hostile.iter().cloned())
        .collect();
    let v = oracle::judge(&record, &got, order, &hostile);
    report.failures.extend(v.failures);
    report.events = v.events;
    report.deliveries = v.deliveries;
    report.duplicates = v.duplicates;
    report.dead_lettered = v.dead_lettered;
    attribute(&mut report, &timeline, &got);
    // At-least-once allows a copy per fault, never one without a fault:
    // with nothing gone wrong, every event is sent once.
    if let Some(n) = report.duplicates_by_fault.get("none") {
        report.failures.push(format!(
            "DUPLICATE: {n} deliveries repeated an event before any fault was injected"
        ));
    }
    for (_, f) in &s.faults {
        *report.faults.entry(f.kind()).or_default() += 1;
    }
    latencies(&mut report, &produced, &got);

    let mut sv = sup.into_inner().unwrap();
    sv.stop(slot_lost);
    report.failures.append(&mut sv.failures);
    // Stopping may not take the slot back: it stays past the last commit.
    match slot_position(&pg_connect_retry().await, &w.slot).await {
        Some(l) if l >= last_commit => {}
        at => report.failures.push(format!(
            "after the relay stopped, its slot is {} (the last commit is {last_commit})",
            at.map_or("gone".into(), |l| format!("at {l}"))
        )),
    }
    report.peak_rss = sv.peak_rss;
    if sv.peak_rss > RSS_BOUND {
        report.failures.push(format!(
            "MEMORY: the relay's peak RSS {} MiB passed {} MiB",
            sv.peak_rss >> 20,
            RSS_BOUND >> 20
        ));
    }
    report.relay_starts = sv.starts;
    report.remedies = sv.remedies.into_iter().map(|r| r.text).collect();
    consumer.stop();
    // Leave the servers as found: a failed run must not poison the next.
    ctl_async(
        rabbitmq_ctl,
        &["ctl", "set_vm_memory_high_watermark", "0.4"],
    )
    .await;
    if report.failed() || std::env::var("CHECK_KEEP").is_ok_and(|v| v != "0") {
        // The relay's logs and config, for the failure (or when asked).
        let kept = crate::out_dir().join(format!("run-{}-{}", s.seed, w.p));
        let _ = std::fs::create_dir_all(&kept);
        for f in std::fs::read_dir(w.dir.path())
            .into_iter()
            .flatten()
            .flatten()
        {
            let _ = std::fs::copy(f.path(), kept.join(f.file_name()));
        }
        println!("checker: the relay's logs are in {}", kept.display());
    }
    w.cleanup().await;
    report.wall_secs = started.elapsed().as_secs_f64();
    report
}

/// What [`drain_until_complete`] saw.
struct Drained {
    record: Result<Vec<Committed>, String>,
    /// The slot's confirmed position, last read.
    confirmed: Lsn,
    /// When everything was delivered and the slot past the last commit,
    /// from the start, as the consumer's and the slot's timestamps say;
    /// `None`: not within `bound`.
    drained: Option<Duration>,
    /// [`DRAIN_BOUND`] plus `read` plus `remedy`.
    bound: Duration,
    /// Spent in the operator's remedies during the drain (the relay stands
    /// stopped meanwhile, as documented).
    remedy: Duration,
    /// Spent waiting for the run's statements to end, and reading the record.
    writers: Duration,
    read: Duration,
}

/// Waits (at most [`DRAIN_BOUND`] plus the record's decoding, plus the
/// time remedies take meanwhile) until every committed event was delivered
/// or dead-lettered and the slot passed the last commit.
async fn drain_until_complete(
    w: &World,
    consumer: &Consumer,
    sup: &std::sync::Mutex<Supervisor>,
) -> Drained {
    let start = Instant::now();
    let remedied = sup.lock().unwrap().remedy_time();
    let remedy = || sup.lock().unwrap().remedy_time().saturating_sub(remedied);
    let end = start + DRAIN_BOUND;
    // A connection of its own: a fault may have closed any earlier one.
    let pg = &pg_connect_retry().await;
    // A statement the producer gave up on may still commit: wait until
    // none of the run's writes is running, then read the record.
    while Instant::now() < end {
        let busy: i64 = pg
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE pid <> pg_backend_pid() \
                 AND backend_type = 'client backend' AND state <> 'idle' \
                 AND (query LIKE $1 OR query LIKE $2)",
                // Writes name the record; COMMIT PREPARED, the gid.
                &[&format!("%{}%", w.record), &format!("%PREPARED '{}%", w.p)],
            )
            .await
            .map_or(1, |r| r.get(0));
        if busy == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let writers = start.elapsed();
    // Commits are asynchronous here (synchronous_commit = off), and
    // decoding reads only flushed WAL: one synchronous commit that wrote
    // WAL flushes it all.
    let _ = pg
        .batch_execute(&format!(
            "BEGIN; SET LOCAL synchronous_commit = on; INSERT INTO {} VALUES (0); COMMIT",
            w.bulk
        ))
        .await;
    // The record is read (which can take as long as the drain, when the
    // observer slot decodes millions of unpublished rows) while the slot is
    // watched: the drain is judged by when things happened, not by when
    // the checker got to look.
    let mut samples: Vec<(Instant, Lsn)> = Vec::new();
    let reading = CancellationToken::new();
    let (mut record, ()) = tokio::join!(
        async {
            let r = oracle::committed(pg, &w.observer, &w.record).await;
            reading.cancel();
            r
        },
        async {
            let pg = pg_connect_retry().await;
            while !reading.is_cancelled() {
                if let Some(l) = slot_position(&pg, &w.slot).await {
                    samples.push((Instant::now(), l));
                }
                tokio::select! {
                    () = tokio::time::sleep(Duration::from_millis(250)) => {}
                    () = reading.cancelled() => {}
                }
            }
        }
    );
    let read_done = Instant::now();
    let read = read_done - start - writers;
    if std::env::var_os("CHECK_DEBUG").is_some() {
        let rows: i64 = pg
            .query_one(&format!("SELECT count(*) FROM {}", w.record), &[])
            .await
            .map_or(-1, |r| r.get(0));
        let flush: String = pg
            .query_one("SELECT pg_current_wal_flush_lsn()::text", &[])
            .await
            .map_or(String::new(), |r| r.get(0));
        eprintln!(
            "checker: record read: {:?} events decoded, {rows} rows in the table, WAL flushed to {flush}",
            record.as_ref().map(Vec::len)
        );
    }
    // Looked at until the bound, and once at least after the read.
    let seen = |record, confirmed, drained, remedy: Duration| Drained {
        record,
        confirmed,
        drained,
        bound: DRAIN_BOUND + read + remedy,
        remedy,
        writers,
        read,
    };
    loop {
        let spent = remedy();
        let bound = DRAIN_BOUND + read + spent;
        let until = (start + bound).max(read_done + Duration::from_secs(1));
        let pg = pg_connect_retry().await;
        if let Some(l) = slot_position(&pg, &w.slot).await {
            samples.push((Instant::now(), l));
        }
        let confirmed = samples.last().map_or(Lsn(0), |s| s.1);
        if let Ok(r) = &record {
            let last = r.iter().map(|c| c.commit).max().unwrap_or(Lsn(0));
            let passed = samples.iter().find(|s| s.1 >= last).map(|s| s.0);
            // Each event's first delivery (or dead letter).
            let mut first: std::collections::HashMap<String, Instant> =
                std::collections::HashMap::new();
            for d in consumer.snapshot() {
                first.entry(d.id).or_insert(d.at);
            }
            let delivered = r
                .iter()
                .map(|c| first.get(&c.id).copied())
                .try_fold(start, |m, t| t.map(|t| m.max(t)));
            if let (Some(p), Some(d)) = (passed, delivered) {
                let at = p.max(d) - start;
                return seen(record, confirmed, (at <= bound).then_some(at), spent);
            }
        }
        if Instant::now() >= until {
            return seen(record, confirmed, None, spent);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        if record.is_err() {
            record = oracle::committed(&pg, &w.observer, &w.record).await;
        }
    }
}

/// The slot's confirmed position, if it can be read.
async fn slot_position(pg: &tokio_postgres::Client, slot: &str) -> Option<Lsn> {
    pg.query_opt(
        "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
        &[&slot],
    )
    .await
    .ok()
    .flatten()
    .and_then(|row| row.get::<_, Option<String>>(0))
    .and_then(|s| s.parse().ok())
}

/// Whether a fault of `s` could keep the broker's confirms from the relay
/// for `rabbitmq.confirm_timeout_secs` (30 s by default, as the checker runs it), less a
/// margin: a stop that says confirms were overdue needs one.
fn holds_confirms(s: &Schedule) -> bool {
    use crate::schedule::Fault;
    s.faults.iter().any(|(_, f)| match f {
        Fault::Pause { ms }
        | Fault::BrokerRestart { ms }
        | Fault::MemoryAlarm { ms }
        | Fault::FullQueue { ms }
        | Fault::Stall { pg: false, ms } => *ms >= 25_000,
        _ => false,
    })
}

/// How long before a relay logged a nack first deliveries may already have
/// left commit order (the broker's nack, the relay's log line).
const NACK_MARGIN: Duration = Duration::from_secs(10);

/// When a relay of this run first logged a nack, from its logs in `dir`.
fn first_nack(dir: &std::path::Path) -> Option<std::time::SystemTime> {
    relay_logs(dir)
        .iter()
        .flat_map(|log| {
            // A nack line whose time cannot be read counts from the start:
            // no order judged, rather than judged past it.
            log.lines()
                .filter(|l| l.contains("broker nacked"))
                .map(|l| oracle::log_time(l).unwrap_or(std::time::UNIX_EPOCH))
                .min()
        })
        .min()
}

/// The logs of the relays of this run, in `dir`.
fn relay_logs(dir: &std::path::Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|f| {
            let n = f.file_name().to_string_lossy().into_owned();
            n.starts_with("relay-") && n.ends_with(".log")
        })
        .filter_map(|f| std::fs::read_to_string(f.path()).ok())
        .collect()
}

/// How many recoveries of a lost slot the relays of this run started by
/// themselves (not resumed), from their logs in `dir`.
fn recoveries_started(dir: &std::path::Path) -> usize {
    relay_logs(dir)
        .iter()
        .map(|log| {
            // Not a resumed one ("window=rows of the recovery recorded
            // earlier, ...").
            log.lines()
                .filter(|l| l.contains(crate::nemesis::STARTED) && !l.contains("recorded earlier"))
                .count()
        })
        .sum()
}

/// Each duplicate delivery counts against the last fault before it.
fn attribute(
    report: &mut Report,
    timeline: &[(Instant, String)],
    got: &[crate::consumer::Delivery],
) {
    let mut seen = std::collections::HashSet::new();
    for d in got.iter().filter(|d| d.from == From::Main) {
        if !seen.insert(d.id.as_str()) {
            let kind = timeline
                .iter()
                .rev()
                .find(|(t, _)| *t <= d.at)
                .map_or("none", |(_, k)| k.as_str());
            *report
                .duplicates_by_fault
                .entry(kind.to_owned())
                .or_default() += 1;
        }
    }
}

fn latencies(report: &mut Report, produced: &[Produced], got: &[crate::consumer::Delivery]) {
    let mut first: std::collections::HashMap<&str, Instant> = std::collections::HashMap::new();
    for d in got {
        first.entry(d.id.as_str()).or_insert(d.at);
    }
    for p in produced {
        for (id, at) in &p.committed_at {
            if let Some(t) = first.get(id.as_str()) {
                report
                    .latencies_ms
                    .push(t.saturating_duration_since(*at).as_secs_f64() * 1000.0);
            }
        }
    }
}

trait WithCancel: Sized {
    fn with_cancel_on(
        self,
        done: &CancellationToken,
        flag: Arc<AtomicBool>,
    ) -> impl Future<Output = ()>;
}

impl<F: Future<Output = ()>> WithCancel for F {
    /// Runs `self` until `flag` is set (the producers are done), then cancels
    /// `done` so that it ends.
    fn with_cancel_on(
        self,
        done: &CancellationToken,
        flag: Arc<AtomicBool>,
    ) -> impl Future<Output = ()> {
        let done = done.clone();
        async move {
            let watcher = async {
                while !flag.load(std::sync::atomic::Ordering::SeqCst) {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                done.cancel();
            };
            tokio::join!(self, watcher);
        }
    }
}
