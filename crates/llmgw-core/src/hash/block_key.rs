//! Block identities: a block's digest and the u64 key KV events publish for it.

use std::fmt;

/// A block digest: 32 bytes for sha256, 16 for xxh3-128.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Digest {
    pub(super) bytes: [u8; 32],
    pub(super) len: u8,
}

impl Digest {
    pub fn from_sha256(bytes: [u8; 32]) -> Self {
        Self { bytes, len: 32 }
    }

    pub fn from_xxh128(bytes: [u8; 16]) -> Self {
        let mut b = [0u8; 32];
        if let Some(dst) = b.get_mut(..16) {
            dst.copy_from_slice(&bytes);
        }
        Self { bytes: b, len: 16 }
    }

    /// From raw bytes of length 16 or 32.
    pub fn from_slice(b: &[u8]) -> Option<Self> {
        match b.len() {
            32 => <[u8; 32]>::try_from(b).ok().map(Self::from_sha256),
            16 => <[u8; 16]>::try_from(b).ok().map(Self::from_xxh128),
            _ => None,
        }
    }

    pub fn as_bytes(&self) -> &[u8] {
        self.bytes.get(..usize::from(self.len)).unwrap_or(&self.bytes)
    }

    /// The form KV events publish: the last 8 bytes, big-endian.
    pub fn key(&self) -> BlockKey {
        key_of_bytes(self.as_bytes()).unwrap_or_default()
    }

    pub fn to_hex(&self) -> String {
        hex(self.as_bytes())
    }
}

impl fmt::Debug for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Digest({})", self.to_hex())
    }
}

/// A block's key: vLLM's block hash in the u64 form its KV events publish (the digest's last 8
/// bytes, big-endian; what `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES` sends as an int). Events, the
/// engine mirror, the feed and the index all name blocks by it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, serde::Serialize)]
#[serde(transparent)]
pub struct BlockKey(pub u64);

impl fmt::Display for BlockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// KV-cache groups an engine may have mirrored (hybrid models have a few; past it a group's
/// events are counted as ignored).
pub const MAX_KV_GROUPS: u32 = 16;

/// The key block `key` of KV-cache group `group` is indexed under: the key itself for group 0,
/// a stable mix of key and group for the others. vLLM publishes the same hash in every group
/// that caches the block, and a hybrid model hits only as far as every group allows, so the
/// mirror, the feed and the index keep each group's blocks apart in one key space.
pub fn group_key(key: BlockKey, group: u32) -> BlockKey {
    if group == 0 {
        return key;
    }
    let salt = crate::stable_hash::mix64(0x6b76_5f67_726f_7570 ^ u64::from(group));
    BlockKey(crate::stable_hash::mix64(key.0 ^ salt))
}

/// The published u64 form of a hash given as bytes (`int.from_bytes(b, "big") & (2**64-1)`):
/// its last 8 bytes, big-endian. `None` when shorter than 8 bytes.
pub fn key_of_bytes(b: &[u8]) -> Option<BlockKey> {
    let start = b.len().checked_sub(8)?;
    let tail: [u8; 8] = b.get(start..)?.try_into().ok()?;
    Some(BlockKey(u64::from_be_bytes(tail)))
}

/// Lowercase hex.
pub fn hex(b: &[u8]) -> String {
    use std::fmt::Write as _;
    let mut s = String::with_capacity(b.len().saturating_mul(2));
    for &x in b {
        let _ = write!(s, "{x:02x}");
    }
    s
}
