//! Scenario 7, the channels sweep: the relay with `rabbitmq.channels` = N
//! next to N plain publishers at once (the relay's own client, a process
//! and a connection each), for every N of `BENCH_CHANNELS`, on each queue
//! type, into one queue and into a queue per partition (a consistent-hash
//! exchange on `aggregate_id` with N queues, as README "Consuming in
//! parallel" sets it up). The broker's CPU is split by kind of Erlang
//! process around every run, for the model of a broker with more cores.

use anyhow::{Context, Result};
use serde::Serialize;
use tokio_postgres::Client;

use super::Drain;
use super::check_all_there;
use super::drain::{Backlog, relay_drain};
use crate::Settings;
use crate::broker::{self, BrokerCost};
use crate::ceiling::PublisherRun;
use crate::relay::RelayConfig;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Layout {
    /// One queue bound to a topic exchange with `#`.
    OneQueue,
    /// N queues behind a consistent-hash exchange, N = channels.
    QueuePerPartition,
}

impl Layout {
    pub const ALL: [Layout; 2] = [Layout::OneQueue, Layout::QueuePerPartition];

    pub fn label(self) -> &'static str {
        match self {
            Layout::OneQueue => "one queue",
            Layout::QueuePerPartition => "a queue per partition",
        }
    }

    fn tag(self) -> &'static str {
        match self {
            Layout::OneQueue => "one",
            Layout::QueuePerPartition => "part",
        }
    }
}

/// One N on one queue type and layout.
#[derive(Debug, Clone, Serialize)]
pub struct Cell {
    pub queue_type: String,
    pub layout: Layout,
    pub channels: u32,
    pub queues: u32,
    pub relay: Drain,
    /// The relay's own count of published events (more than the events:
    /// it published some twice, and the queue filled early).
    pub relay_published: Option<f64>,
    /// The broker while the relay drained.
    pub relay_broker: BrokerCost,
    /// N processes of the relay's client at once.
    pub ceiling: PublisherRun,
    pub ceiling_broker: BrokerCost,
    /// Every pass's relay rate (first → last), CPU s/100k and plain
    /// publishers' rate, in the order run: `relay` and `ceiling` are the
    /// median passes of these.
    pub relay_rates: Vec<f64>,
    pub relay_cpu: Vec<f64>,
    pub ceiling_rates: Vec<f64>,
}

/// One pass of one cell, before the passes are folded into a [`Cell`].
struct Pass {
    relay: Drain,
    relay_published: Option<f64>,
    relay_broker: BrokerCost,
    ceiling: PublisherRun,
    ceiling_broker: BrokerCost,
}

/// The median of `runs` by `key` (the lower middle of an even count).
fn median_by<T>(runs: &[T], key: impl Fn(&T) -> f64) -> usize {
    let mut order: Vec<usize> = (0..runs.len()).collect();
    order.sort_by(|&a, &b| key(&runs[a]).total_cmp(&key(&runs[b])));
    order[(order.len() - 1) / 2]
}

/// A cell from its passes: the relay's median pass (by rate) with its
/// broker reading, the plain publishers' median pass with theirs, and every
/// pass's figures for the spread.
fn fold(queue_type: &str, layout: Layout, channels: u32, queues: u32, passes: Vec<Pass>) -> Cell {
    let r = median_by(&passes, |p| p.relay.events_per_s_after_first);
    let c = median_by(&passes, |p| p.ceiling.events_per_s);
    Cell {
        queue_type: queue_type.to_owned(),
        layout,
        channels,
        queues,
        relay_rates: passes
            .iter()
            .map(|p| p.relay.events_per_s_after_first)
            .collect(),
        relay_cpu: passes
            .iter()
            .map(|p| p.relay.cpu_seconds_per_100k)
            .collect(),
        ceiling_rates: passes.iter().map(|p| p.ceiling.events_per_s).collect(),
        relay: passes[r].relay.clone(),
        relay_published: passes[r].relay_published,
        relay_broker: passes[r].relay_broker.clone(),
        ceiling: passes[c].ceiling.clone(),
        ceiling_broker: passes[c].ceiling_broker.clone(),
    }
}

/// Everything the sweep measured.
#[derive(Debug, Clone, Serialize, Default)]
pub struct Sweep {
    pub events: u64,
    pub cells: Vec<Cell>,
    /// lapin with 4 channels on one connection and on 4 connections (one
    /// queue, each queue type): how the relay's channels should connect.
    pub connections: Vec<(String, PublisherRun)>,
}

