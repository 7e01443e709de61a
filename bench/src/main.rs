//! `relay-bench`: the benchmark harness behind `make bench`.
//!
//! ```text
//! relay-bench run        all scenarios against TEST_PG_URL / TEST_AMQP_URL,
//!                        report in target/bench (BENCH_* variables scale it)
//! relay-bench dispatch   the polling dispatcher (a child process of `run`)
//! ```
//!
//! The relay is driven as a process (`target/release/outbox-relay`), exactly
//! as an operator runs it; the harness links the relay's library only for
//! the relay's AMQP client (one bare publisher, and the polling dispatcher).

/// mimalloc for every process of the harness: lapin's I/O thread frees
/// what the publishing thread allocates, and glibc's allocator serializes
/// that on its arena locks. The relay itself, one thread, gains nothing
/// from it and uses the system allocator.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

mod amqp;
mod broker;
mod ceiling;
mod latency;
mod pg;
mod polling;
mod procs;
mod relay;
mod report;
mod run;
mod stats;
mod workload;

use anyhow::{Context, Result, bail};

/// Everything `run` can be told through the environment.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Settings {
    /// Events per drain (relay and polling) and per ceiling publisher.
    pub events: u64,
    /// Interleaved passes of relay drain + bare publishers (best reported).
    pub passes: u64,
    /// Rows per transaction of the backlog.
    pub tx_rows: u64,
    /// Seconds per latency run.
    pub seconds: u64,
    /// Producer rates of the latency runs (events/s).
    pub rates: Vec<u64>,
    /// Queue types for the drains and the ceilings.
    pub queue_types: Vec<String>,
    /// Queue type of the latency runs.
    pub latency_queue_type: String,
    /// Confirm window of every publisher (the relay's `rabbitmq.window`).
    pub window: u64,
    /// Rows per claim of the polling dispatcher.
    pub poll_batch: u64,
    /// Idle poll interval of the polling dispatcher (ms).
    pub poll_interval_ms: u64,
    /// Only the relay drains (no bare publishers, no polling): for quick
    /// measurements while working on the relay.
    pub relay_only: bool,
    /// Whether to drain a table-less outbox too (off to measure a relay
    /// binary from before table-less outboxes existed).
    pub table_less: bool,
    /// `rabbitmq.channels` values of the channels sweep (empty: no sweep).
    pub channels: Vec<u32>,
    /// Events per run of the channels sweep.
    pub channels_events: u64,
    /// Passes of every cell of the channels sweep (the median reported,
    /// the spread shown).
    pub channels_passes: u64,
    /// Only the channels sweep (no drains, ceilings, polling or latency).
    pub channels_only: bool,
    /// Where the report goes.
    pub out_dir: String,
    /// The relay binary.
    pub relay_bin: String,
    /// bench/amqplib (with node_modules), if node is to be used.
    pub node_dir: String,
    /// The outbox table's DDL.
    pub outbox_sql: String,
    /// PostgreSQL's connection URL (password and all; never printed).
    #[serde(skip)]
    pub pg_url: String,
    /// RabbitMQ's URL.
    #[serde(skip)]
    pub amqp_url: String,
}

fn env_u64(name: &str, default: u64) -> Result<u64> {
    match std::env::var(name) {
        Ok(v) if !v.trim().is_empty() => v
            .trim()
            .replace('_', "")
            .parse()
            .with_context(|| format!("{name}={v:?} is not a whole number")),
        _ => Ok(default),
    }
}

fn env_str(name: &str, default: &str) -> String {
    std::env::var(name)
        .ok()
        .filter(|v| !v.trim().is_empty())
        .unwrap_or_else(|| default.to_owned())
}

fn env_list(name: &str, default: &str) -> Vec<String> {
    env_str(name, default)
        .split(',')
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .collect()
}

