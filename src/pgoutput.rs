//! Decoder for PostgreSQL `pgoutput` logical replication messages
//! (protocol version 1, no streaming).
//!
//! The relay receives these frames inside `XLogData` copy messages; decoding
//! them here, purely and without panics, keeps the hostile-input surface in
//! one small, heavily tested place. Column values stay zero-copy slices of
//! the input so large rows are never duplicated on the hot path.

mod cursor;
mod parse;

#[cfg(test)]
mod encode;
#[cfg(test)]
mod frames;
#[cfg(test)]
mod prop_tests;
#[cfg(test)]
mod tests;

use bytes::Bytes;
use smallvec::SmallVec;

/// An LSN as the raw u64 from the wire.
///
/// Kept as a plain integer so this module stays independent of whichever
/// LSN newtype the replication client uses.
pub type WireLsn = u64;

/// One decoded `pgoutput` message, so callers can match on the kind of
/// change instead of re-parsing tags.
#[derive(Debug, Clone, PartialEq, Eq)]
// Rows keep their columns inline (no allocation per event), and rows
// are the common case: boxing them would add back the allocation.
#[allow(clippy::large_enum_variant)]
pub enum LogicalMessage {
    /// Opens a transaction; changes until the matching commit belong to it.
    Begin(Begin),
    /// Closes a transaction; its `end_lsn` is what may be acknowledged.
    Commit(Commit),
    /// Names the replication origin the transaction came from.
    Origin(Origin),
    /// Describes a table's columns, sent before its first change.
    Relation(Relation),
    /// Describes a non-builtin type referenced by a relation.
    Type(TypeMessage),
    /// A new row.
    Insert(Insert),
    /// A changed row.
    Update(Update),
    /// A removed row.
    Delete(Delete),
    /// One or more tables emptied at once.
    Truncate(Truncate),
    /// A `pg_logical_emit_message` payload.
    Message(LogicalDecodingMessage),
}

/// Start of a transaction, needed to group changes and to know the LSN
/// the whole transaction will be acknowledged at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Begin {
    /// LSN of the transaction's commit record.
    pub final_lsn: WireLsn,
    /// Commit time in microseconds since 2000-01-01 UTC.
    pub commit_time: i64,
    /// Transaction id, useful for logging and correlation.
    pub xid: u32,
}

/// End of a transaction; the point at which its changes may be published
/// and its position confirmed back to the server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Commit {
    /// Reserved by the protocol; currently always zero.
    pub flags: u8,
    /// LSN of the commit record.
    pub commit_lsn: WireLsn,
    /// LSN just past the commit record, safe to report as flushed.
    pub end_lsn: WireLsn,
    /// Commit time in microseconds since 2000-01-01 UTC.
    pub commit_time: i64,
}

/// Replication origin of the current transaction, so loops between
/// bidirectionally replicated servers can be detected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Origin {
    /// LSN of the commit on the origin server.
    pub commit_lsn: WireLsn,
    /// Origin name.
    pub name: String,
}

/// Table metadata; row messages only carry the relation id, so this must be
/// cached to interpret them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Relation {
    /// Relation OID, as referenced by row messages.
    pub id: u32,
    /// Schema name.
    pub namespace: String,
    /// Table name.
    pub name: String,
    /// `relreplident` byte: `d`efault, `n`othing, `f`ull or `i`ndex.
    pub replica_identity: u8,
    /// Columns in the order tuple values arrive.
    pub columns: Vec<Column>,
}

/// One column of a [`Relation`], needed to map tuple values to names/types.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Column {
    /// `1` when the column is part of the replica identity key, else `0`.
    pub flags: u8,
    /// Column name.
    pub name: String,
    /// OID of the column's data type.
    pub type_oid: u32,
    /// Type modifier (`atttypmod`), e.g. varchar length; -1 when none.
    pub type_modifier: i32,
}

/// Type metadata, sent so custom type OIDs can be named.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TypeMessage {
    /// Type OID.
    pub id: u32,
    /// Schema name.
    pub namespace: String,
    /// Type name.
    pub name: String,
}

/// A row inserted into a relation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Insert {
    /// Relation OID, resolved via a prior [`Relation`] message.
    pub relation_id: u32,
    /// The new row.
    pub tuple: TupleData,
}

