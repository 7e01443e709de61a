//! The channels sweep in the report: its table, its targets, what limits it
//! here and the model of a broker with more cores.

use super::*;
use crate::broker::{BrokerCost, describe};
use crate::run::channels::{Cell, Layout, Sweep};

/// Cores the model gives the broker.
pub const MODEL_CORES: f64 = 8.0;

/// What a cell's figures say a broker with [`MODEL_CORES`] cores of its own
/// would do (PostgreSQL and the relay on cores of their own too): the
/// lowest of the bounds, each measured here per message.
pub struct Model {
    pub events_per_s: f64,
    pub limit: String,
    /// Every bound (events/s, what).
    pub bounds: Vec<(f64, String)>,
}

fn rate(cpu_per_100k: f64, cores: f64) -> f64 {
    if cpu_per_100k > 0.0 {
        cores * 100_000.0 / cpu_per_100k
    } else {
        f64::INFINITY
    }
}

pub fn model(c: &Cell) -> Model {
    let mut bounds = vec![
        (
            rate(c.relay.cpu_seconds_per_100k, 1.0),
            "the relay (one thread)".to_owned(),
        ),
        (
            rate(c.relay_broker.cpu_seconds_per_100k, MODEL_CORES),
            format!("the broker's CPU on {MODEL_CORES:.0} cores"),
        ),
    ];
    if let Some(w) = c.relay.walsender_cpu_seconds_per_100k {
        bounds.push((rate(w, 1.0), "the walsender (one process)".into()));
    }
    // Every kind's busiest process runs on one core at a time.
    for k in &c.relay_broker.kinds {
        if k.busiest_cpu_seconds_per_100k > 0.0 {
            bounds.push((
                rate(k.busiest_cpu_seconds_per_100k, 1.0),
                format!("one {} process", describe(&k.kind)),
            ));
        }
    }
    bounds.sort_by(|a, b| a.0.total_cmp(&b.0));
    let (events_per_s, limit) = bounds[0].clone();
    Model {
        events_per_s,
        limit,
        bounds,
    }
}

/// CPU per 100k events of everything on this machine that is known: relay,
/// walsender, broker.
fn known_cpu(c: &Cell) -> f64 {
    c.relay.cpu_seconds_per_100k
        + c.relay.walsender_cpu_seconds_per_100k.unwrap_or(0.0)
        + c.relay_broker.cpu_seconds_per_100k
}

/// The relay's rate on the ceiling's clock: from the first message in the
/// queues to the last (the ceiling's runs from its first publish to its
/// last confirm, after connecting).
pub fn relay_rate(c: &Cell) -> f64 {
    c.relay.events_per_s_after_first
}

fn cells<'a>(s: &'a Sweep, qt: &'a str, layout: Layout) -> impl Iterator<Item = &'a Cell> {
    s.cells
        .iter()
        .filter(move |c| c.queue_type == qt && c.layout == layout)
}

fn queue_types(s: &Sweep) -> Vec<&str> {
    let mut q: Vec<&str> = Vec::new();
    for c in &s.cells {
        if !q.contains(&c.queue_type.as_str()) {
            q.push(&c.queue_type);
        }
    }
    q
}

