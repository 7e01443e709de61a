//! Re-publishing outbox rows from the table itself: `recover` after a lost
//! slot, `republish` on purpose.
//!
//! Rows are read with every column cast to text, which is exactly the text
//! form pgoutput sends, so they go through the same [`Mapping`] and
//! [`render`] as streamed rows and come out as the same messages, with the
//! same `message_id`.

use std::sync::Arc;

use bytes::Bytes;
use tokio_postgres::Client;
use tracing::{info, warn};

use crate::config::{Config, quote_ident};
use crate::message::render;
use crate::outbox::{Mapping, OutboxEvent};
use crate::pgoutput::{Column, ColumnValue, Relation, TupleData};
use crate::relay::RelayError;
use crate::sink::{AmqpSink, Unconfirmed};
use crate::source::checkpoint_table;
use crate::source::slot::{self, SlotInfo};
use crate::source::{SourceError, connect_sql, sql_err};

/// Which rows to re-publish.
#[derive(Debug, Clone)]
pub enum Selection {
    /// These event ids.
    Ids(Vec<String>),
    /// Rows created in `[since, until)` (timestamps as PostgreSQL parses them).
    Since {
        /// Inclusive lower bound.
        since: String,
        /// Exclusive upper bound, if any.
        until: Option<String>,
    },
}

/// The outbox table as a pgoutput Relation, from the catalog.
async fn relation(client: &Client, cfg: &Config) -> Result<Relation, SourceError> {
    let t = &cfg.outbox.table;
    let rows = client
        .query(
            "SELECT a.attname::text, a.atttypid::oid FROM pg_attribute a \
             JOIN pg_class c ON c.oid = a.attrelid JOIN pg_namespace n ON n.oid = c.relnamespace \
             WHERE n.nspname = $1 AND c.relname = $2 AND a.attnum > 0 AND NOT a.attisdropped \
             ORDER BY a.attnum",
            &[&t.schema, &t.name],
        )
        .await
        .map_err(sql_err(&cfg.postgres, "reading the outbox table's columns"))?;
    if rows.is_empty() {
        return Err(SourceError::Setup(format!(
            "outbox table {t} does not exist (outbox.table)"
        )));
    }
    Ok(Relation {
        id: 0,
        namespace: t.schema.clone(),
        name: t.name.clone(),
        replica_identity: b'd',
        columns: rows
            .iter()
            .map(|r| Column {
                flags: 0,
                name: r.get(0),
                type_oid: r.get(1),
                type_modifier: -1,
            })
            .collect(),
    })
}

/// Reads the selected rows in creation order, as events.
pub async fn select_events(
    client: &Client,
    cfg: &Config,
    sel: &Selection,
) -> Result<Vec<OutboxEvent>, RelayError> {
    let rel = relation(client, cfg).await?;
    let mapping = Mapping::new(&rel, &cfg.outbox.columns, &cfg.rabbitmq).map(Arc::new);
    let cols = &cfg.outbox.columns;
    let list: Vec<String> = rel
        .columns
        .iter()
        .map(|c| format!("{}::text", quote_ident(&c.name)))
        .collect();
    let created = quote_ident(&cols.created_at);
    let id = quote_ident(&cols.id);
    let base = format!(
        "SELECT {}, (extract(epoch FROM {created}) * 1e6)::bigint FROM {}",
        list.join(", "),
        cfg.outbox.table.quoted()
    );
    let order = format!("ORDER BY {created}, {id}");
    let rows = match sel {
        Selection::Ids(ids) => {
            client
                .query(
                    &format!("{base} WHERE {id}::text = ANY($1) {order}"),
                    &[ids],
                )
                .await
        }
        Selection::Since { since, until } => {
            client
                .query(
                    &format!(
                        "{base} WHERE {created} >= $1::text::timestamptz \
                         AND ($2::text IS NULL OR {created} < $2::text::timestamptz) {order}"
                    ),
                    &[since, until],
                )
                .await
        }
    }
    .map_err(sql_err(&cfg.postgres, "selecting outbox rows"))?;
    let n = rel.columns.len();
    Ok(rows
        .iter()
        .map(|r| OutboxEvent {
            tuple: TupleData(
                (0..n)
                    .map(|i| match r.get::<_, Option<String>>(i) {
                        Some(v) => ColumnValue::Text(Bytes::from(v)),
                        None => ColumnValue::Null,
                    })
                    .collect(),
            ),
            mapping: mapping.clone(),
            commit_time_us: r.get::<_, Option<i64>>(n).unwrap_or(0),
        })
        .collect())
}

