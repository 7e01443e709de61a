//! The polling baseline: the classic outbox dispatcher, run as a process of
//! its own (`relay-bench dispatch`) so that it is measured like the relay.
//!
//! Loop: claim up to `batch` pending rows (`UPDATE … WHERE id IN (SELECT …
//! ORDER BY created_at LIMIT n FOR UPDATE SKIP LOCKED) RETURNING …`), publish
//! them with confirms (the relay's own AMQP client, the same window),
//! mark them published, repeat at once; sleep `poll_ms` when a claim comes
//! back empty.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use tokio::io::AsyncReadExt;

use crate::workload::{ROUTING_KEY, properties, unix_us};

/// The claim, as the dispatcher runs it.
pub fn claim_sql(table: &str, batch: u64) -> String {
    format!(
        "UPDATE {table} SET status = 'claimed', claimed_by = $1, claimed_at = now(), attempts = attempts + 1 \
         WHERE id IN (SELECT id FROM {table} WHERE status = 'pending' ORDER BY created_at LIMIT {batch} FOR UPDATE SKIP LOCKED) \
         RETURNING id::text, aggregate_id, payload::text, extract(epoch FROM created_at)::bigint"
    )
}

/// Marking a claimed batch published (the primary key finds the rows).
pub fn mark_sql(table: &str) -> String {
    format!(
        "UPDATE {table} SET status = 'published', published_at = now() \
         WHERE claimed_by = $1 AND status = 'claimed' AND id = ANY($2::text[]::uuid[])"
    )
}

#[derive(Debug, Clone)]
pub struct DispatchArgs {
    pub table: String,
    pub exchange: String,
    pub window: usize,
    pub batch: u64,
    pub poll_ms: u64,
    /// Exit at the first empty claim (drain) or run until stdin closes.
    pub drain: bool,
    /// Record (event id, mark-published commit time) per event.
    pub record: bool,
    pub result: String,
    pub worker: String,
}

impl DispatchArgs {
    pub fn parse(args: &[String]) -> Result<DispatchArgs> {
        let mut a = DispatchArgs {
            table: String::new(),
            exchange: String::new(),
            window: 1024,
            batch: 500,
            poll_ms: 100,
            drain: false,
            record: false,
            result: String::new(),
            worker: format!("dispatcher-{}", std::process::id()),
        };
        let mut it = args.iter();
        while let Some(k) = it.next() {
            let mut v = || it.next().with_context(|| format!("{k} needs a value"));
            match k.as_str() {
                "--table" => a.table = v()?.clone(),
                "--exchange" => a.exchange = v()?.clone(),
                "--window" => a.window = v()?.parse()?,
                "--batch" => a.batch = v()?.parse()?,
                "--poll-ms" => a.poll_ms = v()?.parse()?,
                "--result" => a.result = v()?.clone(),
                "--drain" => a.drain = true,
                "--record" => a.record = true,
                _ => bail!("dispatch: unknown argument {k}"),
            }
        }
        if a.table.is_empty() || a.exchange.is_empty() || a.result.is_empty() {
            bail!("dispatch needs --table, --exchange and --result");
        }
        Ok(a)
    }

    /// Arguments for the child process.
    pub fn to_args(&self) -> Vec<String> {
        let mut v = vec![
            "dispatch".into(),
            "--table".into(),
            self.table.clone(),
            "--exchange".into(),
            self.exchange.clone(),
            "--window".into(),
            self.window.to_string(),
            "--batch".into(),
            self.batch.to_string(),
            "--poll-ms".into(),
            self.poll_ms.to_string(),
            "--result".into(),
            self.result.clone(),
        ];
        if self.drain {
            v.push("--drain".into());
        }
        if self.record {
            v.push("--record".into());
        }
        v
    }
}

/// What the dispatcher reports when it exits.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct DispatchResult {
    pub events: u64,
    pub batches: u64,
    pub empty_claims: u64,
    pub cpu_seconds: f64,
    pub peak_rss_bytes: u64,
    pub claim_seconds: f64,
    pub publish_seconds: f64,
    pub mark_seconds: f64,
    /// (event id, µs since the epoch when its mark-published UPDATE returned)
    pub published: Vec<(String, i64)>,
}

