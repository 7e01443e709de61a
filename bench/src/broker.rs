//! The broker's CPU over an interval, split by the kind of Erlang process
//! that spent it: what the channels sweep's model of a bigger broker is
//! built from.
//!
//! beam.smp's CPU (utime + stime from /proc) is shared out in proportion
//! to reductions (the Erlang VM's unit of work), read per process with
//! `rabbitmqctl eval` before and after. A process's kind is the module it
//! started in (`$initial_call`): `rabbit_channel` is a channel,
//! `rabbit_reader` a connection's reader, `rabbit_prequeue` a classic
//! queue, `ra_server_proc` a quorum queue's member, `ra_log_wal` the
//! quorum WAL, `rabbit_msg_store` the classic message store. Schedulers
//! that spin while idle spend CPU no process is charged for; shared out
//! this way, it makes every figure a little high (a model built on them
//! errs low).

use std::collections::HashMap;

use anyhow::{Context, Result, bail};
use serde::Serialize;

/// One reading: beam's CPU and every live process's reductions.
pub struct Snapshot {
    cpu_seconds: f64,
    total_reductions: u64,
    /// pid → (kind, reductions)
    processes: HashMap<String, (String, u64)>,
}

/// What one kind of process spent over an interval.
#[derive(Debug, Clone, Serialize, Default)]
pub struct KindCost {
    pub kind: String,
    /// Processes of this kind that did any work.
    pub processes: u32,
    /// All of them, CPU seconds per 100,000 messages.
    pub cpu_seconds_per_100k: f64,
    /// The busiest one alone: it runs on one core at a time, so it caps
    /// the rate at 100,000 ÷ this messages/s however many cores there are.
    pub busiest_cpu_seconds_per_100k: f64,
}

/// The broker's cost over an interval, per 100,000 messages.
#[derive(Debug, Clone, Serialize, Default)]
pub struct BrokerCost {
    pub cpu_seconds_per_100k: f64,
    /// Kinds by CPU, most first; work of processes that ended within the
    /// interval is not in any kind.
    pub kinds: Vec<KindCost>,
    /// The share of the interval's reductions done by no process alive at
    /// its end (ended, or short-lived): charged to no kind.
    pub unattributed_share: f64,
}

impl BrokerCost {
    /// The kind whose busiest process caps the rate lowest.
    pub fn busiest(&self) -> Option<&KindCost> {
        self.kinds.iter().max_by(|a, b| {
            a.busiest_cpu_seconds_per_100k
                .total_cmp(&b.busiest_cpu_seconds_per_100k)
        })
    }
}

const EVAL: &str = r#"[io:format("~s ~s ~b~n", [pid_to_list(P), K, R]) || P <- erlang:processes(), {K, R} <- [case erlang:process_info(P, [reductions, dictionary, initial_call]) of [{reductions, R0}, {dictionary, D}, {initial_call, IC}] -> {case proplists:get_value('$initial_call', D) of {M, _, _} -> atom_to_list(M); _ -> atom_to_list(element(1, IC)) end, R0}; _ -> {skip, 0} end], K =/= skip], io:format("total ~b~n", [element(1, erlang:statistics(exact_reductions))]), io:format("os_pid ~s~n", [os:getpid()]), ok."#;

