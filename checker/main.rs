//! The whole-system checker: random schedules of every feature against
//! every fault, on the real relay and the harness's real servers, judged
//! by an oracle from the database's own record (see `oracle.rs`).
//!
//! Run under `integration/servers.sh with` (the make targets do):
//!
//! - no settings (`make test`): the fixed seeds below and every schedule
//!   in `checker/regressions/`; exit 1 on any failure;
//! - `CHECK_SEED=<n>`: that seed's schedule (`make check-seed`), replayed
//!   (with `CHECK_PRINT=1`: printed only);
//! - `CHECK_SCHEDULE=<file>`: a schedule as printed (a shrunk one);
//! - `SOAK_SECONDS=<n>` (`make soak`): random seeds until the time is up,
//!   a report in `target/checker/soak.md`.
//!
//! A failing run is shrunk (`CHECK_SHRINK=<runs>`, default 12; 0: off):
//! faults, transactions and producers removed while it still fails; the
//! result goes to `target/checker/shrunk-<seed>.sched`, ready to be kept
//! in `checker/regressions/`.
//!
//! Size of a drawn run: `CHECK_PRODUCERS` (3), `CHECK_TXS` (30 per
//! producer), `CHECK_FAULTS` (6). `CHECK_RELAY_BIN` runs another build of
//! the relay (a defect put back on a scratch branch). `CHECK_KEEP=1` keeps
//! each run's relay logs in `target/checker/run-<seed>-<prefix>/`, passed
//! or not (a failed run's are always kept). `CHECK_OUT=<dir>` puts all of
//! that in `<dir>` instead of `target/checker/`.

#[path = "../tests/common/mod.rs"]
mod common;
mod consumer;
mod nemesis;
mod oracle;
mod proxy;
mod report;
mod rng;
mod run;
mod schedule;
mod shrink;
mod workload;
mod world;

use std::time::{Duration, Instant};

use schedule::{Schedule, Size};

/// The seeds `make test` runs (each a minute or less).
const FIXED_SEEDS: [u64; 3] = [2, 6, 7];

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name).map_or(default, |v| {
        v.trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name} must be an unsigned integer"))
    })
}

/// A setting given a value (make passes empty ones).
fn set(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

fn size() -> Size {
    Size {
        producers: env_u64("CHECK_PRODUCERS", 3) as usize,
        txs: env_u64("CHECK_TXS", 30) as usize,
        faults: env_u64("CHECK_FAULTS", 6) as usize,
    }
}

fn main() {
    // libtest's arguments (`cargo test -- --test-threads=4`) mean nothing here.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let ok = rt.block_on(async_main());
    std::process::exit(if ok { 0 } else { 1 });
}

async fn async_main() -> bool {
    std::fs::create_dir_all(out_dir()).unwrap();
    // A judge that cannot fail proves nothing: it is shown wrong runs first.
    if let Err(e) = oracle::self_check() {
        eprintln!("checker: the oracle passed a run it must fail: {e}");
        return false;
    }
    if let Err(e) = schedule::self_check() {
        eprintln!("checker: {e}");
        return false;
    }
    if let Some(path) = set("CHECK_SCHEDULE") {
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        let s: Schedule = text.parse().unwrap_or_else(|e| panic!("{path}: {e}"));
        return !check(&s).await.failed();
    }
    if let Some(seed) = set("CHECK_SEED") {
        let seed: u64 = seed
            .trim()
            .parse()
            .expect("CHECK_SEED must be an unsigned integer");
        if set("CHECK_PRINT").is_some() {
            print!("{}", Schedule::generate(seed, size()));
            return true;
        }
        return !check(&Schedule::generate(seed, size())).await.failed();
    }
    if set("SOAK_SECONDS").is_some() {
        return soak(Duration::from_secs(env_u64("SOAK_SECONDS", 600))).await;
    }
    let mut ok = true;
    for seed in FIXED_SEEDS {
        ok &= !check(&Schedule::generate(seed, size())).await.failed();
    }
    for (path, s) in regressions() {
        println!("checker: regression {path}");
        ok &= !check(&s).await.failed();
    }
    ok
}

/// Where reports, shrunk schedules and kept logs go: `CHECK_OUT`, else
/// `target/checker` (two soaks at once each need their own).
pub fn out_dir() -> std::path::PathBuf {
    set("CHECK_OUT").map_or_else(
        || std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/checker"),
        std::path::PathBuf::from,
    )
}

/// The kept schedules of `checker/regressions/`.
fn regressions() -> Vec<(String, Schedule)> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("checker/regressions");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .map(|d| d.filter_map(Result::ok).map(|e| e.path()).collect())
        .unwrap_or_default();
    files.retain(|p| p.extension().is_some_and(|e| e == "sched"));
    files.sort();
    files
        .into_iter()
        .map(|p| {
            let text = std::fs::read_to_string(&p).unwrap();
            let s = text
                .parse()
                .unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            (p.display().to_string(), s)
        })
        .collect()
}

/// Runs `s` and prints its verdict; on failure shrinks it.
async fn check(s: &Schedule) -> run::Report {
    println!(
        "checker: seed {} ({:?}), replay with CHECK_SEED={}\n{s}",
        s.seed, s.setup.shape, s.seed
    );
    let r = run::bounded(s).await;
    println!("{}", report::one_line(&r));
    if !r.failed() {
        return r;
    }
    for f in &r.failures {
        println!("checker: FAILED seed {}: {f}", s.seed);
    }
    let budget = env_u64("CHECK_SHRINK", 12) as usize;
    if budget > 0 {
        let small = shrink::shrink(s, budget).await;
        let path = out_dir().join(format!("shrunk-{}.sched", s.seed));
        std::fs::write(&path, small.to_string()).unwrap();
        println!(
            "checker: shrunk schedule (replay: CHECK_SCHEDULE={}):\n{small}",
            path.display()
        );
    }
    r
}

async fn soak(length: Duration) -> bool {
    let end = Instant::now() + length;
    let mut reports = Vec::new();
    let mut seed = env_u64(
        "SOAK_FIRST_SEED",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs(),
    );
    while Instant::now() < end {
        let s = Schedule::generate(seed, size());
        reports.push(check(&s).await);
        seed += 1;
        std::fs::write(out_dir().join("soak.md"), report::soak(&reports, length)).unwrap();
    }
    reports.iter().all(|r| !r.failed())
}
