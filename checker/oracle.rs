//! The judge. What the database committed comes from its own record: an
//! observer slot (`test_decoding`) decodes the side record's rows, one per
//! committed event, with each transaction's commit position, in commit
//! order. What was delivered comes from the independent consumer. From the
//! two: every committed event delivered at least once or dead-lettered
//! with a reason; nothing delivered that did not commit; first deliveries
//! in commit order per aggregate (its type and id: what the relay keeps
//! on one channel; with one channel, per id alone); nothing reached the victim queue, no forged header
//! came through; the relay's slot reached the last commit.

use std::collections::{HashMap, HashSet};
use std::time::Instant;

use outbox_relay::lsn::Lsn;
use tokio_postgres::Client;

use crate::consumer::{Delivery, From};

/// One committed event, as the database recorded it.
#[derive(Debug, Clone)]
pub struct Committed {
    pub id: String,
    /// `aggregate_type/aggregate_id`.
    pub agg: String,
    pub commit: Lsn,
}

/// With one channel the relay publishes everything in commit order, so
/// the order owed holds per aggregate id across types too: the stricter
/// check, where several channels owe it per type and id only.
pub fn by_id_alone(record: &mut [Committed]) {
    for c in record {
        if let Some((_, id)) = c.agg.split_once('/') {
            c.agg = id.to_owned();
        }
    }
}

/// The record, in commit order (within a transaction, in write order).
pub async fn committed(
    pg: &Client,
    observer: &str,
    record: &str,
) -> Result<Vec<Committed>, String> {
    let rows = pg
        .query(
            "SELECT lsn::text, data FROM pg_logical_slot_peek_changes($1, NULL, NULL, 'skip-empty-xacts', '1') \
             WHERE data NOT LIKE 'table public.%_bulk:%'",
            &[&observer],
        )
        .await
        .map_err(|e| format!("reading the observer slot: {}", e.as_db_error().map_or(e.to_string(), |d| d.message().to_owned())))?;
    let prefix = format!("table public.{record}: INSERT: ");
    let mut out = Vec::new();
    let mut open: Vec<(String, String)> = Vec::new();
    for r in rows {
        let lsn: String = r.get(0);
        let data: String = r.get(1);
        if data.starts_with("BEGIN") {
            open.clear();
        } else if data.starts_with("COMMIT") {
            let commit: Lsn = lsn.parse().map_err(|_| format!("bad lsn {lsn}"))?;
            for (id, agg) in open.drain(..) {
                out.push(Committed { id, agg, commit });
            }
        } else if let Some(cols) = data.strip_prefix(&prefix) {
            let id =
                quoted_after(cols, "id[text]:").ok_or_else(|| format!("record row {data:?}"))?;
            let agg =
                quoted_after(cols, "agg[text]:").ok_or_else(|| format!("record row {data:?}"))?;
            open.push((id, agg));
        }
    }
    Ok(out)
}

/// The single-quoted value after `key` (quotes doubled inside).
fn quoted_after(s: &str, key: &str) -> Option<String> {
    let rest = &s[s.find(key)? + key.len()..];
    let mut chars = rest.strip_prefix('\'')?.chars().peekable();
    let mut v = String::new();
    while let Some(c) = chars.next() {
        if c == '\'' {
            if chars.peek() == Some(&'\'') {
                chars.next();
                v.push('\'');
            } else {
                return Some(v);
            }
        } else {
            v.push(c);
        }
    }
    None
}

/// What the judge found.
#[derive(Debug, Default)]
pub struct Verdict {
    pub failures: Vec<String>,
    pub events: usize,
    pub deliveries: usize,
    pub duplicates: usize,
    pub dead_lettered: usize,
}

