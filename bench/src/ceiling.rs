//! The broker's ceiling: bare publishers with confirms, the relay's window,
//! message shape and queue, nothing else in the way.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde::Serialize;

use crate::workload::{
    ROUTING_KEY, aggregate_id, event_id, pad_len, payload, properties, unix_secs, unix_us,
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
pub const RELAY_CLIENT: &str = "outbox-relay's AMQP client";
/// Every bare publisher, in the order the report lists them.
pub const PUBLISHERS: [&str; 4] = [LAPIN_AWAIT_EACH, LAPIN_PIPELINED, RELAY_CLIENT, AMQPLIB];

/// A bare publisher in Rust, run as a process of its own (`relay-bench
/// publish`), set up as the relay is (one-thread runtime; mimalloc, which
/// spares lapin cross-thread frees on glibc's arena locks), so
/// that its CPU is the publisher's alone.
#[derive(Debug, Clone, Copy)]
pub enum RustPublisher {
    /// lapin, [`crate::amqp::publish_awaiting_each`].
    LapinAwaitEach,
    /// lapin, [`crate::amqp::publish_pipelined`].
    LapinPipelined,
    /// The relay's own AMQP client (`outbox_relay::sink::wire`), driven as
    /// the relay drives it.
    RelayClient,
}

impl RustPublisher {
    fn name(self) -> &'static str {
        match self {
            RustPublisher::LapinAwaitEach => LAPIN_AWAIT_EACH,
            RustPublisher::LapinPipelined => LAPIN_PIPELINED,
            RustPublisher::RelayClient => RELAY_CLIENT,
        }
    }

    fn flag(self) -> &'static str {
        match self {
            RustPublisher::LapinAwaitEach => "--await-each",
            RustPublisher::LapinPipelined => "--pipelined",
            RustPublisher::RelayClient => "--relay-client",
        }
    }

    fn description(self) -> &'static str {
        match self {
            RustPublisher::LapinAwaitEach => {
                "`basic_publish(..).await` before the next publish, confirms awaited concurrently, at most `window` unconfirmed"
            }
            RustPublisher::LapinPipelined => {
                "each basic_publish future polled once (frames queued in order), completions and confirms awaited concurrently, at most `window` unconfirmed"
            }
            RustPublisher::RelayClient => {
                "the relay's publishing client: one task owns the socket; publishes queued into its write buffer a batch at a time and written while answers are read, at most `window` unconfirmed"
            }
        }
    }
}

/// Runs publisher `which` over `n` messages.
pub async fn rust_publisher(
    url: &str,
    exchange: &str,
    window: usize,
    n: u64,
    which: RustPublisher,
) -> Result<PublisherRun> {
    let exe = std::env::current_exe()?;
    let mut cmd = tokio::process::Command::new(exe);
    cmd.arg("publish")
        .args(["--exchange", exchange])
        .args(["--window", &window.to_string()])
        .args(["--events", &n.to_string()])
        .arg(which.flag())
        // The URL carries the password: not on the command line.
        .env("BENCH_PUBLISH_URL", url)
        .kill_on_drop(true);
    let r = run_publisher(cmd, &format!("relay-bench publish {}", which.flag())).await?;
    Ok(PublisherRun {
        name: which.name().into(),
        description: which.description().into(),
        events: r.events,
        seconds: r.seconds,
        events_per_s: r.events as f64 / r.seconds,
        cpu_seconds_per_100k: r.cpu_seconds / r.events as f64 * 100_000.0,
        nacked: r.nacked,
        returned: r.returned,
    })
}

/// `procs` publisher processes at once (`relay-bench publish`, each with
/// `args` and its own share of the `n` events), started together: the
/// run's clock goes from the first process's first publish to the last
/// one's last confirm, its CPU is every process's.
pub async fn publishers_at_once(
    url: &str,
    exchange: &str,
    window: usize,
    n: u64,
    procs: u64,
    args: &[&str],
    (name, description): (String, String),
) -> Result<PublisherRun> {
    let exe = std::env::current_exe()?;
    // Time enough for every process to start and connect first.
    let start_at = unix_us() + 1_500_000 + 100_000 * procs as i64;
    let mut runs = Vec::new();
    for k in 0..procs {
        let (from, to) = (k * n / procs, (k + 1) * n / procs);
        let mut cmd = tokio::process::Command::new(&exe);
        cmd.arg("publish")
            .args(["--exchange", exchange])
            .args(["--window", &window.to_string()])
            .args(["--events", &(to - from).to_string()])
            .args(["--first", &from.to_string()])
            .args(["--start-at-us", &start_at.to_string()])
            .args(args)
            .env("BENCH_PUBLISH_URL", url)
            .kill_on_drop(true);
        runs.push(async move {
            run_publisher(cmd, &format!("relay-bench publish {args:?} ({k})")).await
        });
    }
    let outs = futures_util::future::join_all(runs)
        .await
        .into_iter()
        .collect::<Result<Vec<_>>>()?;
    let started = outs.iter().filter_map(|o| o.started_us).min();
    let ended = outs.iter().filter_map(|o| o.ended_us).max();
    let (Some(started), Some(ended)) = (started, ended) else {
        bail!("{name}: a publisher printed no start or end time");
    };
    let seconds = ((ended - started) as f64 / 1e6).max(1e-6);
    let cpu: f64 = outs.iter().map(|o| o.cpu_seconds).sum();
    Ok(PublisherRun {
        name,
        description,
        events: n,
        seconds,
        events_per_s: n as f64 / seconds,
        cpu_seconds_per_100k: cpu / n as f64 * 100_000.0,
        nacked: outs.iter().map(|o| o.nacked).sum(),
        returned: outs.iter().map(|o| o.returned).sum(),
    })
}

