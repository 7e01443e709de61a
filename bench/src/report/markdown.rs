//! report.md and the tables printed at the end of a run.

use super::*;

pub(super) fn targets_md(r: &Report) -> String {
    let mut m = String::new();
    m.push_str("| target | threshold | measured | result |\n|---|---|---|---|\n");
    for t in &r.targets {
        let _ = writeln!(
            m,
            "| {} | {} | {} | {} |",
            t.name,
            t.threshold,
            t.measured,
            met(t.met)
        );
    }
    m
}

pub(super) fn throughput_md(r: &Report) -> String {
    let mut m = String::new();
    let qts: Vec<&QueueTypeResult> = r.queue_types.iter().collect();
    let _ = write!(m, "| events/s |");
    for q in &qts {
        let _ = write!(m, " {} queue |", q.queue_type);
    }
    m.push_str("\n|---|");
    for _ in &qts {
        m.push_str("---:|");
    }
    m.push('\n');
    let row = |m: &mut String, label: &str, f: &dyn Fn(&QueueTypeResult) -> String| {
        let _ = write!(m, "| {label} |");
        for q in &qts {
            let _ = write!(m, " {} |", f(q));
        }
        m.push('\n');
    };
    let opt = |v: Option<f64>| v.map_or("–".into(), num);
    row(
        &mut m,
        "**relay drain** (process start → queue holds all)",
        &|q| format!("**{}**", opt(q.relay.as_ref().map(|d| d.events_per_s))),
    );
    row(
        &mut m,
        "relay drain, first message → all (start-up excluded)",
        &|q| opt(q.relay.as_ref().map(|d| d.events_per_s_after_first)),
    );
    row(
        &mut m,
        "PostgreSQL decode limit: pg_recvlogical, pgoutput (rows/s)",
        &|q| opt(q.decode.as_ref().map(|d| d.rows_per_s)),
    );
    for name in PUBLISHERS {
        row(&mut m, &format!("broker: {name}"), &|q| {
            opt(publisher(q, name).map(|p| p.events_per_s))
        });
    }
    row(
        &mut m,
        "**broker ceiling** (fastest bare publisher)",
        &|q| {
            q.ceiling().map_or("–".into(), |c| {
                format!("**{}** ({})", num(c.events_per_s), c.name)
            })
        },
    );
    row(
        &mut m,
        "**polling dispatcher drain** (process start → queue holds all)",
        &|q| format!("**{}**", opt(q.polling.as_ref().map(|d| d.events_per_s))),
    );
    row(
        &mut m,
        "ratio relay / broker ceiling",
        &|q| match (&q.relay, q.ceiling()) {
            (Some(d), Some(c)) => format!("{:.2}", d.events_per_s / c.events_per_s),
            _ => "–".into(),
        },
    );
    row(
        &mut m,
        "ratio relay / PostgreSQL decode",
        &|q| match (&q.relay, &q.decode) {
            (Some(d), Some(c)) => format!("{:.2}", d.events_per_s / c.rows_per_s),
            _ => "–".into(),
        },
    );
    row(
        &mut m,
        "ratio relay / polling",
        &|q| match (&q.relay, &q.polling) {
            (Some(d), Some(p)) => format!("{:.2}", d.events_per_s / p.events_per_s),
            _ => "–".into(),
        },
    );
    row(
        &mut m,
        "ratio broker ceiling / polling (the most any relay could reach)",
        &|q| match (q.ceiling(), &q.polling) {
            (Some(c), Some(p)) => format!("{:.2}", c.events_per_s / p.events_per_s),
            _ => "–".into(),
        },
    );
    for (label, x, y) in [
        (
            "ratio lapin pipelined / lapin awaiting each",
            LAPIN_PIPELINED,
            LAPIN_AWAIT_EACH,
        ),
        ("ratio lapin pipelined / amqplib", LAPIN_PIPELINED, AMQPLIB),
        (
            "ratio outbox-relay's client / lapin pipelined",
            RELAY_CLIENT,
            LAPIN_PIPELINED,
        ),
    ] {
        row(
            &mut m,
            label,
            &|q| match (publisher(q, x), publisher(q, y)) {
                (Some(a), Some(b)) => format!("{:.2}", a.events_per_s / b.events_per_s),
                _ => "–".into(),
            },
        );
    }
    m
}

