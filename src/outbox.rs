//! From decoded pgoutput messages to outbox events.
//!
//! Keeps the relation cache: pgoutput sends a Relation message before the
//! first change of a table in a session, and again whenever its definition
//! changes (e.g. after `ALTER TABLE outbox ADD COLUMN`). Columns are looked up
//! by name in the newest Relation, so added, dropped or reordered columns are
//! followed without a restart. Only INSERTs into the configured outbox tables
//! become events, and transactional logical messages with a configured
//! prefix (the table-less outbox, [`emitted`]); every other change is
//! ignored.

pub mod emitted;

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;

use crate::config::OutboxConfig;
use crate::lsn::Lsn;
use crate::message::guard::ExchangeGuard;
use crate::pgoutput::{Column, ColumnValue, LogicalMessage, Relation, TupleData};
use crate::template::{Part, Template};

/// PostgreSQL type OIDs the payload column may have.
mod oid {
    pub const BYTEA: u32 = 17;
    pub const TEXT: u32 = 25;
    pub const JSON: u32 = 114;
    pub const BPCHAR: u32 = 1042;
    pub const VARCHAR: u32 = 1043;
    pub const JSONB: u32 = 3802;
}

/// How the payload column's text form becomes the message body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PayloadKind {
    /// json/jsonb: the JSON text, `content_type = application/json`.
    Json,
    /// text/varchar: the UTF-8 text, `content_type = text/plain`.
    Text,
    /// bytea: pgoutput sends `\x<hex>`; the body is the decoded bytes.
    Bytea,
}

impl PayloadKind {
    /// The payload kind of a column type, if supported.
    pub fn of_type(type_oid: u32) -> Option<PayloadKind> {
        match type_oid {
            oid::JSON | oid::JSONB => Some(PayloadKind::Json),
            oid::TEXT | oid::VARCHAR | oid::BPCHAR => Some(PayloadKind::Text),
            oid::BYTEA => Some(PayloadKind::Bytea),
            _ => None,
        }
    }
}

/// One template part, resolved against the current relation.
#[derive(Debug, Clone)]
pub enum ResolvedPart {
    /// Copied as is.
    Literal(String),
    /// Value of the column at this index.
    Column {
        /// Index in the tuple.
        index: usize,
        /// Column name, for error messages.
        name: String,
    },
}

/// Where each role's column sits in the outbox relation's tuples, as of the
/// newest Relation message.
#[derive(Debug)]
pub struct Mapping {
    /// Index of the id column.
    pub id: usize,
    /// Index of the aggregate type column.
    pub aggregate_type: usize,
    /// Index of the aggregate id column.
    pub aggregate_id: usize,
    /// Index of the event type column.
    pub event_type: usize,
    /// Index of the payload column.
    pub payload: usize,
    /// How to turn the payload into a body.
    pub payload_kind: PayloadKind,
    /// Index of the headers column, when the table has one.
    pub headers: Option<usize>,
    /// The exchange template, resolved.
    pub exchange: Vec<ResolvedPart>,
    /// The routing key template, resolved.
    pub routing_key: Vec<ResolvedPart>,
    /// `outbox.routing_headers`: the row's `CC`/`BCC` are sent (else dropped).
    pub routing_headers: bool,
    /// What a templated exchange may render to; `None` for a literal one.
    pub exchange_guard: Option<ExchangeGuard>,
}

/// The outbox table's definition does not fit the configuration.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MappingError {
    /// A configured column is not in the table.
    #[error(
        "outbox table {table} has no column {column:?} (configured as {key}); add the column or change {key}"
    )]
    MissingColumn {
        /// The table.
        table: String,
        /// The missing column.
        column: String,
        /// Config key that names it.
        key: String,
    },
    /// A table-less outbox's logical message is not a JSON object, or has
    /// no id.
    #[error("logical message with prefix {prefix:?} at {at} (outbox {key}): {reason}")]
    Message {
        /// The message prefix.
        prefix: String,
        /// Its position in the WAL: the same on every replay, so its dead
        /// letter's `message_id` (`lsn-<at>`) is stable.
        at: Lsn,
        /// The outbox's config key.
        key: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The payload column's type is not json, jsonb, text, varchar or bytea.
    #[error(
        "outbox table {table}: payload column {column:?} has unsupported type oid {type_oid}; use jsonb, json, text, varchar or bytea"
    )]
    PayloadType {
        /// The table.
        table: String,
        /// The payload column.
        column: String,
        /// Its type.
        type_oid: u32,
    },
}

