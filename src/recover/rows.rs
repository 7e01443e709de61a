//! Reading outbox rows back from the table, a batch at a time from a cursor.
//!
//! Rows are read with every column in the text its type's output function
//! gives ([`as_sent`]), which is exactly the text form pgoutput sends, so
//! they go through the same [`Mapping`] and [`crate::message::render`] as
//! streamed rows and come out as the same messages, with the same
//! `message_id`. They come table by table (in the order of the config's
//! outboxes), each in the order of its `sequence` column if the config
//! names one, else in `(created_at, tableoid, ctid)` order: the table and
//! that order's key are what a recovery resumes from. All tables are read
//! in one snapshot.

use std::sync::Arc;

use bytes::Bytes;
use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, GenericClient, Portal, Row, Transaction};

use crate::config::{Config, OutboxConfig, TableName, quote_ident};
use crate::outbox::{Mapping, MappingError, OutboxEvent};
use crate::pgoutput::{Column, ColumnValue, Relation, TupleData};
use crate::source::{SourceError, sql_err};

mod resume {
    //! Resume keys: where a row sits in a read, as recorded, and what a record means for a table.

    use std::sync::Arc;

    use super::Selection;

    /// Where a row sits: its table, the tables a read had finished before it,
    /// then its `created_at` and its place in the table's order, in text form.
    ///
    /// With a `sequence` column, that order is the order rows were written, in
    /// and across transactions (where writes to one aggregate are serialized,
    /// its commit order). Without one it is `(created_at, tableoid, ctid)`:
    /// rows of one transaction share `created_at` (its start), the partitions
    /// of a partitioned outbox hand out the same ctids (so the partition is
    /// part of the key), and within one partition the physical order is
    /// usually, not always, the order rows were written: an insert can land in
    /// space vacuum freed before an earlier row of the same transaction. (A
    /// `VACUUM FULL` or `CLUSTER` during a recovery moves rows: the ctid key
    /// then skips or repeats some; do not run one then.)
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub struct Key {
        /// The outbox (index in `Config::outboxes`).
        pub outbox: usize,
        /// Its table, as `schema.table`.
        pub table: String,
        /// Tables wholly read (and, once this row is confirmed, confirmed)
        /// before this one.
        pub done: Arc<[String]>,
        /// `created_at::text`.
        pub created: String,
        /// `<tableoid>/<ctid>`, or the `sequence` column's value.
        pub id: String,
    }

    /// A recovery's resume key as recorded: which tables are done, which one
    /// it is in, and after which row.
    #[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
    struct Place {
        done: Vec<String>,
        at: String,
    }

    impl Key {
        /// As recorded in the checkpoint table: `(created_at, "#<place> <id>")`
        /// where the place names tables, not positions in the config, so that
        /// a config changed between two runs of a recovery cannot make it skip
        /// a table.
        pub fn to_record(&self) -> (String, String) {
            let place = Place {
                done: self.done.to_vec(),
                at: self.table.clone(),
            };
            let place = serde_json::to_string(&place).unwrap_or_default();
            (self.created.clone(), format!("#{place} {}", self.id))
        }
    }

    /// What a recorded resume key means for one table.
    #[derive(Debug, Clone, PartialEq, Eq)]
    enum Resume {
        /// Wholly confirmed already: skip it.
        Done,
        /// Resume after this key (`created_at`, then its place or sequence value).
        After(String, String),
        /// From the window's start.
        Start,
    }