pub async fn dispatch_main(a: DispatchArgs) -> Result<()> {
    let pg_url = std::env::var("TEST_PG_URL").context("TEST_PG_URL")?;
    let amqp_url = std::env::var("TEST_AMQP_URL").context("TEST_AMQP_URL")?;
    let pg = crate::pg::connect(&pg_url).await?;
    let mut wire = crate::amqp::connect_wire(&amqp_url, "relay-bench polling dispatcher").await?;
    let claim = pg.prepare(&claim_sql(&a.table, a.batch)).await?;
    let mark = pg.prepare(&mark_sql(&a.table)).await?;

    // Closing our stdin asks us to stop.
    let (stop_tx, mut stop) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        let mut buf = [0u8; 64];
        let mut stdin = tokio::io::stdin();
        while matches!(stdin.read(&mut buf).await, Ok(n) if n > 0) {}
        let _ = stop_tx.send(true);
    });
    println!("ready");

    let mut r = DispatchResult::default();
    loop {
        if !a.drain && *stop.borrow() {
            break;
        }
        let t = Instant::now();
        let mut rows = pg.query(&claim, &[&a.worker]).await.context("claim")?;
        r.claim_seconds += t.elapsed().as_secs_f64();
        if rows.is_empty() {
            r.empty_claims += 1;
            if a.drain {
                break;
            }
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(a.poll_ms)) => {}
                _ = stop.changed() => {}
            }
            continue;
        }
        // Publish in creation order.
        rows.sort_by_key(|row| row.get::<_, i64>(3));
        let t = Instant::now();
        let tally = crate::amqp::publish_wire(
            &mut wire,
            &a.exchange,
            ROUTING_KEY,
            a.window,
            rows.len() as u64,
            |i| {
                let row = &rows[i as usize];
                let id: &str = row.get(0);
                let agg: &str = row.get(1);
                let body: &str = row.get(2);
                let ts: i64 = row.get(3);
                (
                    body.as_bytes().to_vec(),
                    properties(id, agg, u64::try_from(ts).unwrap_or(0)),
                )
            },
        )
        .await?;
        tally.check()?;
        r.publish_seconds += t.elapsed().as_secs_f64();
        let ids: Vec<String> = rows.iter().map(|row| row.get::<_, String>(0)).collect();
        let t = Instant::now();
        let n = pg
            .execute(&mark, &[&a.worker, &ids])
            .await
            .context("mark published")?;
        let at = unix_us();
        r.mark_seconds += t.elapsed().as_secs_f64();
        if n != ids.len() as u64 {
            bail!("marked {n} of {} claimed rows published", ids.len());
        }
        r.events += n;
        r.batches += 1;
        if a.record {
            r.published.extend(ids.into_iter().map(|id| (id, at)));
        }
    }
    let me = std::process::id().to_string();
    r.cpu_seconds = crate::procs::cpu_seconds(&me)?;
    r.peak_rss_bytes = crate::procs::peak_rss_bytes(&me)?;
    std::fs::write(&a.result, serde_json::to_vec(&r)?)?;
    let _ = wire.close().await;
    Ok(())
}

/// A dispatcher child process.
pub struct Dispatcher {
    pub child: std::process::Child,
    pub args: DispatchArgs,
}

impl Dispatcher {
    /// Starts `relay-bench dispatch …` and waits for its "ready" line.
    pub fn spawn(args: DispatchArgs, log: &std::path::Path) -> Result<Dispatcher> {
        use std::io::BufRead;
        let exe = std::env::current_exe()?;
        let mut child = std::process::Command::new(exe)
            .args(args.to_args())
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::from(std::fs::File::create(log)?))
            .spawn()
            .context("starting the polling dispatcher")?;
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().context("no stdout")?).read_line(&mut line)?;
        if line.trim() != "ready" {
            let _ = child.kill();
            let _ = child.wait();
            bail!(
                "polling dispatcher did not start: {}",
                std::fs::read_to_string(log).unwrap_or_default()
            );
        }
        Ok(Dispatcher { child, args })
    }

    /// Closes its stdin (serve mode: stop), waits, reads its result.
    pub async fn finish(mut self, log: &std::path::Path) -> Result<DispatchResult> {
        drop(self.child.stdin.take());
        let status =
            crate::procs::wait_timeout_async(&mut self.child, Duration::from_secs(120)).await?;
        if !status.success() {
            bail!(
                "polling dispatcher failed ({status}): {}",
                std::fs::read_to_string(log).unwrap_or_default()
            );
        }
        let bytes = std::fs::read(&self.args.result)
            .with_context(|| format!("reading {}", self.args.result))?;
        Ok(serde_json::from_slice(&bytes)?)
    }
}
