//! The digest memo behind [`BlockHasher::with_cache`](super::BlockHasher::with_cache): recent
//! block digests in direct-mapped slots keyed by a 128-bit tag of what determines the block's
//! digest, so a prefix seen before costs one tag per block instead of a sha256. The result is the same digest: a hit needs the whole tag to
//! match. Blocks without extra keys (the common case) are tagged over the parent digest and the
//! token ids with two lanes of NH, the universal hash of UMAC (one 32×32→64-bit multiply per two
//! words: cheap in wasm, unlike 128-bit multiplies), under a secret per-VM key: two distinct
//! blocks collide with probability at most 2⁻⁶⁴ whatever their contents, as long as the key is
//! unknown. Other blocks use a keyed 128-bit xxh3 of the whole preimage.

use super::block_key::Digest;
use crate::stable_hash::{mix64, GOLDEN_GAMMA};

/// Invariant: `slots.len()` is a power of two; a slot whose tag is `[0, 0]` is empty, and no
/// real tag is `[0, 0]` (tags with both halves zero are bumped to `[0, 1]`). Without the `xxhash`
/// feature every tag is `[0, 0]`, so nothing is memoised.
pub(super) struct DigestCache {
    key: u64,
    /// NH key words, two lanes (`NH_WORDS` each).
    nh: Vec<u32>,
    /// (tag, digest bytes, digest length); a zero tag marks an empty slot.
    slots: Vec<([u64; 2], [u8; 32], u8)>,
}

/// Words (parent digest + tokens, as u32) an NH tag covers: blocks of up to 56 tokens.
const NH_WORDS: usize = 64;

/// Key words for NH from a seed (SplitMix64 stream).
fn nh_key(seed: u64) -> Vec<u32> {
    let mut state = seed;
    (0..NH_WORDS.saturating_mul(2))
        .map(|_| {
            state = state.wrapping_add(GOLDEN_GAMMA);
            // The truncating cast takes the low 32 bits of a mixed word.
            mix64(state) as u32
        })
        .collect()
}

/// NH over `words` with key words `k` (as many or more): the sum of
/// ((m₂ᵢ + k₂ᵢ) mod 2³²) × ((m₂ᵢ₊₁ + k₂ᵢ₊₁) mod 2³²) mod 2⁶⁴.
fn nh(words: &[u32], k: &[u32]) -> u64 {
    words.chunks(2).zip(k.chunks_exact(2)).fold(0u64, |acc, (m, k)| {
        let m0 = m.first().copied().unwrap_or(0);
        let m1 = m.get(1).copied().unwrap_or(0);
        let k0 = k.first().copied().unwrap_or(0);
        let k1 = k.get(1).copied().unwrap_or(0);
        acc.wrapping_add(u64::from(m0.wrapping_add(k0)).wrapping_mul(u64::from(m1.wrapping_add(k1))))
    })
}

impl DigestCache {
    /// Up to `slots` entries (rounded up to a power of two, at most 2²⁰), tags keyed by `key`.
    pub(super) fn new(slots: usize, key: u64) -> Self {
        DigestCache {
            key,
            nh: nh_key(key ^ 0x6e68_6b65_7921_2121),
            slots: vec![([0, 0], [0; 32], 0); slots.checked_next_power_of_two().unwrap_or(1 << 20).min(1 << 20)],
        }
    }

    #[cfg(feature = "xxhash")]
    pub(super) fn tag(&self, data: &[u8]) -> [u64; 2] {
        let t = xxhash_rust::xxh3::xxh3_128_with_seed(data, self.key);
        // Truncating casts: the two halves of the tag.
        let hi = (t >> 64) as u64;
        let lo = t as u64;
        [hi, if hi == 0 && lo == 0 { 1 } else { lo }]
    }

    #[cfg(not(feature = "xxhash"))]
    pub(super) fn tag(&self, _data: &[u8]) -> [u64; 2] {
        [0, 0]
    }

    /// The tag of a block without extra keys: the parent digest and the raw token ids (which
    /// determine its preimage). NH when the block fits its key, else a keyed xxh3 apart from
    /// preimage tags.
    pub(super) fn plain_tag(&self, parent: &Digest, tokens: &[u32], scratch: &mut Vec<u8>) -> [u64; 2] {
        let pw = parent.as_bytes().len() / 4;
        let n = pw.saturating_add(tokens.len());
        if let (Some(k0), Some(k1)) = (self.nh.get(..n), self.nh.get(NH_WORDS..NH_WORDS.saturating_add(n))) {
            let mut words = [0u32; NH_WORDS];
            for (w, c) in words.iter_mut().zip(parent.as_bytes().chunks_exact(4)) {
                *w = u32::from_le_bytes([
                    c.first().copied().unwrap_or(0),
                    c.get(1).copied().unwrap_or(0),
                    c.get(2).copied().unwrap_or(0),
                    c.get(3).copied().unwrap_or(0),
                ]);
            }
            for (w, t) in words.iter_mut().skip(pw).zip(tokens) {
                *w = *t;
            }
            let words = words.get(..n).unwrap_or_default();
            // The length enters the tag (NH's bound is for messages of equal length); the mixers
            // are bijections, so they keep NH's collision bound and spread its bits for `slot`.
            let len = (n as u64).wrapping_mul(GOLDEN_GAMMA);
            let hi = mix64(nh(words, k0) ^ len);
            let lo = mix64(nh(words, k1).wrapping_add(len));
            return [hi, if hi == 0 && lo == 0 { 1 } else { lo }];
        }
        self.plain_tag_xxh3(parent, tokens, scratch)
    }

