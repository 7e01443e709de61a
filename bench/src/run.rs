//! `relay-bench run`: every scenario, in order, then the report.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde::Serialize;
use tokio_postgres::Client;

use crate::Settings;
use crate::ceiling::{PublisherRun, RustPublisher};
use crate::latency::LatencyRun;
use crate::polling::{DispatchArgs, Dispatcher, claim_sql};
use crate::relay::RelayConfig;
use crate::report::{Machine, Report};

pub mod channels;
mod drain;
use drain::{drop_leftovers, messages_drain, prepare_relay, relay_drain};

/// Names of everything one queue type uses.
pub struct Names {
    pub queue_type: String,
    pub exchange: String,
    pub queue: String,
    pub table: String,
    pub slot: String,
    pub publication: String,
    pub recv_slot: String,
    pub poll_table: String,
}

impl Names {
    /// Names ending in `_<tag>`, for a queue of type `qt`.
    fn new(qt: &str, tag: &str) -> Names {
        Names {
            queue_type: qt.into(),
            exchange: format!("bench_ex_{tag}"),
            queue: format!("bench_q_{tag}"),
            table: format!("bench_outbox_{tag}"),
            slot: format!("bench_slot_{tag}"),
            publication: format!("bench_pub_{tag}"),
            recv_slot: format!("bench_recv_{tag}"),
            poll_table: format!("bench_poll_{tag}"),
        }
    }
}

/// A drain: N events already committed, a process started, the queue
/// filling up.
#[derive(Debug, Clone, Serialize, Default)]
pub struct Drain {
    pub events: u64,
    /// Process start → the queue holds every event.
    pub seconds: f64,
    pub events_per_s: f64,
    /// First message in the queue → every event (start-up excluded).
    pub seconds_after_first: f64,
    pub events_per_s_after_first: f64,
    pub cpu_seconds: f64,
    pub cpu_seconds_per_100k: f64,
    /// The relay's walsender (decoding the slot for it), per 100,000
    /// events; none for the polling dispatcher.
    pub walsender_cpu_seconds_per_100k: Option<f64>,
    pub peak_rss_bytes: u64,
    /// WAL written while committing the backlog.
    pub insert_wal_bytes: u64,
    pub insert_seconds: f64,
    /// WAL written while draining (the dispatcher's UPDATEs; the relay's
    /// checkpoint row).
    pub drain_wal_bytes: u64,
    /// (insert + drain) / events.
    pub wal_bytes_per_event: f64,
}

/// pg_recvlogical over the backlog's WAL.
#[derive(Debug, Clone, Serialize, Default)]
pub struct Decode {
    pub rows: u64,
    pub wal_bytes: u64,
    pub seconds: f64,
    pub rows_per_s: f64,
}

/// Everything measured on one queue type.
#[derive(Debug, Clone, Serialize, Default)]
pub struct QueueTypeResult {
    pub queue_type: String,
    pub events: u64,
    pub decode: Option<Decode>,
    /// The fastest of `relay_passes`.
    pub relay: Option<Drain>,
    /// The relay draining the same events from a table-less outbox
    /// (transactional logical messages).
    pub relay_messages: Option<Drain>,
    pub relay_passes: Vec<Drain>,
    pub relay_published_metric: Option<f64>,
    /// The fastest run of each publisher.
    pub publishers: Vec<PublisherRun>,
    pub publisher_passes: Vec<PublisherRun>,
    pub skipped_publishers: Vec<String>,
    pub polling: Option<Drain>,
    pub polling_batches: u64,
    pub polling_claim_seconds: f64,
    pub polling_publish_seconds: f64,
    pub polling_mark_seconds: f64,
}

impl QueueTypeResult {
    /// The fastest bare publisher.
    pub fn ceiling(&self) -> Option<&PublisherRun> {
        self.publishers
            .iter()
            .max_by(|a, b| a.events_per_s.total_cmp(&b.events_per_s))
    }
}

fn lsn_diff(a: u64, b: u64) -> u64 {
    b.saturating_sub(a)
}