/// `count` processes of the relay's own client at once: the plain-client
/// ceiling of `count` channels, each on a connection of its own as the
/// relay's channels are.
pub async fn relay_clients(
    url: &str,
    exchange: &str,
    window: usize,
    n: u64,
    count: u64,
) -> Result<PublisherRun> {
    publishers_at_once(
        url,
        exchange,
        window,
        n,
        count,
        &[RustPublisher::RelayClient.flag()],
        (
            format!("{RELAY_CLIENT} × {count}"),
            format!(
                "{count} processes of the relay's client started together, each on a connection of its own, each publishing its share of the events, at most `window` unconfirmed each"
            ),
        ),
    )
    .await
}

/// lapin pipelined, `channels` confirm channels in one process publishing
/// concurrently: on one connection, or on a connection each.
pub async fn lapin_channels(
    url: &str,
    exchange: &str,
    window: usize,
    n: u64,
    channels: u64,
    per_connection: bool,
) -> Result<PublisherRun> {
    let k = channels.to_string();
    let mut args = vec![RustPublisher::LapinPipelined.flag(), "--channels", &k];
    if per_connection {
        args.push("--per-connection");
    }
    let (name, how) = if per_connection {
        (
            format!("lapin pipelined, {channels} connections of one channel"),
            "a connection each",
        )
    } else {
        (
            format!("lapin pipelined, {channels} channels on one connection"),
            "all on one connection",
        )
    };
    publishers_at_once(
        url,
        exchange,
        window,
        n,
        1,
        &args,
        (
            name,
            format!(
                "one process, {channels} confirm channels publishing concurrently ({how}), at most `window` unconfirmed each"
            ),
        ),
    )
    .await
}