pub(super) fn passes_md(r: &Report) -> String {
    let mut m = String::new();
    let n = r.settings.passes as usize;
    m.push_str("| events/s, every pass |");
    for i in 1..=n {
        let _ = write!(m, " pass {i} |");
    }
    m.push_str("\n|---|");
    for _ in 0..n {
        m.push_str("---:|");
    }
    m.push('\n');
    for q in &r.queue_types {
        let _ = write!(m, "| relay drain, {} queue |", q.queue_type);
        for d in &q.relay_passes {
            let _ = write!(m, " {} |", num(d.events_per_s));
        }
        m.push('\n');
        if let Some(d) = &q.relay_messages {
            let _ = writeln!(
                m,
                "| relay drain, table-less outbox, {} queue | {} |",
                q.queue_type,
                num(d.events_per_s)
            );
        }
        for name in PUBLISHERS {
            let runs: Vec<_> = q
                .publisher_passes
                .iter()
                .filter(|p| p.name == name)
                .collect();
            if runs.is_empty() {
                continue;
            }
            let _ = write!(m, "| {name}, {} queue |", q.queue_type);
            for p in runs {
                let _ = write!(m, " {} |", num(p.events_per_s));
            }
            m.push('\n');
        }
    }
    m
}

pub(super) fn cost_md(r: &Report) -> String {
    let mut m = String::new();
    m.push_str("| | CPU s per 100k events (process) | peak RSS (VmHWM) | WAL bytes/event: commit | WAL bytes/event: drain | WAL bytes/event: total |\n|---|---:|---:|---:|---:|---:|\n");
    for q in &r.queue_types {
        for (label, d) in [
            ("relay", &q.relay),
            (
                "relay, table-less outbox (logical messages)",
                &q.relay_messages,
            ),
            ("polling dispatcher", &q.polling),
        ] {
            if let Some(d) = d {
                let _ = writeln!(
                    m,
                    "| {label}, {} queue | {:.2} | {:.1} MB | {:.0} | {:.0} | **{:.0}** |",
                    q.queue_type,
                    d.cpu_seconds_per_100k,
                    mb(d.peak_rss_bytes),
                    d.insert_wal_bytes as f64 / d.events as f64,
                    d.drain_wal_bytes as f64 / d.events as f64,
                    d.wal_bytes_per_event
                );
            }
        }
    }
    // What publishing alone costs a client: the part of the relay's CPU no
    // relay built on that client can avoid.
    for q in &r.queue_types {
        for p in &q.publishers {
            let _ = writeln!(
                m,
                "| bare publisher: {}, {} queue | {:.2} | | | | |",
                p.name, q.queue_type, p.cpu_seconds_per_100k
            );
        }
    }
    for q in &r.queue_types {
        if let (Some(a), Some(b)) = (&q.relay, &q.polling) {
            let _ = writeln!(
                m,
                "| ratio polling / relay, {} queue | | | | | {:.2} |",
                q.queue_type,
                b.wal_bytes_per_event / a.wal_bytes_per_event
            );
        }
    }
    m
}

