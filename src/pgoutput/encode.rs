//! Test-only encoder, the inverse of [`super::decode`], for round-trip tests.

use bytes::{BufMut, Bytes, BytesMut};

use super::parse::{
    BEGIN_TAG, BINARY_KIND, COMMIT_TAG, DELETE_TAG, INSERT_TAG, KEY_TUPLE_TAG, MESSAGE_TAG,
    NEW_TUPLE_TAG, NULL_KIND, OLD_TUPLE_TAG, ORIGIN_TAG, RELATION_TAG, TEXT_KIND, TOAST_KIND,
    TRUNCATE_TAG, TYPE_TAG, UPDATE_TAG,
};
use super::{ColumnValue, LogicalMessage, OldTuple, TupleData};

pub(super) fn encode(msg: &LogicalMessage) -> Bytes {
    let mut out = BytesMut::new();
    match msg {
        LogicalMessage::Begin(m) => {
            out.put_u8(BEGIN_TAG);
            out.put_u64(m.final_lsn);
            out.put_i64(m.commit_time);
            out.put_u32(m.xid);
        }
        LogicalMessage::Commit(m) => {
            out.put_u8(COMMIT_TAG);
            out.put_u8(m.flags);
            out.put_u64(m.commit_lsn);
            out.put_u64(m.end_lsn);
            out.put_i64(m.commit_time);
        }
        LogicalMessage::Origin(m) => {
            out.put_u8(ORIGIN_TAG);
            out.put_u64(m.commit_lsn);
            cstr(&mut out, &m.name);
        }
        LogicalMessage::Relation(m) => {
            out.put_u8(RELATION_TAG);
            out.put_u32(m.id);
            cstr(&mut out, &m.namespace);
            cstr(&mut out, &m.name);
            out.put_u8(m.replica_identity);
            out.put_u16(u16::try_from(m.columns.len()).expect("column count fits u16"));
            for c in &m.columns {
                out.put_u8(c.flags);
                cstr(&mut out, &c.name);
                out.put_u32(c.type_oid);
                out.put_i32(c.type_modifier);
            }
        }
        LogicalMessage::Type(m) => {
            out.put_u8(TYPE_TAG);
            out.put_u32(m.id);
            cstr(&mut out, &m.namespace);
            cstr(&mut out, &m.name);
        }
        LogicalMessage::Insert(m) => {
            out.put_u8(INSERT_TAG);
            out.put_u32(m.relation_id);
            out.put_u8(NEW_TUPLE_TAG);
            tuple(&mut out, &m.tuple);
        }
        LogicalMessage::Update(m) => {
            out.put_u8(UPDATE_TAG);
            out.put_u32(m.relation_id);
            if let Some(old) = &m.old {
                old_tuple(&mut out, old);
            }
            out.put_u8(NEW_TUPLE_TAG);
            tuple(&mut out, &m.new);
        }
        LogicalMessage::Delete(m) => {
            out.put_u8(DELETE_TAG);
            out.put_u32(m.relation_id);
            old_tuple(&mut out, &m.old);
        }
        LogicalMessage::Truncate(m) => {
            out.put_u8(TRUNCATE_TAG);
            out.put_i32(i32::try_from(m.relation_ids.len()).expect("count fits i32"));
            out.put_u8(m.options);
            for id in &m.relation_ids {
                out.put_u32(*id);
            }
        }
        LogicalMessage::Message(m) => {
            out.put_u8(MESSAGE_TAG);
            out.put_u8(m.flags);
            out.put_u64(m.lsn);
            cstr(&mut out, &m.prefix);
            out.put_i32(i32::try_from(m.content.len()).expect("length fits i32"));
            out.put_slice(&m.content);
        }
    }
    out.freeze()
}

fn cstr(out: &mut BytesMut, s: &str) {
    out.put_slice(s.as_bytes());
    out.put_u8(0);
}

fn old_tuple(out: &mut BytesMut, old: &OldTuple) {
    let (tag, data) = match old {
        OldTuple::Key(t) => (KEY_TUPLE_TAG, t),
        OldTuple::Full(t) => (OLD_TUPLE_TAG, t),
    };
    out.put_u8(tag);
    tuple(out, data);
}

fn tuple(out: &mut BytesMut, data: &TupleData) {
    out.put_u16(u16::try_from(data.0.len()).expect("column count fits u16"));
    for value in &data.0 {
        let (kind, payload) = match value {
            ColumnValue::Null => (NULL_KIND, None),
            ColumnValue::UnchangedToast => (TOAST_KIND, None),
            ColumnValue::Text(b) => (TEXT_KIND, Some(b)),
            ColumnValue::Binary(b) => (BINARY_KIND, Some(b)),
        };
        out.put_u8(kind);
        if let Some(b) = payload {
            out.put_i32(i32::try_from(b.len()).expect("length fits i32"));
            out.put_slice(b);
        }
    }
}
