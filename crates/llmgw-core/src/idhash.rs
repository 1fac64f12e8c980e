//! Hashing for maps keyed by block keys (or other keys that are already uniform hashes, such as
//! 128-bit tags), so one multiply (Fibonacci hashing) spreads them; no SipHash, and no random
//! state: iteration order is a function of the inputs only.

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};

#[derive(Default, Clone, Copy)]
pub struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // Only reached for non-u64 keys; fold the bytes in.
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_u64(&mut self, k: u64) {
        self.0 = k.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
    fn write_u128(&mut self, k: u128) {
        // 128-bit tags are uniform too: their low half is enough (the cast truncates).
        self.write_u64(k as u64);
    }
}

pub type BuildKeyHasher = BuildHasherDefault<KeyHasher>;
pub type KeyMap<V> = HashMap<u64, V, BuildKeyHasher>;
pub type KeySet = HashSet<u64, BuildKeyHasher>;
