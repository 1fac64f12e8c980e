//! A msgpack cursor over one payload, on `rmp`'s low-level slice readers: every value is read
//! in place (strings and binaries borrow the payload; nothing is allocated), every failure is a
//! [`MsgpackError`] carrying the byte offset of the value that could not be read.
//!
//! `rmp` has no skip, so [`Reader::skip`] is ours: it walks nested values with a counter of
//! pending items instead of recursion, so hostile nesting cannot exhaust the stack, and refuses
//! a count larger than the bytes left (every item takes at least one byte) before looping.

use super::error::{MsgpackError, MsgpackErrorKind};
use rmp::decode::{self as rd, NumValueReadError, ValueReadError};
use rmp::Marker;

/// The type of the next value, as far as decoding needs to know.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Nil,
    Bool,
    Int,
    Float,
    Str,
    Bin,
    Array,
    Map,
    Ext,
}

impl Kind {
    pub(super) fn name(self) -> &'static str {
        match self {
            Kind::Nil => "nil",
            Kind::Bool => "bool",
            Kind::Int => "integer",
            Kind::Float => "float",
            Kind::Str => "string",
            Kind::Bin => "binary",
            Kind::Array => "array",
            Kind::Map => "map",
            Kind::Ext => "extension",
        }
    }

    /// `None` for the one byte msgpack leaves undefined (0xc1).
    fn of(m: Marker) -> Option<Kind> {
        Some(match m {
            Marker::FixPos(_)
            | Marker::FixNeg(_)
            | Marker::U8
            | Marker::U16
            | Marker::U32
            | Marker::U64
            | Marker::I8
            | Marker::I16
            | Marker::I32
            | Marker::I64 => Kind::Int,
            Marker::FixMap(_) | Marker::Map16 | Marker::Map32 => Kind::Map,
            Marker::FixArray(_) | Marker::Array16 | Marker::Array32 => Kind::Array,
            Marker::FixStr(_) | Marker::Str8 | Marker::Str16 | Marker::Str32 => Kind::Str,
            Marker::Null => Kind::Nil,
            Marker::True | Marker::False => Kind::Bool,
            Marker::Bin8 | Marker::Bin16 | Marker::Bin32 => Kind::Bin,
            Marker::F32 | Marker::F64 => Kind::Float,
            Marker::FixExt1
            | Marker::FixExt2
            | Marker::FixExt4
            | Marker::FixExt8
            | Marker::FixExt16
            | Marker::Ext8
            | Marker::Ext16
            | Marker::Ext32 => Kind::Ext,
            Marker::Reserved => return None,
        })
    }
}

/// An integer as msgpack carries it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Int {
    U(u64),
    I(i64),
}

