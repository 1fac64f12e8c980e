//! The bytes vLLM hashes: the root seed, and for each block the tuple
//! `(parent_digest, tuple(token_ids), extra_keys or None)`.
//!
//! CBOR (the `*_cbor` algorithms) is `cbor2.dumps(obj, canonical=True)`: shortest-form heads,
//! definite lengths, tuples as arrays and `None` as null (RFC 8949 §4.2). `minicbor`'s
//! [`Encoder`] writes exactly that for the items used here (it always picks the shortest head).
//! Pickle (the other algorithms) is CPython's protocol 5, written by [`crate::pickle`]: no crate
//! reproduces CPython's memo and framing choices byte for byte.

use super::block_key::Digest;
use super::extras::ExtraKey;
use super::spec::HashAlgo;
use crate::pickle::{Pickler, PyValue};
use minicbor::encode::Error;
use minicbor::Encoder;
use std::convert::Infallible;

/// The pre-image of the root parent (`NONE_HASH = H(seed)`), in `buf` or the pickler's buffer.
pub(super) fn seed<'a>(algo: HashAlgo, buf: &'a mut Vec<u8>, pickler: &'a mut Pickler, seed: &str) -> &'a [u8] {
    if algo.is_cbor() {
        buf.clear();
        infallible(Encoder::new(&mut *buf).str(seed).map(|_| ()));
        buf
    } else {
        pickler.dumps(&PyValue::Str { s: seed, interned: false })
    }
}

/// The pre-image of one block, in `buf` (CBOR) or the pickler's buffer (pickle); both buffers
/// keep their capacity from block to block.
pub(super) fn block<'a>(
    algo: HashAlgo,
    buf: &'a mut Vec<u8>,
    pickler: &'a mut Pickler,
    parent: &Digest,
    tokens: &[u32],
    extra: &[ExtraKey],
) -> &'a [u8] {
    if algo.is_cbor() {
        buf.clear();
        infallible(cbor_block(&mut Encoder::new(&mut *buf), parent, tokens, extra));
        buf
    } else {
        pickler.dumps(&pickle_block(parent, tokens, extra))
    }
}

/// Drops the result of writing into a `Vec`: its writer cannot fail (`Infallible`), and the
/// `Encoder` methods used here raise no error of their own (only `Encode` impls, unused, do).
fn infallible(r: Result<(), Error<Infallible>>) {
    let _ = r;
}

/// `len` as a CBOR length argument (lossless: `usize` is at most 64 bits on every target).
fn len(n: usize) -> u64 {
    n as u64
}

fn cbor_block<W: minicbor::encode::Write>(
    e: &mut Encoder<W>,
    parent: &Digest,
    tokens: &[u32],
    extra: &[ExtraKey],
) -> Result<(), Error<W::Error>> {
    e.array(3)?.bytes(parent.as_bytes())?.array(len(tokens.len()))?;
    for &t in tokens {
        e.u32(t)?;
    }
    // Lookahead hashing: `(E, *tokens)` with E the keys before it (or None).
    if let Some((ExtraKey::Lookahead(next), keys)) = extra.split_last() {
        e.array(len(next.len()).saturating_add(1))?;
        cbor_keys(e, keys)?;
        for &t in next {
            e.u32(t)?;
        }
        return Ok(());
    }
    cbor_keys(e, extra)
}

/// The tuple of tagged keys, or null when there are none.
fn cbor_keys<W: minicbor::encode::Write>(e: &mut Encoder<W>, extra: &[ExtraKey]) -> Result<(), Error<W::Error>> {
    if extra.is_empty() {
        e.null()?;
        return Ok(());
    }
    e.array(len(extra.len()))?;
    for x in extra {
        match x {
            ExtraKey::Lora { name, path } => e.array(3)?.str("lora")?.str(name)?.str(path)?,
            ExtraKey::Mm { identifier, offset } => e.array(3)?.str("mm")?.str(identifier)?.i64(*offset)?,
            ExtraKey::CacheSalt(s) => e.array(2)?.str("cache_salt")?.str(s)?,
            ExtraKey::PromptEmbeds(d) => e.array(2)?.str("prompt_embeds")?.bytes(d)?,
            // Only meaningful last (handled above); anywhere else it is written as its tokens.
            ExtraKey::Lookahead(next) => {
                let e = e.array(len(next.len()))?;
                for &t in next {
                    e.u32(t)?;
                }
                e
            }
        };
    }
    Ok(())
}

