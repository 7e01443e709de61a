//! The nemesis, and the supervisor that keeps the relay running as
//! systemd would. Faults are real: signals to the relay and the
//! walsender, the servers stopped and restarted, the slot dropped, DDL,
//! connections stalled, cut or half-closed in the proxies, operators'
//! commands. When the relay stops with a documented error, the supervisor
//! does what the error says (as an operator would) and starts it again;
//! any other exit is a failure.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::common::*;
use crate::consumer::Consumer;
use crate::schedule::Fault;
use crate::world::World;

pub struct Supervisor {
    relay: Option<Relay>,
    pub failures: Vec<String>,
    pub peak_rss: u64,
    pub starts: usize,
    /// What the operator did, for the report.
    pub remedies: Vec<String>,
    /// Outbox tables dropped and created again so far (`recreate`).
    recreated: usize,
}

impl Supervisor {
    pub fn new(w: &World) -> Mutex<Supervisor> {
        Mutex::new(Supervisor {
            relay: Some(w.spawn_relay()),
            failures: Vec::new(),
            peak_rss: 0,
            starts: 1,
            remedies: Vec::new(),
            recreated: 0,
        })
    }

    fn sample_rss(&mut self) {
        if let Some(r) = &self.relay
            && let Ok(s) = std::fs::read_to_string(format!("/proc/{}/status", r.pid()))
            && let Some(kb) = s
                .lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<u64>().ok())
        {
            self.peak_rss = self.peak_rss.max(kb * 1024);
        }
    }

    /// Ends the relay: SIGTERM, and it must exit 0, or 1 with the
    /// documented word that a recovery was stopped half way (the record
    /// stays for the next start; every event was judged delivered by then,
    /// and the rest of the window is re-publication).
    pub fn stop(&mut self) {
        self.sample_rss();
        if let Some(mut r) = self.relay.take() {
            if let Ok(Some(s)) = r.child.try_wait() {
                self.failures.push(format!(
                    "the relay had exited {s} before the end: {}",
                    r.log_tail()
                ));
                return;
            }
            signal(r.pid(), "TERM");
            match wait_timeout(&mut r.child, Duration::from_secs(40)) {
                Some(s) if s.success() => {}
                Some(s)
                    if s.code() == Some(1)
                        && r.log_tail().lines().last().is_some_and(|l| {
                            l.starts_with("outbox-relay: stopped before the recovery of slot")
                        }) => {}
                Some(s) => self
                    .failures
                    .push(format!("the relay exited {s} on SIGTERM: {}", r.log_tail())),
                None => {
                    self.failures
                        .push("the relay did not exit within 40 s of SIGTERM".into());
                    r.kill9();
                }
            }
        }
    }

    fn pid(&self) -> Option<u32> {
        self.relay.as_ref().map(Relay::pid)
    }
}

/// Runs of a remedy's command before the remedy counts as failed.
const REMEDY_ATTEMPTS: u32 = 10;

/// Whether a command failed for a connection lost or refused, or a server
/// going down or coming up (not for a timeout, nor for what it found).
fn cut_off(out: &str) -> bool {
    let out = out.to_ascii_lowercase();
    !out.contains("no end within")
        && [
            "connection closed",
            "closed the connection",
            "connection reset",
            "connection refused",
            "broken pipe",
            "unexpected eof",
            "the database system is",
        ]
        .iter()
        .any(|s| out.contains(s))
}