async fn queue_type_round(
    s: &Settings,
    pg: &Client,
    amqp: &lapin::Connection,
    n: &Names,
    explain: &mut Option<String>,
    node: &Result<String, String>,
) -> Result<QueueTypeResult> {
    let mut r = QueueTypeResult {
        queue_type: n.queue_type.clone(),
        events: s.events,
        ..Default::default()
    };
    let work = Path::new(&s.out_dir).join("work");
    eprintln!("== {} queue ==", n.queue_type);
    let cfg = prepare_relay(s, pg, amqp, n).await?;
    // One slot per drain pass, all created before the inserts.
    let mut cfgs = vec![cfg];
    for pass in 2..=s.passes {
        let slot = format!("{}_p{pass}", n.slot);
        let cfg = RelayConfig::write(
            s,
            &format!("{}-p{pass}", n.slot.trim_start_matches("bench_slot_")),
            &n.table,
            &slot,
            &n.publication,
            &n.exchange,
        )?;
        cfg.setup()?;
        cfgs.push(cfg);
    }
    pg.execute(
        "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
        &[&n.recv_slot],
    )
    .await?;

    // 1. The backlog, committed while the relay is stopped.
    eprintln!(
        "  committing {} events in {}-row transactions ...",
        s.events, s.tx_rows
    );
    let lsn0 = crate::pg::wal_lsn(pg).await?;
    let insert = crate::pg::insert_backlog(pg, &n.table, 1, s.events, s.tx_rows).await?;
    let lsn1 = crate::pg::wal_lsn(pg).await?;
    pg.batch_execute("CHECKPOINT").await?;

    // 2a. PostgreSQL's decode rate over the same WAL.
    eprintln!("  pg_recvlogical (pgoutput) over the backlog ...");
    let d = crate::pg::recvlogical(&s.pg_url, &n.recv_slot, &n.publication, lsn1)?;
    pg.execute("SELECT pg_drop_replication_slot($1)", &[&n.recv_slot])
        .await?;
    r.decode = Some(Decode {
        rows: s.events,
        wal_bytes: lsn_diff(lsn0, lsn1),
        seconds: d.as_secs_f64(),
        rows_per_s: s.events as f64 / d.as_secs_f64(),
    });

    // 1 and 2b, interleaved: every pass drains with the relay (its own
    // slot, so each pass reads the same WAL) and runs every bare publisher;
    // the best of each is reported, every pass is kept in report.json.
    let mut probe = crate::amqp::DepthProbe::new(&s.amqp_url, &n.queue).await?;
    let window = s.window as usize;
    for (pass, cfg) in cfgs.iter().enumerate() {
        eprintln!("  pass {} of {}: relay drain ...", pass + 1, cfgs.len());
        let backlog = drain::Backlog { lsn0, lsn1, insert };
        let d = relay_drain(s, pg, cfg, &mut probe, &backlog, &mut || {}).await?;
        eprintln!(
            "    relay: {:.0} events/s, {:.2} CPU s/100k, peak RSS {:.1} MB",
            d.0.events_per_s,
            d.0.cpu_seconds_per_100k,
            d.0.peak_rss_bytes as f64 / 1048576.0
        );
        r.relay_published_metric = d.1;
        r.relay_passes.push(d.0);
        let publishers = if s.relay_only { 0 } else { 4 };
        for which in 0..publishers {
            probe.purge().await?;
            let run = match which {
                0 => {
                    eprintln!("  ceiling: lapin awaiting each publish ...");
                    crate::ceiling::rust_publisher(
                        &s.amqp_url,
                        &n.exchange,
                        window,
                        s.events,
                        RustPublisher::LapinAwaitEach,
                    )
                    .await?
                }
                1 => {
                    eprintln!("  ceiling: lapin pipelined ...");
                    crate::ceiling::rust_publisher(
                        &s.amqp_url,
                        &n.exchange,
                        window,
                        s.events,
                        RustPublisher::LapinPipelined,
                    )
                    .await?
                }
                2 => {
                    eprintln!("  ceiling: outbox-relay's client ...");
                    crate::ceiling::rust_publisher(
                        &s.amqp_url,
                        &n.exchange,
                        window,
                        s.events,
                        RustPublisher::RelayClient,
                    )
                    .await?
                }
                _ => match node {
                    Ok(_) => {
                        eprintln!("  ceiling: amqplib ...");
                        crate::ceiling::amqplib(
                            &s.node_dir,
                            &s.amqp_url,
                            &n.exchange,
                            window,
                            s.events,
                        )
                        .await?
                    }
                    Err(why) => {
                        if pass == 0 {
                            eprintln!("  ceiling: amqplib skipped: {why}");
                            r.skipped_publishers
                                .push(format!("{}: {why}", crate::ceiling::AMQPLIB));
                        }
                        continue;
                    }
                },
            };
            check_all_there(&run, &mut probe, s.events).await?;
            eprintln!("    {:.0} events/s", run.events_per_s);
            r.publisher_passes.push(run);
        }
    }
    probe.purge().await?;
    if s.table_less {
        r.relay_messages = Some(messages_drain(s, pg, n, &mut probe).await?);
        probe.purge().await?;
    }
    r.relay = r
        .relay_passes
        .iter()
        .max_by(|a, b| a.events_per_s.total_cmp(&b.events_per_s))
        .cloned();
    for name in crate::ceiling::PUBLISHERS {
        if let Some(best) = r
            .publisher_passes
            .iter()
            .filter(|p| p.name == name)
            .max_by(|a, b| a.events_per_s.total_cmp(&b.events_per_s))
        {
            r.publishers.push(best.clone());
        }
    }

    if s.relay_only {
        probe.close().await;
        drop_leftovers(pg, n).await?;
        return Ok(r);
    }

    // 3. The polling baseline over the same number of events.
    eprintln!("  polling baseline: committing {} events ...", s.events);
    crate::pg::create_poll_table(pg, &n.poll_table).await?;
    let p0 = crate::pg::wal_lsn(pg).await?;
    let pinsert = crate::pg::insert_backlog(pg, &n.poll_table, 1, s.events, s.tx_rows).await?;
    let p1 = crate::pg::wal_lsn(pg).await?;
    pg.batch_execute(&format!("VACUUM ANALYZE {}", n.poll_table))
        .await?;
    if explain.is_none() {
        let sql = claim_sql(&n.poll_table, s.poll_batch).replace("$1", "'explain'");
        *explain = Some(crate::pg::explain_analyze(pg, &sql).await?);
    }
    pg.batch_execute("CHECKPOINT").await?;
    let p1b = crate::pg::wal_lsn(pg).await?;
    eprintln!("  polling dispatcher drain ...");
    let log = work.join(format!("dispatcher-drain-{}.log", n.queue_type));
    let t0 = Instant::now();
    let mut d = Dispatcher::spawn(
        DispatchArgs {
            table: n.poll_table.clone(),
            exchange: n.exchange.clone(),
            window,
            batch: s.poll_batch,
            poll_ms: s.poll_interval_ms,
            drain: true,
            record: false,
            result: work
                .join(format!("dispatcher-drain-{}.json", n.queue_type))
                .display()
                .to_string(),
            worker: String::new(),
        },
        &log,
    )?;
    let waited = probe
        .wait_for(
            s.events,
            Duration::from_millis(20),
            Duration::from_secs(1800),
            || match d.child.try_wait()? {
                Some(st) if !st.success() => bail!("dispatcher exited ({st}) during the drain"),
                _ => Ok(()),
            },
        )
        .await;
    let res = d.finish(&log).await;
    let (first, done) = waited?;
    let res = res?;
    let p2 = crate::pg::wal_lsn(pg).await?;
    if res.events != s.events {
        bail!(
            "the dispatcher published {} of {} events",
            res.events,
            s.events
        );
    }
    let secs = (done - t0).as_secs_f64();
    let after_first = (done - first).as_secs_f64().max(1e-9);
    // The CHECKPOINT's own WAL record is not the dispatcher's.
    let drain_wal = lsn_diff(p1b, p2);
    r.polling = Some(Drain {
        events: s.events,
        seconds: secs,
        events_per_s: s.events as f64 / secs,
        seconds_after_first: after_first,
        events_per_s_after_first: s.events as f64 / after_first,
        cpu_seconds: res.cpu_seconds,
        cpu_seconds_per_100k: res.cpu_seconds / s.events as f64 * 100_000.0,
        walsender_cpu_seconds_per_100k: None,
        peak_rss_bytes: res.peak_rss_bytes,
        insert_wal_bytes: lsn_diff(p0, p1),
        insert_seconds: pinsert.as_secs_f64(),
        drain_wal_bytes: drain_wal,
        wal_bytes_per_event: (lsn_diff(p0, p1) + drain_wal) as f64 / s.events as f64,
    });
    r.polling_batches = res.batches;
    r.polling_claim_seconds = res.claim_seconds;
    r.polling_publish_seconds = res.publish_seconds;
    r.polling_mark_seconds = res.mark_seconds;
    eprintln!("  polling: {:.0} events/s", s.events as f64 / secs);
    probe.purge().await?;
    probe.close().await;
    // The drained tables and the slot are done with: free the WAL the slot
    // holds and the disk the tables take.
    drop_leftovers(pg, n).await?;
    Ok(r)
}