/// `relay-bench publish --exchange X --window W --events N
/// (--await-each | --pipelined | --relay-client) [--first F]
/// [--start-at-us T] [--channels K [--per-connection]]`
/// (URL in `BENCH_PUBLISH_URL`): publishes events F+1..=F+N, prints one
/// [`PublisherOut`] line. The clock and the CPU run from the first publish
/// to the last confirm. `--start-at-us`: connect, then wait until that
/// Unix time (µs) before the first publish, so that several processes
/// publish at once. `--channels K` (lapin pipelined only): K confirm
/// channels publishing concurrently, on one connection, or with
/// `--per-connection` on a connection each.
pub async fn publish_main(args: &[String]) -> Result<()> {
    let (mut exchange, mut window, mut n) = (String::new(), 1024, 0);
    let (mut first, mut start_at, mut channels, mut per_connection) = (0u64, 0i64, 1u64, false);
    let mut which = None;
    let mut it = args.iter();
    while let Some(k) = it.next() {
        let mut v = || it.next().with_context(|| format!("{k} needs a value"));
        match k.as_str() {
            "--exchange" => exchange = v()?.clone(),
            "--window" => window = v()?.parse()?,
            "--events" => n = v()?.parse()?,
            "--first" => first = v()?.parse()?,
            "--start-at-us" => start_at = v()?.parse()?,
            "--channels" => channels = v()?.parse::<u64>()?.max(1),
            "--per-connection" => per_connection = true,
            flag => {
                which = Some(
                    [
                        RustPublisher::LapinAwaitEach,
                        RustPublisher::LapinPipelined,
                        RustPublisher::RelayClient,
                    ]
                    .into_iter()
                    .find(|p| p.flag() == flag)
                    .with_context(|| format!("publish: unknown argument {k}"))?,
                )
            }
        }
    }
    let which =
        which.context("publish: which publisher (--await-each, --pipelined, --relay-client)?")?;
    if channels > 1 && !matches!(which, RustPublisher::LapinPipelined) {
        bail!("publish: --channels needs --pipelined");
    }
    let url = std::env::var("BENCH_PUBLISH_URL").context("BENCH_PUBLISH_URL is not set")?;
    let tag = 0xc0 + which as u32;
    let ts = unix_secs();
    // Bodies and properties are built inside the loop, as a real publisher
    // (and the relay) does.
    let msg = move |i: u64| {
        let i = first + i + 1;
        (
            payload(i).into_bytes(),
            properties(&event_id(tag, i), &aggregate_id(i), ts),
        )
    };
    let m = match which {
        RustPublisher::RelayClient => {
            let mut wire = crate::amqp::connect_wire(&url, "relay-bench ceiling").await?;
            wait_until(start_at).await;
            let r = measured(crate::amqp::publish_wire(
                &mut wire,
                &exchange,
                ROUTING_KEY,
                window,
                n,
                msg,
            ))
            .await?;
            let _ = wire.close().await;
            r
        }
        RustPublisher::LapinPipelined if channels > 1 => {
            let conns = if per_connection { channels } else { 1 };
            let mut conn = Vec::new();
            for _ in 0..conns {
                conn.push(crate::amqp::connect(&url, "relay-bench ceiling").await?);
            }
            let mut chans = Vec::new();
            for k in 0..channels {
                chans.push(crate::amqp::confirm_channel(&conn[(k % conns) as usize]).await?);
            }
            wait_until(start_at).await;
            // Channel k publishes events k*n/K .. (k+1)*n/K.
            let part = |k: u64| k * n / channels;
            let r = measured(async {
                let runs = chans.iter().enumerate().map(|(k, ch)| {
                    let (from, to) = (part(k as u64), part(k as u64 + 1));
                    crate::amqp::publish_pipelined(
                        ch,
                        &exchange,
                        ROUTING_KEY,
                        window,
                        to - from,
                        move |i| msg(from + i),
                    )
                });
                let mut sum = crate::amqp::Tally::default();
                for t in futures_util::future::join_all(runs).await {
                    let t = t?;
                    sum.acked += t.acked;
                    sum.nacked += t.nacked;
                    sum.returned += t.returned;
                }
                Ok(sum)
            })
            .await?;
            for c in conn {
                let _ = c.close(200, "bye".into()).await;
            }
            r
        }
        lapin => {
            let conn = crate::amqp::connect(&url, "relay-bench ceiling").await?;
            let ch = crate::amqp::confirm_channel(&conn).await?;
            wait_until(start_at).await;
            let r = if matches!(lapin, RustPublisher::LapinPipelined) {
                measured(crate::amqp::publish_pipelined(
                    &ch,
                    &exchange,
                    ROUTING_KEY,
                    window,
                    n,
                    msg,
                ))
                .await?
            } else {
                measured(crate::amqp::publish_awaiting_each(
                    &ch,
                    &exchange,
                    ROUTING_KEY,
                    window,
                    n,
                    msg,
                ))
                .await?
            };
            let _ = conn.close(200, "bye".into()).await;
            r
        }
    };
    let out = PublisherOut {
        events: n,
        seconds: m.seconds,
        cpu_seconds: m.cpu_seconds,
        nacked: m.tally.nacked,
        returned: m.tally.returned,
        started_us: Some(m.started_us),
        ended_us: Some(m.ended_us),
    };
    println!("{}", serde_json::to_string(&out)?);
    Ok(())
}

/// A publish loop's tally, wall seconds, this process's CPU seconds over
/// the same interval, and that interval in Unix µs.
struct Measured {
    tally: crate::amqp::Tally,
    seconds: f64,
    cpu_seconds: f64,
    started_us: i64,
    ended_us: i64,
}

async fn measured(
    publishing: impl Future<Output = Result<crate::amqp::Tally>>,
) -> Result<Measured> {
    let cpu0 = crate::procs::cpu_seconds("self")?;
    let (t, started_us) = (Instant::now(), unix_us());
    let tally = publishing.await?;
    let seconds = t.elapsed().as_secs_f64();
    Ok(Measured {
        tally,
        seconds,
        cpu_seconds: crate::procs::cpu_seconds("self")? - cpu0,
        started_us,
        ended_us: unix_us(),
    })
}

/// Sleeps until Unix time `at_us` (µs); returns at once if 0 or past.
async fn wait_until(at_us: i64) {
    let wait = at_us - unix_us();
    if wait > 0 {
        tokio::time::sleep(Duration::from_micros(wait as u64)).await;
    }
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
    /// First publish and last confirm, Unix µs (the Rust publishers).
    #[serde(default)]
    started_us: Option<i64>,
    #[serde(default)]
    ended_us: Option<i64>,
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
