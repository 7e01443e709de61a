//! The nemesis, and the supervisor that keeps the relay running as
//! systemd would. Faults are real: signals to the relay and the
//! walsender, the servers stopped and restarted, the slot dropped, DDL,
//! connections stalled, cut or half-closed in the proxies, operators'
//! commands. When the relay stops with a documented error, the supervisor
//! does what the error says (as an operator would) and starts it again;
//! any other exit is a failure.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::common::{
    Relay, ctl_async, pg_connect_retry, pg_ctl, rabbitmq_ctl, signal, try_server_ctl, wait_timeout,
};
use crate::consumer::Consumer;
use crate::schedule::Fault;
use crate::world::World;

/// When a `recreate` ran: its DDL committed between the two.
#[derive(Clone, Copy)]
pub struct Recreated {
    /// Just before the DDL was sent.
    pub sent: Instant,
    /// Just after it was seen committed.
    pub done: Instant,
}

/// A documented stop and what the operator did about it.
pub struct Remedy {
    /// The relay's words and the operator's commands, for the report.
    pub text: String,
    /// When the relay that stopped was started.
    pub started: Instant,
    /// When its exit was seen.
    pub stopped: Instant,
    pub began: Instant,
    pub ended: Instant,
    /// The commands succeeded and included a `republish`.
    pub republished: bool,
}

pub struct Supervisor {
    relay: Option<Relay>,
    pub failures: Vec<String>,
    pub peak_rss: u64,
    pub starts: usize,
    /// What the operator did.
    pub remedies: Vec<Remedy>,
    /// When the outbox table was last dropped and created again
    /// (`recreate`), while no remedy begun after it has succeeded.
    owed: Option<Instant>,
    /// The database's time from which rows of the re-created table may
    /// date (the oldest open transaction when it was re-created), for the
    /// oldest re-creation no remedy has answered yet: what an operator
    /// passes to `republish --since`, rather than the whole run.
    owed_since: Option<String>,
    /// The same, for the last re-creation (answered or not).
    recreated_since: Option<String>,
    /// Outbox tables re-created (`recreate` that committed): each explains
    /// the documented stops naming `republish` that came after it, by
    /// relays started before a remedy begun after it succeeded (see
    /// [`Supervisor::republish_explained`]).
    pub recreates: Vec<Recreated>,
    /// Slots dropped (`drop-slot` that succeeded): each explains one
    /// recovery the relay starts by itself, never more, and only a drop
    /// explains a refusal because a recovery runs.
    pub dropped: usize,
    /// When first-delivery order stopped being owed: the first remedy
    /// (the re-publication it starts goes by `created_at`), or the first
    /// fault after which the README allows otherwise, at the moment it
    /// acts (a full queue nacks, `republish`, a slot dropped, a table
    /// re-created).
    pub order_broken: Option<Instant>,
    /// Faults that end or refuse connections (server restarts, proxy cuts,
    /// stalls, backends terminated), as (start, end): an operator's
    /// command cut off is run again only if one of them explains it.
    disruptions: Vec<(Instant, Option<Instant>)>,
    /// Since when a remedy runs, if one does.
    remedying: Option<Instant>,
    /// Time spent in remedies so far, the running one excluded.
    remedied: Duration,
    /// How many `drop-slot`s found no checkpoint with a commit time
    /// recorded for the slot (the relay had confirmed nothing yet): each
    /// explains one documented "no checkpoint recorded ... republish
    /// --since" stop, never more.
    pub dropped_unrecorded: usize,
}