/// A row updated in a relation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Update {
    /// Relation OID, resolved via a prior [`Relation`] message.
    pub relation_id: u32,
    /// Old key or row; only sent when the key changed or identity is FULL.
    pub old: Option<OldTuple>,
    /// The new row; unchanged TOASTed values appear as `UnchangedToast`.
    pub new: TupleData,
}

/// A row deleted from a relation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delete {
    /// Relation OID, resolved via a prior [`Relation`] message.
    pub relation_id: u32,
    /// Identity of the removed row.
    pub old: OldTuple,
}

/// Old row image; which kind arrives depends on the table's replica
/// identity, and a key image has non-key columns null.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OldTuple {
    /// Replica-identity key columns only (`K`).
    Key(TupleData),
    /// The full old row (`O`, REPLICA IDENTITY FULL).
    Full(TupleData),
}

/// Tables truncated together in one statement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Truncate {
    /// Bit mask: `1` = `CASCADE`, `2` = `RESTART IDENTITY`.
    pub options: u8,
    /// OIDs of the truncated relations.
    pub relation_ids: Vec<u32>,
}

/// Payload from `pg_logical_emit_message`, usable as an out-of-band
/// channel through the replication stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogicalDecodingMessage {
    /// `1` when the message is transactional, else `0`.
    pub flags: u8,
    /// LSN of the message.
    pub lsn: WireLsn,
    /// Prefix chosen by the emitter, used to route the message.
    pub prefix: String,
    /// Raw payload, a zero-copy slice of the frame.
    pub content: Bytes,
}

/// Column values of one row, in relation column order. Up to 8 columns
/// (the default outbox table has 7) live inline: decoding a row allocates
/// nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TupleData(pub SmallVec<[ColumnValue; 8]>);

impl From<Vec<ColumnValue>> for TupleData {
    fn from(v: Vec<ColumnValue>) -> Self {
        TupleData(SmallVec::from_vec(v))
    }
}

/// One column value; values are zero-copy slices of the input frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ColumnValue {
    /// SQL NULL (`n`).
    Null,
    /// TOASTed value that did not change and so was not sent (`u`).
    UnchangedToast,
    /// Value in the type's text output format (`t`).
    Text(Bytes),
    /// Value in the type's binary send format (`b`).
    Binary(Bytes),
}

impl ColumnValue {
    /// Gives the payload when one was actually sent, so callers need not
    /// match on the text/binary distinction just to get the bytes.
    #[must_use]
    pub fn as_bytes(&self) -> Option<&Bytes> {
        match self {
            Self::Text(b) | Self::Binary(b) => Some(b),
            Self::Null | Self::UnchangedToast => None,
        }
    }
}

impl Relation {
    /// Finds where a named column sits in this relation's tuples, since
    /// tuple values are positional.
    #[must_use]
    pub fn column_index(&self, name: &str) -> Option<usize> {
        self.columns.iter().position(|c| c.name == name)
    }
}

/// Why a frame could not be decoded; all variants mean the frame is unusable.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum DecodeError {
    /// The frame ended before a field was complete.
    #[error("pgoutput message truncated: needed {needed} more bytes reading {what}")]
    Truncated {
        /// The field being read.
        what: &'static str,
        /// How many more bytes it required.
        needed: usize,
    },
    /// The first byte is not a protocol-v1 message tag.
    #[error("unknown pgoutput message tag {0:#04x}")]
    UnknownTag(u8),
    /// The bytes are present but malformed (negative length, bad kind byte,
    /// non-UTF-8 or unterminated string, trailing bytes, ...).
    #[error("invalid pgoutput data: {0}")]
    Invalid(String),
}

/// Decodes exactly one `pgoutput` message; the whole buffer must be
/// consumed, so framing errors surface instead of being silently ignored.
///
/// # Errors
///
/// [`DecodeError::Truncated`] if the frame ends early,
/// [`DecodeError::UnknownTag`] for a tag outside protocol v1, and
/// [`DecodeError::Invalid`] for malformed fields or trailing bytes.
pub fn decode(buf: Bytes) -> Result<LogicalMessage, DecodeError> {
    parse::message(buf)
}