/// Reads the broker behind `TEST_RABBITMQ_CTL` (set by
/// `integration/servers.sh with`).
pub fn snapshot() -> Result<Snapshot> {
    let ctl = std::env::var("TEST_RABBITMQ_CTL")
        .context("TEST_RABBITMQ_CTL is not set: run through `make bench`")?;
    let mut words = ctl.split_whitespace();
    let prog = words.next().context("TEST_RABBITMQ_CTL is empty")?;
    let out = std::process::Command::new(prog)
        .args(words)
        .args(["ctl", "eval", EVAL])
        .output()
        .context("running rabbitmqctl eval")?;
    if !out.status.success() {
        bail!(
            "rabbitmqctl eval failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let (mut total, mut os_pid, mut processes) = (None, None, HashMap::new());
    for line in text.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        match f.as_slice() {
            ["total", n] => total = n.parse().ok(),
            ["os_pid", p] => os_pid = Some(p.to_string()),
            [pid, kind, n] if pid.starts_with('<') => {
                if let Ok(n) = n.parse() {
                    processes.insert(pid.to_string(), (kind.to_string(), n));
                }
            }
            _ => {}
        }
    }
    let pid = os_pid.context("rabbitmqctl eval printed no os_pid")?;
    Ok(Snapshot {
        cpu_seconds: crate::procs::cpu_seconds(&pid)?,
        total_reductions: total.context("rabbitmqctl eval printed no total")?,
        processes,
    })
}

/// The cost of `messages` messages between two snapshots.
pub fn cost(before: &Snapshot, after: &Snapshot, messages: u64) -> BrokerCost {
    let per_100k = 100_000.0 / messages.max(1) as f64;
    let cpu = (after.cpu_seconds - before.cpu_seconds).max(0.0);
    let reductions = after
        .total_reductions
        .saturating_sub(before.total_reductions);
    let cpu_per_reduction = if reductions > 0 {
        cpu / reductions as f64
    } else {
        0.0
    };
    let mut kinds: HashMap<&str, KindCost> = HashMap::new();
    let mut charged = 0u64;
    for (pid, (kind, r1)) in &after.processes {
        let r0 = before.processes.get(pid).map_or(0, |(_, r)| *r);
        let worked = r1.saturating_sub(r0);
        if worked == 0 {
            continue;
        }
        charged += worked;
        let c = worked as f64 * cpu_per_reduction * per_100k;
        let k = kinds.entry(kind).or_insert_with(|| KindCost {
            kind: kind.clone(),
            ..Default::default()
        });
        k.processes += 1;
        k.cpu_seconds_per_100k += c;
        k.busiest_cpu_seconds_per_100k = k.busiest_cpu_seconds_per_100k.max(c);
    }
    let mut kinds: Vec<KindCost> = kinds.into_values().collect();
    kinds.sort_by(|a, b| b.cpu_seconds_per_100k.total_cmp(&a.cpu_seconds_per_100k));
    BrokerCost {
        cpu_seconds_per_100k: cpu * per_100k,
        kinds,
        unattributed_share: if reductions > 0 {
            1.0 - (charged as f64 / reductions as f64).min(1.0)
        } else {
            0.0
        },
    }
}

/// What a kind is, for the report.
pub fn describe(kind: &str) -> &str {
    match kind {
        "rabbit_channel" => "channel",
        "rabbit_reader" => "connection reader",
        "rabbit_writer" => "connection writer",
        "rabbit_prequeue" | "rabbit_amqqueue_process" => "classic queue",
        "rabbit_msg_store" => "message store (classic)",
        "ra_server_proc" => "quorum queue member",
        "ra_log_wal" => "quorum WAL",
        "ra_log_segment_writer" => "quorum segment writer",
        "rabbit_queue_index" => "queue index (classic)",
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snap(cpu: f64, total: u64, procs: &[(&str, &str, u64)]) -> Snapshot {
        Snapshot {
            cpu_seconds: cpu,
            total_reductions: total,
            processes: procs
                .iter()
                .map(|(p, k, r)| (p.to_string(), (k.to_string(), *r)))
                .collect(),
        }
    }

    #[test]
    fn cpu_is_shared_by_reductions_and_the_busiest_process_is_kept() {
        // 10 s of CPU over 1,000 reductions: 0.01 s each, for 200,000
        // messages. Two channels did 300 and 100, the queue 500, an idle
        // process nothing; 100 went to processes that ended.
        let before = snap(
            5.0,
            1_000,
            &[
                ("<0.1.0>", "rabbit_channel", 0),
                ("<0.2.0>", "rabbit_channel", 50),
                ("<0.3.0>", "rabbit_prequeue", 0),
                ("<0.4.0>", "idle", 7),
            ],
        );
        let after = snap(
            15.0,
            2_000,
            &[
                ("<0.1.0>", "rabbit_channel", 300),
                ("<0.2.0>", "rabbit_channel", 150),
                ("<0.3.0>", "rabbit_prequeue", 500),
                ("<0.4.0>", "idle", 7),
            ],
        );
        let c = cost(&before, &after, 200_000);
        assert!((c.cpu_seconds_per_100k - 5.0).abs() < 1e-9);
        assert_eq!(c.kinds.len(), 2, "{:?}", c.kinds);
        let q = &c.kinds[0];
        assert_eq!((q.kind.as_str(), q.processes), ("rabbit_prequeue", 1));
        assert!((q.cpu_seconds_per_100k - 2.5).abs() < 1e-9);
        let ch = &c.kinds[1];
        assert_eq!((ch.kind.as_str(), ch.processes), ("rabbit_channel", 2));
        assert!((ch.cpu_seconds_per_100k - 2.0).abs() < 1e-9);
        assert!((ch.busiest_cpu_seconds_per_100k - 1.5).abs() < 1e-9);
        assert_eq!(
            c.busiest().map(|k| k.kind.as_str()),
            Some("rabbit_prequeue")
        );
        assert!((c.unattributed_share - 0.1).abs() < 1e-9);
    }
}
