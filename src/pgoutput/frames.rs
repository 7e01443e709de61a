//! Hand-built wire frames for every message kind, written field by field
//! from the protocol docs so they check the decoder independently of the
//! test encoder.

use bytes::Bytes;

use super::*;

pub(super) const REL: u32 = 16384;
pub(super) const LSN: u64 = 0x0000_0001_0000_0010;
const TS: i64 = 700_000_000_000_000;

/// Concatenates raw field encodings into one frame.
pub(super) fn frame(parts: &[&[u8]]) -> Bytes {
    Bytes::from(parts.concat())
}

pub(super) fn text(s: &'static str) -> ColumnValue {
    ColumnValue::Text(Bytes::from_static(s.as_bytes()))
}

fn begin() -> (Bytes, LogicalMessage) {
    let buf = frame(&[
        b"B",
        &LSN.to_be_bytes(),
        &TS.to_be_bytes(),
        &758u32.to_be_bytes(),
    ]);
    let msg = Begin {
        final_lsn: LSN,
        commit_time: TS,
        xid: 758,
    };
    (buf, LogicalMessage::Begin(msg))
}

fn commit() -> (Bytes, LogicalMessage) {
    let end = LSN + 0x28;
    let buf = frame(&[
        b"C",
        &[0],
        &LSN.to_be_bytes(),
        &end.to_be_bytes(),
        &TS.to_be_bytes(),
    ]);
    let msg = Commit {
        flags: 0,
        commit_lsn: LSN,
        end_lsn: end,
        commit_time: TS,
    };
    (buf, LogicalMessage::Commit(msg))
}

fn origin() -> (Bytes, LogicalMessage) {
    let buf = frame(&[b"O", &LSN.to_be_bytes(), b"node_a\0"]);
    let msg = Origin {
        commit_lsn: LSN,
        name: "node_a".into(),
    };
    (buf, LogicalMessage::Origin(msg))
}

pub(super) fn relation() -> (Bytes, LogicalMessage) {
    let buf = frame(&[
        b"R",
        &REL.to_be_bytes(),
        b"public\0",
        b"outbox\0",
        b"d",
        &2u16.to_be_bytes(),
        &[1],
        b"id\0",
        &20u32.to_be_bytes(),
        &(-1i32).to_be_bytes(),
        &[0],
        b"payload\0",
        &3802u32.to_be_bytes(),
        &(-1i32).to_be_bytes(),
    ]);
    let col = |flags, name: &str, type_oid| Column {
        flags,
        name: name.into(),
        type_oid,
        type_modifier: -1,
    };
    let msg = Relation {
        id: REL,
        namespace: "public".into(),
        name: "outbox".into(),
        replica_identity: b'd',
        columns: vec![col(1, "id", 20), col(0, "payload", 3802)],
    };
    (buf, LogicalMessage::Relation(msg))
}

fn type_msg() -> (Bytes, LogicalMessage) {
    let buf = frame(&[b"Y", &16400u32.to_be_bytes(), b"public\0", b"mood\0"]);
    let msg = TypeMessage {
        id: 16400,
        namespace: "public".into(),
        name: "mood".into(),
    };
    (buf, LogicalMessage::Type(msg))
}

pub(super) fn insert_all_kinds() -> (Bytes, LogicalMessage) {
    let buf = frame(&[
        b"I",
        &REL.to_be_bytes(),
        b"N",
        &4u16.to_be_bytes(),
        b"n",
        b"u",
        b"t",
        &3i32.to_be_bytes(),
        b"abc",
        b"b",
        &2i32.to_be_bytes(),
        &[0xde, 0xad],
    ]);
    let tuple = TupleData::from(vec![
        ColumnValue::Null,
        ColumnValue::UnchangedToast,
        text("abc"),
        ColumnValue::Binary(Bytes::from_static(&[0xde, 0xad])),
    ]);
    (
        buf,
        LogicalMessage::Insert(Insert {
            relation_id: REL,
            tuple,
        }),
    )
}

fn update_without_old() -> (Bytes, LogicalMessage) {
    let buf = frame(&[
        b"U",
        &REL.to_be_bytes(),
        b"N",
        &1u16.to_be_bytes(),
        b"t",
        &1i32.to_be_bytes(),
        b"x",
    ]);
    let msg = Update {
        relation_id: REL,
        old: None,
        new: TupleData::from(vec![text("x")]),
    };
    (buf, LogicalMessage::Update(msg))
}

fn update_with_key() -> (Bytes, LogicalMessage) {
    let buf = frame(&[
        b"U",
        &REL.to_be_bytes(),
        b"K",
        &2u16.to_be_bytes(),
        b"t",
        &1i32.to_be_bytes(),
        b"1",
        b"n",
        b"N",
        &2u16.to_be_bytes(),
        b"t",
        &1i32.to_be_bytes(),
        b"2",
        b"u",
    ]);
    let msg = Update {
        relation_id: REL,
        old: Some(OldTuple::Key(TupleData::from(vec![
            text("1"),
            ColumnValue::Null,
        ]))),
        new: TupleData::from(vec![text("2"), ColumnValue::UnchangedToast]),
    };
    (buf, LogicalMessage::Update(msg))
}