/// A cursor over a msgpack payload. Invariant: `rest` is a suffix of `buf`; a failed read
/// leaves it where it was.
#[derive(Debug, Clone)]
pub(super) struct Reader<'a> {
    buf: &'a [u8],
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    pub(super) fn new(buf: &'a [u8]) -> Self {
        Self { buf, rest: buf }
    }

    pub(super) fn position(&self) -> usize {
        self.buf.len().saturating_sub(self.rest.len())
    }

    /// Bytes not yet read.
    pub(super) fn remaining(&self) -> usize {
        self.rest.len()
    }

    pub(super) fn is_at_end(&self) -> bool {
        self.rest.is_empty()
    }

    fn err(&self, kind: MsgpackErrorKind) -> MsgpackError {
        MsgpackError { at: self.position(), kind }
    }

    fn truncated(&self) -> MsgpackError {
        self.err(MsgpackErrorKind::Truncated)
    }

    fn marker(&self) -> Result<Marker, MsgpackError> {
        self.rest.first().map(|&b| Marker::from_u8(b)).ok_or_else(|| self.truncated())
    }

    /// The kind of the next value, without consuming it.
    pub(super) fn peek_kind(&self) -> Result<Kind, MsgpackError> {
        let m = self.marker()?;
        Kind::of(m).ok_or_else(|| self.err(MsgpackErrorKind::InvalidMarker(m.to_u8())))
    }

    fn unexpected(&self, expected: &'static str) -> MsgpackError {
        let found = self.peek_kind().map(Kind::name).unwrap_or("invalid data");
        self.err(MsgpackErrorKind::Unexpected { expected, found })
    }

    /// A `rmp` error at the current value (not yet consumed): a slice reader fails only by
    /// running out of bytes, so every read error is truncation.
    fn value_err<E: rd::RmpReadErr>(&self, e: ValueReadError<E>, expected: &'static str) -> MsgpackError {
        match e {
            ValueReadError::TypeMismatch(_) => self.unexpected(expected),
            ValueReadError::InvalidMarkerRead(_) | ValueReadError::InvalidDataRead(_) => self.truncated(),
        }
    }

    fn num_err<E: rd::RmpReadErr>(&self, e: NumValueReadError<E>, expected: &'static str) -> MsgpackError {
        match e {
            NumValueReadError::TypeMismatch(_) => self.unexpected(expected),
            NumValueReadError::OutOfRange => self.err(MsgpackErrorKind::OutOfRange { expected }),
            NumValueReadError::InvalidMarkerRead(_) | NumValueReadError::InvalidDataRead(_) => self.truncated(),
        }
    }

    /// Runs one `rmp` read on a copy of the cursor and commits it only on success.
    fn run<T, E>(&mut self, f: impl FnOnce(&mut &'a [u8]) -> Result<T, E>) -> Result<T, E> {
        let mut r = self.rest;
        let v = f(&mut r)?;
        self.rest = r;
        Ok(v)
    }

    /// Takes `n` bytes after a header read on `r` (a copy of the cursor), committing both.
    fn take_after(&mut self, mut r: &'a [u8], n: usize) -> Result<&'a [u8], MsgpackError> {
        if n > r.len() {
            return Err(self.truncated());
        }
        let (data, tail) = r.split_at(n);
        r = tail;
        self.rest = r;
        Ok(data)
    }

    /// Consumes a nil if one is next.
    pub(super) fn try_nil(&mut self) -> Result<bool, MsgpackError> {
        if self.peek_kind()? == Kind::Nil {
            self.rest = self.rest.get(1..).unwrap_or_default();
            Ok(true)
        } else {
            Ok(false)
        }
    }

    pub(super) fn read_array_len(&mut self) -> Result<usize, MsgpackError> {
        let n = self.run(rd::read_array_len).map_err(|e| self.value_err(e, "array"))?;
        usize::try_from(n).map_err(|_| self.err(MsgpackErrorKind::OutOfRange { expected: "length" }))
    }

    pub(super) fn read_map_len(&mut self) -> Result<usize, MsgpackError> {
        let n = self.run(rd::read_map_len).map_err(|e| self.value_err(e, "map"))?;
        usize::try_from(n).map_err(|_| self.err(MsgpackErrorKind::OutOfRange { expected: "length" }))
    }

    pub(super) fn read_str(&mut self) -> Result<&'a str, MsgpackError> {
        let mut r = self.rest;
        let n = rd::read_str_len(&mut r).map_err(|e| self.value_err(e, "string"))?;
        let at = self.buf.len().saturating_sub(r.len());
        let n = usize::try_from(n).map_err(|_| self.truncated())?;
        let b = self.take_after(r, n)?;
        std::str::from_utf8(b).map_err(|_| MsgpackError { at, kind: MsgpackErrorKind::InvalidUtf8 })
    }

    pub(super) fn read_bin(&mut self) -> Result<&'a [u8], MsgpackError> {
        let mut r = self.rest;
        let n = rd::read_bin_len(&mut r).map_err(|e| self.value_err(e, "binary"))?;
        let n = usize::try_from(n).map_err(|_| self.truncated())?;
        self.take_after(r, n)
    }

    pub(super) fn read_int(&mut self) -> Result<Int, MsgpackError> {
        let signed = matches!(self.marker()?, Marker::FixNeg(_) | Marker::I8 | Marker::I16 | Marker::I32 | Marker::I64);
        if signed {
            self.run(rd::read_int::<i64, _>).map(Int::I).map_err(|e| self.num_err(e, "integer"))
        } else {
            self.run(rd::read_int::<u64, _>).map(Int::U).map_err(|e| self.num_err(e, "integer"))
        }
    }

    pub(super) fn read_u64(&mut self) -> Result<u64, MsgpackError> {
        self.run(rd::read_int::<u64, _>).map_err(|e| self.num_err(e, "unsigned integer"))
    }

    pub(super) fn read_u32(&mut self) -> Result<u32, MsgpackError> {
        self.run(rd::read_int::<u32, _>).map_err(|e| self.num_err(e, "32-bit unsigned integer"))
    }

    pub(super) fn read_i64(&mut self) -> Result<i64, MsgpackError> {
        self.run(rd::read_int::<i64, _>).map_err(|e| self.num_err(e, "64-bit integer"))
    }

    pub(super) fn read_bool(&mut self) -> Result<bool, MsgpackError> {
        self.run(rd::read_bool).map_err(|e| self.value_err(e, "bool"))
    }

    /// A float, or an integer read as a float (timestamps).
    pub(super) fn read_f64(&mut self) -> Result<f64, MsgpackError> {
        match self.marker()? {
            Marker::F64 => self.run(rd::read_f64).map_err(|e| self.value_err(e, "float")),
            Marker::F32 => self.run(rd::read_f32).map(f64::from).map_err(|e| self.value_err(e, "float")),
            _ => match self.read_int() {
                Ok(Int::U(u)) => Ok(u as f64),
                Ok(Int::I(i)) => Ok(i as f64),
                Err(e) if e.kind == MsgpackErrorKind::Truncated => Err(e),
                Err(_) => Err(self.unexpected("float")),
            },
        }
    }

    /// Skips one complete value, however deeply nested, without recursion.
    pub(super) fn skip(&mut self) -> Result<(), MsgpackError> {
        let mut pending: u64 = 1;
        while pending > 0 {
            pending = pending.saturating_sub(1);
            let m = self.marker()?;
            let mut r = self.rest;
            // Bytes of payload after the header, and items nested in the value.
            let (data, items): (usize, u64) = match m {
                Marker::Reserved => return Err(self.err(MsgpackErrorKind::InvalidMarker(m.to_u8()))),
                Marker::FixPos(_) | Marker::FixNeg(_) | Marker::Null | Marker::True | Marker::False => {
                    r = r.get(1..).unwrap_or_default();
                    (0, 0)
                }
                Marker::U8 | Marker::I8 => (2, 0),
                Marker::U16 | Marker::I16 => (3, 0),
                Marker::U32 | Marker::I32 | Marker::F32 => (5, 0),
                Marker::U64 | Marker::I64 | Marker::F64 => (9, 0),
                Marker::FixExt1 => (3, 0),
                Marker::FixExt2 => (4, 0),
                Marker::FixExt4 => (6, 0),
                Marker::FixExt8 => (10, 0),
                Marker::FixExt16 => (18, 0),
                Marker::FixStr(_) | Marker::Str8 | Marker::Str16 | Marker::Str32 => {
                    (self.len_of(rd::read_str_len(&mut r).map_err(|e| self.value_err(e, "string"))?)?, 0)
                }
                Marker::Bin8 | Marker::Bin16 | Marker::Bin32 => {
                    (self.len_of(rd::read_bin_len(&mut r).map_err(|e| self.value_err(e, "binary"))?)?, 0)
                }
                Marker::Ext8 | Marker::Ext16 | Marker::Ext32 => {
                    let meta = rd::read_ext_meta(&mut r).map_err(|e| self.value_err(e, "extension"))?;
                    (self.len_of(meta.size)?, 0)
                }
                Marker::FixArray(_) | Marker::Array16 | Marker::Array32 => {
                    (0, u64::from(rd::read_array_len(&mut r).map_err(|e| self.value_err(e, "array"))?))
                }
                Marker::FixMap(_) | Marker::Map16 | Marker::Map32 => {
                    (0, u64::from(rd::read_map_len(&mut r).map_err(|e| self.value_err(e, "map"))?).saturating_mul(2))
                }
            };
            // `r` is past the header, or still at the marker for fixed-width values (whose
            // `data` counts the marker).
            self.take_after(r, data)?;
            pending = pending.saturating_add(items);
            if pending > self.rest.len() as u64 {
                return Err(self.truncated());
            }
        }
        Ok(())
    }

    fn len_of(&self, n: u32) -> Result<usize, MsgpackError> {
        usize::try_from(n).map_err(|_| self.truncated())
    }
}