/// Watches the relay until `done`: restarts it after a documented stop,
/// once the operator's remedy has run; counts any other exit as a failure.
pub async fn supervise(
    w: &World,
    sup: &Mutex<Supervisor>,
    done: &tokio_util::sync::CancellationToken,
) {
    loop {
        tokio::select! {
            () = done.cancelled() => return,
            () = tokio::time::sleep(Duration::from_millis(250)) => {}
        }
        let exited = {
            let mut s = sup.lock().unwrap();
            s.sample_rss();
            match s.relay.as_mut().map(|r| r.child.try_wait()) {
                Some(Ok(Some(status))) => {
                    let r = s.relay.take().unwrap();
                    Some((status, r.log_tail()))
                }
                _ => None,
            }
        };
        let Some((status, log)) = exited else {
            continue;
        };
        let remedy = remedy_for(&log);
        let said = log.lines().last().unwrap_or_default().to_owned();
        match &remedy {
            Some(args) => {
                let mut all = vec![format!("relay exited {status}: {said}")];
                let mut failed = None;
                for a in args {
                    // As an operator would: a command whose connection was
                    // cut (by the fault of the moment) is run again, a few
                    // times, before the remedy counts as failed; any other
                    // failure (a timeout included) counts at once.
                    let mut line = String::new();
                    for attempt in 1..=REMEDY_ATTEMPTS {
                        let began = std::time::Instant::now();
                        let out = run_cmd(w, a).await;
                        line = format!(
                            "operator: outbox-relay {} -> {out} ({:.1} s{})",
                            a.join(" "),
                            began.elapsed().as_secs_f64(),
                            if attempt > 1 {
                                format!(", attempt {attempt}")
                            } else {
                                String::new()
                            }
                        );
                        if out == "ok" {
                            break;
                        }
                        if attempt == REMEDY_ATTEMPTS || !cut_off(&out) {
                            failed = Some(line.clone());
                            break;
                        }
                        all.push(line.clone());
                        tokio::time::sleep(Duration::from_secs(3)).await;
                    }
                    all.push(line);
                }
                let mut s = sup.lock().unwrap();
                s.remedies.push(all.join("; "));
                if let Some(f) = failed {
                    s.failures
                        .push(format!("the documented remedy failed: {f}"));
                }
            }
            None => sup.lock().unwrap().failures.push(format!(
                "the relay exited {status} with no documented remedy: {}",
                tail(&log, 6)
            )),
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        let mut s = sup.lock().unwrap();
        if s.relay.is_none() {
            s.relay = Some(w.spawn_relay());
            s.starts += 1;
        }
    }
}

fn tail(log: &str, n: usize) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(n)..].join(" | ")
}

/// The commands a documented stop names, as the operator runs them.
fn remedy_for(log: &str) -> Option<Vec<Vec<String>>> {
    let last = log.lines().rev().find(|l| !l.trim().is_empty())?;
    if let Some(i) = last.find("republish --since ") {
        let words: Vec<String> = last[i + "republish ".len()..]
            .split_whitespace()
            .map(|w| w.trim_end_matches(['`', '.', ',', ')', '"']).to_owned())
            .collect();
        let mut args = vec!["republish".to_owned()];
        let mut it = words.into_iter();
        while let Some(w) = it.next() {
            if w == "--since" || w == "--table" {
                let value = it.next().unwrap_or_default();
                // A placeholder (`<time>`) is no time: the operator then
                // republishes from when the run started.
                if w == "--since" && !value.starts_with(|c: char| c.is_ascii_digit()) {
                    args.push(w);
                    args.push("{started_at}".into());
                    continue;
                }
                args.push(w);
                args.push(value);
            } else {
                break;
            }
        }
        return Some(vec![vec!["setup".into()], args]);
    }
    if last.contains("outbox-relay recover") {
        return Some(vec![vec!["recover".into()]]);
    }
    None
}

async fn run_cmd(w: &World, args: &[String]) -> String {
    let mut cmd = w.relay_cmd(&args[0]);
    cmd.args(
        args[1..]
            .iter()
            .map(|a| a.replace("{started_at}", &w.started_at)),
    );
    let mut cmd = tokio::process::Command::from(cmd);
    // A command given up on must not go on beside the next.
    cmd.kill_on_drop(true);
    match tokio::time::timeout(Duration::from_secs(180), cmd.output()).await {
        Ok(Ok(o)) if o.status.success() => "ok".into(),
        Ok(Ok(o)) => format!(
            "FAILED {}: {}",
            o.status,
            String::from_utf8_lossy(&o.stderr)
                .lines()
                .last()
                .unwrap_or_default()
        ),
        Ok(Err(e)) => format!("FAILED to start: {e}"),
        Err(_) => "FAILED: no end within 180 s".into(),
    }
}