fn update_with_full_old() -> (Bytes, LogicalMessage) {
    let buf = frame(&[
        b"U",
        &REL.to_be_bytes(),
        b"O",
        &2u16.to_be_bytes(),
        b"t",
        &1i32.to_be_bytes(),
        b"1",
        b"t",
        &3i32.to_be_bytes(),
        b"old",
        b"N",
        &2u16.to_be_bytes(),
        b"t",
        &1i32.to_be_bytes(),
        b"1",
        b"t",
        &3i32.to_be_bytes(),
        b"new",
    ]);
    let msg = Update {
        relation_id: REL,
        old: Some(OldTuple::Full(TupleData::from(vec![
            text("1"),
            text("old"),
        ]))),
        new: TupleData::from(vec![text("1"), text("new")]),
    };
    (buf, LogicalMessage::Update(msg))
}

fn delete_with_key() -> (Bytes, LogicalMessage) {
    let buf = frame(&[
        b"D",
        &REL.to_be_bytes(),
        b"K",
        &2u16.to_be_bytes(),
        b"t",
        &1i32.to_be_bytes(),
        b"1",
        b"n",
    ]);
    let old = OldTuple::Key(TupleData::from(vec![text("1"), ColumnValue::Null]));
    (
        buf,
        LogicalMessage::Delete(Delete {
            relation_id: REL,
            old,
        }),
    )
}

fn delete_with_full_old() -> (Bytes, LogicalMessage) {
    let buf = frame(&[
        b"D",
        &REL.to_be_bytes(),
        b"O",
        &2u16.to_be_bytes(),
        b"t",
        &1i32.to_be_bytes(),
        b"1",
        b"b",
        &3i32.to_be_bytes(),
        &[1, 2, 3],
    ]);
    let binary = ColumnValue::Binary(Bytes::from_static(&[1, 2, 3]));
    let old = OldTuple::Full(TupleData::from(vec![text("1"), binary]));
    (
        buf,
        LogicalMessage::Delete(Delete {
            relation_id: REL,
            old,
        }),
    )
}

fn truncate() -> (Bytes, LogicalMessage) {
    let buf = frame(&[
        b"T",
        &3i32.to_be_bytes(),
        &[1],
        &REL.to_be_bytes(),
        &(REL + 1).to_be_bytes(),
        &(REL + 2).to_be_bytes(),
    ]);
    let msg = Truncate {
        options: 1,
        relation_ids: vec![REL, REL + 1, REL + 2],
    };
    (buf, LogicalMessage::Truncate(msg))
}

fn message_transactional() -> (Bytes, LogicalMessage) {
    let buf = frame(&[
        b"M",
        &[1],
        &LSN.to_be_bytes(),
        b"outbox\0",
        &5i32.to_be_bytes(),
        b"hello",
    ]);
    let msg = LogicalDecodingMessage {
        flags: 1,
        lsn: LSN,
        prefix: "outbox".into(),
        content: Bytes::from_static(b"hello"),
    };
    (buf, LogicalMessage::Message(msg))
}

fn message_non_transactional() -> (Bytes, LogicalMessage) {
    let buf = frame(&[
        b"M",
        &[0],
        &LSN.to_be_bytes(),
        b"audit\0",
        &0i32.to_be_bytes(),
    ]);
    let msg = LogicalDecodingMessage {
        flags: 0,
        lsn: LSN,
        prefix: "audit".into(),
        content: Bytes::new(),
    };
    (buf, LogicalMessage::Message(msg))
}

/// Every valid hand-built frame with its expected decoding.
pub(super) fn all_frames() -> Vec<(Bytes, LogicalMessage)> {
    vec![
        begin(),
        commit(),
        origin(),
        relation(),
        type_msg(),
        insert_all_kinds(),
        update_without_old(),
        update_with_key(),
        update_with_full_old(),
        delete_with_key(),
        delete_with_full_old(),
        truncate(),
        message_transactional(),
        message_non_transactional(),
    ]
}

fn assert_decodes((buf, expected): (Bytes, LogicalMessage)) {
    assert_eq!(decode(buf), Ok(expected));
}

#[test]
fn decodes_begin() {
    assert_decodes(begin())
}
#[test]
fn decodes_commit() {
    assert_decodes(commit())
}
#[test]
fn decodes_origin() {
    assert_decodes(origin())
}
#[test]
fn decodes_relation() {
    assert_decodes(relation())
}
#[test]
fn decodes_type() {
    assert_decodes(type_msg())
}
#[test]
fn decodes_insert_with_every_value_kind() {
    assert_decodes(insert_all_kinds())
}
#[test]
fn decodes_update_without_old() {
    assert_decodes(update_without_old())
}
#[test]
fn decodes_update_with_key() {
    assert_decodes(update_with_key())
}
#[test]
fn decodes_update_with_full_old() {
    assert_decodes(update_with_full_old())
}
#[test]
fn decodes_delete_with_key() {
    assert_decodes(delete_with_key())
}
#[test]
fn decodes_delete_with_full_old() {
    assert_decodes(delete_with_full_old())
}
#[test]
fn decodes_truncate_with_several_ids() {
    assert_decodes(truncate())
}
#[test]
fn decodes_transactional_message() {
    assert_decodes(message_transactional())
}
#[test]
fn decodes_non_transactional_message() {
    assert_decodes(message_non_transactional())
}

#[test]
fn encoder_matches_hand_built_frames() {
    for (buf, msg) in all_frames() {
        assert_eq!(super::encode::encode(&msg), buf, "{msg:?}");
    }
}