impl Sweep {
    pub fn cell(&self, queue_type: &str, layout: Layout, channels: u32) -> Option<&Cell> {
        self.cells
            .iter()
            .find(|c| c.queue_type == queue_type && c.layout == layout && c.channels == channels)
    }
}

const TABLE: &str = "bench_outbox_ch";
const PUBLICATION: &str = "bench_pub_ch";
const SLOT_PREFIX: &str = "bench_slot_ch_";

/// Exchange and queues of one cell.
fn topology(qt: &str, layout: Layout, channels: u32) -> (String, Vec<String>) {
    match layout {
        Layout::OneQueue => (
            format!("bench_ex_ch_{qt}"),
            vec![format!("bench_q_ch_{qt}")],
        ),
        Layout::QueuePerPartition => (
            format!("bench_hx_ch_{qt}"),
            (0..channels)
                .map(|i| format!("bench_q_ch_{qt}_part_{i}"))
                .collect(),
        ),
    }
}

/// A cell's exchange and queues, the queues empty and new.
async fn declare(
    amqp: &lapin::Connection,
    layout: Layout,
    exchange: &str,
    queues: &[String],
    qt: &str,
) -> Result<()> {
    match layout {
        Layout::OneQueue => crate::amqp::declare(amqp, exchange, &queues[0], qt).await,
        Layout::QueuePerPartition => {
            crate::amqp::declare_partitions(amqp, exchange, queues, qt).await
        }
    }
}

