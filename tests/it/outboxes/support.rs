//! What the tests of several outboxes share (`tests/it/outboxes.rs`): writing
//! mixed transactions into tables and logical messages, checking what
//! arrived, and rewriting the fixture's config for several outboxes.

use std::collections::HashMap;

use tokio_postgres::Client;

use super::common::*;

/// One event written by [`write_tx`].
#[derive(Debug, Clone)]
pub struct Written {
    /// The table, or `message`.
    pub into: String,
    pub id: String,
    pub aggregate: String,
    pub seq: u64,
}

/// Where an event of [`write_tx`] goes: an outbox table, or the message
/// prefix.
#[derive(Debug, Clone)]
pub enum Into {
    Table(String),
    Message(String),
}

/// Writes one transaction of `events` (target, aggregate) with per-aggregate
/// sequence numbers; commits or rolls back. Returns what it wrote.
pub async fn write_tx(
    pg: &mut Client,
    events: &[(Into, String)],
    seqs: &mut HashMap<String, u64>,
    commit: bool,
) -> Vec<Written> {
    let tx = pg.transaction().await.unwrap();
    let mut out = Vec::new();
    for (into, aggregate) in events {
        let seq = seqs.entry(aggregate.clone()).or_default();
        *seq += 1;
        let payload = serde_json::json!({"aggregate": aggregate, "seq": *seq});
        let id = match into {
            Into::Table(t) => tx
                .query_one(
                    &format!(
                        "INSERT INTO {t} (aggregate_type, aggregate_id, event_type, payload) \
                         VALUES ('order', $1, 'placed', $2::text::jsonb) RETURNING id::text"
                    ),
                    &[aggregate, &payload.to_string()],
                )
                .await
                .unwrap()
                .get::<_, String>(0),
            Into::Message(prefix) => {
                let id = format!("m-{aggregate}-{seq}-{}", std::process::id());
                let content = serde_json::json!({
                    "id": id, "aggregate_type": "order", "aggregate_id": aggregate,
                    "event_type": "placed", "payload": payload,
                });
                let schema: serde_json::Value =
                    serde_json::from_str(include_str!("../../../schema/emitted.schema.json"))
                        .unwrap();
                assert!(jsonschema::is_valid(&schema, &content), "{content}");
                tx.execute(
                    "SELECT pg_logical_emit_message(true, $1, $2::text)",
                    &[prefix, &content.to_string()],
                )
                .await
                .unwrap();
                id
            }
        };
        out.push(Written {
            into: match into {
                Into::Table(t) => t.clone(),
                Into::Message(_) => "message".into(),
            },
            id,
            aggregate: aggregate.clone(),
            seq: *seq,
        });
    }
    if commit {
        tx.commit().await.unwrap();
    } else {
        tx.rollback().await.unwrap();
    }
    out
}

/// Every committed event delivered, none rolled back, nothing unknown, and
/// first deliveries in per-aggregate order. Returns the duplicates.
pub fn check(committed: &[Written], rolled_back: &[Written], got: &[Received]) -> usize {
    let counts = count_by_id(got);
    let missing: Vec<&str> = (committed.iter())
        .filter(|w| !counts.contains_key(&w.id))
        .map(|w| w.id.as_str())
        .collect();
    assert!(
        missing.is_empty(),
        "{} of {} committed events never arrived, e.g. {:?}",
        missing.len(),
        committed.len(),
        &missing[..missing.len().min(5)]
    );
    for w in rolled_back {
        assert!(
            !counts.contains_key(&w.id),
            "rolled back {} was delivered",
            w.id
        );
    }
    let known: HashMap<&str, &Written> = committed.iter().map(|w| (w.id.as_str(), w)).collect();
    let mut last: HashMap<&str, u64> = HashMap::new();
    let mut first = std::collections::HashSet::new();
    for r in got {
        let id = r.message_id();
        let w = known
            .get(id.as_str())
            .unwrap_or_else(|| panic!("delivered {id}, which nobody wrote (or rolled back)"));
        if !first.insert(id.clone()) {
            continue;
        }
        let prev = last.insert(w.aggregate.as_str(), w.seq).unwrap_or(0);
        assert!(
            w.seq > prev,
            "aggregate {}: first delivery of seq {} after seq {prev}",
            w.aggregate,
            w.seq
        );
    }
    counts.values().map(|c| c - 1).sum()
}

/// The fixture's config with its single `[outbox]` replaced by `outboxes`
/// (TOML), written to its file.
pub fn set_outboxes(fx: &Fixture, rabbitmq_extra: &str, postgres_extra: &str, outboxes: &str) {
    let text = fx.config_text(rabbitmq_extra);
    let single = format!("[outbox]\ntable = \"public.{}\"\n", fx.table);
    assert!(text.contains(&single), "{text}");
    let text = text.replace(&single, outboxes).replace(
        "status_interval_ms = 200",
        &format!("status_interval_ms = 200\n{postgres_extra}"),
    );
    std::fs::write(&fx.config, text).unwrap();
}

pub async fn create_table(pg: &Client, name: &str) {
    let ddl = std::fs::read_to_string(repo_path("sql/outbox.sql"))
        .unwrap()
        .replace("CREATE TABLE outbox", &format!("CREATE TABLE {name}"));
    pg.batch_execute(&ddl).await.unwrap();
}