#[cfg(test)]
#[allow(clippy::arithmetic_side_effects)]
mod tests {
    use super::*;

    #[test]
    fn ints_of_every_width() {
        let data = [
            0x05, 0xff, 0xcc, 0xc8, 0xcd, 0x01, 0x00, 0xce, 0, 1, 0, 0, 0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
            0xff, 0xd0, 0x80, 0xd3, 0, 0, 0, 0, 0, 0, 0, 7,
        ];
        let mut r = Reader::new(&data);
        assert_eq!(r.read_int(), Ok(Int::U(5)));
        assert_eq!(r.read_int(), Ok(Int::I(-1)));
        assert_eq!(r.read_int(), Ok(Int::U(200)));
        assert_eq!(r.read_int(), Ok(Int::U(256)));
        assert_eq!(r.read_int(), Ok(Int::U(65536)));
        assert_eq!(r.read_u64(), Ok(u64::MAX));
        assert_eq!(r.read_int(), Ok(Int::I(-128)));
        assert_eq!(r.read_u64(), Ok(7));
        assert!(r.is_at_end());
        let mut r = Reader::new(&[0xff]);
        assert_eq!(
            r.read_u64().map_err(|e| e.kind),
            Err(MsgpackErrorKind::OutOfRange { expected: "unsigned integer" })
        );
        assert_eq!(r.position(), 0);
    }

