//! Log sequence numbers: a position in PostgreSQL's write-ahead log.

use std::fmt;
use std::str::FromStr;

/// A WAL position. Ordered: a larger value is later in the log.
///
/// PostgreSQL prints these as two hexadecimal halves, `16/B374D848`; that is
/// the form this type parses and displays.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Lsn(pub u64);

impl Lsn {
    /// The invalid position `0/0`; PostgreSQL ignores it in status updates.
    pub const ZERO: Lsn = Lsn(0);
}

impl fmt::Display for Lsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:X}/{:X}", self.0 >> 32, self.0 & 0xFFFF_FFFF)
    }
}

/// The text was not of the form `HEX/HEX`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not an LSN (expected the form 16/B374D848): {0:?}")]
pub struct ParseLsnError(pub String);

impl FromStr for Lsn {
    type Err = ParseLsnError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || ParseLsnError(s.to_owned());
        let (hi, lo) = s.split_once('/').ok_or_else(err)?;
        let hi = u32::from_str_radix(hi, 16).map_err(|_| err())?;
        let lo = u32::from_str_radix(lo, 16).map_err(|_| err())?;
        Ok(Lsn((u64::from(hi) << 32) | u64::from(lo)))
    }
}

impl From<pgwire_replication::Lsn> for Lsn {
    fn from(l: pgwire_replication::Lsn) -> Self {
        Lsn(l.as_u64())
    }
}

impl From<Lsn> for pgwire_replication::Lsn {
    fn from(l: Lsn) -> Self {
        pgwire_replication::Lsn::from_u64(l.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_through_text() {
        for s in ["0/0", "16/B374D848", "FFFFFFFF/FFFFFFFF", "0/1"] {
            let lsn: Lsn = s.parse().unwrap();
            assert_eq!(lsn.to_string(), s);
        }
        assert_eq!("16/B374D848".parse::<Lsn>().unwrap(), Lsn(0x16_B374_D848));
    }

    #[test]
    fn orders_by_position() {
        let a: Lsn = "0/FFFFFFFF".parse().unwrap();
        let b: Lsn = "1/0".parse().unwrap();
        assert!(a < b);
    }

    #[test]
    fn rejects_garbage() {
        for s in ["", "16", "16/", "/1", "G/1", "1/2/3", "100000000/0"] {
            assert!(s.parse::<Lsn>().is_err(), "{s}");
        }
    }
}
