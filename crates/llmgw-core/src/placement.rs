//! Keyed placement of keys that are already hashes (block keys, 128-bit tags) in the index
//! and in maps: [`mix64`] of the key XOR a per-process secret ([`placement_secret`]); no
//! SipHash. Whoever publishes block keys chooses them, so their placement must not be
//! predictable: an unkeyed multiply lets a publisher send keys that all land in one bucket.

use crate::hash::BlockKey;
use crate::stable_hash::{mix64, GOLDEN_GAMMA};
use std::collections::HashMap;
use std::hash::{BuildHasher, BuildHasherDefault, Hasher};
use std::sync::OnceLock;

/// A secret drawn once per process (per wasm VM) from the host's random source (std's
/// `RandomState`, which reads the OS or WASI random source): the placement of block keys in the
/// index and the maps depends on it, so nobody outside can choose keys that collide.
pub fn placement_secret() -> u64 {
    static SECRET: OnceLock<u64> = OnceLock::new();
    *SECRET.get_or_init(|| std::collections::hash_map::RandomState::new().hash_one(0x706c_6163_655f_6b65_u64))
}

/// Where a block key (or tag) is placed: a keyed bijection of it.
#[inline]
pub fn place(k: u64) -> u64 {
    mix64(k ^ placement_secret())
}

#[derive(Default, Clone, Copy)]
pub struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // Only reached for non-u64 keys; fold the bytes in.
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(GOLDEN_GAMMA);
        }
    }
    fn write_u64(&mut self, k: u64) {
        self.0 = place(k);
    }
    fn write_u128(&mut self, k: u128) {
        // 128-bit tags are uniform too: their low half is enough (the cast truncates).
        self.write_u64(k as u64);
    }
}

pub type BuildKeyHasher = BuildHasherDefault<KeyHasher>;
/// Maps keyed by block keys, with the cheap key hasher.
pub type KeyMap<V> = HashMap<BlockKey, V, BuildKeyHasher>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_chosen_to_share_a_bucket_under_a_multiply_spread_when_placed() {
        // Keys whose product with the golden gamma agrees in its low 20 bits: under the old
        // placement (one multiply, buckets by low bits) all 4,096 share one bucket of 2^20.
        let inv = {
            // The inverse of GOLDEN_GAMMA modulo 2^64 (Newton's iteration).
            let mut x = GOLDEN_GAMMA;
            for _ in 0..6 {
                x = x.wrapping_mul(2u64.wrapping_sub(GOLDEN_GAMMA.wrapping_mul(x)));
            }
            x
        };
        assert_eq!(GOLDEN_GAMMA.wrapping_mul(inv), 1);
        let keys: Vec<u64> = (1..=4096u64).map(|i| (i << 20).wrapping_mul(inv)).collect();
        let mask = (1u64 << 20) - 1;
        let old: std::collections::HashSet<u64> = keys.iter().map(|k| k.wrapping_mul(GOLDEN_GAMMA) & mask).collect();
        assert_eq!(old.len(), 1);
        let mut counts = HashMap::new();
        for &k in &keys {
            let mut h = KeyHasher::default();
            h.write_u64(k);
            *counts.entry(h.finish() & 0xfff).or_insert(0u32) += 1;
        }
        // 4,096 keys over 4,096 buckets: the fullest holds a handful, as random keys would.
        assert!(counts.values().copied().max().unwrap() <= 10, "{:?}", counts.values().max());
    }
}