impl Mapping {
    /// Finds the configured columns in `rel`.
    pub fn new(rel: &Relation, outbox: &OutboxConfig) -> Result<Mapping, MappingError> {
        let cols = &outbox.columns;
        let table = format!("{}.{}", rel.namespace, rel.name);
        let find = |column: &str, key: &str| -> Result<usize, MappingError> {
            find_column(&rel.columns, column).ok_or_else(|| MappingError::MissingColumn {
                table: table.clone(),
                column: column.to_owned(),
                key: key.to_owned(),
            })
        };
        let key = |field: &str| outbox.key_of(field);
        let payload = find(&cols.payload, &key("payload"))?;
        let payload_type = rel.columns[payload].type_oid;
        let payload_kind =
            PayloadKind::of_type(payload_type).ok_or_else(|| MappingError::PayloadType {
                table: table.clone(),
                column: cols.payload.clone(),
                type_oid: payload_type,
            })?;
        let resolve = |t: &Template, key: &str| -> Result<Vec<ResolvedPart>, MappingError> {
            t.parts()
                .iter()
                .map(|p| match p {
                    Part::Literal(s) => Ok(ResolvedPart::Literal(s.clone())),
                    Part::Column(c) => {
                        let name = cols.resolve(c);
                        Ok(ResolvedPart::Column {
                            index: find(name, key)?,
                            name: name.to_owned(),
                        })
                    }
                })
                .collect()
        };
        Ok(Mapping {
            id: find(&cols.id, &key("id"))?,
            aggregate_type: find(&cols.aggregate_type, &key("aggregate_type"))?,
            aggregate_id: find(&cols.aggregate_id, &key("aggregate_id"))?,
            event_type: find(&cols.event_type, &key("event_type"))?,
            payload,
            payload_kind,
            headers: find_column(&rel.columns, &cols.headers),
            exchange: resolve(&outbox.exchange, &outbox.template_keys.0)?,
            routing_key: resolve(&outbox.routing_key, &outbox.template_keys.1)?,
            routing_headers: outbox.routing_headers,
            exchange_guard: outbox
                .exchange
                .as_literal()
                .is_none()
                .then(|| ExchangeGuard {
                    key: outbox.template_keys.0.clone(),
                    pattern: outbox.exchange_pattern.clone(),
                }),
        })
    }
}

fn find_column(columns: &[Column], name: &str) -> Option<usize> {
    columns.iter().position(|c| c.name == name)
}

/// One committed INSERT into the outbox table, not yet mapped to a message.
#[derive(Debug, Clone)]
pub struct OutboxEvent {
    /// The row, as pgoutput sent it (zero-copy slices of the WAL message).
    pub tuple: TupleData,
    /// The column mapping in force when the row was decoded, or why there is
    /// none (the row is then undeliverable).
    pub mapping: Result<Arc<Mapping>, MappingError>,
    /// Commit time of its transaction, microseconds since the Unix epoch.
    pub commit_time_us: i64,
    /// Which outbox it came from: its index in `Config::outboxes`.
    pub outbox: usize,
}

impl OutboxEvent {
    /// The value of column `index`, if present and not NULL.
    pub fn value(&self, index: usize) -> Option<&Bytes> {
        self.tuple.0.get(index).and_then(ColumnValue::as_bytes)
    }

    /// Bytes of column values it holds: what memory budgets count.
    pub fn bytes(&self) -> usize {
        self.tuple
            .0
            .iter()
            .map(|c| c.as_bytes().map_or(0, Bytes::len))
            .sum()
    }
}

/// What a WAL message meant for the outbox.
#[derive(Debug)]
// Rows keep their columns inline (no allocation per event), and rows
// are the common case: boxing them would add back the allocation.
#[allow(clippy::large_enum_variant)]
pub enum Decoded {
    /// An INSERT into the outbox table.
    Event(OutboxEvent),
    /// Anything else: schema messages, other tables, other kinds of change.
    Nothing,
    /// A non-transactional logical message with an outbox's prefix:
    /// skipped (and counted).
    Skipped,
}

/// Errors that stop the stream: the WAL itself cannot be understood.
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    /// pgoutput bytes did not decode.
    #[error("cannot decode pgoutput message: {0}")]
    Decode(#[from] crate::pgoutput::DecodeError),
    /// A change for a relation never described by a Relation message.
    #[error("change for relation {0} arrived before its Relation message")]
    UnknownRelation(u32),
    /// A change outside BEGIN/COMMIT.
    #[error("pgoutput change outside a transaction")]
    OutsideTransaction,
    /// An INSERT into a table that is neither an outbox nor one of its
    /// partitions: the publication publishes more than the outboxes. Never
    /// skipped, since the slot would move past it.
    #[error(
        "INSERT into {table} (relation {oid}), which is not the outbox table {outbox} nor one of \
         its partitions, arrived through the publication (postgres.publication); stopping rather \
         than skipping it. Publish only the outbox (ALTER PUBLICATION ... SET TABLE {outbox}); \
         if {table} is a partition attached since the relay started, restart it, or set \
         publish_via_partition_root = true on the publication. PostgreSQL decides what a \
         publication covers as of each change's WAL position, so changes already written stay \
         published: this one is in {tx}"
    )]
    ForeignRelation {
        /// The transaction, and how to move past it.
        tx: String,
        /// The table as the Relation message named it.
        table: String,
        /// Its relation id.
        oid: u32,
        /// The configured outbox tables.
        outbox: String,
    },
}

