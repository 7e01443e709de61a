//! Malformed, truncated and padded frames must yield errors, never panics.

use bytes::Bytes;

use super::frames::{LSN, REL, all_frames, frame, insert_all_kinds, relation, text};
use super::*;

#[test]
fn every_strict_prefix_is_an_error() {
    for (buf, _) in all_frames() {
        for len in 0..buf.len() {
            assert!(decode(buf.slice(..len)).is_err(), "prefix {len} of {buf:?}");
        }
    }
}

#[test]
fn trailing_garbage_is_invalid() {
    for (buf, _) in all_frames() {
        let padded = frame(&[&buf, b"x"]);
        assert!(
            matches!(decode(padded), Err(DecodeError::Invalid(_))),
            "{buf:?}"
        );
    }
}

#[test]
fn column_values_are_zero_copy_slices() {
    let (buf, _) = insert_all_kinds();
    let range = buf.as_ptr_range();
    let Ok(LogicalMessage::Insert(insert)) = decode(buf.clone()) else {
        panic!("decode failed")
    };
    for value in insert.tuple.0.iter().filter_map(ColumnValue::as_bytes) {
        assert!(range.contains(&value.as_ptr()), "value was copied");
    }
}

#[test]
fn empty_buffer_is_truncated() {
    assert_eq!(
        decode(Bytes::new()),
        Err(DecodeError::Truncated {
            what: "message tag",
            needed: 1
        })
    );
}

#[test]
fn unknown_and_streaming_tags_are_rejected() {
    for tag in [b'Z', b'S', b'E', b'c', b'A', 0] {
        assert_eq!(
            decode(frame(&[&[tag], &[0; 16]])),
            Err(DecodeError::UnknownTag(tag))
        );
    }
}

#[test]
fn negative_column_length_is_invalid() {
    let buf = frame(&[
        b"I",
        &REL.to_be_bytes(),
        b"N",
        &1u16.to_be_bytes(),
        b"t",
        &(-1i32).to_be_bytes(),
    ]);
    assert!(matches!(decode(buf), Err(DecodeError::Invalid(_))));
}

#[test]
fn negative_message_length_and_truncate_count_are_invalid() {
    let msg = frame(&[
        b"M",
        &[0],
        &LSN.to_be_bytes(),
        b"p\0",
        &(-5i32).to_be_bytes(),
    ]);
    assert!(matches!(decode(msg), Err(DecodeError::Invalid(_))));
    let trunc = frame(&[b"T", &(-1i32).to_be_bytes(), &[0]]);
    assert!(matches!(decode(trunc), Err(DecodeError::Invalid(_))));
}

#[test]
fn bad_column_kind_byte_is_invalid() {
    let buf = frame(&[b"I", &REL.to_be_bytes(), b"N", &1u16.to_be_bytes(), b"x"]);
    assert!(matches!(decode(buf), Err(DecodeError::Invalid(_))));
}

#[test]
fn bad_tuple_type_byte_is_invalid() {
    let empty = 0u16.to_be_bytes();
    for buf in [
        frame(&[b"I", &REL.to_be_bytes(), b"K", &empty]),
        frame(&[b"U", &REL.to_be_bytes(), b"X", &empty]),
        frame(&[b"U", &REL.to_be_bytes(), b"K", &empty, b"K", &empty]),
        frame(&[b"D", &REL.to_be_bytes(), b"N", &empty]),
    ] {
        assert!(
            matches!(decode(buf.clone()), Err(DecodeError::Invalid(_))),
            "{buf:?}"
        );
    }
}

#[test]
fn counts_larger_than_data_are_truncated() {
    let tuple = frame(&[b"I", &REL.to_be_bytes(), b"N", &3u16.to_be_bytes(), b"n"]);
    assert!(matches!(decode(tuple), Err(DecodeError::Truncated { .. })));
    let huge = frame(&[b"I", &REL.to_be_bytes(), b"N", &u16::MAX.to_be_bytes()]);
    assert!(matches!(decode(huge), Err(DecodeError::Truncated { .. })));
    let rel = frame(&[
        b"R",
        &REL.to_be_bytes(),
        b"s\0",
        b"t\0",
        b"d",
        &9u16.to_be_bytes(),
    ]);
    assert!(matches!(decode(rel), Err(DecodeError::Truncated { .. })));
    let trunc = frame(&[b"T", &i32::MAX.to_be_bytes(), &[0], &REL.to_be_bytes()]);
    assert!(matches!(decode(trunc), Err(DecodeError::Truncated { .. })));
}

#[test]
fn value_length_past_end_reports_shortfall() {
    let buf = frame(&[
        b"I",
        &REL.to_be_bytes(),
        b"N",
        &1u16.to_be_bytes(),
        b"b",
        &10i32.to_be_bytes(),
        b"abc",
    ]);
    assert_eq!(
        decode(buf),
        Err(DecodeError::Truncated {
            what: "binary column value",
            needed: 7
        })
    );
}

#[test]
fn missing_nul_terminator_is_invalid() {
    let buf = frame(&[b"O", &LSN.to_be_bytes(), b"node_a"]);
    assert!(matches!(decode(buf), Err(DecodeError::Invalid(_))));
}

#[test]
fn non_utf8_name_is_invalid() {
    let buf = frame(&[b"Y", &1u32.to_be_bytes(), b"public\0", b"\xff\xfe\0"]);
    assert!(matches!(decode(buf), Err(DecodeError::Invalid(_))));
}

#[test]
fn accessors_find_payloads_and_columns() {
    let Ok(LogicalMessage::Relation(rel)) = decode(relation().0) else {
        panic!("decode failed")
    };
    assert_eq!(rel.column_index("payload"), Some(1));
    assert_eq!(rel.column_index("missing"), None);
    assert_eq!(text("a").as_bytes(), Some(&Bytes::from_static(b"a")));
    assert_eq!(ColumnValue::Null.as_bytes(), None);
    assert_eq!(ColumnValue::UnchangedToast.as_bytes(), None);
}

#[test]
fn errors_render_readably() {
    assert_eq!(
        DecodeError::UnknownTag(b'Z').to_string(),
        "unknown pgoutput message tag 0x5a"
    );
    let err = DecodeError::Truncated {
        what: "xid",
        needed: 2,
    };
    assert_eq!(
        err.to_string(),
        "pgoutput message truncated: needed 2 more bytes reading xid"
    );
}
