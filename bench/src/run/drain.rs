//! The relay as a process in a round: set up for a queue type, timed through a drain, cleaned up.

use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use tokio_postgres::Client;

use super::{Drain, Names, lsn_diff};
use crate::Settings;
use crate::relay::{RelayConfig, metric_value};

pub(super) async fn drop_leftovers(pg: &Client, n: &Names) -> Result<()> {
    // The slots of every pass (`<slot>`, `<slot>_p2`, ...) and the decode
    // slot; also what an earlier run on the same servers left.
    let which = "slot_name = $1 OR starts_with(slot_name, $2 || '_p') OR slot_name = $3";
    pg.execute(
        &format!("SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE ({which}) AND active_pid IS NOT NULL"),
        &[&n.slot, &n.slot, &n.recv_slot],
    )
    .await?;
    tokio::time::sleep(Duration::from_millis(200)).await;
    pg.execute(
        &format!(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE {which}"
        ),
        &[&n.slot, &n.slot, &n.recv_slot],
    )
    .await?;
    pg.batch_execute(&format!(
        "DROP PUBLICATION IF EXISTS {}; DROP TABLE IF EXISTS {}; DROP TABLE IF EXISTS {};",
        n.publication, n.table, n.poll_table
    ))
    .await?;
    Ok(())
}

/// Table, exchange, queue, relay config and `outbox-relay setup`.
pub(super) async fn prepare_relay(
    s: &Settings,
    pg: &Client,
    amqp: &lapin::Connection,
    n: &Names,
) -> Result<RelayConfig> {
    drop_leftovers(pg, n).await?;
    crate::amqp::declare(amqp, &n.exchange, &n.queue, &n.queue_type).await?;
    crate::pg::create_outbox(pg, &s.outbox_sql, &n.table).await?;
    let cfg = RelayConfig::write(
        s,
        n.slot.trim_start_matches("bench_slot_"),
        &n.table,
        &n.slot,
        &n.publication,
        &n.exchange,
    )?;
    cfg.setup()?;
    Ok(cfg)
}

/// One relay drain: start `outbox-relay run`, wait until the queue holds
/// every event, read CPU and RSS, stop it. Also returns the relay's own
/// count of published events.
/// The committed backlog a drain reads: WAL positions around the inserts
/// and how long they took.
#[derive(Clone, Copy)]
pub(super) struct Backlog {
    pub lsn0: u64,
    pub lsn1: u64,
    pub insert: Duration,
}