    #[cfg(feature = "xxhash")]
    fn plain_tag_xxh3(&self, parent: &Digest, tokens: &[u32], scratch: &mut Vec<u8>) -> [u64; 2] {
        scratch.clear();
        scratch.extend_from_slice(parent.as_bytes());
        for t in tokens {
            scratch.extend_from_slice(&t.to_le_bytes());
        }
        let t = xxhash_rust::xxh3::xxh3_128_with_seed(scratch, self.key ^ 0x706c_6169_6e21_2121);
        let hi = (t >> 64) as u64;
        let lo = t as u64;
        [hi, if hi == 0 && lo == 0 { 1 } else { lo }]
    }

    #[cfg(not(feature = "xxhash"))]
    fn plain_tag_xxh3(&self, _parent: &Digest, _tokens: &[u32], _scratch: &mut Vec<u8>) -> [u64; 2] {
        [0, 0]
    }

    fn slot(&self, tag: &[u64; 2]) -> usize {
        // `slots.len()` is a power of two; the truncating cast keeps the low bits.
        (tag[1] as usize) & self.slots.len().wrapping_sub(1)
    }

    pub(super) fn get(&self, tag: &[u64; 2]) -> Option<Digest> {
        let (t, bytes, len) = self.slots.get(self.slot(tag))?;
        if t != tag || *tag == [0, 0] {
            return None;
        }
        Digest::from_slice(bytes.get(..usize::from(*len))?)
    }

    pub(super) fn put(&mut self, tag: [u64; 2], d: &Digest) {
        if tag == [0, 0] {
            return;
        }
        let i = self.slot(&tag);
        if let Some(s) = self.slots.get_mut(i) {
            *s = (tag, d.bytes, d.len);
        }
    }
}

#[cfg(test)]
#[allow(clippy::arithmetic_side_effects)]
mod tests {
    use super::super::*;

    #[test]
    fn the_digest_memo_changes_no_digest() {
        for algo in [HashAlgo::Sha256Cbor, HashAlgo::Sha256] {
            let Ok(mut plain) = BlockHasher::new(algo, Some("0")) else { panic!("hasher") };
            // 4 slots: most blocks evict each other, some hit.
            let Ok(memo) = BlockHasher::new(algo, Some("0")) else { panic!("hasher") };
            let mut memo = memo.with_cache(4, 0x1234);
            let base: Vec<u32> = (0..64).map(|i| i * 7919 % 150_000).collect();
            for round in 0..3u32 {
                for (salt, lora) in [(None, None), (Some("s"), None), (None, Some(("a", "/p")))] {
                    let mut toks = base.clone();
                    toks[40] = round;
                    let ex = RequestExtras {
                        lookahead: 0,
                        cache_salt: salt.map(str::to_owned),
                        lora: lora.map(|(a, b): (&str, &str)| (a.to_owned(), b.to_owned())),
                        mm: Vec::new(),
                    };
                    assert_eq!(memo.hash_request(&toks, 8, &ex), plain.hash_request(&toks, 8, &ex));
                }
            }
            let Ok(big) = BlockHasher::new(algo, Some("0")) else { panic!("hasher") };
            let mut big = big.with_cache(1024, 7);
            let ex = RequestExtras::default();
            let first = big.hash_request(&base, 16, &ex);
            assert_eq!(big.hash_request(&base, 16, &ex), first);
            assert_eq!(first, plain.hash_request(&base, 16, &ex));
        }
    }

    #[test]
    fn memo_tags_separate_near_identical_blocks() {
        let Ok(h) = BlockHasher::new(HashAlgo::Sha256Cbor, Some("0")) else { panic!("hasher") };
        let h = h.with_cache(16, 0x5eed);
        let Some(c) = h.cache.as_ref() else { panic!("memo") };
        let parent = Digest::from_sha256([3; 32]);
        let other = Digest::from_sha256({
            let mut b = [3; 32];
            b[31] = 4;
            b
        });
        let base: Vec<u32> = (0..16).map(|i| i * 7919).collect();
        let mut scratch = Vec::new();
        let mut seen = std::collections::HashSet::new();
        assert!(seen.insert(c.plain_tag(&parent, &base, &mut scratch)));
        assert!(seen.insert(c.plain_tag(&other, &base, &mut scratch)));
        // Shorter block, and the same with a trailing zero token.
        assert!(seen.insert(c.plain_tag(&parent, &base[..15], &mut scratch)));
        let mut z = base[..15].to_vec();
        z.push(0);
        assert!(seen.insert(c.plain_tag(&parent, &z, &mut scratch)));
        // Every single-token change and every adjacent swap.
        for i in 0..16 {
            for d in [1u32, 2, 1 << 16, u32::MAX] {
                let mut t = base.clone();
                t[i] = t[i].wrapping_add(d);
                assert!(seen.insert(c.plain_tag(&parent, &t, &mut scratch)), "token {i} + {d}");
            }
            if i < 15 {
                let mut t = base.clone();
                t.swap(i, i + 1);
                assert!(seen.insert(c.plain_tag(&parent, &t, &mut scratch)), "swap {i}");
            }
        }
        // Blocks too long for the NH key take the xxh3 path, and still differ.
        let long: Vec<u32> = (0..100).collect();
        let mut long2 = long.clone();
        long2[99] = 7;
        assert!(seen.insert(c.plain_tag(&parent, &long, &mut scratch)));
        assert!(seen.insert(c.plain_tag(&parent, &long2, &mut scratch)));
        // Another key, other tags.
        let Ok(h2) = BlockHasher::new(HashAlgo::Sha256Cbor, Some("0")) else { panic!("hasher") };
        let h2 = h2.with_cache(16, 0x5eee);
        let Some(c2) = h2.cache.as_ref() else { panic!("memo") };
        assert_ne!(c2.plain_tag(&parent, &base, &mut scratch), c.plain_tag(&parent, &base, &mut scratch));
    }
}