/// Drops `slot` once its walsender (its relay just stopped) has gone.
async fn drop_slot(pg: &Client, slot: &str) -> Result<()> {
    for _ in 0..50 {
        let dropped = pg
            .execute(
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1 AND active_pid IS NULL",
                &[&slot],
            )
            .await?;
        if dropped == 1 {
            return Ok(());
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    anyhow::bail!("slot {slot} still active 5 s after its relay stopped")
}

async fn drop_leftovers(pg: &Client) -> Result<()> {
    pg.execute(
        "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE starts_with(slot_name, $1) AND active_pid IS NOT NULL",
        &[&SLOT_PREFIX],
    )
    .await?;
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    pg.execute(
        "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE starts_with(slot_name, $1)",
        &[&SLOT_PREFIX],
    )
    .await?;
    pg.batch_execute(&format!(
        "DROP PUBLICATION IF EXISTS {PUBLICATION}; DROP TABLE IF EXISTS {TABLE};"
    ))
    .await?;
    Ok(())
}

/// The sweep. Each pass commits a backlog of `s.channels_events` events
/// that serves every cell: each relay drains it through a slot of its own,
/// created before the pass's inserts.
pub async fn sweep(s: &Settings, pg: &Client, amqp: &lapin::Connection) -> Result<Sweep> {
    let mut s = s.clone();
    s.events = s.channels_events;
    let s = &s;
    eprintln!(
        "== channels sweep: N = {:?}, {} events per run, {} passes ==",
        s.channels, s.events, s.channels_passes
    );
    drop_leftovers(pg).await?;
    let r = sweep_passes(s, pg, amqp).await;
    // On an error too: no slot left holding WAL.
    let left = drop_leftovers(pg).await;
    let out = r?;
    left?;
    Ok(out)
}

/// The cells of one pass, each with a slot of its own, made before that
/// pass's backlog (so that each replays it once, and a pass holds no more
/// slots than there are cells: `max_replication_slots`).
fn pass_plan(s: &Settings, pass: u64) -> Result<Vec<(String, Layout, u32, RelayConfig)>> {
    let mut plan = Vec::new();
    for qt in &s.queue_types {
        for layout in Layout::ALL {
            for &n in &s.channels {
                let (exchange, _) = topology(qt, layout, n);
                let slot = format!("{SLOT_PREFIX}{qt}_{}_{n}_p{pass}", layout.tag());
                let cfg = RelayConfig::write_channels(
                    s,
                    &format!("ch-{qt}-{}-{n}-p{pass}", layout.tag()),
                    TABLE,
                    &slot,
                    PUBLICATION,
                    &exchange,
                    n,
                )?;
                cfg.setup()?;
                plan.push((qt.clone(), layout, n, cfg));
            }
        }
    }
    Ok(plan)
}

async fn sweep_passes(s: &Settings, pg: &Client, amqp: &lapin::Connection) -> Result<Sweep> {
    crate::pg::create_outbox(pg, &s.outbox_sql, TABLE).await?;
    let mut out = Sweep {
        events: s.events,
        ..Default::default()
    };
    let window = s.window as usize;
    // Passes interleaved (every cell once, then again), so that a drift of
    // the machine's load spreads over the cells instead of landing on one.
    let mut runs: Vec<Vec<Pass>> = Vec::new();
    let mut cells: Vec<(String, Layout, u32)> = Vec::new();
    for pass in 0..s.channels_passes as usize {
        let plan = pass_plan(s, pass as u64)?;
        eprintln!("  pass {}: committing {} events ...", pass + 1, s.events);
        let lsn0 = crate::pg::wal_lsn(pg).await?;
        let first = 1 + pass as u64 * s.events;
        let insert = crate::pg::insert_backlog(pg, TABLE, first, s.events, s.tx_rows).await?;
        let lsn1 = crate::pg::wal_lsn(pg).await?;
        pg.batch_execute("CHECKPOINT").await?;
        let backlog = Backlog { lsn0, lsn1, insert };
        if runs.is_empty() {
            runs = plan.iter().map(|_| Vec::new()).collect();
            cells = plan
                .iter()
                .map(|(q, l, n, _)| (q.clone(), *l, *n))
                .collect();
        }
        for (k, (qt, layout, n, cfg)) in plan.iter().enumerate() {
            let (exchange, queues) = topology(qt, *layout, *n);
            declare(amqp, *layout, &exchange, &queues, qt).await?;
            let mut probe = crate::amqp::DepthProbe::over(&s.amqp_url, queues.clone()).await?;
            eprintln!(
                "  pass {}/{}, {qt}, {}, N = {n}: relay drain ...",
                pass + 1,
                s.channels_passes,
                layout.label()
            );
            let b0 = broker::snapshot()?;
            // Read while the relay still runs: its connections' processes
            // (channels, readers, writers) are alive to be charged.
            let mut b1 = None;
            let (relay, published) = relay_drain(s, pg, cfg, &mut probe, &backlog, &mut || {
                b1 = Some(broker::snapshot())
            })
            .await?;
            let b1 = b1.context("the drain ended without reading the broker")??;
            let relay_broker = broker::cost(&b0, &b1, s.events);
            eprintln!(
                "    relay: {:.0} events/s ({:.0} after the first), {:.2} CPU s/100k; broker {:.2} CPU s/100k, {:.0}% not charged to a live process",
                relay.events_per_s,
                relay.events_per_s_after_first,
                relay.cpu_seconds_per_100k,
                relay_broker.cpu_seconds_per_100k,
                relay_broker.unattributed_share * 100.0
            );
            // Fresh queues for the plain publishers, as the relay had: no
            // purged messages being cleaned up during their run.
            probe.purge().await?;
            declare(amqp, *layout, &exchange, &queues, qt).await?;
            eprintln!(
                "  pass {}/{}, {qt}, {}, N = {n}: {n} plain publishers ...",
                pass + 1,
                s.channels_passes,
                layout.label()
            );
            let b0 = broker::snapshot()?;
            let ceiling =
                crate::ceiling::relay_clients(&s.amqp_url, &exchange, window, s.events, *n as u64)
                    .await?;
            let ceiling_broker = broker::cost(&b0, &broker::snapshot()?, s.events);
            check_all_there(&ceiling, &mut probe, s.events).await?;
            eprintln!(
                "    plain: {:.0} events/s; broker {:.2} CPU s/100k",
                ceiling.events_per_s, ceiling_broker.cpu_seconds_per_100k
            );
            if pass == 0 && *n == 4 && *layout == Layout::OneQueue {
                for per_connection in [false, true] {
                    probe.purge().await?;
                    let run = crate::ceiling::lapin_channels(
                        &s.amqp_url,
                        &exchange,
                        window,
                        s.events,
                        4,
                        per_connection,
                    )
                    .await?;
                    check_all_there(&run, &mut probe, s.events).await?;
                    eprintln!("    {}: {:.0} events/s", run.name, run.events_per_s);
                    out.connections.push((qt.clone(), run));
                }
            }
            probe.purge().await?;
            probe.close().await;
            crate::amqp::delete(amqp, &exchange, &queues).await?;
            runs[k].push(Pass {
                relay,
                relay_published: published,
                relay_broker,
                ceiling,
                ceiling_broker,
            });
            // This pass's slot is done with: the WAL it held goes.
            drop_slot(pg, &cfg.slot).await?;
        }
    }
    for ((qt, layout, n), passes) in cells.iter().zip(runs) {
        let queues = topology(qt, *layout, *n).1.len() as u32;
        out.cells.push(fold(qt, *layout, *n, queues, passes));
    }
    Ok(out)
}
