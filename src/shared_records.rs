//! The one codec of the records the filter keeps in proxy-wasm shared data (in-flight counts,
//! VM heartbeats, replica and tokenizer health, speculative entries): a shared value is a run of
//! fixed-width records, each a run of little-endian `u32` and `u64` fields. A trailing partial
//! record (a value written by another build) is ignored. The variable-length values (the tokens
//! kept for next turns, the text prompts handed on) are read with the same [`FieldReader`].

use llmgw_core::stable_hash::stable_hash;
use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};

/// A fixed-width record of shared data.
pub trait SharedRecord: Sized {
    /// Bytes per record.
    const SIZE: usize;
    /// The record from its bytes (`None`: too short).
    fn read(fields: &mut FieldReader<'_>) -> Option<Self>;
    /// Appends the record's fields to `out`, little-endian, in the order `read` takes them.
    fn write(&self, out: &mut Vec<u8>);
}

/// Reads one record's fields in order.
pub struct FieldReader<'a>(&'a [u8]);

impl<'a> FieldReader<'a> {
    pub fn new(bytes: &'a [u8]) -> Self {
        FieldReader(bytes)
    }

    /// What is left unread.
    pub fn rest(&self) -> &'a [u8] {
        self.0
    }

    pub fn u32(&mut self) -> Option<u32> {
        let (head, tail) = self.0.split_first_chunk::<4>()?;
        self.0 = tail;
        Some(u32::from_le_bytes(*head))
    }

    pub fn u64(&mut self) -> Option<u64> {
        let (head, tail) = self.0.split_first_chunk::<8>()?;
        self.0 = tail;
        Some(u64::from_le_bytes(*head))
    }

    pub fn u128(&mut self) -> Option<u128> {
        let (head, tail) = self.0.split_first_chunk::<16>()?;
        self.0 = tail;
        Some(u128::from_le_bytes(*head))
    }

    /// The rest as `u32` fields (a trailing partial field is ignored).
    pub fn rest_u32s(&self) -> Vec<u32> {
        self.0.chunks_exact(4).filter_map(|c| c.try_into().ok()).map(u32::from_le_bytes).collect()
    }
}

/// The records of a shared value.
pub fn decode<R: SharedRecord>(v: &[u8]) -> impl Iterator<Item = R> + '_ {
    v.chunks_exact(R::SIZE).filter_map(|r| R::read(&mut FieldReader(r)))
}

/// Keeps at most `max` of `records`: those with the lowest `key` (the updated longest ago, the
/// soonest to lapse) go first.
pub fn keep_highest<R, K: Ord>(records: &mut Vec<R>, max: usize, key: impl FnMut(&R) -> K) {
    if records.len() > max {
        records.sort_by_key(key);
        let extra = records.len().saturating_sub(max);
        records.drain(..extra);
    }
}

/// A shared value holding `records`.
pub fn encode<R: SharedRecord>(records: impl IntoIterator<Item = R>) -> Vec<u8> {
    let mut out = Vec::new();
    for r in records {
        r.write(&mut out);
    }
    out
}

/// Hashes the ids records are keyed by for a per-decision index. The ids are already stable
/// hashes of configured addresses (well mixed, not chosen by clients), so one multiply and fold
/// spreads them: a decision indexes thousands of records, and SipHash's cost there was most of
/// the difference between a decision with the records filled and one with them empty.
#[derive(Default)]
pub struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0 ^ (self.0 >> 29)
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0 ^ n).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }

    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n));
    }
}

/// Records indexed by id, as a decision reads them.
pub type IdMap<V> = HashMap<u64, V, BuildHasherDefault<IdHasher>>;
/// A set of ids, as a decision reads it.
pub type IdSet = HashSet<u64, BuildHasherDefault<IdHasher>>;

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
        fn read(f: &mut FieldReader<'_>) -> Option<Self> {
            Some(Pair(f.u32()?, f.u64()?))
        }
        fn write(&self, out: &mut Vec<u8>) {
            out.extend_from_slice(&self.0.to_le_bytes());
            out.extend_from_slice(&self.1.to_le_bytes());
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
