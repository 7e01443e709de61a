//! Bounds-checked big-endian reader over a [`Bytes`] buffer.
//!
//! Every read checks `remaining()` first and reports a [`DecodeError`]
//! instead of panicking, so hostile or truncated frames can never crash the
//! relay.

use bytes::Bytes;

use super::DecodeError;

/// Reader that hands out zero-copy slices of the frame it was built from.
pub(crate) struct Cursor {
    buf: Bytes,
}

impl Cursor {
    pub(crate) fn new(buf: Bytes) -> Self {
        Self { buf }
    }

    pub(crate) fn remaining(&self) -> usize {
        self.buf.len()
    }

    /// Takes the next `n` bytes as a slice sharing the input allocation.
    pub(crate) fn bytes(&mut self, n: usize, what: &'static str) -> Result<Bytes, DecodeError> {
        match n.checked_sub(self.remaining()) {
            Some(needed) if needed > 0 => Err(DecodeError::Truncated { what, needed }),
            _ => Ok(self.buf.split_to(n)),
        }
    }

    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], DecodeError> {
        let chunk = self.bytes(N, what)?;
        <[u8; N]>::try_from(chunk.as_ref()).map_err(|_| DecodeError::Truncated { what, needed: N })
    }

    pub(crate) fn u8(&mut self, what: &'static str) -> Result<u8, DecodeError> {
        Ok(u8::from_be_bytes(self.array(what)?))
    }

    pub(crate) fn u16(&mut self, what: &'static str) -> Result<u16, DecodeError> {
        Ok(u16::from_be_bytes(self.array(what)?))
    }

    pub(crate) fn u32(&mut self, what: &'static str) -> Result<u32, DecodeError> {
        Ok(u32::from_be_bytes(self.array(what)?))
    }

    pub(crate) fn i32(&mut self, what: &'static str) -> Result<i32, DecodeError> {
        Ok(i32::from_be_bytes(self.array(what)?))
    }

    pub(crate) fn u64(&mut self, what: &'static str) -> Result<u64, DecodeError> {
        Ok(u64::from_be_bytes(self.array(what)?))
    }

    pub(crate) fn i64(&mut self, what: &'static str) -> Result<i64, DecodeError> {
        Ok(i64::from_be_bytes(self.array(what)?))
    }

    /// Reads an `Int32` length or count, rejecting negative values.
    pub(crate) fn len_i32(&mut self, what: &'static str) -> Result<usize, DecodeError> {
        let n = self.i32(what)?;
        usize::try_from(n).map_err(|_| DecodeError::Invalid(format!("negative {what}: {n}")))
    }

    /// Reads a NUL-terminated UTF-8 string.
    pub(crate) fn cstr(&mut self, what: &'static str) -> Result<String, DecodeError> {
        let Some(nul) = self.buf.iter().position(|&b| b == 0) else {
            return Err(DecodeError::Invalid(format!(
                "missing NUL terminator in {what}"
            )));
        };
        let raw = self.bytes(nul, what)?;
        self.u8(what)?; // the NUL terminator found above
        std::str::from_utf8(&raw)
            .map(str::to_owned)
            .map_err(|e| DecodeError::Invalid(format!("{what} is not valid UTF-8: {e}")))
    }

    /// Fails if anything is left, since a frame holds exactly one message.
    pub(crate) fn finish(self) -> Result<(), DecodeError> {
        match self.remaining() {
            0 => Ok(()),
            n => Err(DecodeError::Invalid(format!(
                "{n} trailing bytes after message"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_big_endian_integers_in_order() {
        let mut cur = Cursor::new(Bytes::from_static(&[
            1, 0, 2, 0, 0, 0, 3, 0xff, 0xff, 0xff, 0xfe, 0, 0, 0, 0, 0, 0, 0, 4,
        ]));
        assert_eq!(cur.u8("a"), Ok(1));
        assert_eq!(cur.u16("b"), Ok(2));
        assert_eq!(cur.u32("c"), Ok(3));
        assert_eq!(cur.i32("d"), Ok(-2));
        assert_eq!(cur.u64("e"), Ok(4));
        assert!(cur.finish().is_ok());
    }

    #[test]
    fn short_read_reports_missing_byte_count() {
        let mut cur = Cursor::new(Bytes::from_static(&[0, 0, 0]));
        assert_eq!(
            cur.i64("x"),
            Err(DecodeError::Truncated {
                what: "x",
                needed: 5
            })
        );
    }

    #[test]
    fn negative_length_is_invalid() {
        let mut cur = Cursor::new(Bytes::from_static(&[0xff, 0xff, 0xff, 0xff]));
        assert!(matches!(cur.len_i32("len"), Err(DecodeError::Invalid(_))));
    }

    #[test]
    fn cstr_consumes_terminator_and_checks_utf8() {
        let mut cur = Cursor::new(Bytes::from_static(b"ab\0\xff\0"));
        assert_eq!(cur.cstr("s").as_deref(), Ok("ab"));
        assert!(matches!(cur.cstr("s"), Err(DecodeError::Invalid(_))));
        let mut cur = Cursor::new(Bytes::from_static(b"abc"));
        assert!(matches!(cur.cstr("s"), Err(DecodeError::Invalid(_))));
    }

    #[test]
    fn finish_rejects_leftovers() {
        let cur = Cursor::new(Bytes::from_static(b"x"));
        assert!(matches!(cur.finish(), Err(DecodeError::Invalid(_))));
    }
}
