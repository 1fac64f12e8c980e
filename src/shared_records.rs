//! The one codec of the records the filter keeps in proxy-wasm shared data (in-flight counts,
//! VM heartbeats, replica and tokenizer health, speculative entries): a shared value is a run of
//! fixed-width records, each a run of little-endian `u32` and `u64` fields. A trailing partial
//! record (a value written by another build) is ignored.

use llmgw_core::stable_hash::stable_hash;

/// A fixed-width record of shared data.
pub trait SharedRecord: Sized {
    /// Bytes per record.
    const SIZE: usize;
    fn read(fields: &mut Fields<'_>) -> Option<Self>;
    fn write(&self, out: &mut Fields<'_>);
}

/// Reads or writes one record's fields in order.
pub enum Fields<'a> {
    Reading(&'a [u8]),
    Writing(&'a mut Vec<u8>),
}

impl Fields<'_> {
    pub fn u32(&mut self) -> Option<u32> {
        let Fields::Reading(rest) = self else { return None };
        let (head, tail) = rest.split_first_chunk::<4>()?;
        *rest = tail;
        Some(u32::from_le_bytes(*head))
    }

    pub fn u64(&mut self) -> Option<u64> {
        let Fields::Reading(rest) = self else { return None };
        let (head, tail) = rest.split_first_chunk::<8>()?;
        *rest = tail;
        Some(u64::from_le_bytes(*head))
    }

    pub fn put_u32(&mut self, v: u32) {
        if let Fields::Writing(out) = self {
            out.extend_from_slice(&v.to_le_bytes());
        }
    }

    pub fn put_u64(&mut self, v: u64) {
        if let Fields::Writing(out) = self {
            out.extend_from_slice(&v.to_le_bytes());
        }
    }
}

/// The records of a shared value.
pub fn decode<R: SharedRecord>(v: &[u8]) -> impl Iterator<Item = R> + '_ {
    v.chunks_exact(R::SIZE).filter_map(|r| R::read(&mut Fields::Reading(r)))
}

/// A shared value holding `records`.
pub fn encode<R: SharedRecord>(records: impl IntoIterator<Item = R>) -> Vec<u8> {
    let mut out = Vec::new();
    for r in records {
        r.write(&mut Fields::Writing(&mut out));
    }
    out
}

/// The id an address is recorded under.
pub fn address_id(address: &str) -> u64 {
    stable_hash(address.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq)]
    struct Pair(u32, u64);

    impl SharedRecord for Pair {
        const SIZE: usize = 12;
        fn read(f: &mut Fields<'_>) -> Option<Self> {
            Some(Pair(f.u32()?, f.u64()?))
        }
        fn write(&self, f: &mut Fields<'_>) {
            f.put_u32(self.0);
            f.put_u64(self.1);
        }
    }

    #[test]
    fn records_round_trip_little_endian_and_a_partial_tail_is_ignored() {
        let mut v = encode([Pair(1, 2), Pair(u32::MAX, u64::MAX)]);
        assert_eq!(v.len(), 24);
        assert_eq!(&v[..12], &[1, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0]);
        v.extend_from_slice(&[9, 9, 9]);
        assert_eq!(decode::<Pair>(&v).collect::<Vec<_>>(), vec![Pair(1, 2), Pair(u32::MAX, u64::MAX)]);
    }
}