/// A bare publisher's run counts only if the broker took every message
/// and the queues hold them all.
async fn check_all_there(
    run: &PublisherRun,
    probe: &mut crate::amqp::DepthProbe,
    events: u64,
) -> Result<()> {
    if run.nacked > 0 || run.returned > 0 {
        bail!(
            "{}: {} nacked, {} returned",
            run.name,
            run.nacked,
            run.returned
        );
    }
    probe
        .wait_for(
            events,
            Duration::from_millis(50),
            Duration::from_secs(30),
            || Ok(()),
        )
        .await
        .with_context(|| format!("{}: confirmed messages missing from the queues", run.name))?;
    Ok(())
}

pub async fn run(s: Settings) -> Result<()> {
    let started = Instant::now();
    let started_at =
        crate::procs::command_output("date", &["-u", "+%Y-%m-%dT%H:%M:%SZ"]).unwrap_or_default();
    if !Path::new(&s.relay_bin).exists() {
        bail!("{} not found: cargo build --release first", s.relay_bin);
    }
    std::fs::create_dir_all(Path::new(&s.out_dir).join("work"))?;
    let pg = crate::pg::connect(&s.pg_url).await?;
    let amqp = crate::amqp::connect(&s.amqp_url, "relay-bench").await?;
    let node = crate::ceiling::node_ready(&s.node_dir);
    let mut machine = Machine::collect(&pg).await;
    machine.node = node.clone().unwrap_or_else(|e| format!("not used: {e}"));
    eprintln!(
        "relay-bench: {} events per drain, {} s per latency run at {:?} events/s, queue types {:?}",
        s.events, s.seconds, s.rates, s.queue_types
    );

    let mut explain = None;
    let mut rounds = Vec::new();
    let others = !s.channels_only;
    for qt in s.queue_types.iter().filter(|_| others) {
        let n = Names::new(qt, qt);
        rounds.push(queue_type_round(&s, &pg, &amqp, &n, &mut explain, &node).await?);
    }

    // 4. Latency under load.
    let mut latency: Vec<LatencyRun> = Vec::new();
    if others && !s.rates.is_empty() && s.seconds > 0 {
        // Tables, queue and slot of their own: the slot starts at the
        // current WAL position, not behind the drains' WAL.
        let n = Names::new(&s.latency_queue_type, "latency");
        eprintln!("== latency under load ({} queue) ==", n.queue_type);
        let cfg = prepare_relay(&s, &pg, &amqp, &n).await?;
        crate::pg::create_poll_table(&pg, &n.poll_table).await?;
        pg.batch_execute("CHECKPOINT").await?;
        latency.extend(
            crate::latency::relay_runs(&s, &cfg, &n.slot, &n.table, &n.queue, &amqp).await?,
        );
        pg.batch_execute("CHECKPOINT").await?;
        latency.extend(
            crate::latency::polling_runs(&s, &n.poll_table, &n.exchange, &n.queue, &amqp).await?,
        );
    }

    // 5. Several channels.
    // Last, so that its failure (a broker without the consistent-hash
    // plugin, rabbitmqctl refusing) costs the report nothing else.
    let (channels, channels_error) = if s.channels.is_empty() {
        (None, None)
    } else {
        match channels::sweep(&s, &pg, &amqp).await {
            Ok(sweep) => (Some(sweep), None),
            Err(e) => {
                eprintln!("relay-bench: the channels sweep failed: {e:#}");
                (None, Some(format!("{e:#}")))
            }
        }
    };

    machine.load_after = crate::report::loadavg();
    let report = Report {
        started_at,
        duration_seconds: started.elapsed().as_secs_f64(),
        settings: s.clone(),
        machine,
        queue_types: rounds,
        latency,
        channels,
        channels_error,
        claim_explain: explain.unwrap_or_default(),
        claim_sql: claim_sql("outbox_poll", s.poll_batch),
        mark_sql: crate::polling::mark_sql("outbox_poll"),
        targets: Vec::new(),
    };
    let _ = amqp.close(200, "bye".into()).await;
    crate::report::write(report, &s.out_dir)
}
