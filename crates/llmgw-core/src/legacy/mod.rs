//! The hand-written msgpack and CBOR codecs as they were before `rmp` and `minicbor`, kept only
//! so the codec benchmark can compare old and new in one run (feature `legacy-codec`, off by
//! default; never shipped). Removed once the comparison is recorded.
#![allow(dead_code, clippy::all, missing_docs)]

pub mod cbor;
pub mod decode;
pub mod msgpack;

use crate::hash::Digest;
use sha2::{Digest as _, Sha256};

/// The CBOR pre-image of a block without extra keys, as `hash.rs` wrote it by hand.
pub fn cbor_block(b: &mut Vec<u8>, parent: &Digest, tokens: &[u32]) {
    b.clear();
    cbor::array_header(b, 3);
    cbor::bytes(b, parent.as_bytes());
    cbor::array_header(b, tokens.len());
    for &t in tokens {
        cbor::uint(b, u64::from(t));
    }
    cbor::null(b);
}

/// The sha256_cbor chain of a request without extra keys, with the hand-written CBOR: the loop
/// `BlockHasher::hash_request_into` ran (no memo).
pub fn hash_chain(buf: &mut Vec<u8>, root: Digest, tokens: &[u32], block_size: usize, out: &mut Vec<Digest>) {
    let mut parent = root;
    for block in tokens.chunks_exact(block_size) {
        cbor_block(buf, &parent, block);
        let d = Digest::from_sha256(Sha256::digest(&buf[..]).into());
        out.push(d);
        parent = d;
    }
}