/// The relations that are the outbox, resolved when a session starts: the
/// table's OID and those of its partitions (a partitioned outbox published
/// without `publish_via_partition_root` sends each partition's own id).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OutboxOids {
    /// The outbox table (the partition root when it is partitioned).
    pub root: u32,
    /// Its partitions, at every level.
    pub partitions: Vec<u32>,
}

/// A relation's mapping, or why it has none.
pub type MappingResult = Result<Arc<Mapping>, MappingError>;

/// The relation cache and the transaction state of one replication session.
#[derive(Debug)]
pub struct OutboxDecoder {
    outboxes: Vec<OutboxConfig>,
    /// Which relation ids are each table outbox (`None`: a table-less one).
    oids: Vec<Option<OutboxOids>>,
    /// Relation id -> (outbox, mapping) when it is an outbox table, else its
    /// name.
    relations: HashMap<u32, Result<(usize, MappingResult), String>>,
    /// The table-less outboxes, by prefix.
    messages: emitted::Prefixes,
    /// Commit time of the open transaction (µs since the Unix epoch).
    open_tx: Option<i64>,
    /// Its xid and commit LSN, when known.
    open_xid: Option<(u32, Lsn)>,
}

/// Microseconds from the Unix epoch to PostgreSQL's epoch, 2000-01-01.
pub const PG_EPOCH_OFFSET_US: i64 = 946_684_800_000_000;

impl OutboxDecoder {
    /// A decoder for a new session: the relation cache starts empty, as the
    /// server re-sends Relation messages on every new stream.
    /// `oids`: for each of `outboxes`, its relation ids (`None` for a
    /// table-less outbox).
    pub fn new(outboxes: &[OutboxConfig], oids: Vec<Option<OutboxOids>>) -> Self {
        OutboxDecoder {
            messages: emitted::Prefixes::new(outboxes),
            outboxes: outboxes.to_vec(),
            oids,
            relations: HashMap::new(),
            open_tx: None,
            open_xid: None,
        }
    }

    /// Whether a Relation message describes the outbox: by relation id (the
    /// table, followed through a RENAME while streaming, or one of its
    /// partitions), or by the name it had when the change was written
    /// (pgoutput names relations as of the WAL being decoded, so rows
    /// written before a rename or a re-creation still count).
    fn which_outbox(&self, rel: &Relation) -> Option<usize> {
        let tables = self.outboxes.iter().enumerate();
        let tables = tables.filter_map(|(i, o)| Some((i, o, o.table()?, self.oids[i].as_ref())));
        let mut by_oid = None;
        for (i, o, table, oids) in tables {
            if rel.namespace == table.schema && rel.name == table.name {
                return Some(i);
            }
            if oids.is_some_and(|x| rel.id == x.root || x.partitions.contains(&rel.id)) {
                if oids.is_some_and(|x| x.root == rel.id) {
                    tracing::warn!(
                        table = %format!("{}.{}", rel.namespace, rel.name),
                        configured = %table,
                        "the outbox table was renamed; following it by its relation id (update \
                         {} before the next restart)",
                        o.key_of("table")
                    );
                }
                by_oid = by_oid.or(Some(i));
            }
        }
        by_oid
    }

    /// The configured outbox tables, for messages.
    fn tables(&self) -> String {
        let names: Vec<String> = self
            .outboxes
            .iter()
            .filter_map(|o| o.table().map(|t| t.to_string()))
            .collect();
        names.join(", ")
    }

    /// BEGIN, with the commit time in PostgreSQL's epoch as pgoutput sends it.
    pub fn begin(&mut self, commit_time_pg_us: i64) {
        self.open_tx = Some(commit_time_pg_us.saturating_add(PG_EPOCH_OFFSET_US));
    }

    /// BEGIN, also naming the transaction (its xid and commit LSN), so that
    /// an error about one of its changes can say which it is.
    pub fn begin_tx(&mut self, commit_time_pg_us: i64, xid: u32, commit_lsn: Lsn) {
        self.begin(commit_time_pg_us);
        self.open_xid = Some((xid, commit_lsn));
    }