    /// What the record `after` says of `table`, when the config's tables are
    /// `tables`. A record of the single-table versions (no `#`) applies to the
    /// table of a single-table config only; any record that cannot be placed
    /// restarts every table from the window's start: more sent, none lost.
    fn resume(after: &(String, String), table: &str, tables: &[String]) -> Resume {
        let (created, id) = after;
        let Some(rest) = id.strip_prefix('#') else {
            return match tables {
                [only] if only == table => Resume::After(created.clone(), id.clone()),
                _ => Resume::Start,
            };
        };
        let parsed = rest
            .rsplit_once(' ')
            .and_then(|(place, ctid)| Some((serde_json::from_str::<Place>(place).ok()?, ctid)));
        let Some((place, ctid)) = parsed else {
            return Resume::Start;
        };
        if place.at == table {
            Resume::After(created.clone(), ctid.to_owned())
        } else if place.done.iter().any(|d| d == table) {
            Resume::Done
        } else {
            Resume::Start
        }
    }

    /// What `sel` means for the table of outbox `t` (of the tables `tables`,
    /// by name): `None` when a window's resume key says it is done, else the
    /// selection with the key that applies to it.
    pub(super) fn for_table(sel: &Selection, t: &str, tables: &[String]) -> Option<Selection> {
        let Selection::Window {
            since,
            commit_ts,
            after: Some(after),
        } = sel
        else {
            return Some(sel.clone());
        };
        let after = match resume(after, t, tables) {
            Resume::Done => return None,
            Resume::After(created, id) => Some((created, id)),
            Resume::Start => None,
        };
        Some(Selection::Window {
            since: since.clone(),
            commit_ts: *commit_ts,
            after,
        })
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn resume_keys_name_tables_not_positions() {
            let tables: Vec<String> = ["s.a", "s.b", "s.c"].map(String::from).to_vec();
            let key = Key {
                outbox: 1,
                table: "s.b".into(),
                done: Arc::from(vec!["s.a".to_owned()]),
                created: "2026-12-01 10:00:00+00".into(),
                id: "16384/(0,5)".into(),
            };
            let rec = key.to_record();
            assert_eq!(resume(&rec, "s.a", &tables), Resume::Done);
            assert_eq!(
                resume(&rec, "s.b", &tables),
                Resume::After(key.created.clone(), "16384/(0,5)".into())
            );
            assert_eq!(resume(&rec, "s.c", &tables), Resume::Start);
            // Reordered, or a table added before it: still by name.
            let reordered: Vec<String> = ["s.x", "s.b", "s.a"].map(String::from).to_vec();
            assert_eq!(resume(&rec, "s.x", &reordered), Resume::Start);
            assert_eq!(resume(&rec, "s.a", &reordered), Resume::Done);
            // A name with a space or a quote survives the record.
            let odd = Key {
                table: "\"my schema\".\"a b\"".into(),
                done: Arc::from(Vec::new()),
                ..key.clone()
            };
            assert!(matches!(
                resume(&odd.to_record(), &odd.table, &tables),
                Resume::After(..)
            ));
            // A single-table version's record: that table, if it is the only one.
            let legacy = ("t".to_owned(), "(0,7)".to_owned());
            let one = vec!["s.a".to_owned()];
            assert_eq!(
                resume(&legacy, "s.a", &one),
                Resume::After("t".into(), "(0,7)".into())
            );
            assert_eq!(resume(&legacy, "s.a", &tables), Resume::Start);
            // Garbage: from the start.
            let junk = ("t".to_owned(), "#{not json (0,1)".to_owned());
            assert_eq!(resume(&junk, "s.a", &tables), Resume::Start);
            let sel = Selection::Window {
                since: "s".into(),
                commit_ts: false,
                after: Some(rec),
            };
            assert!(for_table(&sel, "s.a", &tables).is_none());
            assert!(matches!(
                for_table(&sel, "s.c", &tables),
                Some(Selection::Window { after: None, .. })
            ));
        }
    }
}
pub use resume::Key;
use resume::for_table;

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
        /// Resume after this key: `created_at` and the row's place in its
        /// table's order (ctid, or sequence value), both in text form (see
        /// `after_key` for a key of another order).
        after: Option<(String, String)>,
    },
}