/// Judges `got` against `record`. `order`: until when first deliveries
/// must follow commit order per aggregate (`None`: not at all), that is
/// until the first fault after which they may not (a nacked message's
/// retry comes after later events; a re-publication goes by created_at:
/// README).
pub fn judge(
    record: &[Committed],
    got: &[Delivery],
    order: Option<Instant>,
    hostile: &HashSet<String>,
) -> Verdict {
    let mut v = Verdict {
        events: record.len(),
        deliveries: got.len(),
        ..Verdict::default()
    };
    let committed: HashMap<&str, &Committed> = record.iter().map(|c| (c.id.as_str(), c)).collect();
    let mut main: HashMap<&str, usize> = HashMap::new();
    let mut dead: HashSet<&str> = HashSet::new();
    let mut unknown = Vec::new();
    for d in got {
        match d.from {
            From::Main => *main.entry(d.id.as_str()).or_default() += 1,
            From::Dead => {
                dead.insert(d.id.as_str());
                if !hostile.contains(&d.id) {
                    v.failures.push(format!(
                        "an ordinary event was dead-lettered: {} ({:?})",
                        d.id, d.reason
                    ));
                }
                if d.reason.as_deref().is_none_or(str::is_empty) {
                    v.failures
                        .push(format!("dead letter {} carries no reason", d.id));
                }
            }
            From::Victim => v.failures.push(format!(
                "{} reached the victim queue (a row routed itself)",
                d.id
            )),
        }
        if d.forged {
            v.failures.push(format!(
                "{} came through with a row-forged x-outbox-* header ({:?})",
                d.id, d.from
            ));
        }
        if !committed.contains_key(d.id.as_str()) {
            unknown.push(d.id.clone());
        }
    }
    if !unknown.is_empty() {
        v.failures.push(format!(
            "{} deliveries of events that never committed (rolled back, or unknown), e.g. {:?}",
            unknown.len(),
            &unknown[..unknown.len().min(3)]
        ));
    }
    let missing: Vec<&Committed> = record
        .iter()
        .filter(|c| !main.contains_key(c.id.as_str()) && !dead.contains(c.id.as_str()))
        .collect();
    if !missing.is_empty() {
        v.failures.push(format!(
            "LOST: {} of {} committed events neither delivered nor dead-lettered, e.g. {:?}",
            missing.len(),
            record.len(),
            missing
                .iter()
                .take(3)
                .map(|c| (&c.id, c.commit.to_string()))
                .collect::<Vec<_>>()
        ));
    }
    v.duplicates = main.values().map(|n| n - 1).sum();
    v.dead_lettered = dead.len();
    if let Some(until) = order {
        let bad = out_of_order(record, got, &dead, until);
        if !bad.is_empty() {
            v.failures.push(format!(
                "{} first deliveries out of commit order (before the first fault that may \
                 reorder), e.g. {:?}",
                bad.len(),
                &bad[..bad.len().min(3)]
            ));
        }
    }
    v
}

/// First deliveries to the main queue before `until` that break commit
/// order within their aggregate: one that comes after a later event of its
/// aggregate, and one delivered while an earlier event of its aggregate
/// (not dead-lettered) had not been. Once the queue's first deliveries
/// are in order, at any moment those of an aggregate are a prefix of its
/// events, in commit order.
fn out_of_order(
    record: &[Committed],
    got: &[Delivery],
    dead: &HashSet<&str>,
    until: Instant,
) -> Vec<String> {
    let position: HashMap<&str, usize> = record
        .iter()
        .enumerate()
        .map(|(i, c)| (c.id.as_str(), i))
        .collect();
    // Each aggregate's events, in commit order, dead letters left out.
    let mut events: HashMap<&str, Vec<usize>> = HashMap::new();
    for (i, c) in record.iter().enumerate() {
        if !dead.contains(c.id.as_str()) {
            events.entry(c.agg.as_str()).or_default().push(i);
        }
    }
    // How far into its aggregate's events the first deliveries have come.
    let mut next: HashMap<&str, usize> = HashMap::new();
    let mut first = HashSet::new();
    let mut bad = Vec::new();
    for d in got.iter().filter(|d| d.from == From::Main && d.at < until) {
        let Some(&pos) = position.get(d.id.as_str()) else {
            continue;
        };
        if !first.insert(d.id.as_str()) || dead.contains(d.id.as_str()) {
            continue;
        }
        let agg = record[pos].agg.as_str();
        let seq = &events[agg];
        let n = next.entry(agg).or_default();
        match seq.get(*n) {
            Some(&expected) if expected == pos => *n += 1,
            expected => {
                bad.push(format!(
                    "{} (#{pos}) of aggregate {agg:?} while #{} ({}) was not delivered yet",
                    d.id,
                    expected.map_or("?".into(), |e| e.to_string()),
                    expected.map_or("?", |&e| record[e].id.as_str())
                ));
                // Judge what follows against where this one stands.
                if let Some(i) = seq.iter().position(|&e| e == pos) {
                    *n = (*n).max(i + 1);
                }
            }
        }
    }
    bad
}