/// Publishes `events` in order with confirms (a window of
/// `rabbitmq.window`); returns how many the broker confirmed. Stops at the
/// first failure: re-running is safe, ids are stable.
pub async fn publish_all(cfg: &Config, events: &[OutboxEvent]) -> Result<usize, RelayError> {
    let mut sink = AmqpSink::connect(&cfg.rabbitmq).await?;
    let mut pending = Unconfirmed::default();
    let mut settled = Vec::new();
    let mut confirmed = 0;
    let mut events = events.iter();
    loop {
        let next = if pending.len() < cfg.rabbitmq.window && !sink.wants_flush() {
            events.next()
        } else {
            None
        };
        match next {
            Some(ev) => {
                let env = render(ev)?;
                let id = env.properties.message_id().as_ref().map(|m| m.to_string());
                let tag = sink.publish(env)?;
                pending.push(tag, id);
            }
            None if pending.is_empty() => break,
            None => {
                let ev = sink.answer().await?;
                pending.apply(ev, Option::clone, &mut settled)?;
                for (_, res) in settled.drain(..) {
                    res?;
                    confirmed += 1;
                }
            }
        }
    }
    sink.close().await;
    Ok(confirmed)
}

/// What `recover` found and did.
#[derive(Debug)]
pub enum RecoverOutcome {
    /// The slot is fine: nothing to do.
    Healthy(SlotInfo),
    /// Rows that were (or, with `--dry-run`, would be) re-published.
    Republished {
        /// From which creation time (checkpoint minus overlap).
        since: String,
        /// How many rows.
        rows: usize,
        /// First and last event ids.
        first_last: Option<(String, String)>,
        /// Whether anything was done.
        dry_run: bool,
    },
}

/// `recover`: when the slot is missing or lost, recreate it and re-publish
/// the rows created since the last checkpoint minus `overlap_secs`.
pub async fn recover(
    cfg: &Config,
    dry_run: bool,
    overlap_secs: u64,
) -> Result<RecoverOutcome, RelayError> {
    let client = connect_sql(&cfg.postgres).await?;
    let info = slot::slot_info(&client, cfg).await?;
    if let Some(info) = &info {
        if info.wal_status.as_deref() != Some("lost") {
            return Ok(RecoverOutcome::Healthy(info.clone()));
        }
    }
    let checkpoint = checkpoint_table::read(&client, cfg).await?;
    let Some(since_us) = checkpoint.as_ref().and_then(|c| c.last_commit_time_us) else {
        return Err(SourceError::Setup(format!(
            "no checkpoint recorded for slot {:?} in {}; choose the rows yourself with \
             `outbox-relay republish --since TIME`, after `outbox-relay setup` recreates the slot",
            cfg.postgres.slot, cfg.postgres.checkpoint_table
        ))
        .into());
    };
    let since_us = since_us - (overlap_secs as i64) * 1_000_000;
    let since: String = client
        .query_one(
            "SELECT to_char(to_timestamp($1::float8 / 1e6) AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')",
            &[&(since_us as f64)],
        )
        .await
        .map_err(sql_err(&cfg.postgres, "computing the recovery start"))?
        .get(0);

    if !dry_run {
        // New slot first: every commit after its creation is streamed by
        // `run`; every row visible now is re-published here. The overlap
        // between the two is delivered twice, never zero times.
        if info.is_some() {
            client
                .execute("SELECT pg_drop_replication_slot($1)", &[&cfg.postgres.slot])
                .await
                .map_err(sql_err(&cfg.postgres, "dropping the lost slot"))?;
        }
        slot::setup(&client, cfg).await?;
        info!(slot = %cfg.postgres.slot, "replication slot recreated");
    }
    let sel = Selection::Since {
        since: since.clone(),
        until: None,
    };
    let events = select_events(&client, cfg, &sel).await?;
    let ids: Vec<String> = events
        .iter()
        .filter_map(|e| {
            let m = e.mapping.as_ref().ok()?;
            e.value(m.id)
                .map(|v| String::from_utf8_lossy(v).into_owned())
        })
        .collect();
    let first_last = ids.first().cloned().zip(ids.last().cloned());
    if !dry_run {
        let n = publish_all(cfg, &events).await?;
        if n != events.len() {
            warn!(
                published = n,
                selected = events.len(),
                "not every row was confirmed"
            );
        }
    }
    Ok(RecoverOutcome::Republished {
        since,
        rows: events.len(),
        first_last,
        dry_run,
    })
}
