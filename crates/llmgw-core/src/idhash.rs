//! Hashing for maps keyed by block keys. The keys are already cryptographic hashes, so one
//! multiply (Fibonacci hashing) spreads them; no SipHash, and no random state: iteration order
//! is a function of the inputs only.

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
}

pub type BuildKeyHasher = BuildHasherDefault<KeyHasher>;
pub type KeyMap<V> = HashMap<u64, V, BuildKeyHasher>;
pub type KeySet = HashSet<u64, BuildKeyHasher>;