/// The judge, shown runs whose verdict is known: in order, out of order
/// within an aggregate (before and after the moment order is no longer
/// owed), a gap, a loss, a rolled-back event, a dead letter without a
/// reason. `Err` names the first it judged wrongly.
pub fn self_check() -> Result<(), String> {
    let t = log_time("1970-01-02T00:00:01.500000Z  WARN ...");
    if t != Some(std::time::UNIX_EPOCH + std::time::Duration::from_millis(86_401_500)) {
        return Err(format!("a log line's time read as {t:?}"));
    }
    if log_time("2026-12-05T17:18:22.890833Z x")
        != Some(std::time::UNIX_EPOCH + std::time::Duration::from_micros(1_796_491_102_890_833))
    {
        return Err("2026-12-05T17:18:22.890833Z read wrong".into());
    }
    let t0 = Instant::now();
    let at = |s: u64| t0 + std::time::Duration::from_secs(s);
    let ev = |id: &str, agg: &str, commit: u64| Committed {
        id: id.into(),
        agg: agg.into(),
        commit: Lsn(commit),
    };
    let record = [
        ev("a1", "a", 10),
        ev("b1", "b", 10),
        ev("a2", "a", 20),
        ev("a3", "a", 30),
    ];
    let got = |order: &[(&str, u64)]| -> Vec<Delivery> {
        order
            .iter()
            .map(|&(id, s)| Delivery {
                from: if id.starts_with("dead:") {
                    From::Dead
                } else {
                    From::Main
                },
                id: id.trim_start_matches("dead:").into(),
                at: at(s),
                forged: false,
                reason: None,
            })
            .collect()
    };
    let always = Some(at(1000));
    let none = HashSet::new();
    // What, the deliveries, until when order is owed, the failure expected.
    type Case<'a> = (&'a str, Vec<Delivery>, Option<Instant>, Option<&'a str>);
    let cases: [Case; 8] = [
        (
            "in order, b interleaved, a2 repeated",
            got(&[("a1", 1), ("b1", 2), ("a2", 3), ("a2", 4), ("a3", 5)]),
            always,
            None,
        ),
        (
            "a3 before a2",
            got(&[("a1", 1), ("b1", 2), ("a3", 3), ("a2", 4)]),
            always,
            Some("out of commit order"),
        ),
        (
            "a3 before a2, a2 after order stops being owed",
            got(&[("a1", 1), ("b1", 2), ("a3", 3), ("a2", 9)]),
            Some(at(5)),
            Some("out of commit order"),
        ),
        (
            "a2 and a3 swapped, both after order stops being owed",
            got(&[("a1", 1), ("b1", 2), ("a3", 6), ("a2", 7)]),
            Some(at(5)),
            None,
        ),
        (
            "a3 before a2, order not owed",
            got(&[("a1", 1), ("b1", 2), ("a3", 3), ("a2", 4)]),
            None,
            None,
        ),
        (
            "a2 lost",
            got(&[("a1", 1), ("b1", 2), ("a3", 3)]),
            None,
            Some("LOST"),
        ),
        (
            "an event that never committed",
            got(&[("a1", 1), ("b1", 2), ("a2", 3), ("x9", 4), ("a3", 5)]),
            always,
            Some("never committed"),
        ),
        (
            "a dead letter without a reason",
            got(&[("a1", 1), ("b1", 2), ("dead:a2", 3), ("a3", 4)]),
            always,
            Some("carries no reason"),
        ),
    ];
    let hostile: HashSet<String> = ["a2".to_owned()].into();
    for (what, deliveries, order, expect) in cases {
        let h = if what.contains("dead letter") {
            &hostile
        } else {
            &none
        };
        let v = judge(&record, &deliveries, order, h);
        let ok = match expect {
            None => v.failures.is_empty(),
            Some(word) => v.failures.iter().any(|f| f.contains(word)),
        };
        if !ok {
            return Err(format!(
                "{what}: expected {}, judged {:?}",
                expect.map_or("a pass".into(), |w| format!("a failure saying {w:?}")),
                v.failures
            ));
        }
    }
    Ok(())
}

/// The time a relay log line starts with (`2026-12-05T17:18:22.890833Z`,
/// UTC, as the relay logs).
pub fn log_time(line: &str) -> Option<std::time::SystemTime> {
    let ts = line.split_whitespace().next()?.strip_suffix('Z')?;
    let (date, time) = ts.split_once('T')?;
    let mut d = date.splitn(3, '-').map(|x| x.parse::<i64>().ok());
    let (y, m, day) = (d.next()??, d.next()??, d.next()??);
    let (hms, frac) = time.split_once('.').unwrap_or((time, "0"));
    let mut t = hms.splitn(3, ':').map(|x| x.parse::<i64>().ok());
    let (h, min, sec) = (t.next()??, t.next()??, t.next()??);
    // Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * ((m + 9) % 12) + 2) / 5 + day - 1;
    let days = era * 146_097 + yoe * 365 + yoe / 4 - yoe / 100 + doy - 719_468;
    let secs = u64::try_from(days * 86_400 + h * 3_600 + min * 60 + sec).ok()?;
    let micros: u64 = format!("{frac:0<6}").get(..6)?.parse().ok()?;
    Some(
        std::time::UNIX_EPOCH
            + std::time::Duration::from_secs(secs)
            + std::time::Duration::from_micros(micros),
    )
}