/// The block tuple as Python values: tags are interned strings (literals in vLLM's source), the
/// other strings are not, and that changes the pickle's memo references.
fn pickle_block<'a>(parent: &'a Digest, tokens: &'a [u32], extra: &'a [ExtraKey]) -> PyValue<'a> {
    let extra_v = match extra.split_last() {
        // Lookahead hashing: `(E, *tokens)`.
        Some((ExtraKey::Lookahead(next), keys)) => {
            let mut items = Vec::with_capacity(next.len().saturating_add(1));
            items.push(pickle_keys(keys));
            items.extend(next.iter().map(|&t| PyValue::Int(i64::from(t))));
            PyValue::Tuple(items)
        }
        _ => pickle_keys(extra),
    };
    PyValue::Tuple(vec![PyValue::Bytes(parent.as_bytes()), PyValue::UIntTuple(tokens), extra_v])
}

/// The tuple of tagged keys as Python values, or None when there are none.
fn pickle_keys(extra: &[ExtraKey]) -> PyValue<'_> {
    let tag = |s| PyValue::Str { s, interned: true };
    let plain = |s| PyValue::Str { s, interned: false };
    if extra.is_empty() {
        PyValue::None
    } else {
        PyValue::Tuple(
            extra
                .iter()
                .map(|e| match e {
                    ExtraKey::Lora { name, path } => PyValue::Tuple(vec![tag("lora"), plain(name), plain(path)]),
                    ExtraKey::Mm { identifier, offset } => {
                        PyValue::Tuple(vec![tag("mm"), plain(identifier), PyValue::Int(*offset)])
                    }
                    ExtraKey::CacheSalt(s) => PyValue::Tuple(vec![tag("cache_salt"), plain(s)]),
                    ExtraKey::PromptEmbeds(d) => PyValue::Tuple(vec![tag("prompt_embeds"), PyValue::Bytes(d)]),
                    ExtraKey::Lookahead(next) => PyValue::UIntTuple(next),
                })
                .collect(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cbor(parent: &Digest, tokens: &[u32], extra: &[ExtraKey]) -> Vec<u8> {
        let mut buf = Vec::new();
        block(HashAlgo::Sha256Cbor, &mut buf, &mut Pickler::new(), parent, tokens, extra).to_vec()
    }

    #[test]
    fn cbor_heads_are_shortest() {
        let p = Digest::from_xxh128([7; 16]);
        let toks = [0, 23, 24, 255, 256, 65_535, 65_536, u32::MAX];
        let mut want = vec![0x83, 0x50];
        want.extend([7; 16]);
        want.extend([0x88, 0x00, 0x17, 0x18, 24, 0x18, 0xff, 0x19, 1, 0, 0x19, 0xff, 0xff, 0x1a, 0, 1, 0, 0]);
        want.extend([0x1a, 0xff, 0xff, 0xff, 0xff, 0xf6]);
        assert_eq!(cbor(&p, &toks, &[]), want);
        // Negative offsets are major type 1; text and byte strings carry their lengths.
        let extra = [
            ExtraKey::Mm { identifier: "i".into(), offset: -25 },
            ExtraKey::PromptEmbeds(vec![1, 2]),
            ExtraKey::Mm { identifier: "j".into(), offset: i64::MIN },
        ];
        let got = cbor(&p, &[], &extra);
        let tail: &[u8] = &[
            0x80, 0x83, 0x83, 0x62, b'm', b'm', 0x61, b'i', 0x38, 24, 0x82, 0x6d, b'p', b'r', b'o', b'm', b'p', b't',
            b'_', b'e', b'm', b'b', b'e', b'd', b's', 0x42, 1, 2, 0x83, 0x62, b'm', b'm', 0x61, b'j', 0x3b, 0x7f, 0xff,
            0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
        ];
        assert_eq!(got.get(18..), Some(tail));
    }

    #[test]
    fn cbor_seed_is_a_text_string() {
        let mut buf = Vec::new();
        assert_eq!(seed(HashAlgo::XxhashCbor, &mut buf, &mut Pickler::new(), "0"), [0x61, b'0']);
    }
}
