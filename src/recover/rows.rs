//! Reading outbox rows back from the table, a batch at a time from a cursor.
//!
//! Rows are read with every column cast to text, which is exactly the text
//! form pgoutput sends, so they go through the same [`Mapping`] and
//! [`crate::message::render`] as streamed rows and come out as the same
//! messages, with the same `message_id`. They come in `(created_at, id)`
//! order, which is also the key a recovery resumes from.

use std::sync::Arc;

use bytes::Bytes;
use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, Portal, Row, Transaction};

use crate::config::{Config, quote_ident};
use crate::outbox::{Mapping, MappingError, OutboxEvent};
use crate::pgoutput::{Column, ColumnValue, Relation, TupleData};
use crate::source::{SourceError, sql_err};

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
    /// A recovery's window: rows created at or after `since`, or (with
    /// `commit_ts`) committed at or after it; after the key `after`.
    Window {
        /// Lower bound.
        since: String,
        /// Also take rows whose transaction committed at or after `since`
        /// (`track_commit_timestamp` is on).
        commit_ts: bool,
        /// Resume after this `(created_at, id)`, both in text form.
        after: Option<(String, String)>,
    },
}

/// Where a row sits in `(created_at, id)` order, in text form.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Key {
    /// `created_at::text`.
    pub created: String,
    /// `id::text`.
    pub id: String,
}

/// Rows fetched per round trip.
const FETCH: i32 = 256;

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

/// The query for `sel` and its parameters; `select` is the column list.
fn query(cfg: &Config, sel: &Selection, select: &str) -> (String, Vec<Box<dyn ToSql + Sync>>) {
    let cols = &cfg.outbox.columns;
    let created = quote_ident(&cols.created_at);
    let id = quote_ident(&cols.id);
    let base = format!("SELECT {select} FROM {}", cfg.outbox.table.quoted());
    match sel {
        Selection::Ids(ids) => (
            format!("{base} WHERE {id}::text = ANY($1)"),
            vec![Box::new(ids.clone())],
        ),
        Selection::Since { since, until } => (
            format!(
                "{base} WHERE {created} >= $1::text::timestamptz \
                 AND ($2::text IS NULL OR {created} < $2::text::timestamptz)"
            ),
            vec![Box::new(since.clone()), Box::new(until.clone())],
        ),
        Selection::Window {
            since,
            commit_ts,
            after,
        } => {
            let committed = if *commit_ts {
                " OR coalesce(pg_xact_commit_timestamp(xmin) >= $1::text::timestamptz, false)"
                    .to_owned()
            } else {
                String::new()
            };
            let (after_created, after_id) = after.clone().unzip();
            (
                format!(
                    "{base} WHERE ({created} >= $1::text::timestamptz{committed}) \
                     AND ($2::text IS NULL OR ({created}, {id}::text) > ($2::text::timestamptz, $3::text))"
                ),
                vec![
                    Box::new(since.clone()),
                    Box::new(after_created),
                    Box::new(after_id),
                ],
            )
        }
    }
}

/// How many rows `sel` selects now.
pub async fn count(client: &Client, cfg: &Config, sel: &Selection) -> Result<i64, SourceError> {
    let (sql, params) = query(cfg, sel, "count(*)");
    let params: Vec<&(dyn ToSql + Sync)> = params.iter().map(|p| p.as_ref()).collect();
    let row = client
        .query_one(&sql, &params)
        .await
        .map_err(sql_err(&cfg.postgres, "counting outbox rows"))?;
    Ok(row.get(0))
}

/// The selected rows in `(created_at, id)` order, a batch at a time, from
/// a cursor in a read-only transaction (one snapshot for the whole read).
pub struct Rows<'a> {
    tx: Transaction<'a>,
    portal: Portal,
    columns: usize,
    mapping: Result<Arc<Mapping>, MappingError>,
    done: bool,
    cfg: &'a Config,
}

impl<'a> Rows<'a> {
    /// Opens the cursor for `sel` on `client` (which it holds until dropped).
    pub async fn open(
        client: &'a mut Client,
        cfg: &'a Config,
        sel: &Selection,
    ) -> Result<Rows<'a>, SourceError> {
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
        let select = format!(
            "{}, (extract(epoch FROM {created}) * 1e6)::bigint, {created}::text, {id}::text",
            list.join(", ")
        );
        let (sql, params) = query(cfg, sel, &select);
        let sql = format!("{sql} ORDER BY {created}, {id}::text");
        let err = || sql_err(&cfg.postgres, "selecting outbox rows");
        let tx = client
            .build_transaction()
            .read_only(true)
            .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
            .start()
            .await
            .map_err(err())?;
        // The read waits while the broker applies back-pressure: a server
        // timeout on idle transactions must not end it.
        tx.batch_execute("SET LOCAL idle_in_transaction_session_timeout = 0")
            .await
            .map_err(err())?;
        let params: Vec<&(dyn ToSql + Sync)> = params.iter().map(|p| p.as_ref()).collect();
        let portal = tx.bind(sql.as_str(), &params).await.map_err(err())?;
        Ok(Rows {
            tx,
            portal,
            columns: rel.columns.len(),
            mapping,
            done: false,
            cfg,
        })
    }

    /// The next batch (empty at the end).
    pub async fn next_batch(&mut self) -> Result<Vec<(OutboxEvent, Key)>, SourceError> {
        if self.done {
            return Ok(Vec::new());
        }
        let rows = self
            .tx
            .query_portal(&self.portal, FETCH)
            .await
            .map_err(sql_err(&self.cfg.postgres, "reading outbox rows"))?;
        if rows.len() < FETCH as usize {
            self.done = true;
        }
        Ok(rows.iter().map(|r| self.event(r)).collect())
    }

    fn event(&self, r: &Row) -> (OutboxEvent, Key) {
        let n = self.columns;
        let ev = OutboxEvent {
            tuple: TupleData(
                (0..n)
                    .map(|i| match r.get::<_, Option<String>>(i) {
                        Some(v) => ColumnValue::Text(Bytes::from(v)),
                        None => ColumnValue::Null,
                    })
                    .collect(),
            ),
            mapping: self.mapping.clone(),
            commit_time_us: r.get::<_, Option<i64>>(n).unwrap_or(0),
        };
        let key = Key {
            created: r.get::<_, Option<String>>(n + 1).unwrap_or_default(),
            id: r.get::<_, Option<String>>(n + 2).unwrap_or_default(),
        };
        (ev, key)
    }
}