pub(super) fn latency_md(r: &Report) -> String {
    let mut m = String::new();
    m.push_str("| design | rate (target → achieved) | events | commit→consume p50 / p99 / max (ms) | commit→confirm p50 / p99 / max (ms) | process CPU s per 100k |\n|---|---|---:|---|---|---:|\n");
    for l in &r.latency {
        let c = &l.commit_to_consume;
        let f = &l.commit_to_confirm;
        let _ = writeln!(
            m,
            "| {} | {} → {:.0} /s | {}{} | {} / **{}** / {} | {} / **{}** / {} {} | {:.2} |",
            l.design,
            num(l.target_rate as f64),
            l.achieved_rate,
            num(l.events as f64),
            if l.missing > 0 {
                format!(" ({} missing)", l.missing)
            } else {
                String::new()
            },
            ms(c.p50_ms),
            ms(c.p99_ms),
            ms(c.max_ms),
            ms(f.p50_ms),
            ms(f.p99_ms),
            ms(f.max_ms),
            if l.commit_to_confirm_measured {
                "(measured)"
            } else {
                "(estimate)"
            },
            if l.events > 0 {
                l.process_cpu_seconds / l.events as f64 * 100_000.0
            } else {
                0.0
            }
        );
    }
    let rates: Vec<u64> = {
        let mut v: Vec<u64> = r.latency.iter().map(|l| l.target_rate).collect();
        v.sort_unstable();
        v.dedup();
        v
    };
    for rate in rates {
        if let (Some(a), Some(b)) = (latency_at(r, "relay", rate), latency_at(r, "polling", rate)) {
            let _ = writeln!(
                m,
                "| ratio polling / relay at {} /s | | | p50 {:.1}× · p99 **{:.1}×** | p50 {:.1}× · p99 **{:.1}×** | |",
                num(rate as f64),
                b.commit_to_consume.p50_ms / a.commit_to_consume.p50_ms,
                b.commit_to_consume.p99_ms / a.commit_to_consume.p99_ms,
                b.commit_to_confirm.p50_ms / a.commit_to_confirm.p50_ms,
                b.commit_to_confirm.p99_ms / a.commit_to_confirm.p99_ms,
            );
        }
    }
    m
}

pub(super) fn confirm_hist_md(r: &Report) -> String {
    let mut m = String::new();
    m.push_str("| rate | confirms | mean (ms) | p50 (ms, interpolated; bucket ≤) | p99 (ms, interpolated; bucket ≤) |\n|---|---:|---:|---|---|\n");
    for l in r.latency.iter().filter(|l| l.design == "relay") {
        if let Some(h) = &l.publish_to_confirm {
            let _ = writeln!(
                m,
                "| {} /s | {} | {} | {} (≤ {}) | {} (≤ {}) |",
                num(l.target_rate as f64),
                num(h.count),
                ms(h.mean_ms),
                ms(h.p50_ms),
                ms(h.p50_bucket_le_ms),
                ms(h.p99_ms),
                ms(h.p99_bucket_le_ms)
            );
        }
    }
    m
}

