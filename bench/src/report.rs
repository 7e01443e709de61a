//! The benchmark report: report.json (every raw figure), report.md (tables, targets; markdown.rs), chart.svg (chart.rs).

use std::fmt::Write as _;
use std::path::Path;

use anyhow::Result;
use serde::Serialize;
use tokio_postgres::Client;

use crate::Settings;
use crate::ceiling::{AMQPLIB, LAPIN_AWAIT_EACH, LAPIN_PIPELINED, PUBLISHERS, RELAY_CLIENT};
use crate::latency::LatencyRun;
use crate::procs::command_output;
use crate::run::QueueTypeResult;

mod channels;
mod chart;
mod markdown;
use chart::svg;
use markdown::*;

#[derive(Debug, Clone, Serialize, Default)]
pub struct Machine {
    pub nproc: usize,
    pub cpu_model: String,
    pub memory_gib: f64,
    pub kernel: String,
    pub os: String,
    pub postgresql: String,
    pub rabbitmq: String,
    pub lapin: String,
    pub node: String,
    pub relay_commit: String,
    pub load_before: String,
    pub load_after: String,
}

pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

impl Machine {
    pub async fn collect(pg: &Client) -> Machine {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu_model = cpuinfo
            .lines()
            .find(|l| l.starts_with("model name"))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.trim().to_owned())
            .unwrap_or_else(|| "unknown".into());
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let mem_kb: f64 = meminfo
            .lines()
            .find(|l| l.starts_with("MemTotal:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0);
        let os = std::fs::read_to_string("/etc/os-release")
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix("PRETTY_NAME="))
            .map(|v| v.trim_matches('"').to_owned())
            .unwrap_or_default();
        let lapin = include_str!("../Cargo.lock")
            .split("[[package]]")
            .find(|p| p.contains("name = \"lapin\""))
            .and_then(|p| p.lines().find_map(|l| l.strip_prefix("version = ")))
            .map(|v| v.trim_matches('"').to_owned())
            .unwrap_or_default();
        let commit = command_output("git", &["rev-parse", "--short", "HEAD"]).unwrap_or_default();
        let dirty = command_output("git", &["status", "--porcelain", "--", "src", "Cargo.toml"])
            .map(|s| !s.is_empty())
            .unwrap_or(false);
        Machine {
            nproc: std::thread::available_parallelism().map_or(0, |n| n.get()),
            cpu_model,
            memory_gib: mem_kb / 1024.0 / 1024.0,
            kernel: command_output("uname", &["-sr"]).unwrap_or_default(),
            os,
            postgresql: crate::pg::version(pg).await.unwrap_or_default(),
            rabbitmq: command_output("dpkg-query", &["-W", "-f=${Version}", "rabbitmq-server"])
                .unwrap_or_else(|| "unknown".into()),
            lapin,
            node: String::new(),
            relay_commit: if dirty {
                format!("{commit} + uncommitted changes in src/")
            } else {
                commit
            },
            load_before: loadavg(),
            load_after: String::new(),
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Target {
    pub name: String,
    pub threshold: String,
    pub measured: String,
    /// None: not measured in this run.
    pub met: Option<bool>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub started_at: String,
    pub duration_seconds: f64,
    pub settings: Settings,
    pub machine: Machine,
    pub queue_types: Vec<QueueTypeResult>,
    pub latency: Vec<LatencyRun>,
    pub channels: Option<crate::run::channels::Sweep>,
    /// Why the channels sweep has no figures, if it failed.
    pub channels_error: Option<String>,
    pub claim_sql: String,
    pub mark_sql: String,
    pub claim_explain: String,
    pub targets: Vec<Target>,
}

fn latency_at<'a>(r: &'a Report, design: &str, rate: u64) -> Option<&'a LatencyRun> {
    r.latency
        .iter()
        .find(|l| l.design == design && l.target_rate == rate)
}

fn targets(r: &Report) -> Vec<Target> {
    let mut t = Vec::new();
    for q in &r.queue_types {
        let (relay, ceiling) = (q.relay.as_ref(), q.ceiling());
        t.push(Target {
            name: format!("relay drain ≥ 0.9 × broker ceiling ({})", q.queue_type),
            threshold: "≥ 0.90".into(),
            measured: match (relay, ceiling) {
                (Some(d), Some(c)) => format!(
                    "{:.2} ({:.0} / {:.0} events/s, {})",
                    d.events_per_s / c.events_per_s,
                    d.events_per_s,
                    c.events_per_s,
                    c.name
                ),
                _ => "not measured".into(),
            },
            met: match (relay, ceiling) {
                (Some(d), Some(c)) => Some(d.events_per_s >= 0.9 * c.events_per_s),
                _ => None,
            },
        });
    }
    for q in &r.queue_types {
        let (relay, poll) = (q.relay.as_ref(), q.polling.as_ref());
        t.push(Target {
            name: format!("relay drain ≥ 2.5 × polling drain ({})", q.queue_type),
            threshold: "≥ 2.5".into(),
            measured: match (relay, poll) {
                (Some(d), Some(p)) => format!(
                    "{:.2} ({:.0} / {:.0} events/s)",
                    d.events_per_s / p.events_per_s,
                    d.events_per_s,
                    p.events_per_s
                ),
                _ => "not measured".into(),
            },
            met: match (relay, poll) {
                (Some(d), Some(p)) => Some(d.events_per_s >= 2.5 * p.events_per_s),
                _ => None,
            },
        });
    }
    let (rl, pl) = (latency_at(r, "relay", 1000), latency_at(r, "polling", 1000));
    t.push(Target {
        name: "p99 commit-to-confirm at 1,000 events/s: polling ÷ relay".into(),
        threshold: "≥ 4".into(),
        measured: match (rl, pl) {
            (Some(a), Some(b)) if a.commit_to_confirm.p99_ms > 0.0 => format!(
                "{:.1} (polling {:.1} ms / relay {:.1} ms, both measured)",
                b.commit_to_confirm.p99_ms / a.commit_to_confirm.p99_ms,
                b.commit_to_confirm.p99_ms,
                a.commit_to_confirm.p99_ms
            ),
            _ => "not measured".into(),
        },
        met: match (rl, pl) {
            (Some(a), Some(b)) if a.commit_to_confirm.p99_ms > 0.0 => {
                Some(b.commit_to_confirm.p99_ms >= 4.0 * a.commit_to_confirm.p99_ms)
            }
            _ => None,
        },
    });
    let drains: Vec<_> = r
        .queue_types
        .iter()
        .filter_map(|q| q.relay.as_ref().map(|d| (q, d)))
        .collect();
    let worst_cpu = drains.iter().max_by(|a, b| {
        a.1.cpu_seconds_per_100k
            .total_cmp(&b.1.cpu_seconds_per_100k)
    });
    t.push(Target {
        name: "relay CPU per 100,000 events (drain, worst queue type)".into(),
        threshold: "< 1.0 s".into(),
        measured: worst_cpu.map_or("not measured".into(), |(q, d)| {
            format!("{:.2} s ({})", d.cpu_seconds_per_100k, q.queue_type)
        }),
        met: worst_cpu.map(|(_, d)| d.cpu_seconds_per_100k < 1.0),
    });
    let worst_rss = drains.iter().max_by_key(|(_, d)| d.peak_rss_bytes);
    t.push(Target {
        name: "relay peak RSS during the drain (worst queue type)".into(),
        threshold: "< 64 MB".into(),
        measured: worst_rss.map_or("not measured".into(), |(q, d)| {
            format!("{:.1} MB ({})", mb(d.peak_rss_bytes), q.queue_type)
        }),
        met: worst_rss.map(|(_, d)| d.peak_rss_bytes < 64 * 1024 * 1024),
    });
    if let Some(sweep) = &r.channels {
        t.extend(channels::targets(sweep));
    }
    t
}

fn mb(b: u64) -> f64 {
    b as f64 / 1024.0 / 1024.0
}

fn num(v: f64) -> String {
    if !v.is_finite() {
        return "–".into();
    }
    let s = format!("{:.0}", v);
    let (sign, digits) = s.strip_prefix('-').map_or(("", s.as_str()), |d| ("-", d));
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    format!("{sign}{out}")
}

fn ms(v: f64) -> String {
    if !v.is_finite() {
        "–".into()
    } else if v < 10.0 {
        format!("{v:.2}")
    } else if v < 100.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.0}")
    }
}