    #[test]
    fn skip_nested_and_truncated() {
        // [ {"a": [1, "x"]}, bin(2), 1.5f32, fixext1 ] then 7
        let data = [
            0x94, 0x81, 0xa1, b'a', 0x92, 0x01, 0xa1, b'x', 0xc4, 0x02, 9, 9, 0xca, 0x3f, 0xc0, 0, 0, 0xd4, 1, 2, 0x07,
        ];
        let mut r = Reader::new(&data);
        assert_eq!(r.skip(), Ok(()));
        assert_eq!(r.read_u64(), Ok(7));
        for n in 0..data.len() - 1 {
            let mut r = Reader::new(&data[..n]);
            assert_eq!(r.skip().map_err(|e| e.kind), Err(MsgpackErrorKind::Truncated), "{n} bytes");
        }
        // An array claiming 2^32-1 items in 5 bytes is refused at once.
        let mut r = Reader::new(&[0xdd, 0xff, 0xff, 0xff, 0xff]);
        assert_eq!(r.skip().map_err(|e| e.kind), Err(MsgpackErrorKind::Truncated));
        // Deep nesting costs no stack.
        let mut deep = vec![0x91; 1 << 20];
        deep.push(0xc0);
        assert_eq!(Reader::new(&deep).skip(), Ok(()));
        assert_eq!(Reader::new(&[0xc1]).skip().map_err(|e| e.kind), Err(MsgpackErrorKind::InvalidMarker(0xc1)));
    }

    #[test]
    fn type_errors_name_both_sides() {
        let mut r = Reader::new(&[0xa1, b'x']);
        let e = r.read_array_len().err();
        assert_eq!(e.map(|e| e.to_string()).as_deref(), Some("expected array, found string at byte 0"));
        assert_eq!(r.read_str(), Ok("x"));
        let mut r = Reader::new(&[0x92, 0xa2, 0xff, 0xfe]);
        assert_eq!(r.read_array_len(), Ok(2));
        assert_eq!(r.read_str().map_err(|e| (e.at, e.kind)), Err((2, MsgpackErrorKind::InvalidUtf8)));
        assert_eq!(Reader::new(&[0xa3, b'a']).read_str().map_err(|e| e.kind), Err(MsgpackErrorKind::Truncated));
    }
}
