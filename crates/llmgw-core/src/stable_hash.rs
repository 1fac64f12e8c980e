//! Stable hashing: no random state and no platform dependence, so a value hashes the same in
//! every process, build and gateway (natively and in wasm). Routing keys (the approximate
//! fallback's rendezvous order, engine keys) are made with it.
//!
//! * [`mix64`]: SplitMix64's finaliser, a bijection on u64 that spreads every input bit.
//! * [`stable_hash`]: 64-bit FNV-1a of bytes, finished by [`mix64`].

/// The odd constant ⌊2⁶⁴/φ⌋ behind Fibonacci hashing and SplitMix64's increment.
pub const GOLDEN_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64's finaliser: a bijection on u64 that spreads every input bit.
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// 64-bit FNV-1a followed by a SplitMix64 finaliser: stable across platforms, builds and
/// processes (no random state), which is what cross-gateway consistency needs.
pub fn stable_hash(data: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in data {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    mix64(h)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stable_values_do_not_drift() {
        // Pinned: routing keys must not change between builds or gateways.
        assert_eq!(mix64(0), 0);
        assert_eq!(mix64(1), 0x5692_161d_100b_05e5);
        assert_eq!(stable_hash(b"abc"), 0x0dd4_9049_0804_b508);
        assert_ne!(stable_hash(b"abc"), stable_hash(b"abd"));
    }
}