    /// COMMIT.
    pub fn commit(&mut self) {
        self.open_tx = None;
    }

    /// Decodes one XLogData payload (not BEGIN/COMMIT, which the replication
    /// client hands over already parsed).
    pub fn decode(&mut self, data: Bytes) -> Result<Decoded, StreamError> {
        match crate::pgoutput::decode(data)? {
            LogicalMessage::Relation(rel) => {
                let entry = if let Some(i) = self.which_outbox(&rel) {
                    let mapping = Mapping::new(&rel, &self.outboxes[i]).map(Arc::new);
                    if let Err(e) = &mapping {
                        tracing::error!(error = %e, "outbox relation does not match the configuration");
                    }
                    // Optional, so its loss does not stop anything: said,
                    // since trace ids or CC/BCC copies go with it.
                    let had_headers = matches!(
                        self.relations.get(&rel.id),
                        Some(Ok((_, Ok(m)))) if m.headers.is_some()
                    );
                    if had_headers && mapping.as_ref().is_ok_and(|m| m.headers.is_none()) {
                        tracing::warn!(
                            table = %format!("{}.{}", rel.namespace, rel.name),
                            column = %self.outboxes[i].columns.headers,
                            key = %self.outboxes[i].key_of("headers"),
                            "the outbox table lost its headers column (renamed or dropped) while streaming: \
                             its events go out without the row's headers"
                        );
                    }
                    Ok((i, mapping))
                } else {
                    Err(format!("{}.{}", rel.namespace, rel.name))
                };
                self.relations.insert(rel.id, entry);
                Ok(Decoded::Nothing)
            }
            LogicalMessage::Insert(ins) => {
                let commit_time_us = self.open_tx.ok_or(StreamError::OutsideTransaction)?;
                match self.relations.get(&ins.relation_id) {
                    None => Err(StreamError::UnknownRelation(ins.relation_id)),
                    Some(Err(table)) => Err(StreamError::ForeignRelation {
                        table: table.clone(),
                        oid: ins.relation_id,
                        outbox: self.tables(),
                        tx: match self.open_xid {
                            Some((xid, lsn)) => format!(
                                "transaction {xid}, committed at {lsn}: to skip it, advance the \
                                 slot past it (SELECT pg_replication_slot_advance('<slot>', \
                                 '{}')), then re-publish its outbox rows, if any (SELECT \
                                 id FROM <outbox table> WHERE xmin = '{xid}', for each of {}), \
                                 with `outbox-relay republish --id`",
                                Lsn(lsn.0 + 1),
                                self.tables()
                            ),
                            None => "an unknown transaction".to_owned(),
                        },
                    }),
                    Some(Ok((outbox, mapping))) => Ok(Decoded::Event(OutboxEvent {
                        tuple: ins.tuple,
                        mapping: mapping.clone(),
                        commit_time_us,
                        outbox: *outbox,
                    })),
                }
            }
            LogicalMessage::Begin(b) => {
                self.begin(b.commit_time);
                Ok(Decoded::Nothing)
            }
            LogicalMessage::Commit(_) => {
                self.commit();
                Ok(Decoded::Nothing)
            }
            LogicalMessage::Message(m) => {
                let at = Lsn(m.lsn);
                self.message(m.flags & 1 == 1, &m.prefix, m.content, at)
            }
            LogicalMessage::Origin(_)
            | LogicalMessage::Type(_)
            | LogicalMessage::Update(_)
            | LogicalMessage::Delete(_)
            | LogicalMessage::Truncate(_) => Ok(Decoded::Nothing),
        }
    }

    /// A logical message (`pg_logical_emit_message`): an event when its
    /// prefix is a table-less outbox's and it is transactional.
    pub fn message(
        &mut self,
        transactional: bool,
        prefix: &str,
        content: Bytes,
        at: Lsn,
    ) -> Result<Decoded, StreamError> {
        let Some(emitted) = self.messages.get(prefix) else {
            return Ok(Decoded::Nothing);
        };
        if !transactional {
            // Sent at once, outside any transaction: it may belong to one
            // that later rolled back, and it has no commit to order it by.
            tracing::warn!(
                prefix,
                %at,
                "skipping a non-transactional logical message with an outbox prefix; emit outbox \
                 events with pg_logical_emit_message(true, ...)"
            );
            return Ok(Decoded::Skipped);
        }
        let commit_time_us = self.open_tx.ok_or(StreamError::OutsideTransaction)?;
        let outbox = emitted.outbox;
        let (tuple, mapping) = emitted::row(&self.outboxes[outbox], emitted, content, at);
        Ok(Decoded::Event(OutboxEvent {
            tuple,
            mapping,
            commit_time_us,
            outbox,
        }))
    }
}
