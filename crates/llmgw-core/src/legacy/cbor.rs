//! The subset of canonical CBOR (RFC 8949 §4.2, as `cbor2.dumps(obj, canonical=True)` writes it)
//! that vLLM's `sha256_cbor` block hashes use: shortest-form integers, byte and text strings,
//! definite-length arrays (Python tuples) and null (`None`).

/// Writes a major type with its argument in the shortest form.
fn head(out: &mut Vec<u8>, major: u8, arg: u64) {
    let m = major << 5;
    if arg < 24 {
        // `arg < 24` so the cast keeps the value.
        out.push(m | (arg as u8));
    } else if let Ok(v) = u8::try_from(arg) {
        out.push(m | 24);
        out.push(v);
    } else if let Ok(v) = u16::try_from(arg) {
        out.push(m | 25);
        out.extend_from_slice(&v.to_be_bytes());
    } else if let Ok(v) = u32::try_from(arg) {
        out.push(m | 26);
        out.extend_from_slice(&v.to_be_bytes());
    } else {
        out.push(m | 27);
        out.extend_from_slice(&arg.to_be_bytes());
    }
}

/// An unsigned integer (major type 0).
pub fn uint(out: &mut Vec<u8>, v: u64) {
    head(out, 0, v);
}

/// A signed integer: major type 0 when non-negative, major type 1 (encoding `-1 - v`) otherwise.
pub fn int(out: &mut Vec<u8>, v: i64) {
    if let Ok(u) = u64::try_from(v) {
        head(out, 0, u);
    } else {
        // v < 0, so -1 - v is in 0..=i64::MAX and cannot overflow.
        let n = (-1i64).wrapping_sub(v) as u64;
        head(out, 1, n);
    }
}

/// A byte string (major type 2).
pub fn bytes(out: &mut Vec<u8>, b: &[u8]) {
    head(out, 2, b.len() as u64);
    out.extend_from_slice(b);
}

/// A UTF-8 text string (major type 3).
pub fn text(out: &mut Vec<u8>, s: &str) {
    head(out, 3, s.len() as u64);
    out.extend_from_slice(s.as_bytes());
}

/// The header of a definite-length array of `len` items (major type 4).
pub fn array_header(out: &mut Vec<u8>, len: usize) {
    head(out, 4, len as u64);
}

/// `None`.
pub fn null(out: &mut Vec<u8>) {
    out.push(0xf6);
}

#[cfg(test)]
#[allow(clippy::arithmetic_side_effects)]
mod tests {
    use super::*;

    fn enc(f: impl Fn(&mut Vec<u8>)) -> Vec<u8> {
        let mut v = Vec::new();
        f(&mut v);
        v
    }

    #[test]
    fn shortest_forms() {
        assert_eq!(enc(|o| uint(o, 0)), [0x00]);
        assert_eq!(enc(|o| uint(o, 23)), [0x17]);
        assert_eq!(enc(|o| uint(o, 24)), [0x18, 24]);
        assert_eq!(enc(|o| uint(o, 255)), [0x18, 0xff]);
        assert_eq!(enc(|o| uint(o, 256)), [0x19, 0x01, 0x00]);
        assert_eq!(enc(|o| uint(o, 65536)), [0x1a, 0, 1, 0, 0]);
        assert_eq!(enc(|o| uint(o, 1 << 32)), [0x1b, 0, 0, 0, 1, 0, 0, 0, 0]);
        assert_eq!(enc(|o| int(o, -1)), [0x20]);
        assert_eq!(enc(|o| int(o, -12)), [0x2b]);
        assert_eq!(enc(|o| int(o, -25)), [0x38, 24]);
        assert_eq!(enc(|o| int(o, i64::MIN)), [0x3b, 0x7f, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]);
        assert_eq!(enc(|o| text(o, "0")), [0x61, 0x30]);
        assert_eq!(enc(|o| bytes(o, &[1, 2])), [0x42, 1, 2]);
        assert_eq!(enc(|o| array_header(o, 3)), [0x83]);
        assert_eq!(enc(null), [0xf6]);
    }
}