fn met(m: Option<bool>) -> &'static str {
    match m {
        Some(true) => "**met**",
        Some(false) => "**not met**",
        None => "not measured",
    }
}

fn publisher<'a>(q: &'a QueueTypeResult, name: &str) -> Option<&'a crate::ceiling::PublisherRun> {
    q.publishers.iter().find(|p| p.name == name)
}

pub fn write(mut r: Report, out_dir: &str) -> Result<()> {
    r.targets = targets(&r);
    let dir = Path::new(out_dir);
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join("report.json"), serde_json::to_vec_pretty(&r)?)?;
    std::fs::write(dir.join("report.md"), markdown(&r))?;
    std::fs::write(dir.join("chart.svg"), svg(&r))?;
    if !r.queue_types.is_empty() {
        println!("\n## Throughput\n\n{}", throughput_md(&r));
    }
    if !r.latency.is_empty() {
        println!(
            "## Latency ({} queue)\n\n{}",
            r.settings.latency_queue_type,
            latency_md(&r)
        );
    }
    if !r.queue_types.is_empty() {
        println!("## Cost\n\n{}", cost_md(&r));
    }
    if let Some(sweep) = &r.channels {
        println!("## Several channels\n\n{}", channels::table_md(sweep));
        println!("{}", channels::model_md(sweep, r.machine.nproc));
    }
    println!("## Targets\n\n{}", targets_md(&r));
    for t in &r.targets {
        println!(
            "target {}: {} — {} (threshold {})",
            match t.met {
                Some(true) => "MET",
                Some(false) => "NOT MET",
                None => "NOT MEASURED",
            },
            t.name,
            t.measured,
            t.threshold
        );
    }
    println!(
        "\nreport: {0}/report.md, {0}/report.json, {0}/chart.svg (took {1:.1} min)",
        out_dir,
        r.duration_seconds / 60.0
    );
    Ok(())
}
