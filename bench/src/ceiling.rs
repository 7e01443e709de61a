//! The broker's ceiling: bare publishers with confirms, the relay's window,
//! message shape and queue, nothing else in the way.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde::Serialize;

use crate::workload::{
    ROUTING_KEY, aggregate_id, event_id, pad_len, payload, properties, unix_secs,
};

/// One publisher's run.
#[derive(Debug, Clone, Serialize)]
pub struct PublisherRun {
    pub name: String,
    pub description: String,
    pub events: u64,
    pub seconds: f64,
    pub events_per_s: f64,
    /// Client CPU (user + system, every thread) from the first publish to
    /// the last confirm, per 100,000 messages.
    pub cpu_seconds_per_100k: f64,
    pub nacked: u64,
    pub returned: u64,
}

pub const LAPIN_AWAIT_EACH: &str = "lapin, awaiting each publish";
pub const LAPIN_PIPELINED: &str = "lapin, pipelined";
pub const AMQPLIB: &str = "amqplib (Node)";

/// lapin, one connection and channel in confirm mode; `pipelined` selects
/// [`crate::amqp::publish_pipelined`] over
/// [`crate::amqp::publish_awaiting_each`]. Runs as a process of its own
/// (`relay-bench publish`), set up as the relay is (one-thread runtime,
/// mimalloc), so that its CPU is the publisher's alone.
pub async fn lapin(
    url: &str,
    exchange: &str,
    window: usize,
    n: u64,
    pipelined: bool,
) -> Result<PublisherRun> {
    let exe = std::env::current_exe()?;
    let mut cmd = tokio::process::Command::new(exe);
    cmd.arg("publish")
        .args(["--exchange", exchange])
        .args(["--window", &window.to_string()])
        .args(["--events", &n.to_string()])
        // The URL carries the password: not on the command line.
        .env("BENCH_PUBLISH_URL", url)
        .kill_on_drop(true);
    if pipelined {
        cmd.arg("--pipelined");
    }
    let r = run_publisher(cmd, "relay-bench publish").await?;
    Ok(PublisherRun {
        name: if pipelined {
            LAPIN_PIPELINED
        } else {
            LAPIN_AWAIT_EACH
        }
        .into(),
        description: if pipelined {
            "each basic_publish future polled once (frames queued in order), completions and confirms awaited concurrently, at most `window` unconfirmed".into()
        } else {
            "`basic_publish(..).await` before the next publish, confirms awaited concurrently, at most `window` unconfirmed".into()
        },
        events: r.events,
        seconds: r.seconds,
        events_per_s: r.events as f64 / r.seconds,
        cpu_seconds_per_100k: r.cpu_seconds / r.events as f64 * 100_000.0,
        nacked: r.nacked,
        returned: r.returned,
    })
}