pub(super) fn markdown(r: &Report) -> String {
    let s = &r.settings;
    let mc = &r.machine;
    let mut m = String::new();
    let _ = writeln!(m, "# outbox-relay benchmark\n");
    let _ = writeln!(
        m,
        "Run {} (took {:.1} min) by `make bench`. Relay: `{}` at {}. Raw figures: `report.json`; chart: `chart.svg`.\n",
        r.started_at,
        r.duration_seconds / 60.0,
        s.relay_bin,
        mc.relay_commit
    );
    let _ = writeln!(
        m,
        "Workload: {} events per drain, committed in {}-row transactions while nothing reads them; 300-byte JSON payloads; \
         confirm window {} for every publisher; polling claims {} rows per round, sleeps {} ms when idle; latency runs of {} s at {} events/s on a {} queue.\n",
        num(s.events as f64),
        s.tx_rows,
        s.window,
        s.poll_batch,
        s.poll_interval_ms,
        s.seconds,
        s.rates
            .iter()
            .map(|v| num(*v as f64))
            .collect::<Vec<_>>()
            .join(" and "),
        s.latency_queue_type
    );
    let _ = writeln!(
        m,
        "Machine: {} CPUs ({}), {:.1} GiB memory, {}, {}; PostgreSQL {}, RabbitMQ {}, lapin {}, {}. \
         Load average before / after: {} / {}. Servers, relay, publishers and load generator all share these cores.\n",
        mc.nproc,
        mc.cpu_model,
        mc.memory_gib,
        mc.os,
        mc.kernel,
        mc.postgresql,
        mc.rabbitmq,
        mc.lapin,
        mc.node,
        mc.load_before,
        mc.load_after
    );
    let busy = |l: &str| {
        l.split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
            .is_some_and(|v| v > 0.5 * mc.nproc as f64)
    };
    if busy(&mc.load_before) {
        let _ = writeln!(
            m,
            "**Note:** the machine was already busy when the run started (1-minute load average {} on {} CPUs): other processes competed for the cores, so throughput is understated and latency tails are noisier than on an idle machine.\n",
            mc.load_before.split_whitespace().next().unwrap_or("?"),
            mc.nproc
        );
    }
    let _ = writeln!(m, "## Targets\n\n{}", targets_md(r));
    let _ = writeln!(
        m,
        "## Throughput\n\nBest of {} interleaved passes (relay drain, then each bare publisher, again); polling: one drain.\n\n{}",
        s.passes,
        throughput_md(r)
    );
    if s.passes > 1 {
        let _ = writeln!(m, "{}", passes_md(r));
    }
    for q in &r.queue_types {
        for sk in &q.skipped_publishers {
            let _ = writeln!(m, "- {} queue: not run: {sk}", q.queue_type);
        }
    }
    let _ = writeln!(m, "## Cost\n\n{}", cost_md(r));
    let _ = writeln!(
        m,
        "WAL is `pg_current_wal_insert_lsn()` before and after, divided by the events: *commit* is the application's INSERTs \
         (the polling table carries its status columns and the partial index), *drain* is what the design writes afterwards \
         (polling: the claim and mark-published UPDATEs, including the index maintenance; relay: its checkpoint row, at most once a second). \
         The throwaway server runs with `full_page_writes = off`: with the default `on`, the polling design's UPDATEs would also log full-page images after every checkpoint, and its WAL figure would be higher.\n"
    );
    if !r.latency.is_empty() {
        let _ = writeln!(
            m,
            "## Latency under load ({} queue)\n\n{}",
            s.latency_queue_type,
            latency_md(r)
        );
        let _ = writeln!(
            m,
            "The relay's own `outbox_relay_confirm_latency_seconds` (publish → broker confirm) over each run:\n\n{}",
            confirm_hist_md(r)
        );
        let _ = writeln!(m, "### What each latency measures\n");
        let _ = writeln!(
            m,
            "- **commit→consume** (both designs, measured per event): the producer stamps each event id with the wall clock right after its `COMMIT` returns; \
             a consumer on the queue (same process, no-ack) stamps each delivery. Clock: `SystemTime` on this machine.\n\
             - **commit→confirm, polling** (measured per event): from the same COMMIT stamp to the moment the dispatcher's mark-published `UPDATE` returned — \
             it runs after every message of the batch was confirmed by the broker, so it is when the outbox row is known to be delivered.\n\
             - **commit→confirm, relay** (measured per event, by the relay): its `outbox_relay_commit_to_confirm_seconds` histogram, from the transaction's commit \
             timestamp in the WAL (taken by PostgreSQL before the commit record is flushed, so a little earlier than the producer's stamp: this leans high) to the broker's \
             confirm of the message. Quantiles are interpolated inside the histogram's buckets (1, 2, 3, 5, 7.5, 10, 15, 20, 30, 50, 75, 100, 150, 250 ms, ...); \
             max is the upper bound of the highest bucket used.\n\
             - Producers: {} connections, transactions of 1–10 rows (uniform), scheduled evenly at the target rate; \"achieved\" is events ÷ wall time. \
             The polling dispatcher runs continuously: when a claim returns rows it claims again at once; when it returns none it sleeps {} ms.\n",
            4, s.poll_interval_ms
        );
    }
    if let Some(sweep) = &r.channels {
        let _ = writeln!(m, "{}", super::channels::section_md(r, sweep));
    }
    if let Some(e) = &r.channels_error {
        let _ = writeln!(
            m,
            "## Several channels\n\nNot measured: the sweep failed: {e}\n"
        );
    }
    let _ = writeln!(
        m,
        "## Polling baseline: the claim\n\nThe dispatcher's loop (one dispatcher, so that messages keep commit order like the relay's single channel):\n\n```sql\n-- claim ($1 = dispatcher id)\n{}\n-- publish every row with confirms (lapin, pipelined, window {}), then\n{}\n```\n\n\
         Partial index `CREATE INDEX … ON outbox_poll (created_at) WHERE status = 'pending'`. \
         `EXPLAIN (ANALYZE, BUFFERS)` of the claim on the freshly loaded table ({} pending rows, after `VACUUM ANALYZE`; rolled back):\n\n```\n{}```\n",
        r.claim_sql,
        s.window,
        r.mark_sql,
        num(s.events as f64),
        r.claim_explain
    );
    let _ = writeln!(m, "## Method\n");
    let _ = writeln!(
        m,
        "- One pair of throwaway servers (`integration/servers.sh with`: PostgreSQL with `fsync = off`, `synchronous_commit = off`, `full_page_writes = off`; \
         a private RabbitMQ node) for everything; each scenario starts from an empty durable queue bound with `#` to a durable topic exchange; a `CHECKPOINT` precedes each drain.\n\
         - The application's sessions (backlog, producers, polling dispatcher) commit with `synchronous_commit = on`, PostgreSQL's default: with the server's `off`, \
         a commit's WAL is flushed only by the WAL writer every 200 ms, and logical decoding (which reads flushed WAL only) would wait for it — \
         a latency the relay would not have on a default server. With `fsync = off` such a flush is a write(), not an fsync.\n\
         - **Backlog drain**: the slot is created by `outbox-relay setup`, the events are committed while no relay runs, then `outbox-relay run` starts; \
         the clock runs from process start until a passive `queue.declare` (every 20 ms, no consumer attached) reports every event in the queue. \
         CPU is utime+stime from `/proc/PID/stat` and peak RSS is `VmHWM`, both read at that moment.\n\
         - **PostgreSQL decode limit**: a second pgoutput slot created before the inserts, streamed by `pg_recvlogical -o proto_version=1 -o publication_names=…` \
         up to the WAL position after the inserts (`--endpos`) into /dev/null.\n\
         - **Broker ceiling**: bare publishers, one connection and one confirm-mode channel each, same exchange, queue, window, `mandatory`, properties \
         (persistent, message_id, type, content_type, timestamp, headers aggregate_type and aggregate_id) and 300-byte body; clock from the first publish \
         to the last confirm; the ceiling is the fastest. *lapin, awaiting each publish* awaits `basic_publish(..).await` (lapin pushes the frames on the \
         first poll, then waits for its I/O loop to write them) before the next publish, so every message waits for the I/O thread; *lapin, pipelined* polls \
         each publish future once (frames queued in order) and awaits completions and confirms concurrently, bounded by the window; *outbox-relay's AMQP client* \
         is the relay's own publishing client (`outbox_relay::sink::wire`) driven as the relay drives it (a batch of publishes queued into its write buffer, \
         written in one call while answers are read); *amqplib* is Node's \
         ConfirmChannel with a callback per publish. The Rust publishers run as processes of their own set up as the relay is (one-thread tokio runtime; with mimalloc, which spares lapin's cross-thread frees glibc's arena locks); their client CPU (user + system of the publishing process, every thread, over the same interval) is in the cost table.\n\
         - **Order**: per queue type: backlog, decode, then {} pass(es) of [relay drain (a slot of its own per pass, all created before the inserts, so every pass reads the same WAL), \
         lapin awaiting each, lapin pipelined, outbox-relay's client, amqplib], then the polling backlog and drain. The latency runs come last, on tables, a queue and a relay slot of their own; \
         the relay is started first and the runs begin once its slot has caught up with the current WAL position.\n\
         - **Polling baseline**: the same events committed into a table with `status`, `attempts`, `claimed_by`, `claimed_at`; the dispatcher is a separate \
         process (`relay-bench dispatch`), timed the same way as the relay, publishing with the relay's own AMQP client (same window), so that the two \
         designs differ only in how they find the events.\n",
        s.passes
    );
    m
}

// ------------------------------------------------------------------ SVG
