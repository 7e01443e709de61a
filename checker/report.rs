//! What a run and a soak print: a line per run, and the soak's report.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::time::Duration;

use crate::run::Report;

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn sorted(v: impl IntoIterator<Item = f64>) -> Vec<f64> {
    let mut v: Vec<f64> = v.into_iter().collect();
    v.sort_by(f64::total_cmp);
    v
}

pub fn one_line(r: &Report) -> String {
    let l = sorted(r.latencies_ms.iter().copied());
    format!(
        "checker: seed {} {}: {} events committed ({} txs, {} rolled back, {} failed), {} deliveries, \
         {} duplicates {:?}, {} dead-lettered; faults {:?}; relay started {}x; drained in {:.1}s (writers {:.1}s, record {:.1}s); \
         commit-to-delivery p50 {:.0} ms p99 {:.0} ms; peak RSS {} MiB; {:.0}s{}",
        r.seed,
        if r.failed() { "FAILED" } else { "passed" },
        r.events,
        r.produced.0,
        r.produced.1,
        r.produced.2,
        r.deliveries,
        r.duplicates,
        r.duplicates_by_fault,
        r.dead_lettered,
        r.faults,
        r.relay_starts,
        r.drain_secs,
        r.drain_phases.0,
        r.drain_phases.1,
        percentile(&l, 0.5),
        percentile(&l, 0.99),
        r.peak_rss >> 20,
        r.wall_secs,
        if r.remedies.is_empty() {
            String::new()
        } else {
            format!("; operator: {}", r.remedies.join(" / "))
        }
    )
}

/// The soak's report (markdown), rewritten after every run.
pub fn soak(reports: &[Report], asked: Duration) -> String {
    let mut faults: BTreeMap<&str, usize> = BTreeMap::new();
    let mut dups: BTreeMap<&str, usize> = BTreeMap::new();
    for r in reports {
        for (k, n) in &r.faults {
            *faults.entry(k).or_default() += n;
        }
        for (k, n) in &r.duplicates_by_fault {
            *dups.entry(k).or_default() += n;
        }
    }
    let l = sorted(reports.iter().flat_map(|r| r.latencies_ms.iter().copied()));
    let sum = |f: fn(&Report) -> usize| reports.iter().map(f).sum::<usize>();
    let wall: f64 = reports.iter().map(|r| r.wall_secs).sum();
    let mut s = String::new();
    let _ = writeln!(s, "# Checker soak\n");
    let _ = writeln!(
        s,
        "- asked for {} s; ran {} runs in {:.0} s; {} failed",
        asked.as_secs(),
        reports.len(),
        wall,
        reports.iter().filter(|r| r.failed()).count()
    );
    let _ = writeln!(
        s,
        "- events checked: {}; deliveries {}; duplicates {}; dead-lettered {}",
        sum(|r| r.events),
        sum(|r| r.deliveries),
        sum(|r| r.duplicates),
        sum(|r| r.dead_lettered)
    );
    let _ = writeln!(
        s,
        "- commit-to-delivery p50 {:.0} ms, p99 {:.0} ms; peak RSS {} MiB; slowest drain {:.1} s",
        percentile(&l, 0.5),
        percentile(&l, 0.99),
        reports.iter().map(|r| r.peak_rss).max().unwrap_or(0) >> 20,
        reports.iter().map(|r| r.drain_secs).fold(0.0, f64::max)
    );
    let _ = writeln!(
        s,
        "\n| fault | injected | duplicates after it |\n|---|---:|---:|"
    );
    for (k, n) in &faults {
        let _ = writeln!(s, "| {k} | {n} | {} |", dups.get(k).copied().unwrap_or(0));
    }
    let _ = writeln!(s, "\n## Failures\n");
    for r in reports.iter().filter(|r| r.failed()) {
        let _ = writeln!(s, "### seed {}\n", r.seed);
        for f in &r.failures {
            let _ = writeln!(s, "- {f}");
        }
        let _ = writeln!(s, "\n```\n{}```\n", r.schedule);
    }
    s
}