impl Supervisor {
    pub fn new(w: &World) -> Mutex<Supervisor> {
        Mutex::new(Supervisor {
            relay: Some(w.spawn_relay()),
            failures: Vec::new(),
            peak_rss: 0,
            starts: 1,
            remedies: Vec::new(),
            owed: None,
            owed_since: None,
            recreated_since: None,
            recreates: Vec::new(),
            dropped: 0,
            order_broken: None,
            disruptions: Vec::new(),
            remedying: None,
            remedied: Duration::ZERO,
            dropped_unrecorded: 0,
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

    /// Total time spent in remedies, the running one included.
    pub fn remedy_time(&self) -> Duration {
        self.remedied + self.remedying.map_or(Duration::ZERO, |t| t.elapsed())
    }

    /// Ends the relay: SIGTERM, and it must exit 0, or 1 with the
    /// documented word that a recovery was stopped half way (the record
    /// stays for the next start; every event was judged delivered by then,
    /// and the rest of the window is re-publication). That exit is
    /// accepted only when the run lost its slot (`slot_lost`: nothing else
    /// starts a recovery) and the recovery still moves: one under way is
    /// given [`RECOVERY_PATIENCE`] to end, and fails as a STALL if its
    /// confirmed count stood still all that time.
    pub fn stop(&mut self, slot_lost: bool) {
        self.sample_rss();
        if let Some(mut r) = self.relay.take() {
            if let Ok(Some(s)) = r.child.try_wait() {
                self.failures.push(format!(
                    "the relay had exited {s} before the end: {}",
                    r.log_tail()
                ));
                return;
            }
            if slot_lost && recovering(&r.log_text()) {
                let before = recovery_confirmed(&r.log_text());
                let end = Instant::now() + RECOVERY_PATIENCE;
                while Instant::now() < end && recovering(&r.log_text()) {
                    std::thread::sleep(Duration::from_millis(250));
                }
                let log = r.log_text();
                if recovering(&log) && recovery_confirmed(&log) == before {
                    self.failures.push(format!(
                        "STALL: the relay's recovery confirmed no row in {RECOVERY_PATIENCE:?} at \
                         the end of the run (confirmed={before:?}): {}",
                        r.log_tail()
                    ));
                }
            }
            signal(r.pid(), "TERM");
            match wait_timeout(&mut r.child, Duration::from_secs(40)) {
                Some(s) if s.success() => {}
                Some(s) if slot_lost && recovery_stopped(s, &r.log_tail()) => {}
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

    /// Whether a re-created table explains a stop naming `republish` (by
    /// a relay started at `started`, seen exited at `stopped`): one
    /// re-created before the stop, and before no `republish` begun after
    /// it had succeeded by the relay's start. A relay started later (after
    /// a plain restart, or once the remedy ran) has nothing to republish:
    /// its stop would be a defect the remedy hides. Relays started before
    /// the remedy ended (a spare waiting for the slot, one started beside
    /// the remedy) stop for the same change, each rightly. Where the
    /// times leave a doubt (a remedy begun while the DDL was committing),
    /// the stop is explained.
    pub fn republish_explained(&self, started: Instant, stopped: Instant) -> bool {
        self.recreates.iter().any(|r| {
            r.sent < stopped
                && !(self.remedies.iter())
                    .any(|m| m.republished && m.began > r.done && m.ended < started)
        })
    }

    fn pid(&self) -> Option<u32> {
        self.relay.as_ref().map(Relay::pid)
    }

    /// The relay, taken from the supervisor to be killed, unless it has
    /// exited already: then it stays, so that the supervisor judges its
    /// exit (a kill must not hide a crash).
    fn take_running(&mut self) -> Option<Relay> {
        self.sample_rss();
        match self.relay.as_mut().map(|r| r.child.try_wait()) {
            Some(Ok(None)) => self.relay.take(),
            _ => None,
        }
    }

    /// Whether a disruption overlaps `[from - DISRUPTION_SLACK, to]`.
    fn disrupted(&self, from: Instant, to: Instant) -> bool {
        let from = from.checked_sub(DISRUPTION_SLACK).unwrap_or(from);
        self.disruptions
            .iter()
            .any(|&(s, e)| s <= to && e.is_none_or(|e| e >= from))
    }
}

/// How long after a disruption ends a command may still find a server
/// coming up (the broker's listeners, PostgreSQL's recovery) or a proxy's
/// connection dying.
const DISRUPTION_SLACK: Duration = Duration::from_secs(15);

/// Records a disruption over `f`'s run.
async fn disruption<T>(sup: &Mutex<Supervisor>, f: impl Future<Output = T>) -> T {
    let i = {
        let mut s = sup.lock().unwrap();
        s.disruptions.push((Instant::now(), None));
        s.disruptions.len() - 1
    };
    let r = f.await;
    sup.lock().unwrap().disruptions[i].1 = Some(Instant::now());
    r
}

/// Processes the nemesis stopped (`SIGSTOP`) and has not let go yet: a run
/// cut off by its bound lets them go ([`let_go`]), else a stopped
/// walsender would hold its slot, and block `pg_ctl`, for every later run.
static STOPPED: Mutex<Vec<u32>> = Mutex::new(Vec::new());

/// `SIGSTOP` to `pid` for `d`, then `SIGCONT`.
async fn stopped_for(pid: u32, d: Duration) {
    STOPPED.lock().unwrap().push(pid);
    signal(pid, "STOP");
    tokio::time::sleep(d).await;
    signal(pid, "CONT");
    STOPPED.lock().unwrap().retain(|p| *p != pid);
}

/// Undoes what a run cut off half way may have left in force: stopped
/// processes, the broker stopped or under a memory alarm.
pub async fn let_go() {
    let stopped = std::mem::take(&mut *STOPPED.lock().unwrap());
    for pid in stopped {
        signal(pid, "CONT");
    }
    // Reported, never a panic: a command cut off with the run (a broker
    // stop under way) may make these fail; the next run's own checks say
    // what is left.
    let _ = tokio::task::spawn_blocking(|| {
        for (var, args) in [
            ("TEST_PG_CTL", &["start"][..]),
            ("TEST_RABBITMQ_CTL", &["start"][..]),
            (
                "TEST_RABBITMQ_CTL",
                &["ctl", "set_vm_memory_high_watermark", "0.4"][..],
            ),
        ] {
            if let Err(e) = try_server_ctl(var, args) {
                eprintln!("checker: after a run cut off: {e}");
            }
        }
    })
    .await;
}

/// How long a recovery under way at the end of a run is given to end (it
/// logs its confirmed count every 5 s).
const RECOVERY_PATIENCE: Duration = Duration::from_secs(30);

/// The relay's log line of a new recovery.
pub const STARTED: &str = "recover: recovery recorded window=";

/// Whether the log's last recovery (begun or resumed) has not ended.
fn recovering(log: &str) -> bool {
    let began = [STARTED, "finishing the recovery recorded earlier"]
        .iter()
        .filter_map(|m| log.rfind(m))
        .max();
    began.is_some_and(|b| log.rfind("recovery complete").is_none_or(|e| e < b))
}

/// The confirmed count of the log's last `re-publishing` line.
fn recovery_confirmed(log: &str) -> Option<String> {
    let line = log.lines().rev().find(|l| l.contains("re-publishing"))?;
    let v = &line[line.find("confirmed=")? + "confirmed=".len()..];
    Some(v.split_whitespace().next().unwrap_or_default().to_owned())
}

/// Whether `s` is the documented exit of a relay stopped by a signal
/// half way through a recovery (which keeps its record for the next start).
fn recovery_stopped(s: std::process::ExitStatus, log_tail: &str) -> bool {
    s.code() == Some(1)
        && log_tail
            .lines()
            .last()
            .is_some_and(|l| l.starts_with("outbox-relay: stopped before the recovery of slot"))
}

/// How long an operator goes on running again a command a fault cut off
/// (broker restarts can follow each other for half a minute and more),
/// 3 s apart.
const PATIENCE: Duration = Duration::from_secs(120);

/// Whether a command failed for a connection lost or refused, or a server
/// going down or coming up (not for a timeout, nor for what it found). Of
/// the broker's `connection.close` codes, only 320 (`CONNECTION_FORCED`:
/// a broker shutting down) is a cut; the others are refusals, which a
/// retry must not hide.
fn cut_off(out: &str) -> bool {
    let out = out.to_ascii_lowercase();
    let closed = |o: &str| {
        o.match_indices("closed the connection").any(|(i, m)| {
            let rest = &o[i + m.len()..];
            match rest.strip_prefix(": ") {
                Some(r) if r.starts_with(|c: char| c.is_ascii_digit()) => r.starts_with("320"),
                _ => true,
            }
        })
    };
    !out.contains("no end within")
        && (closed(&out)
            || [
                "connection closed",
                "connection reset",
                "connection refused",
                "broken pipe",
                "unexpected eof",
                "the database system is",
                // 57P01: a server shutting down (pg-restart) ends sessions so.
                "terminating connection due to administrator command",
            ]
            .iter()
            .any(|s| out.contains(s)))
}

/// Runs an operator's command as an operator would: one whose connection
/// was cut by a fault (one of the supervisor's disruptions, during the
/// attempt or just before it) is run again, 3 s apart, for up to
/// [`PATIENCE`]; any other failure (a timeout, a cut no fault explains) is
/// final. Returns whether it succeeded, and a line per run.
async fn persist(w: &World, sup: &Mutex<Supervisor>, args: &[String]) -> (bool, Vec<String>) {
    let began = Instant::now();
    let mut lines = Vec::new();
    for attempt in 1.. {
        let t = Instant::now();
        let out = run_cmd(w, args).await;
        let explained = sup.lock().unwrap().disrupted(t, Instant::now());
        lines.push(format!(
            "operator: outbox-relay {} -> {out} ({:.1} s{})",
            args.join(" "),
            t.elapsed().as_secs_f64(),
            if attempt > 1 {
                format!(", attempt {attempt}")
            } else {
                String::new()
            }
        ));
        if out == "ok" {
            return (true, lines);
        }
        if !cut_off(&out) || began.elapsed() >= PATIENCE {
            return (false, lines);
        }
        if !explained {
            lines.push("operator: no fault explains that cut: not run again".into());
            return (false, lines);
        }
        tokio::time::sleep(Duration::from_secs(3)).await;
    }
    unreachable!()
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
                    // Its standard output says what it did last ("stopped
                    // before streaming ...").
                    let out =
                        std::fs::read_to_string(r.log.with_extension("out")).unwrap_or_default();
                    Some((
                        status,
                        r.log_tail(),
                        tail(&out, 2),
                        r.started,
                        Instant::now(),
                    ))
                }
                _ => None,
            }
        };
        let Some((status, log, out, started, stopped)) = exited else {
            continue;
        };
        let remedy = {
            let s = sup.lock().unwrap();
            let since = s
                .owed_since
                .as_ref()
                .or(s.recreated_since.as_ref())
                .unwrap_or(&w.started_at);
            remedy_for(&log, since, w)
        };
        let said = log.lines().last().unwrap_or_default().to_owned();
        // The relay's claim, checked: a slot lost before any checkpoint.
        if said.contains("no checkpoint recorded for slot") && claim_refuted(&w.slot).await {
            sup.lock().unwrap().failures.push(format!(
                "the relay stopped saying no checkpoint is recorded, but the checkpoint table \
                 holds one for slot {}: {said}",
                w.slot
            ));
        }
        match &remedy {
            Some(args) => {
                let began = Instant::now();
                {
                    let mut s = sup.lock().unwrap();
                    s.remedying = Some(began);
                    s.order_broken.get_or_insert(began);
                }
                let mut all = vec![format!("relay exited {status}: {said}")];
                let mut failed = None;
                for a in args {
                    let (ok, lines) = persist(w, sup, a).await;
                    all.extend(lines);
                    if !ok {
                        // The next command (republish after setup) would
                        // only fail for the same cause.
                        failed = all.last().cloned();
                        break;
                    }
                }
                let mut s = sup.lock().unwrap();
                s.remedying = None;
                s.remedied += began.elapsed();
                s.remedies.push(Remedy {
                    text: all.join("; "),
                    started,
                    stopped,
                    began,
                    ended: Instant::now(),
                    republished: failed.is_none() && args.iter().any(|a| a[0] == "republish"),
                });
                match failed {
                    Some(f) => s
                        .failures
                        .push(format!("the documented remedy failed: {f}")),
                    // A table re-created before this remedy began has had
                    // its remedy.
                    None if s.owed.is_some_and(|t| t < began) => {
                        s.owed = None;
                        s.owed_since = None;
                    }
                    None => {}
                }
            }
            None => sup.lock().unwrap().failures.push(format!(
                "the relay exited {status} with no documented remedy: {} (its output: {out})",
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

/// Whether the relay has recorded a checkpoint with a commit time for
/// `slot`, the one thing a recovery of a lost slot starts from. A missing
/// table (the relay has not made it yet) is no checkpoint; any other
/// error counts as one, so that it can never excuse a stop.
async fn checkpoint_recorded(pg: &tokio_postgres::Client, slot: &str) -> bool {
    read_checkpoint(pg, slot).await.unwrap_or(true)
}

/// Whether the checkpoint table holds a checkpoint for `slot` (read up to
/// five times, 1 s apart, while it cannot be read).
async fn claim_refuted(slot: &str) -> bool {
    for _ in 0..5 {
        if let Some(recorded) = read_checkpoint(&pg_connect_retry().await, slot).await {
            return recorded;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    eprintln!("checker: could not read the checkpoint table to check the relay's claim");
    false
}

/// [`checkpoint_recorded`], `None` when it cannot be read (a server
/// restarting): nothing to accuse the relay of.
async fn read_checkpoint(pg: &tokio_postgres::Client, slot: &str) -> Option<bool> {
    match pg
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM public.outbox_relay_checkpoint \
             WHERE slot_name = $1 AND last_commit_time IS NOT NULL)",
            &[&slot],
        )
        .await
    {
        Ok(row) => Some(row.get(0)),
        Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::UNDEFINED_TABLE) => {
            Some(false)
        }
        Err(_) => None,
    }
}

fn tail(log: &str, n: usize) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(n)..].join(" | ")
}

/// The commands a documented stop names, as the operator runs them. Where
/// the stop leaves the time to the operator (`--since <time>`), the
/// operator gives what they know: the start of the run for a slot lost
/// before any checkpoint (nothing was confirmed), else `since`, from when
/// the rows of the last re-created table may date, and that table.
fn remedy_for(log: &str, since: &str, w: &World) -> Option<Vec<Vec<String>>> {
    let last = log.lines().rev().find(|l| !l.trim().is_empty())?;
    if let Some(i) = last.find("republish --since ") {
        let words: Vec<String> = last[i + "republish ".len()..]
            .split_whitespace()
            .map(|x| x.trim_end_matches(['`', '.', ',', ')', '"']).to_owned())
            .collect();
        let mut args = vec!["republish".to_owned()];
        let mut it = words.into_iter();
        let mut chose = false;
        while let Some(word) = it.next() {
            if word != "--since" && word != "--table" {
                break;
            }
            let value = it.next().unwrap_or_default();
            args.push(word.clone());
            // A placeholder (`<time>`, `TIME`) is no time: the operator
            // picks one.
            if word == "--since" && !value.starts_with(|c: char| c.is_ascii_digit()) {
                if last.contains("no checkpoint recorded for slot") {
                    args.push("{started_at}".into());
                } else {
                    chose = true;
                    args.push(since.to_owned());
                }
            } else {
                args.push(value);
            }
        }
        // The re-created table, the only one whose rows the stream missed.
        if chose
            && since != w.started_at
            && w.tables.len() > 1
            && !args.iter().any(|a| a == "--table")
        {
            args.extend(["--table".into(), w.tables[0].clone()]);
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
            // A relay that has exited already is the supervisor's to judge.
            let r = sup.lock().unwrap().take_running();
            if let Some(r) = r {
                r.kill9();
            }
            ms(*down).await;
            respawn(w, sup);
        }
        Fault::Pause { ms: m } => {
            let pid = sup.lock().unwrap().pid();
            if let Some(pid) = pid {
                stopped_for(pid, Duration::from_millis(u64::from(*m))).await;
            }
        }
        Fault::Takeover { ms: m } => {
            let second = w.spawn_relay();
            ms(*m).await;
            let first = {
                let mut s = sup.lock().unwrap();
                match s.take_running() {
                    Some(first) => {
                        s.starts += 1;
                        s.relay = Some(second);
                        Some(first)
                    }
                    // The first has exited (the supervisor judges why, or
                    // has replaced it): the spare goes instead.
                    None => Some(second),
                }
            };
            if let Some(r) = first {
                r.kill9();
            }
        }
        Fault::BrokerRestart { ms: m } => {
            disruption(sup, async {
                ctl_async(rabbitmq_ctl, &["stop"]).await;
                ms(*m).await;
                ctl_async(rabbitmq_ctl, &["start"]).await;
            })
            .await;
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
            order_broken(sup);
            consumer
                .paused
                .store(true, std::sync::atomic::Ordering::SeqCst);
            ms(*m).await;
            consumer
                .paused
                .store(false, std::sync::atomic::Ordering::SeqCst);
        }
        Fault::PgRestart => disruption(sup, ctl_async(pg_ctl, &["restart"])).await,
        Fault::TerminateWalsender => {
            let pg = pg_connect_retry().await;
            let _ = disruption(
                sup,
                pg.execute(
                    "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots \
                     WHERE slot_name = $1 AND active_pid IS NOT NULL",
                    &[&w.slot],
                ),
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
                stopped_for(pid as u32, Duration::from_millis(u64::from(*m))).await;
            }
        }
        Fault::DropSlot { kill, graceful } => {
            // Not "finishing the recovery recorded earlier": a new one.
            let recoveries = |s: &Supervisor| {
                s.relay
                    .as_ref()
                    .map(|r| (r.pid(), r.log_text().matches(STARTED).count()))
            };
            let before = recoveries(&sup.lock().unwrap());
            let pg = pg_connect_retry().await;
            // Read before the drop. A checkpoint found is never taken back
            // (the relay deletes none), but "none" can go stale: one
            // written between this read and the drop leaves an excuse
            // unused, a leniency the issue note lists (read again after
            // the drop, and check the relay's claim when it stops).
            let unrecorded = !checkpoint_recorded(&pg, &w.slot).await;
            let end = Instant::now() + Duration::from_secs(10);
            order_broken(sup);
            let dropped = disruption(sup, async {
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
                        return true;
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                false
            })
            .await;
            // Only a drop that happened explains a stop; and "no
            // checkpoint" only if none was there after the drop either (one
            // written between the two reads is the relay's to use).
            if dropped {
                let unrecorded = unrecorded && !checkpoint_recorded(&pg, &w.slot).await;
                let mut s = sup.lock().unwrap();
                s.dropped += 1;
                if unrecorded {
                    s.dropped_unrecorded += 1;
                }
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
            disruption(sup, async {
                p.stall(true);
                ms(*m).await;
                p.stall(false);
            })
            .await;
        }
        Fault::Cut { pg } => {
            disruption(sup, async {
                (if *pg { &w.pg_proxy } else { &w.amqp_proxy }).cut();
            })
            .await;
        }
        Fault::HalfClose { pg } => {
            disruption(sup, async {
                (if *pg { &w.pg_proxy } else { &w.amqp_proxy }).half_close();
            })
            .await;
        }
        Fault::AddColumn => {
            let sql = format!(
                "ALTER TABLE {} ADD COLUMN IF NOT EXISTS chk_extra text DEFAULT 'x'",
                w.tables[0]
            );
            match ddl(&sql).await {
                Ok(()) => {}
                // A workload transaction (a prepared one, a million rows)
                // held the table past the lock timeout: the column is not
                // added, as a migration with a lock_timeout backs off, and
                // the run goes on. Unless the relay holds it (a recovery's
                // snapshot, prune, setup left open): that is a finding.
                Err(e) if e.contains("55P03") => {
                    let holders = lock_holders(&w.tables[0]).await;
                    if holders.iter().any(|a| a.starts_with("outbox-relay")) {
                        return Err(format!(
                            "{e}; the relay holds the table: {}",
                            holders.join(", ")
                        ));
                    }
                    eprintln!(
                        "checker: add-column not applied: {e} (held by: {})",
                        if holders.is_empty() {
                            "nobody now".to_owned()
                        } else {
                            holders.join(", ")
                        }
                    )
                }
                Err(e) => return Err(e),
            }
        }
        Fault::Recreate => {
            // The rows a re-created table receives before `setup` adds it
            // to the publication again are in that table only (the stream
            // never carries them): dropping it once more before the
            // operator's remedy has run loses them for good, whatever the
            // relay does. So a second re-creation waits until a remedy
            // begun after the first has succeeded: for as long as one
            // runs (the run's own bound ends a hang), else 60 s (a relay
            // that never stops for the first is then judged by the oracle).
            let end = Instant::now() + Duration::from_secs(60);
            loop {
                let (owed, remedying) = {
                    let s = sup.lock().unwrap();
                    (s.owed.is_some(), s.remedying.is_some())
                };
                if !owed || (!remedying && Instant::now() >= end) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            let t = &w.tables[0];
            // A retry after a COMMIT whose answer was lost must not drop
            // the new table again: the table's oid tells.
            let pg = pg_connect_retry().await;
            let oid: i64 = pg
                .query_one(&format!("SELECT '{t}'::regclass::oid::int8"), &[])
                .await
                .map_err(|e| format!("reading the oid of {t}: {e}"))?
                .get(0);
            // Rows of the new table date from no earlier than the oldest
            // transaction open now (one waiting on the table's lock writes
            // into the new table with its own start time): what the
            // operator passes to `republish --since`.
            let since: String = pg
                .query_one(
                    "SELECT to_char(least(now(), min(xact_start)) AT TIME ZONE 'UTC' \
                     - interval '1 second', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"') \
                     FROM pg_stat_activity WHERE backend_type = 'client backend' \
                     AND usename <> $1",
                    // Not the relay's own (a recovery's or republish's
                    // long read): only a writer can write the new table.
                    &[&w.role],
                )
                .await
                .map_err(|e| format!("reading the oldest open transaction: {e}"))?
                .get(0);
            drop(pg);
            order_broken(sup);
            let sent = Instant::now();
            ddl_once(
                &format!("BEGIN; DROP TABLE {t} CASCADE; {} COMMIT", w.table_ddl(t)),
                Some(&format!(
                    "SELECT coalesce(to_regclass('{t}')::oid::int8 <> {oid}, false)"
                )),
            )
            .await?;
            let mut s = sup.lock().unwrap();
            s.owed = Some(Instant::now());
            s.owed_since.get_or_insert_with(|| since.clone());
            s.recreated_since = Some(since);
            s.recreates.push(Recreated {
                sent,
                done: Instant::now(),
            });
        }
        Fault::AttachPartition => {
            let t = &w.tables[0];
            ddl(&format!(
                "CREATE TABLE IF NOT EXISTS {t}_late PARTITION OF {t} FOR VALUES IN ('{}')",
                w.aggregate_type(2)
            ))
            .await?
        }
        Fault::Prune => operator(w, sup, &["prune", "--older-than", "2s"]).await?,
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
            order_broken(sup);
            operator(w, sup, &["republish", "--since", &since]).await?
        }
        Fault::SetupCmd => operator(w, sup, &["setup"]).await?,
    }
    Ok(())
}

/// Who holds a lock on `table` now: each session's application_name
/// (its pid without one; a prepared transaction, which has no session,
/// as "prepared").
async fn lock_holders(table: &str) -> Vec<String> {
    let pg = pg_connect_retry().await;
    pg.query(
        "SELECT DISTINCT CASE WHEN l.pid IS NULL THEN 'prepared' \
         ELSE coalesce(nullif(a.application_name, ''), 'pid ' || l.pid) END FROM pg_locks l \
         LEFT JOIN pg_stat_activity a ON a.pid = l.pid \
         WHERE l.relation = to_regclass($1) AND l.granted",
        &[&table],
    )
    .await
    .map(|rows| rows.iter().map(|r| r.get::<_, String>(0)).collect())
    .unwrap_or_default()
}

async fn ddl(sql: &str) -> Result<(), String> {
    ddl_once(sql, None).await
}

/// Runs `sql`; a server a fault just restarted may end the first
/// connection (or refuse it while it starts up), so it is tried again on a
/// new one, unless `applied` (a query answering one bool) says the lost
/// try took effect.
async fn ddl_once(sql: &str, applied: Option<&str>) -> Result<(), String> {
    let mut last = String::new();
    for attempt in 0..5 {
        let pg = pg_connect_retry().await;
        if attempt > 0
            && let Some(q) = applied
            && pg
                .query_one(q, &[])
                .await
                .is_ok_and(|r| r.get::<_, bool>(0))
        {
            return Ok(());
        }
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

/// From now on, first deliveries may leave commit order (as documented).
pub fn order_broken(sup: &Mutex<Supervisor>) {
    sup.lock()
        .unwrap()
        .order_broken
        .get_or_insert_with(Instant::now);
}

/// A relay again, unless one runs, or the supervisor is carrying out a
/// remedy (it starts the relay when the remedy is done: one started before
/// `setup` would stop again for the same cause).
fn respawn(w: &World, sup: &Mutex<Supervisor>) {
    let mut s = sup.lock().unwrap();
    if s.relay.is_none() && s.remedying.is_none() {
        s.relay = Some(w.spawn_relay());
        s.starts += 1;
    }
}

/// SIGTERM to the relay (as a deploy or `systemctl restart` sends), then
/// a new one at once. Not stopped within 30 s is a failure.
/// It must exit 0, or 1 with the documented word that it stopped a
/// recovery half way; a relay that had exited already is left to the
/// supervisor (and its remedy).
async fn stop_gracefully(w: &World, sup: &Mutex<Supervisor>) -> Result<(), String> {
    let r = {
        let mut s = sup.lock().unwrap();
        match s.relay.as_mut().map(|r| r.child.try_wait()) {
            Some(Ok(None)) => s.relay.take(),
            _ => return Ok(()),
        }
    };
    let mut bad = None;
    if let Some(mut r) = r {
        signal(r.pid(), "TERM");
        let (r, status) = tokio::task::spawn_blocking(move || {
            let s = wait_timeout(&mut r.child, Duration::from_secs(30));
            (r, s)
        })
        .await
        .map_err(|e| e.to_string())?;
        match status {
            None => {
                bad = Some(format!(
                    "HANG: the relay did not stop within 30 s of SIGTERM; log:\n{}",
                    r.log_tail()
                ));
                r.kill9();
            }
            Some(s) if s.success() || recovery_stopped(s, &r.log_tail()) => {}
            Some(s) => bad = Some(format!("the relay exited {s} on SIGTERM: {}", r.log_tail())),
        }
    }
    respawn(w, sup);
    bad.map_or(Ok(()), Err)
}

async fn operator(w: &World, sup: &Mutex<Supervisor>, args: &[&str]) -> Result<(), String> {
    let args: Vec<String> = args.iter().map(|s| (*s).to_owned()).collect();
    let (ok, lines) = persist(w, sup, &args).await;
    let last = lines.last().cloned().unwrap_or_default();
    if ok {
        return Ok(());
    }
    // A documented refusal: the operator runs it another time (`prune`
    // keeps the rows a lost slot's recovery needs, seed 1797418585). Only
    // a slot dropped explains it: nothing else starts a recovery.
    // The three ways `prune` says so: a recovery holding its lock, one
    // recorded in the checkpoint row and not finished (seed 1800200010: a
    // prune 4 ms after a drop-slot), the slot not there yet. `setup`
    // refuses to make a dropped slot again (seed 1808600037): while a
    // recovery is recorded, or once a relay has streamed from it (a new
    // slot would skip what was committed meanwhile): only `recover` may.
    let lost = sup.lock().unwrap().dropped > 0;
    if lost
        && (last.contains("a recovery of this slot is running")
            || (args[0] == "prune"
                && (last.contains("is missing or lost: `outbox-relay recover`")
                    || last.contains("a recovery is under way")))
            || (args[0] == "setup"
                && (last.contains("the slot is gone") || last.contains("is gone, but a relay"))
                && last.contains("outbox-relay recover")))
    {
        eprintln!("checker: {} refused while a recovery runs", args.join(" "));
        return Ok(());
    }
    // A `republish` from after a re-created table's rows sends its rows and
    // then says that it did not cover the change (README, guarantee 6a):
    // only a re-creation explains it.
    if args[0] == "republish"
        && !sup.lock().unwrap().recreates.is_empty()
        && last.contains("the relay refuses to start until")
    {
        eprintln!(
            "checker: {} did not cover the re-created table",
            args.join(" ")
        );
        return Ok(());
    }
    Err(last)
}