/// The table outboxes to read, in config order: all, or the one `only`
/// names (its table, as in the config).
pub fn tables(cfg: &Config, only: Option<&str>) -> Result<Vec<usize>, SourceError> {
    let all: Vec<usize> = (cfg.outboxes.iter().enumerate())
        .filter(|(_, o)| o.table().is_some())
        .map(|(i, _)| i)
        .collect();
    let Some(only) = only else {
        return Ok(all);
    };
    let wanted = crate::config::parse_table_name_arg(only)
        .map_err(|e| SourceError::Setup(format!("--table {only:?}: {e}")))?;
    match all
        .iter()
        .find(|&&i| cfg.outboxes[i].table() == Some(&wanted))
    {
        Some(&i) => Ok(vec![i]),
        None => Err(SourceError::Setup(format!(
            "--table {only:?} is not one of the outbox tables of the config ({})",
            all.iter()
                .filter_map(|&i| cfg.outboxes[i].table().map(|t| t.to_string()))
                .collect::<Vec<_>>()
                .join(", ")
        ))),
    }
}

fn table_of(o: &OutboxConfig) -> &TableName {
    o.table().expect("a table outbox")
}

/// Rows fetched per round trip.
const FETCH: i32 = 256;

/// The outbox table as a pgoutput Relation, from the catalog.
async fn relation(
    client: &impl GenericClient,
    cfg: &Config,
    o: &OutboxConfig,
) -> Result<Relation, SourceError> {
    let t = table_of(o);
    let rows = client
        .query(
            "SELECT a.attname::text, a.atttypid::oid, a.attnotnull FROM pg_attribute a \
             JOIN pg_class c ON c.oid = a.attrelid JOIN pg_namespace n ON n.oid = c.relnamespace \
             WHERE n.nspname = $1 AND c.relname = $2 AND a.attnum > 0 AND NOT a.attisdropped \
             ORDER BY a.attnum",
            &[&t.schema, &t.name],
        )
        .await
        .map_err(sql_err(&cfg.postgres, "reading the outbox table's columns"))?;
    if rows.is_empty() {
        return Err(SourceError::Setup(format!(
            "outbox table {t} does not exist ({})",
            o.key_of("table")
        )));
    }
    if let Some(seq) = &o.columns.sequence {
        // Resuming after a key compares values: NULLs would be skipped.
        let col = rows.iter().find(|r| r.get::<_, String>(0) == *seq);
        let integer = [20u32, 21, 23, 1700];
        if !col.is_some_and(|r| integer.contains(&r.get::<_, u32>(1)) && r.get::<_, bool>(2)) {
            return Err(SourceError::Setup(format!(
                "{}: outbox table {t} needs a NOT NULL integer column {seq:?} whose values \
                 increase in the order rows are written (e.g. `ALTER TABLE {t} ADD COLUMN \
                 {} bigint GENERATED ALWAYS AS IDENTITY`), or leave the key out",
                o.key_of("sequence"),
                quote_ident(seq)
            )));
        }
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

/// Column `name` as pgoutput sends it: its type's output function, which
/// `format('%s')` calls. A cast to text is not always that: `char(n)` loses
/// its padding (`'a '::char(2)::text` is `a`), a boolean becomes `true`
/// (pgoutput: `t`). NULL stays NULL.
fn as_sent(name: &str) -> String {
    let c = quote_ident(name);
    format!("CASE WHEN {c} IS NULL THEN NULL ELSE format('%s', {c}) END")
}

/// The names (`schema.table`) of outboxes `tables`.
fn names(cfg: &Config, tables: &[usize]) -> Vec<String> {
    (tables.iter())
        .map(|&t| table_of(&cfg.outboxes[t]).to_string())
        .collect()
}

/// The query for `sel` on one outbox table and its parameters; `select`
/// is the column list.
fn query(o: &OutboxConfig, sel: &Selection, select: &str) -> (String, Vec<Box<dyn ToSql + Sync>>) {
    let cols = &o.columns;
    let created = quote_ident(&cols.created_at);
    let base = format!("SELECT {select} FROM {}", table_of(o).quoted());
    match sel {
        Selection::Ids(ids) => (
            format!("{base} WHERE {} = ANY($1)", as_sent(&cols.id)),
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
            let after_key = after_key(o, after_id.as_deref());
            (
                format!(
                    "{base} WHERE ({created} >= $1::text::timestamptz{committed}) AND {after_key}"
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

/// The order rows are read in: the outbox's `sequence` column, or
/// `(created_at, tableoid, ctid)`. A ctid is unique in one heap only: the
/// partitions of a partitioned outbox hand out the same ctids, and rows of
/// one transaction share `created_at`, so without the partition the order
/// has ties, and resuming after one of them skips the others. Qualified
/// by the table: a bare name in ORDER BY means the output column of that
/// name first, and the select list has them all as text (`ctid` by text
/// puts `(5,10)` before `(5,9)`).
fn order_by(o: &OutboxConfig) -> String {
    let t = table_of(o).quoted();
    match &o.columns.sequence {
        Some(seq) => format!("{t}.{}", quote_ident(seq)),
        None => format!(
            "{t}.{}, {t}.tableoid, {t}.ctid",
            quote_ident(&o.columns.created_at)
        ),
    }
}

/// A row's place in that order, as text (its `Key::id`): the sequence
/// value, or `<tableoid>/<ctid>` (no space: see `Key::to_record`).
fn key_of_row(o: &OutboxConfig) -> String {
    match &o.columns.sequence {
        Some(seq) => format!("{}::text", quote_ident(seq)),
        None => "tableoid::text || '/' || ctid::text".to_owned(),
    }
}

/// The kinds of recorded id in `(created_at, tableoid, ctid)` order.
#[derive(Debug, PartialEq, Eq)]
enum PlaceId {
    /// `<tableoid>/<ctid>`: this version's key, total.
    Partitioned,
    /// A bare ctid, recorded by a version before the partition was part of
    /// the key: exact in a plain table only.
    Ctid,
    /// Anything else (an older version's event id).
    Other,
}

fn place_id(id: &str) -> PlaceId {
    match id.split_once('/') {
        Some((oid, ctid)) if oid.parse::<u32>().is_ok() && ctid.starts_with('(') => {
            PlaceId::Partitioned
        }
        _ if id.starts_with('(') => PlaceId::Ctid,
        _ => PlaceId::Other,
    }
}

/// The condition "after the recorded key" (`$2` its `created_at`, `$3` its
/// id, both NULL for none). A key of another order (recorded before the
/// config's `sequence` changed, or an older version's event id) cannot be
/// compared: in `(created_at, tableoid, ctid)` order it resumes at its
/// `created_at`, in sequence order from the window's start. An older
/// version's bare ctid is exact in a plain table; in a partition (where
/// `pg_partition_root` is not NULL) the rows tied with it on `created_at`
/// are taken again. More sent, none lost.
fn after_key(o: &OutboxConfig, id: Option<&str>) -> String {
    let created = quote_ident(&o.columns.created_at);
    match (&o.columns.sequence, id.map(place_id)) {
        (Some(seq), _) if id.is_some_and(|id| id.parse::<i128>().is_ok()) => format!(
            "($2::text IS NULL OR {} > $3::text::numeric)",
            quote_ident(seq)
        ),
        (Some(_), _) => "($2::text IS NULL OR $3::text IS NOT NULL)".to_owned(),
        (None, Some(PlaceId::Other)) => format!(
            "($2::text IS NULL OR ({created} >= $2::text::timestamptz AND $3::text IS NOT NULL))"
        ),
        (None, Some(PlaceId::Ctid)) => format!(
            "($2::text IS NULL OR ({created}, ctid) > ($2::text::timestamptz, $3::text::tid) \
             OR ({created} = $2::text::timestamptz AND pg_partition_root(tableoid) IS NOT NULL))"
        ),
        (None, _) => format!(
            "($2::text IS NULL OR ({created}, tableoid, ctid) > ($2::text::timestamptz, \
             split_part($3::text, '/', 1)::oid, split_part($3::text, '/', 2)::tid))"
        ),
    }
}

/// How many rows `sel` selects now in the outbox tables `tables`.
pub async fn count(
    client: &Client,
    cfg: &Config,
    sel: &Selection,
    tables: &[usize],
) -> Result<i64, SourceError> {
    let mut n = 0;
    let all = names(cfg, tables);
    for (&t, name) in tables.iter().zip(&all) {
        let Some(sel) = for_table(sel, name, &all) else {
            continue;
        };
        let (sql, params) = query(&cfg.outboxes[t], &sel, "count(*)");
        let params: Vec<&(dyn ToSql + Sync)> = params.iter().map(|p| p.as_ref()).collect();
        let row = client
            .query_one(&sql, &params)
            .await
            .map_err(sql_err(&cfg.postgres, "counting outbox rows"))?;
        n += row.get::<_, i64>(0);
    }
    Ok(n)
}

/// The selected rows, table by table in their order (see [`Key`]), a batch
/// at a time, from cursors in one read-only transaction (one snapshot for
/// the whole read).
pub struct Rows<'a> {
    tx: Transaction<'a>,
    cfg: &'a Config,
    sel: Selection,
    /// Outboxes still to read, in order.
    tables: std::collections::VecDeque<usize>,
    /// The names of every table of the read, in order.
    names: Vec<String>,
    /// Tables wholly read (or done before), for the keys.
    done: Arc<[String]>,
    current: Option<Cursor>,
}

/// The cursor over one table.
struct Cursor {
    outbox: usize,
    table: String,
    portal: Portal,
    columns: usize,
    mapping: Result<Arc<Mapping>, MappingError>,
    done: bool,
}

impl<'a> Rows<'a> {
    /// Opens the read of `sel` in the outbox tables `tables` on `client`
    /// (which it holds until dropped).
    pub async fn open(
        client: &'a mut Client,
        cfg: &'a Config,
        sel: &Selection,
        tables: &[usize],
    ) -> Result<Rows<'a>, SourceError> {
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
        Ok(Rows {
            tx,
            cfg,
            sel: sel.clone(),
            tables: tables.iter().copied().collect(),
            names: names(cfg, tables),
            done: Arc::from(Vec::new()),
            current: None,
        })
    }

    /// The cursor over the next table the selection reaches, if any.
    async fn next_cursor(&mut self) -> Result<Option<Cursor>, SourceError> {
        let cfg = self.cfg;
        if let Some(c) = &self.current {
            let mut done = self.done.to_vec();
            done.push(c.table.clone());
            self.done = Arc::from(done);
        }
        while let Some(t) = self.tables.pop_front() {
            let o = &cfg.outboxes[t];
            let table = table_of(o).to_string();
            let Some(sel) = for_table(&self.sel, &table, &self.names) else {
                let mut done = self.done.to_vec();
                done.push(table);
                self.done = Arc::from(done);
                continue;
            };
            let rel = relation(&self.tx, cfg, o).await?;
            let mapping = Mapping::new(&rel, o).map(Arc::new);
            let list: Vec<String> = rel.columns.iter().map(|c| as_sent(&c.name)).collect();
            let created = quote_ident(&o.columns.created_at);
            let select = format!(
                "{}, (extract(epoch FROM {created}) * 1e6)::bigint, {created}::text, {}",
                list.join(", "),
                key_of_row(o)
            );
            let (sql, params) = query(o, &sel, &select);
            let sql = format!("{sql} ORDER BY {}", order_by(o));
            let params: Vec<&(dyn ToSql + Sync)> = params.iter().map(|p| p.as_ref()).collect();
            let portal = (self.tx.bind(sql.as_str(), &params).await)
                .map_err(sql_err(&cfg.postgres, "selecting outbox rows"))?;
            return Ok(Some(Cursor {
                outbox: t,
                table,
                portal,
                columns: rel.columns.len(),
                mapping,
                done: false,
            }));
        }
        Ok(None)
    }

    /// The next batch (empty at the end).
    pub async fn next_batch(&mut self) -> Result<Vec<(OutboxEvent, Key)>, SourceError> {
        loop {
            if self.current.as_ref().is_none_or(|c| c.done) {
                match self.next_cursor().await? {
                    Some(c) => self.current = Some(c),
                    None => return Ok(Vec::new()),
                }
            }
            let c = self.current.as_mut().expect("just set");
            let rows = (self.tx.query_portal(&c.portal, FETCH).await)
                .map_err(sql_err(&self.cfg.postgres, "reading outbox rows"))?;
            if rows.len() < FETCH as usize {
                c.done = true;
            }
            if !rows.is_empty() {
                return Ok(rows.iter().map(|r| event(c, &self.done, r)).collect());
            }
        }
    }
}

fn event(c: &Cursor, done: &Arc<[String]>, r: &Row) -> (OutboxEvent, Key) {
    let n = c.columns;
    let ev = OutboxEvent {
        tuple: TupleData(
            (0..n)
                .map(|i| match r.get::<_, Option<String>>(i) {
                    Some(v) => ColumnValue::Text(Bytes::from(v)),
                    None => ColumnValue::Null,
                })
                .collect(),
        ),
        mapping: c.mapping.clone(),
        commit_time_us: r.get::<_, Option<i64>>(n).unwrap_or(0),
        outbox: c.outbox,
    };
    let key = Key {
        outbox: c.outbox,
        table: c.table.clone(),
        done: Arc::clone(done),
        created: r.get::<_, Option<String>>(n + 1).unwrap_or_default(),
        id: r.get::<_, Option<String>>(n + 2).unwrap_or_default(),
    };
    (ev, key)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_resumes_only_in_the_order_it_was_taken_in() {
        let cfg = crate::config::Config::from_toml(
            "[postgres]\nurl = \"postgres://u@h/d\"\n[outbox]\ntable = \"s.t\"\n\
             [rabbitmq]\nurl = \"amqp://h\"\nexchange = \"x\"",
            "test.toml",
            [],
        )
        .unwrap();
        let mut o = cfg.outboxes[0].clone();
        // (created_at, tableoid, ctid): a key of this order compares in
        // full; an older version's bare ctid compares, and takes its ties
        // again in a partition; any other resumes at its created_at.
        assert!(after_key(&o, Some("16384/(3,10)")).contains("tableoid, ctid) > ("));
        let bare = after_key(&o, Some("(3,10)"));
        assert!(bare.contains(", ctid) > (") && bare.contains("pg_partition_root"));
        assert!(after_key(&o, Some("42")).contains(">= $2::text::timestamptz"));
        assert!(after_key(&o, Some("1/x")).contains(">= $2::text::timestamptz"));
        assert_eq!(
            order_by(&o),
            "\"s\".\"t\".\"created_at\", \"s\".\"t\".tableoid, \"s\".\"t\".ctid"
        );
        // Sequence order: a number compares; a ctid restarts the window.
        o.columns.sequence = Some("seq".into());
        assert!(after_key(&o, Some("-7")).contains("\"seq\" > $3::text::numeric"));
        assert_eq!(
            after_key(&o, Some("(3,10)")),
            "($2::text IS NULL OR $3::text IS NOT NULL)"
        );
        assert_eq!(order_by(&o), "\"s\".\"t\".\"seq\"");
        assert_eq!(key_of_row(&o), "\"seq\"::text");
    }
}
