//! Property tests: no input panics, and encode/decode round-trips.

use bytes::Bytes;
use proptest::collection::vec;
use proptest::prelude::*;

use super::encode::encode;
use super::*;

const TAGS: &[u8] = b"BCORYIUDTM";

fn name() -> impl Strategy<Value = String> {
    "\\PC{0,12}"
}

fn blob() -> impl Strategy<Value = Bytes> {
    vec(any::<u8>(), 0..24).prop_map(Bytes::from)
}

fn column_value() -> impl Strategy<Value = ColumnValue> {
    prop_oneof![
        Just(ColumnValue::Null),
        Just(ColumnValue::UnchangedToast),
        blob().prop_map(ColumnValue::Text),
        blob().prop_map(ColumnValue::Binary),
    ]
}

fn tuple() -> impl Strategy<Value = TupleData> {
    vec(column_value(), 0..12).prop_map(TupleData::from)
}

fn old_tuple() -> impl Strategy<Value = OldTuple> {
    prop_oneof![
        tuple().prop_map(OldTuple::Key),
        tuple().prop_map(OldTuple::Full)
    ]
}

fn relation() -> impl Strategy<Value = Relation> {
    let column = (any::<u8>(), name(), any::<u32>(), any::<i32>()).prop_map(
        |(flags, name, type_oid, type_modifier)| Column {
            flags,
            name,
            type_oid,
            type_modifier,
        },
    );
    (any::<u32>(), name(), name(), any::<u8>(), vec(column, 0..8)).prop_map(
        |(id, namespace, name, replica_identity, columns)| Relation {
            id,
            namespace,
            name,
            replica_identity,
            columns,
        },
    )
}

fn insert() -> impl Strategy<Value = Insert> {
    (any::<u32>(), tuple()).prop_map(|(relation_id, tuple)| Insert { relation_id, tuple })
}

/// Every message kind, for the general round-trip property.
fn message() -> impl Strategy<Value = LogicalMessage> {
    prop_oneof![
        relation().prop_map(LogicalMessage::Relation),
        insert().prop_map(LogicalMessage::Insert),
        (any::<u32>(), proptest::option::of(old_tuple()), tuple()).prop_map(
            |(relation_id, old, new)| LogicalMessage::Update(Update {
                relation_id,
                old,
                new
            })
        ),
        (any::<u32>(), old_tuple())
            .prop_map(|(relation_id, old)| LogicalMessage::Delete(Delete { relation_id, old })),
        (any::<u8>(), vec(any::<u32>(), 0..8)).prop_map(|(options, relation_ids)| {
            LogicalMessage::Truncate(Truncate {
                options,
                relation_ids,
            })
        }),
        (any::<u8>(), any::<u64>(), name(), blob()).prop_map(|(flags, lsn, prefix, content)| {
            LogicalMessage::Message(LogicalDecodingMessage {
                flags,
                lsn,
                prefix,
                content,
            })
        }),
        (any::<u64>(), name())
            .prop_map(|(commit_lsn, name)| { LogicalMessage::Origin(Origin { commit_lsn, name }) }),
        (any::<u32>(), name(), name()).prop_map(|(id, namespace, name)| {
            LogicalMessage::Type(TypeMessage {
                id,
                namespace,
                name,
            })
        }),
    ]
}

proptest! {
    #[test]
    fn arbitrary_bytes_never_panic(data in vec(any::<u8>(), 0..256)) {
        let _ = decode(Bytes::from(data));
    }

    #[test]
    fn tagged_arbitrary_bytes_never_panic(
        tag in proptest::sample::select(TAGS),
        data in vec(any::<u8>(), 0..256),
    ) {
        let mut buf = vec![tag];
        buf.extend_from_slice(&data);
        let _ = decode(Bytes::from(buf));
    }

    #[test]
    fn mutated_valid_frames_never_panic(
        pick in any::<proptest::sample::Index>(),
        at in any::<proptest::sample::Index>(),
        byte in any::<u8>(),
    ) {
        let frames = super::frames::all_frames();
        let mut buf = frames[pick.index(frames.len())].0.to_vec();
        let i = at.index(buf.len());
        buf[i] = byte;
        let _ = decode(Bytes::from(buf));
    }

    #[test]
    fn relation_round_trips(rel in relation()) {
        let msg = LogicalMessage::Relation(rel);
        prop_assert_eq!(decode(encode(&msg)), Ok(msg));
    }

    #[test]
    fn insert_round_trips(ins in insert()) {
        let msg = LogicalMessage::Insert(ins);
        prop_assert_eq!(decode(encode(&msg)), Ok(msg));
    }

    #[test]
    fn any_message_round_trips(msg in message()) {
        prop_assert_eq!(decode(encode(&msg)), Ok(msg));
    }
}