/// `relay-bench publish --exchange X --window W --events N [--pipelined]`
/// (URL in `BENCH_PUBLISH_URL`): publishes, prints one [`PublisherOut`]
/// line. The clock and the CPU run from the first publish to the last
/// confirm.
pub async fn publish_main(args: &[String]) -> Result<()> {
    let (mut exchange, mut window, mut n, mut pipelined) = (String::new(), 1024, 0, false);
    let mut it = args.iter();
    while let Some(k) = it.next() {
        let mut v = || it.next().with_context(|| format!("{k} needs a value"));
        match k.as_str() {
            "--exchange" => exchange = v()?.clone(),
            "--window" => window = v()?.parse()?,
            "--events" => n = v()?.parse()?,
            "--pipelined" => pipelined = true,
            _ => bail!("publish: unknown argument {k}"),
        }
    }
    let url = std::env::var("BENCH_PUBLISH_URL").context("BENCH_PUBLISH_URL is not set")?;
    let conn = crate::amqp::connect(&url, "relay-bench ceiling").await?;
    let ch = crate::amqp::confirm_channel(&conn).await?;
    let tag = if pipelined { 0xc1 } else { 0xc0 };
    let ts = unix_secs();
    // Bodies and properties are built inside the loop, as a real publisher
    // (and the relay) does.
    let msg = |i: u64| {
        let i = i + 1;
        (
            payload(i).into_bytes(),
            properties(&event_id(tag, i), &aggregate_id(i), ts),
        )
    };
    let cpu0 = crate::procs::cpu_seconds("self")?;
    let t = Instant::now();
    let tally = if pipelined {
        crate::amqp::publish_pipelined(&ch, &exchange, ROUTING_KEY, window, n, msg).await?
    } else {
        crate::amqp::publish_awaiting_each(&ch, &exchange, ROUTING_KEY, window, n, msg).await?
    };
    let seconds = t.elapsed().as_secs_f64();
    let cpu_seconds = crate::procs::cpu_seconds("self")? - cpu0;
    let _ = conn.close(200, "bye".into()).await;
    let out = PublisherOut {
        events: n,
        seconds,
        cpu_seconds,
        nacked: tally.nacked,
        returned: tally.returned,
    };
    println!("{}", serde_json::to_string(&out)?);
    Ok(())
}

/// What a publisher process prints (Rust and Node alike).
#[derive(serde::Serialize, serde::Deserialize)]
pub struct PublisherOut {
    events: u64,
    seconds: f64,
    /// Its own user + system CPU over the same interval.
    cpu_seconds: f64,
    nacked: u64,
    returned: u64,
}

/// Runs a publisher process, parses its line.
async fn run_publisher(mut cmd: tokio::process::Command, what: &str) -> Result<PublisherOut> {
    let out = tokio::time::timeout(Duration::from_secs(600), cmd.output())
        .await
        .with_context(|| format!("{what} timed out"))?
        .with_context(|| format!("running {what}"))?;
    if !out.status.success() {
        bail!(
            "{what} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let line = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(line.trim()).with_context(|| format!("parsing {what} output {line:?}"))
}

/// Whether node and bench/amqplib/node_modules/amqplib are there.
pub fn node_ready(node_dir: &str) -> Result<String, String> {
    let version = crate::procs::command_output("node", &["--version"])
        .ok_or_else(|| "node is not installed".to_owned())?;
    let pkg = Path::new(node_dir).join("node_modules/amqplib/package.json");
    let text = std::fs::read_to_string(&pkg)
        .map_err(|_| format!("{} missing (npm install in {node_dir})", pkg.display()))?;
    let amqplib = serde_json::from_str::<serde_json::Value>(&text)
        .ok()
        .and_then(|v| v["version"].as_str().map(str::to_owned))
        .unwrap_or_else(|| "?".into());
    Ok(format!("node {version}, amqplib {amqplib}"))
}

/// bench/amqplib/publish.js.
pub async fn amqplib(
    node_dir: &str,
    url: &str,
    exchange: &str,
    window: usize,
    n: u64,
) -> Result<PublisherRun> {
    let mut cmd = tokio::process::Command::new("node");
    cmd.arg("publish.js")
        .arg(url)
        .arg(exchange)
        .arg(ROUTING_KEY)
        .arg(n.to_string())
        .arg(window.to_string())
        .arg(pad_len().to_string())
        .current_dir(node_dir)
        .kill_on_drop(true);
    let r = run_publisher(cmd, "node publish.js").await?;
    Ok(PublisherRun {
        name: AMQPLIB.into(),
        description: "ConfirmChannel, publish with a callback per message, at most `window` unconfirmed, waits for 'drain' when the socket buffer is full".into(),
        events: r.events,
        seconds: r.seconds,
        events_per_s: r.events as f64 / r.seconds,
        cpu_seconds_per_100k: r.cpu_seconds / r.events as f64 * 100_000.0,
        nacked: r.nacked,
        returned: r.returned,
    })
}
