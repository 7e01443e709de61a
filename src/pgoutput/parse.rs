//! Per-message parsers behind [`super::decode`].

use bytes::Bytes;
use smallvec::SmallVec;

use super::cursor::Cursor;
use super::{
    Begin, Column, ColumnValue, Commit, DecodeError, Delete, Insert, LogicalDecodingMessage,
    LogicalMessage, OldTuple, Origin, Relation, Truncate, TupleData, TypeMessage, Update,
};

pub(crate) const BEGIN_TAG: u8 = b'B';
pub(crate) const COMMIT_TAG: u8 = b'C';
pub(crate) const ORIGIN_TAG: u8 = b'O';
pub(crate) const RELATION_TAG: u8 = b'R';
pub(crate) const TYPE_TAG: u8 = b'Y';
pub(crate) const INSERT_TAG: u8 = b'I';
pub(crate) const UPDATE_TAG: u8 = b'U';
pub(crate) const DELETE_TAG: u8 = b'D';
pub(crate) const TRUNCATE_TAG: u8 = b'T';
pub(crate) const MESSAGE_TAG: u8 = b'M';

pub(crate) const NEW_TUPLE_TAG: u8 = b'N';
pub(crate) const KEY_TUPLE_TAG: u8 = b'K';
pub(crate) const OLD_TUPLE_TAG: u8 = b'O';

pub(crate) const NULL_KIND: u8 = b'n';
pub(crate) const TOAST_KIND: u8 = b'u';
pub(crate) const TEXT_KIND: u8 = b't';
pub(crate) const BINARY_KIND: u8 = b'b';

pub(crate) fn message(buf: Bytes) -> Result<LogicalMessage, DecodeError> {
    let mut cur = Cursor::new(buf);
    let msg = match cur.u8("message tag")? {
        BEGIN_TAG => LogicalMessage::Begin(Begin {
            final_lsn: cur.u64("begin final LSN")?,
            commit_time: cur.i64("begin commit time")?,
            xid: cur.u32("begin xid")?,
        }),
        COMMIT_TAG => LogicalMessage::Commit(Commit {
            flags: cur.u8("commit flags")?,
            commit_lsn: cur.u64("commit LSN")?,
            end_lsn: cur.u64("commit end LSN")?,
            commit_time: cur.i64("commit time")?,
        }),
        ORIGIN_TAG => LogicalMessage::Origin(Origin {
            commit_lsn: cur.u64("origin commit LSN")?,
            name: cur.cstr("origin name")?,
        }),
        RELATION_TAG => LogicalMessage::Relation(relation(&mut cur)?),
        TYPE_TAG => LogicalMessage::Type(TypeMessage {
            id: cur.u32("type OID")?,
            namespace: cur.cstr("type namespace")?,
            name: cur.cstr("type name")?,
        }),
        INSERT_TAG => LogicalMessage::Insert(Insert {
            relation_id: cur.u32("insert relation id")?,
            tuple: new_tuple(&mut cur)?,
        }),
        UPDATE_TAG => LogicalMessage::Update(update(&mut cur)?),
        DELETE_TAG => LogicalMessage::Delete(delete(&mut cur)?),
        TRUNCATE_TAG => LogicalMessage::Truncate(truncate(&mut cur)?),
        MESSAGE_TAG => LogicalMessage::Message(LogicalDecodingMessage {
            flags: cur.u8("message flags")?,
            lsn: cur.u64("message LSN")?,
            prefix: cur.cstr("message prefix")?,
            content: {
                let len = cur.len_i32("message content length")?;
                cur.bytes(len, "message content")?
            },
        }),
        other => return Err(DecodeError::UnknownTag(other)),
    };
    cur.finish()?;
    Ok(msg)
}

fn relation(cur: &mut Cursor) -> Result<Relation, DecodeError> {
    let id = cur.u32("relation OID")?;
    let namespace = cur.cstr("relation namespace")?;
    let name = cur.cstr("relation name")?;
    let replica_identity = cur.u8("relation replica identity")?;
    let count = usize::from(cur.u16("relation column count")?);
    let mut columns = Vec::with_capacity(count.min(cur.remaining()));
    for _ in 0..count {
        columns.push(Column {
            flags: cur.u8("column flags")?,
            name: cur.cstr("column name")?,
            type_oid: cur.u32("column type OID")?,
            type_modifier: cur.i32("column type modifier")?,
        });
    }
    Ok(Relation {
        id,
        namespace,
        name,
        replica_identity,
        columns,
    })
}

fn update(cur: &mut Cursor) -> Result<Update, DecodeError> {
    let relation_id = cur.u32("update relation id")?;
    let (old, new) = match cur.u8("tuple type")? {
        KEY_TUPLE_TAG => (Some(OldTuple::Key(tuple(cur)?)), new_tuple(cur)?),
        OLD_TUPLE_TAG => (Some(OldTuple::Full(tuple(cur)?)), new_tuple(cur)?),
        NEW_TUPLE_TAG => (None, tuple(cur)?),
        other => return Err(invalid_tuple_tag(other, "update")),
    };
    Ok(Update {
        relation_id,
        old,
        new,
    })
}

fn delete(cur: &mut Cursor) -> Result<Delete, DecodeError> {
    let relation_id = cur.u32("delete relation id")?;
    let old = match cur.u8("tuple type")? {
        KEY_TUPLE_TAG => OldTuple::Key(tuple(cur)?),
        OLD_TUPLE_TAG => OldTuple::Full(tuple(cur)?),
        other => return Err(invalid_tuple_tag(other, "delete")),
    };
    Ok(Delete { relation_id, old })
}

fn truncate(cur: &mut Cursor) -> Result<Truncate, DecodeError> {
    let count = cur.len_i32("truncate relation count")?;
    let options = cur.u8("truncate options")?;
    let mut relation_ids = Vec::with_capacity(count.min(cur.remaining() / 4));
    for _ in 0..count {
        relation_ids.push(cur.u32("truncate relation id")?);
    }
    Ok(Truncate {
        options,
        relation_ids,
    })
}

fn new_tuple(cur: &mut Cursor) -> Result<TupleData, DecodeError> {
    match cur.u8("tuple type")? {
        NEW_TUPLE_TAG => tuple(cur),
        other => Err(invalid_tuple_tag(other, "new tuple")),
    }
}

fn invalid_tuple_tag(tag: u8, context: &str) -> DecodeError {
    DecodeError::Invalid(format!("unexpected tuple type {tag:#04x} in {context}"))
}

fn tuple(cur: &mut Cursor) -> Result<TupleData, DecodeError> {
    let count = usize::from(cur.u16("tuple column count")?);
    let mut values = SmallVec::with_capacity(count.min(cur.remaining()));
    for _ in 0..count {
        values.push(column_value(cur)?);
    }
    Ok(TupleData(values))
}

fn column_value(cur: &mut Cursor) -> Result<ColumnValue, DecodeError> {
    match cur.u8("column value kind")? {
        NULL_KIND => Ok(ColumnValue::Null),
        TOAST_KIND => Ok(ColumnValue::UnchangedToast),
        TEXT_KIND => {
            let len = cur.len_i32("text column length")?;
            Ok(ColumnValue::Text(cur.bytes(len, "text column value")?))
        }
        BINARY_KIND => {
            let len = cur.len_i32("binary column length")?;
            Ok(ColumnValue::Binary(cur.bytes(len, "binary column value")?))
        }
        other => Err(DecodeError::Invalid(format!(
            "unknown column value kind {other:#04x}"
        ))),
    }
}