pub(super) fn targets(s: &Sweep) -> Vec<Target> {
    let mut t = Vec::new();
    for qt in queue_types(s) {
        for layout in Layout::ALL {
            // Both clocks from the first message to the last: the relay's
            // start-up (connections, START_REPLICATION) is not the broker's.
            let ratios: Vec<(u32, f64)> = cells(s, qt, layout)
                .map(|c| (c.channels, relay_rate(c) / c.ceiling.events_per_s))
                .collect();
            let worst = ratios.iter().map(|r| r.1).reduce(f64::min);
            t.push(Target {
                name: format!(
                    "relay with N channels ≥ 0.9 × N plain publishers, every N ({qt}, {})",
                    layout.label()
                ),
                threshold: "≥ 0.90 at every N".into(),
                measured: if ratios.is_empty() {
                    "not measured".into()
                } else {
                    ratios
                        .iter()
                        .map(|(n, r)| format!("N={n}: {r:.2}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                },
                met: worst.map(|w| w >= 0.9),
            });
        }
        let base = s.cell(qt, Layout::OneQueue, 1);
        let four = s.cell(qt, Layout::QueuePerPartition, 4);
        t.push(Target {
            name: format!(
                "relay, 4 channels and a queue per partition ≥ 1.4 × relay, 1 channel ({qt})"
            ),
            threshold: "≥ 1.40".into(),
            // The plain publishers' own gain over the same two cells says
            // how far this machine lets any publisher go.
            measured: match (four, base) {
                (Some(f), Some(b)) => format!(
                    "{:.2} ({:.0} / {:.0} events/s; the plain publishers: {:.2})",
                    f.relay.events_per_s / b.relay.events_per_s,
                    f.relay.events_per_s,
                    b.relay.events_per_s,
                    f.ceiling.events_per_s / b.ceiling.events_per_s
                ),
                _ => "not measured".into(),
            },
            met: match (four, base) {
                (Some(f), Some(b)) => Some(f.relay.events_per_s >= 1.4 * b.relay.events_per_s),
                _ => None,
            },
        });
        // CPU per event against N = 1 of the same layout, and the plain
        // publishers' own ratio in the same cells (what N connections and
        // that cell's rate cost a client that does nothing else).
        let mut worst: Option<(f64, &Cell, Option<f64>)> = None;
        for layout in Layout::ALL {
            let Some(one) = s.cell(qt, layout, 1) else {
                continue;
            };
            // A CPU figure of 0 (too short a run for the clock ticks) has
            // no ratio.
            if one.relay.cpu_seconds_per_100k <= 0.0 {
                continue;
            }
            for c in cells(s, qt, layout) {
                let ratio = c.relay.cpu_seconds_per_100k / one.relay.cpu_seconds_per_100k;
                let plain = (one.ceiling.cpu_seconds_per_100k > 0.0)
                    .then(|| c.ceiling.cpu_seconds_per_100k / one.ceiling.cpu_seconds_per_100k);
                if worst.is_none_or(|(w, _, _)| ratio > w) {
                    worst = Some((ratio, c, plain));
                }
            }
        }
        t.push(Target {
            name: format!("relay CPU per event with N channels ÷ with 1, worst N ({qt})"),
            threshold: "≤ 1.10 (no worse, within the run-to-run spread)".into(),
            measured: worst.map_or("not measured".into(), |(w, c, plain)| {
                format!(
                    "{w:.2} (N={}, {}: {:.2} s/100k; the plain publishers' own ratio there: {})",
                    c.channels,
                    c.layout.label(),
                    c.relay.cpu_seconds_per_100k,
                    plain.map_or("n/a".into(), |p| format!("{p:.2}"))
                )
            }),
            met: worst.map(|(w, _, _)| w <= 1.10),
        });
    }
    t
}

fn busiest_md(b: &BrokerCost) -> String {
    b.busiest().map_or("–".into(), |k| {
        format!(
            "{} {:.2} ({} of them)",
            describe(&k.kind),
            k.busiest_cpu_seconds_per_100k,
            k.processes
        )
    })
}

/// Every pass's figure, when there were several: " (a, b, c)".
fn spread(rates: &[f64]) -> String {
    if rates.len() < 2 {
        return String::new();
    }
    let all: Vec<String> = rates.iter().map(|r| num(*r)).collect();
    format!(" ({})", all.join(", "))
}

pub(super) fn table_md(s: &Sweep) -> String {
    let mut m = String::new();
    m.push_str(
        "| queue | layout | N | relay events/s, first → last (median pass; all passes) | relay events/s, from process start | N plain publishers events/s (median; all) | relay ÷ plain | relay CPU s/100k | plain CPU s/100k | walsender CPU s/100k | broker CPU s/100k (relay / plain) | busiest broker process, CPU s/100k |\n\
         |---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n",
    );
    for c in &s.cells {
        // The queues filled before every event was published once: some
        // went twice (a reconnect), and the rate overstates.
        let twice = match c.relay_published {
            Some(p) if p > s.events as f64 => format!(" (published {})", num(p)),
            _ => String::new(),
        };
        let _ = writeln!(
            m,
            "| {} | {} | {} | **{}**{twice}{} | {} | {}{} | {:.2} | {:.2} | {:.2} | {} | {:.2} / {:.2} | {} |",
            c.queue_type,
            c.layout.label(),
            c.channels,
            num(relay_rate(c)),
            spread(&c.relay_rates),
            num(c.relay.events_per_s),
            num(c.ceiling.events_per_s),
            spread(&c.ceiling_rates),
            relay_rate(c) / c.ceiling.events_per_s,
            c.relay.cpu_seconds_per_100k,
            c.ceiling.cpu_seconds_per_100k,
            c.relay
                .walsender_cpu_seconds_per_100k
                .map_or("–".into(), |w| format!("{w:.2}")),
            c.relay_broker.cpu_seconds_per_100k,
            c.ceiling_broker.cpu_seconds_per_100k,
            busiest_md(&c.relay_broker),
        );
    }
    m
}

pub(super) fn model_md(s: &Sweep, nproc: usize) -> String {
    let mut m = String::new();
    m.push_str(
        "| queue | layout | N | measured here | CPU-bound here (relay + walsender + broker on the cores) | model, broker on 8 cores | what limits the model | next bound |\n\
         |---|---|---:|---:|---:|---:|---|---|\n",
    );
    for c in &s.cells {
        let md = model(c);
        let next = md
            .bounds
            .get(1)
            .map_or("–".into(), |(r, what)| format!("{} ({})", num(*r), what));
        let _ = writeln!(
            m,
            "| {} | {} | {} | {} | {} | {} | {} | {} |",
            c.queue_type,
            c.layout.label(),
            c.channels,
            num(relay_rate(c)),
            num(rate(known_cpu(c), nproc as f64)),
            num(md.events_per_s),
            md.limit,
            next
        );
    }
    m
}

pub(super) fn kinds_md(s: &Sweep) -> String {
    let mut m = String::new();
    m.push_str("| queue | layout | N | broker CPU s/100k by process kind: all of the kind (busiest one) | reductions charged to no live process |\n|---|---|---:|---|---:|\n");
    for c in &s.cells {
        let kinds = c
            .relay_broker
            .kinds
            .iter()
            .take(6)
            .map(|k| {
                format!(
                    "{} ×{}: {:.2} ({:.2})",
                    describe(&k.kind),
                    k.processes,
                    k.cpu_seconds_per_100k,
                    k.busiest_cpu_seconds_per_100k
                )
            })
            .collect::<Vec<_>>()
            .join("; ");
        let _ = writeln!(
            m,
            "| {} | {} | {} | {} | {:.0}% |",
            c.queue_type,
            c.layout.label(),
            c.channels,
            kinds,
            c.relay_broker.unattributed_share * 100.0
        );
    }
    m
}

pub(super) fn connections_md(s: &Sweep) -> String {
    let mut m = String::new();
    if s.connections.is_empty() {
        return m;
    }
    m.push_str("| queue | publisher | events/s | client CPU s/100k |\n|---|---|---:|---:|\n");
    for (qt, p) in &s.connections {
        let _ = writeln!(
            m,
            "| {qt} | {} | {} | {:.2} |",
            p.name,
            num(p.events_per_s),
            p.cpu_seconds_per_100k
        );
    }
    for c in s
        .cells
        .iter()
        .filter(|c| c.channels == 4 && c.layout == Layout::OneQueue)
    {
        let _ = writeln!(
            m,
            "| {} | {} | {} | {:.2} |",
            c.queue_type,
            c.ceiling.name,
            num(c.ceiling.events_per_s),
            c.ceiling.cpu_seconds_per_100k
        );
    }
    m
}

pub(super) fn section_md(r: &Report, s: &Sweep) -> String {
    let mut m = String::new();
    let _ = writeln!(
        m,
        "## Several channels (`rabbitmq.channels`)\n\n\
         {} events committed once in {}-row transactions; for every queue type, layout and N, the relay drains them with `channels = N` \
         (a slot of its own, created before the inserts), then, on queues deleted and declared again, N processes of the relay's own client \
         publish the same number of events at once (each its share, a connection each, window {} each, started together; clock from the \
         first publish to the last confirm). The relay is compared on the same kind of clock, from the first message in the queues \
         to the last (its start-up, with N connections and START_REPLICATION, is shown apart); the plain publishers have both cores \
         to themselves, while the relay shares them with its walsender. \
         *One queue*: a durable topic exchange bound with `#` to one queue. *A queue per partition*: a consistent-hash exchange hashing the \
         `aggregate_id` header over N queues of weight 1. Each event has its own aggregate, so the relay's channels share the work evenly.\n",
        num(s.events as f64),
        r.settings.tx_rows,
        r.settings.window
    );
    let _ = writeln!(m, "{}", table_md(s));
    let _ = writeln!(
        m,
        "### Channels on one connection, or a connection each\n\nOne queue, N = 4, every publisher in the same run:\n\n{}",
        connections_md(s)
    );
    let _ = writeln!(
        m,
        "### What limits it here, and what a broker with 8 cores would do\n\n\
         *CPU-bound here*: {} cores ÷ the CPU per event of the relay, its walsender and the broker, all measured in the run \
         (PostgreSQL's other work, the probes and the kernel are not counted, so it is an upper bound). \
         The *model* gives the broker {:.0} cores of its own (and PostgreSQL and the relay theirs); its rate is the lowest of: \
         the relay's one thread, the walsender's one process, the broker's CPU per event spread over {:.0} cores, \
         and, for every kind of Erlang process, its busiest process on one core. The broker's CPU is beam.smp's utime+stime, \
         shared out over its processes in proportion to the reductions each did (`rabbitmqctl eval` before the drain and the moment \
         the queues hold every event, the relay's connections still open). It is an estimate, not a measurement of a bigger broker: \
         idle schedulers' spinning is charged to the processes (figures high), while socket I/O in port drivers and the quorum WAL's \
         dirty-I/O writes do no reductions and are spread over every process (the readers' and the WAL's own figures low); \
         it has no bound for the confirm window's round trip, and ignores disk and network, which these runs did not use up \
         (fsync off, loopback).\n\n{}",
        r.machine.nproc,
        MODEL_CORES,
        MODEL_CORES,
        model_md(s, r.machine.nproc)
    );
    let _ = writeln!(
        m,
        "Broker CPU while the relay drained, by kind of process (top six):\n\n{}",
        kinds_md(s)
    );
    m
}