/// `at_done` runs the moment the queue holds every event, while the relay
/// still runs (the channels sweep reads the broker's processes then, with
/// the relay's connections still open).
pub(super) async fn relay_drain(
    s: &Settings,
    pg: &Client,
    cfg: &RelayConfig,
    probe: &mut crate::amqp::DepthProbe,
    backlog: &Backlog,
    at_done: &mut dyn FnMut(),
) -> Result<(Drain, Option<f64>)> {
    let Backlog { lsn0, lsn1, insert } = *backlog;
    probe.purge().await?;
    pg.batch_execute("CHECKPOINT").await?;
    let lsn_start = crate::pg::wal_lsn(pg).await?;
    let t0 = Instant::now();
    let mut child = cfg.spawn("drain")?;
    let pid = child.id().to_string();
    let waited = probe
        .wait_for(
            s.events,
            Duration::from_millis(20),
            Duration::from_secs(1800),
            || match child.try_wait()? {
                Some(st) => bail!("relay exited ({st}) during the drain"),
                None => Ok(()),
            },
        )
        .await;
    let measured = match waited {
        Ok((first, done)) => {
            at_done();
            let cpu = crate::procs::cpu_seconds(&pid)?;
            let rss = crate::procs::peak_rss_bytes(&pid)?;
            let walsender = walsender_cpu(pg, &cfg.slot).await;
            let published =
                cfg.metrics().await.ok().and_then(|t| {
                    metric_value(&t, "outbox_relay_events_total{outcome=\"published\"}")
                });
            Ok((first, done, cpu, rss, walsender, published))
        }
        Err(e) => Err(e),
    };
    let stopped = crate::procs::terminate(&mut child, Duration::from_secs(30)).await;
    let (first, done, cpu, rss, walsender, published) =
        measured.map_err(|e| e.context(format!("relay log:\n{}", cfg.log_tail("drain"))))?;
    stopped?;
    let lsn2 = crate::pg::wal_lsn(pg).await?;
    let secs = (done - t0).as_secs_f64();
    let after_first = (done - first).as_secs_f64().max(1e-9);
    // The CHECKPOINT's own record is not the relay's.
    let drain_wal = lsn_diff(lsn_start, lsn2);
    Ok((
        Drain {
            events: s.events,
            seconds: secs,
            events_per_s: s.events as f64 / secs,
            seconds_after_first: after_first,
            events_per_s_after_first: s.events as f64 / after_first,
            cpu_seconds: cpu,
            cpu_seconds_per_100k: cpu / s.events as f64 * 100_000.0,
            walsender_cpu_seconds_per_100k: walsender.map(|w| w / s.events as f64 * 100_000.0),
            peak_rss_bytes: rss,
            insert_wal_bytes: lsn_diff(lsn0, lsn1),
            insert_seconds: insert.as_secs_f64(),
            drain_wal_bytes: drain_wal,
            wal_bytes_per_event: (lsn_diff(lsn0, lsn1) + drain_wal) as f64 / s.events as f64,
        },
        published,
    ))
}

/// CPU seconds of the walsender streaming `slot` so far (it started with
/// the relay), or none when it cannot be read.
async fn walsender_cpu(pg: &Client, slot: &str) -> Option<f64> {
    let row = pg
        .query_opt(
            "SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .ok()??;
    let pid: Option<i32> = row.get(0);
    crate::procs::cpu_seconds(&pid?.to_string()).ok()
}

/// The relay over the same events as logical messages: no table at all.
pub(super) async fn messages_drain(
    s: &Settings,
    pg: &Client,
    n: &Names,
    probe: &mut crate::amqp::DepthProbe,
) -> Result<Drain> {
    let (slot, publication) = (format!("{}_msg", n.slot), format!("{}_msg", n.publication));
    let prefix = format!("bench-{}", n.queue_type);
    pg.batch_execute(&format!("DROP PUBLICATION IF EXISTS {publication}"))
        .await?;
    let cfg = RelayConfig::write_messages(
        s,
        &format!("{}-msg", n.slot.trim_start_matches("bench_slot_")),
        &prefix,
        &slot,
        &publication,
        &n.exchange,
    )?;
    cfg.setup()?;
    eprintln!(
        "  table-less: emitting {} events as logical messages ...",
        s.events
    );
    let lsn0 = crate::pg::wal_lsn(pg).await?;
    let insert = crate::pg::emit_backlog(pg, &prefix, 1, s.events, s.tx_rows).await?;
    let lsn1 = crate::pg::wal_lsn(pg).await?;
    pg.batch_execute("CHECKPOINT").await?;
    eprintln!("  table-less: relay drain ...");
    let backlog = Backlog { lsn0, lsn1, insert };
    let (d, _) = relay_drain(s, pg, &cfg, probe, &backlog, &mut || {}).await?;
    eprintln!(
        "    relay (table-less): {:.0} events/s, {:.2} CPU s/100k, {:.0} WAL bytes/event",
        d.events_per_s, d.cpu_seconds_per_100k, d.wal_bytes_per_event
    );
    pg.execute("SELECT pg_drop_replication_slot($1)", &[&slot])
        .await?;
    pg.batch_execute(&format!("DROP PUBLICATION IF EXISTS {publication}"))
        .await?;
    Ok(d)
}