impl Settings {
    fn from_env() -> Result<Settings> {
        let events = env_u64("BENCH_EVENTS", 200_000)?;
        let tx_rows = env_u64("BENCH_TX_ROWS", 100)?;
        if events == 0 || tx_rows == 0 || events % tx_rows != 0 {
            bail!(
                "BENCH_EVENTS ({events}) must be a positive multiple of BENCH_TX_ROWS ({tx_rows})"
            );
        }
        let rates = env_list("BENCH_RATES", "1000,5000")
            .iter()
            .map(|r| r.parse().with_context(|| format!("BENCH_RATES: {r:?}")))
            .collect::<Result<Vec<u64>>>()?;
        let queue_types = env_list("BENCH_QUEUE_TYPES", "classic,quorum");
        let latency_queue_type = env_str("BENCH_LATENCY_QUEUE_TYPE", "classic");
        for q in queue_types.iter().chain([&latency_queue_type]) {
            if q != "classic" && q != "quorum" {
                bail!("unknown queue type {q:?} (classic or quorum)");
            }
        }
        let channels = env_list("BENCH_CHANNELS", "1,2,4,8")
            .iter()
            .map(|c| match c.parse::<u32>() {
                Ok(n @ 1..=16) => Ok(n),
                _ => bail!("BENCH_CHANNELS: {c:?} is not a channel count from 1 to 16"),
            })
            .collect::<Result<Vec<u32>>>()?;
        let channels_events = env_u64("BENCH_CHANNELS_EVENTS", 100_000)?;
        if channels_events == 0 || channels_events % tx_rows != 0 {
            bail!(
                "BENCH_CHANNELS_EVENTS ({channels_events}) must be a positive multiple of BENCH_TX_ROWS ({tx_rows})"
            );
        }
        Ok(Settings {
            events,
            channels,
            channels_events,
            channels_passes: env_u64("BENCH_CHANNELS_PASSES", 3)?.max(1),
            channels_only: env_u64("BENCH_CHANNELS_ONLY", 0)? != 0,
            tx_rows,
            passes: env_u64("BENCH_PASSES", 2)?.max(1),
            seconds: env_u64("BENCH_SECONDS", 30)?,
            rates,
            queue_types,
            latency_queue_type,
            window: env_u64("BENCH_WINDOW", 1024)?,
            poll_batch: env_u64("BENCH_POLL_BATCH", 500)?,
            poll_interval_ms: env_u64("BENCH_POLL_INTERVAL_MS", 100)?,
            relay_only: env_u64("BENCH_RELAY_ONLY", 0)? != 0,
            table_less: env_u64("BENCH_TABLE_LESS", 1)? != 0,
            out_dir: env_str("BENCH_OUT", "target/bench"),
            relay_bin: env_str("BENCH_RELAY", "target/release/outbox-relay"),
            node_dir: env_str("BENCH_NODE_DIR", "bench/amqplib"),
            outbox_sql: env_str("BENCH_OUTBOX_SQL", "sql/outbox.sql"),
            pg_url: std::env::var("TEST_PG_URL")
                .context("TEST_PG_URL is not set: run through `make bench` (integration/servers.sh with ...)")?,
            amqp_url: std::env::var("TEST_AMQP_URL")
                .context("TEST_AMQP_URL is not set: run through `make bench` (integration/servers.sh with ...)")?,
        })
    }
}

fn usage() -> ! {
    eprintln!(
        "usage: relay-bench run            (environment: TEST_PG_URL, TEST_AMQP_URL, BENCH_*)\n       relay-bench dispatch ARGS   (the polling dispatcher; started by `run`)\n       relay-bench publish ARGS    (a bare lapin publisher; started by `run`)"
    );
    std::process::exit(2);
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    // The harness drives producers, consumers and probes at once; the
    // dispatcher and the bare publishers are one pipeline each and run as
    // the relay does, on one thread.
    let rt = match args.first().map(String::as_str) {
        Some("run") => tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build(),
        _ => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build(),
    }
    .expect("tokio runtime");
    let res = match args.first().map(String::as_str) {
        Some("run") => Settings::from_env().and_then(|s| rt.block_on(run::run(s))),
        Some("dispatch") => polling::DispatchArgs::parse(&args[1..])
            .and_then(|a| rt.block_on(polling::dispatch_main(a))),
        Some("publish") => rt.block_on(ceiling::publish_main(&args[1..])),
        _ => usage(),
    };
    if let Err(e) = res {
        eprintln!("relay-bench: error: {e:#}");
        std::process::exit(1);
    }
}