/// Runs one fault (or operator command) to its end. An operator command
/// that fails is returned as a failure.
pub async fn inflict(
    w: &World,
    sup: &Mutex<Supervisor>,
    consumer: &Consumer,
    f: &Fault,
) -> Result<(), String> {
    let ms = |m: u32| tokio::time::sleep(Duration::from_millis(u64::from(m)));
    match f {
        Fault::Kill9 { down } => {
            let r = {
                let mut s = sup.lock().unwrap();
                s.sample_rss();
                s.relay.take()
            };
            if let Some(r) = r {
                r.kill9();
            }
            ms(*down).await;
            respawn(w, sup);
        }
        Fault::Pause { ms: m } => {
            let pid = sup.lock().unwrap().pid();
            if let Some(pid) = pid {
                signal(pid, "STOP");
                ms(*m).await;
                signal(pid, "CONT");
            }
        }
        Fault::Takeover { ms: m } => {
            let second = w.spawn_relay();
            ms(*m).await;
            let first = {
                let mut s = sup.lock().unwrap();
                s.sample_rss();
                s.starts += 1;
                s.relay.replace(second)
            };
            if let Some(r) = first {
                r.kill9();
            }
        }
        Fault::BrokerRestart { ms: m } => {
            ctl_async(rabbitmq_ctl, &["stop"]).await;
            ms(*m).await;
            ctl_async(rabbitmq_ctl, &["start"]).await;
        }
        Fault::MemoryAlarm { ms: m } => {
            ctl_async(rabbitmq_ctl, &["ctl", "set_vm_memory_high_watermark", "0"]).await;
            ms(*m).await;
            ctl_async(
                rabbitmq_ctl,
                &["ctl", "set_vm_memory_high_watermark", "0.4"],
            )
            .await;
        }
        Fault::FullQueue { ms: m } => {
            consumer
                .paused
                .store(true, std::sync::atomic::Ordering::SeqCst);
            ms(*m).await;
            consumer
                .paused
                .store(false, std::sync::atomic::Ordering::SeqCst);
        }
        Fault::PgRestart => ctl_async(pg_ctl, &["restart"]).await,
        Fault::TerminateWalsender => {
            let pg = pg_connect_retry().await;
            let _ = pg
                .execute(
                    "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots \
                     WHERE slot_name = $1 AND active_pid IS NOT NULL",
                    &[&w.slot],
                )
                .await;
        }
        Fault::StopWalsender { ms: m } => {
            let pg = pg_connect_retry().await;
            let pid: Option<i32> = pg
                .query_opt(
                    "SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1 AND active_pid IS NOT NULL",
                    &[&w.slot],
                )
                .await
                .ok()
                .flatten()
                .map(|r| r.get(0));
            if let Some(pid) = pid {
                signal(pid as u32, "STOP");
                ms(*m).await;
                signal(pid as u32, "CONT");
            }
        }
        Fault::DropSlot { kill, graceful } => {
            // Not "finishing the recovery recorded earlier": a new one.
            const STARTED: &str = "recover: recovery recorded window=";
            let recoveries = |s: &Supervisor| {
                s.relay
                    .as_ref()
                    .map(|r| (r.pid(), r.log_text().matches(STARTED).count()))
            };
            let before = recoveries(&sup.lock().unwrap());
            let pg = pg_connect_retry().await;
            let end = Instant::now() + Duration::from_secs(10);
            while Instant::now() < end {
                let _ = pg
                    .execute(
                        "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots \
                         WHERE slot_name = $1 AND active_pid IS NOT NULL",
                        &[&w.slot],
                    )
                    .await;
                if pg
                    .execute("SELECT pg_drop_replication_slot($1)", &[&w.slot])
                    .await
                    .is_ok()
                {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            if let Some(kill) = kill {
                // Into the recovery the lost slot starts (if one starts
                // within 30 s), then a kill -9 and a restart at once.
                let end = Instant::now() + Duration::from_secs(30);
                while Instant::now() < end {
                    let now = recoveries(&sup.lock().unwrap());
                    let started = match (before, now) {
                        (Some((p0, n0)), Some((p, n))) => n > if p == p0 { n0 } else { 0 },
                        (None, Some((_, n))) => n > 0,
                        _ => false,
                    };
                    if started {
                        ms(*kill).await;
                        if *graceful {
                            stop_gracefully(w, sup).await?;
                        } else {
                            Box::pin(inflict(w, sup, consumer, &Fault::Kill9 { down: 0 })).await?;
                        }
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                if Instant::now() >= end {
                    eprintln!("checker: drop-slot: no recovery started within 30 s, so no kill");
                }
            }
        }
        Fault::Stall { pg, ms: m } => {
            let p = if *pg { &w.pg_proxy } else { &w.amqp_proxy };
            p.stall(true);
            ms(*m).await;
            p.stall(false);
        }
        Fault::Cut { pg } => (if *pg { &w.pg_proxy } else { &w.amqp_proxy }).cut(),
        Fault::HalfClose { pg } => (if *pg { &w.pg_proxy } else { &w.amqp_proxy }).half_close(),
        Fault::AddColumn => {
            ddl(&format!(
                "ALTER TABLE {} ADD COLUMN IF NOT EXISTS chk_extra text DEFAULT 'x'",
                w.tables[0]
            ))
            .await?
        }
        Fault::Recreate => {
            // The rows a re-created table receives before `setup` adds it
            // to the publication again are in that table only (the stream
            // never carries them): dropping it once more before the
            // operator's remedy has run loses them for good, whatever the
            // relay does. So a second re-creation waits for the remedy of
            // the first (60 s at most: a relay that never stops for the
            // first is then judged by the oracle).
            let owed = sup.lock().unwrap().recreated;
            let end = Instant::now() + Duration::from_secs(60);
            while sup.lock().unwrap().remedies.len() < owed && Instant::now() < end {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            let t = &w.tables[0];
            ddl(&format!(
                "BEGIN; DROP TABLE {t} CASCADE; {} COMMIT",
                w.table_ddl(t)
            ))
            .await?;
            sup.lock().unwrap().recreated += 1;
        }
        Fault::AttachPartition => {
            let t = &w.tables[0];
            ddl(&format!(
                "CREATE TABLE IF NOT EXISTS {t}_late PARTITION OF {t} FOR VALUES IN ('{}')",
                w.aggregate_type(2)
            ))
            .await?
        }
        Fault::Prune => operator(w, &["prune", "--older-than", "2s"]).await?,
        // A window of the last few seconds only: a re-publication of the
        // whole run would hide any loss before it.
        Fault::Republish => {
            let pg = pg_connect_retry().await;
            let since: String = pg
                .query_one(
                    "SELECT to_char(now() AT TIME ZONE 'UTC' - interval '3 seconds', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"')",
                    &[],
                )
                .await
                .map_err(|e| e.to_string())?
                .get(0);
            operator(w, &["republish", "--since", &since]).await?
        }
        Fault::SetupCmd => operator(w, &["setup"]).await?,
    }
    Ok(())
}

async fn ddl(sql: &str) -> Result<(), String> {
    // A server a fault just restarted may end the first connection (or
    // refuse it while it starts up): the DDL is tried again on a new one.
    let mut last = String::new();
    for _ in 0..5 {
        let pg = pg_connect_retry().await;
        // Behind a long transaction (a million-row one, a prepared one),
        // give up rather than queue every producer behind the lock request.
        let r = match pg.batch_execute("SET lock_timeout = '20s'").await {
            Ok(()) => pg.batch_execute(sql).await,
            Err(e) => Err(e),
        };
        let e = match r {
            Ok(()) => return Ok(()),
            Err(e) => e,
        };
        // tokio-postgres says only "db error": the server's words are in
        // the source.
        last = e.as_db_error().map_or_else(
            || e.to_string(),
            |d| format!("{} {}: {}", d.severity(), d.code().code(), d.message()),
        );
        let shut = e
            .as_db_error()
            .is_some_and(|d| d.code().code().starts_with("57P"));
        if !(pg.is_closed() || shut) {
            break;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    Err(format!("DDL {sql:?}: {last}"))
}

/// A relay again, unless one runs.
fn respawn(w: &World, sup: &Mutex<Supervisor>) {
    let mut s = sup.lock().unwrap();
    if s.relay.is_none() {
        s.relay = Some(w.spawn_relay());
        s.starts += 1;
    }
}

/// SIGTERM to the relay (as a deploy or `systemctl restart` sends), then
/// a new one at once. Not stopped within 30 s is a failure.
async fn stop_gracefully(w: &World, sup: &Mutex<Supervisor>) -> Result<(), String> {
    let r = sup.lock().unwrap().relay.take();
    let mut hung = None;
    if let Some(mut r) = r {
        signal(r.pid(), "TERM");
        let (r, status) = tokio::task::spawn_blocking(move || {
            let s = wait_timeout(&mut r.child, Duration::from_secs(30));
            (r, s)
        })
        .await
        .map_err(|e| e.to_string())?;
        if status.is_none() {
            hung = Some(r.log_tail());
            r.kill9();
        }
    }
    respawn(w, sup);
    match hung {
        Some(log) => Err(format!(
            "HANG: the relay did not stop within 30 s of SIGTERM; log:\n{log}"
        )),
        None => Ok(()),
    }
}

async fn operator(w: &World, args: &[&str]) -> Result<(), String> {
    let args: Vec<String> = args.iter().map(|s| (*s).to_owned()).collect();
    // Servers a fault just restarted may still be coming up: an operator
    // tries again a few times.
    let mut out = String::new();
    for _ in 0..3 {
        out = run_cmd(w, &args).await;
        if out == "ok" {
            return Ok(());
        }
        // A documented refusal: the operator runs it another time.
        if out.contains("a recovery of this slot is running") {
            eprintln!("checker: {} refused while a recovery runs", args.join(" "));
            return Ok(());
        }
        tokio::time::sleep(Duration::from_secs(3)).await;
    }
    Err(format!(
        "operator command outbox-relay {}: {out}",
        args.join(" ")
    ))
}
