//! The judge. What the database committed comes from its own record: an
//! observer slot (`test_decoding`) decodes the side record's rows, one per
//! committed event, with each transaction's commit position, in commit
//! order. What was delivered comes from the independent consumer. From the
//! two: every committed event delivered at least once or dead-lettered
//! with a reason; nothing delivered that did not commit; first deliveries
//! in commit order per aggregate; nothing reached the victim queue, no
//! forged header came through; the relay's slot reached the last commit.

use std::collections::{HashMap, HashSet};

use outbox_relay::lsn::Lsn;
use tokio_postgres::Client;

use crate::consumer::{Delivery, From};

/// One committed event, as the database recorded it.
#[derive(Debug, Clone)]
pub struct Committed {
    pub id: String,
    pub agg: String,
    pub commit: Lsn,
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

/// Judges `got` against `record`. `order`: whether first deliveries must
/// follow commit order (not when the broker nacked: a nacked message's
/// retry comes after later events, README).
pub fn judge(
    record: &[Committed],
    got: &[Delivery],
    order: bool,
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
    if order {
        let position: HashMap<&str, usize> = record
            .iter()
            .enumerate()
            .map(|(i, c)| (c.id.as_str(), i))
            .collect();
        let mut first = HashSet::new();
        let mut last: HashMap<&str, usize> = HashMap::new();
        let mut bad = Vec::new();
        for d in got.iter().filter(|d| d.from == From::Main) {
            let Some(&pos) = position.get(d.id.as_str()) else {
                continue;
            };
            if !first.insert(d.id.as_str()) || dead.contains(d.id.as_str()) {
                continue;
            }
            let agg = record[pos].agg.as_str();
            if let Some(prev) = last.insert(agg, pos)
                && prev > pos
            {
                bad.push(format!(
                    "{} (#{pos}) after #{prev} of aggregate {agg:?}",
                    d.id
                ));
            }
        }
        if !bad.is_empty() {
            v.failures.push(format!(
                "{} first deliveries out of commit order, e.g. {:?}",
                bad.len(),
                &bad[..bad.len().min(3)]
            ));
        }
    }
    v
}
