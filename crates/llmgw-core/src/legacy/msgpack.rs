//! A small, allocation-free msgpack reader over a byte slice. Every read is bounds-checked and
//! returns a typed error; skipping nested values is iterative, so hostile nesting cannot
//! overflow the stack.

use std::fmt;

/// Where and why a payload could not be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MsgpackError {
    /// Byte offset in the payload.
    pub at: usize,
    pub kind: MsgpackErrorKind,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MsgpackErrorKind {
    /// The payload ends inside a value.
    Truncated,
    /// A marker byte that msgpack does not define (0xc1).
    InvalidMarker(u8),
    /// A value of another type than the one expected.
    Unexpected { expected: &'static str, found: &'static str },
    /// A string that is not UTF-8.
    InvalidUtf8,
    /// An integer outside the expected range.
    OutOfRange { expected: &'static str },
}

impl fmt::Display for MsgpackError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            MsgpackErrorKind::Truncated => write!(f, "payload truncated at byte {}", self.at),
            MsgpackErrorKind::InvalidMarker(m) => write!(f, "invalid msgpack marker 0x{m:02x} at byte {}", self.at),
            MsgpackErrorKind::Unexpected { expected, found } => {
                write!(f, "expected {expected}, found {found} at byte {}", self.at)
            }
            MsgpackErrorKind::InvalidUtf8 => write!(f, "string is not UTF-8 at byte {}", self.at),
            MsgpackErrorKind::OutOfRange { expected } => {
                write!(f, "integer out of range for {expected} at byte {}", self.at)
            }
        }
    }
}

impl std::error::Error for MsgpackError {}

/// The type of the next value, as far as decoding needs to know.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
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
    pub fn name(self) -> &'static str {
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
}

/// An integer as msgpack carries it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Int {
    U(u64),
    I(i64),
}

impl Int {
    pub fn as_u64(self) -> Option<u64> {
        match self {
            Int::U(u) => Some(u),
            Int::I(i) => u64::try_from(i).ok(),
        }
    }
    pub fn as_i64(self) -> Option<i64> {
        match self {
            Int::U(u) => i64::try_from(u).ok(),
            Int::I(i) => Some(i),
        }
    }
}

/// A cursor over a msgpack payload.
#[derive(Debug, Clone)]
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Self { buf, pos: 0 }
    }

    pub fn position(&self) -> usize {
        self.pos
    }

    pub fn is_at_end(&self) -> bool {
        self.pos >= self.buf.len()
    }

    fn err(&self, at: usize, kind: MsgpackErrorKind) -> MsgpackError {
        MsgpackError { at, kind }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], MsgpackError> {
        let end = self.pos.checked_add(n).ok_or_else(|| self.err(self.pos, MsgpackErrorKind::Truncated))?;
        let s = self.buf.get(self.pos..end).ok_or_else(|| self.err(self.pos, MsgpackErrorKind::Truncated))?;
        self.pos = end;
        Ok(s)
    }

    fn byte(&mut self) -> Result<u8, MsgpackError> {
        let b = *self.buf.get(self.pos).ok_or_else(|| self.err(self.pos, MsgpackErrorKind::Truncated))?;
        self.pos = self.pos.saturating_add(1);
        Ok(b)
    }

    fn be<const N: usize>(&mut self) -> Result<[u8; N], MsgpackError> {
        let s = self.take(N)?;
        <[u8; N]>::try_from(s).map_err(|_| self.err(self.pos, MsgpackErrorKind::Truncated))
    }

    fn len_u8(&mut self) -> Result<usize, MsgpackError> {
        Ok(usize::from(self.byte()?))
    }
    fn len_u16(&mut self) -> Result<usize, MsgpackError> {
        Ok(usize::from(u16::from_be_bytes(self.be()?)))
    }
    fn len_u32(&mut self) -> Result<usize, MsgpackError> {
        let v = u32::from_be_bytes(self.be()?);
        usize::try_from(v).map_err(|_| self.err(self.pos, MsgpackErrorKind::OutOfRange { expected: "length" }))
    }

    /// The kind of the next value, without consuming it.
    pub fn peek_kind(&self) -> Result<Kind, MsgpackError> {
        let m = *self.buf.get(self.pos).ok_or_else(|| self.err(self.pos, MsgpackErrorKind::Truncated))?;
        Ok(match m {
            0x00..=0x7f | 0xe0..=0xff | 0xcc..=0xd3 => Kind::Int,
            0x80..=0x8f | 0xde | 0xdf => Kind::Map,
            0x90..=0x9f | 0xdc | 0xdd => Kind::Array,
            0xa0..=0xbf | 0xd9..=0xdb => Kind::Str,
            0xc0 => Kind::Nil,
            0xc2 | 0xc3 => Kind::Bool,
            0xc4..=0xc6 => Kind::Bin,
            0xc7..=0xc9 | 0xd4..=0xd8 => Kind::Ext,
            0xca | 0xcb => Kind::Float,
            0xc1 => return Err(self.err(self.pos, MsgpackErrorKind::InvalidMarker(m))),
        })
    }

    fn unexpected(&self, expected: &'static str) -> MsgpackError {
        let found = self.peek_kind().map(Kind::name).unwrap_or("invalid data");
        self.err(self.pos, MsgpackErrorKind::Unexpected { expected, found })
    }

    /// Consumes a nil if one is next.
    pub fn try_nil(&mut self) -> Result<bool, MsgpackError> {
        if self.peek_kind()? == Kind::Nil {
            self.pos = self.pos.saturating_add(1);
            Ok(true)
        } else {
            Ok(false)
        }
    }

    pub fn read_array_len(&mut self) -> Result<usize, MsgpackError> {
        let start = self.pos;
        match self.byte()? {
            m @ 0x90..=0x9f => Ok(usize::from(m & 0x0f)),
            0xdc => self.len_u16(),
            0xdd => self.len_u32(),
            _ => {
                self.pos = start;
                Err(self.unexpected("array"))
            }
        }
    }

    pub fn read_map_len(&mut self) -> Result<usize, MsgpackError> {
        let start = self.pos;
        match self.byte()? {
            m @ 0x80..=0x8f => Ok(usize::from(m & 0x0f)),
            0xde => self.len_u16(),
            0xdf => self.len_u32(),
            _ => {
                self.pos = start;
                Err(self.unexpected("map"))
            }
        }
    }

    pub fn read_str(&mut self) -> Result<&'a str, MsgpackError> {
        let start = self.pos;
        let n = match self.byte()? {
            m @ 0xa0..=0xbf => usize::from(m & 0x1f),
            0xd9 => self.len_u8()?,
            0xda => self.len_u16()?,
            0xdb => self.len_u32()?,
            _ => {
                self.pos = start;
                return Err(self.unexpected("string"));
            }
        };
        let at = self.pos;
        let b = self.take(n)?;
        std::str::from_utf8(b).map_err(|_| self.err(at, MsgpackErrorKind::InvalidUtf8))
    }

    pub fn read_bin(&mut self) -> Result<&'a [u8], MsgpackError> {
        let start = self.pos;
        let n = match self.byte()? {
            0xc4 => self.len_u8()?,
            0xc5 => self.len_u16()?,
            0xc6 => self.len_u32()?,
            _ => {
                self.pos = start;
                return Err(self.unexpected("binary"));
            }
        };
        self.take(n)
    }

    pub fn read_int(&mut self) -> Result<Int, MsgpackError> {
        let start = self.pos;
        Ok(match self.byte()? {
            m @ 0x00..=0x7f => Int::U(u64::from(m)),
            m @ 0xe0..=0xff => Int::I(i64::from(m as i8)),
            0xcc => Int::U(u64::from(self.byte()?)),
            0xcd => Int::U(u64::from(u16::from_be_bytes(self.be()?))),
            0xce => Int::U(u64::from(u32::from_be_bytes(self.be()?))),
            0xcf => Int::U(u64::from_be_bytes(self.be()?)),
            0xd0 => Int::I(i64::from(i8::from_be_bytes(self.be()?))),
            0xd1 => Int::I(i64::from(i16::from_be_bytes(self.be()?))),
            0xd2 => Int::I(i64::from(i32::from_be_bytes(self.be()?))),
            0xd3 => Int::I(i64::from_be_bytes(self.be()?)),
            _ => {
                self.pos = start;
                return Err(self.unexpected("integer"));
            }
        })
    }

    pub fn read_u64(&mut self) -> Result<u64, MsgpackError> {
        let at = self.pos;
        self.read_int()?
            .as_u64()
            .ok_or_else(|| self.err(at, MsgpackErrorKind::OutOfRange { expected: "unsigned integer" }))
    }

    pub fn read_i64(&mut self) -> Result<i64, MsgpackError> {
        let at = self.pos;
        self.read_int()?
            .as_i64()
            .ok_or_else(|| self.err(at, MsgpackErrorKind::OutOfRange { expected: "64-bit integer" }))
    }

    pub fn read_bool(&mut self) -> Result<bool, MsgpackError> {
        match self.peek_kind()? {
            Kind::Bool => Ok(self.byte()? == 0xc3),
            _ => Err(self.unexpected("bool")),
        }
    }

    /// A float, or an integer read as a float (timestamps).
    pub fn read_f64(&mut self) -> Result<f64, MsgpackError> {
        let start = self.pos;
        match self.byte()? {
            0xca => Ok(f64::from(f32::from_be_bytes(self.be()?))),
            0xcb => Ok(f64::from_be_bytes(self.be()?)),
            _ => {
                self.pos = start;
                match self.read_int() {
                    Ok(Int::U(u)) => Ok(u as f64),
                    Ok(Int::I(i)) => Ok(i as f64),
                    Err(_) => Err(self.unexpected("float")),
                }
            }
        }
    }

    /// Skips one complete value, however deeply nested, without recursion.
    pub fn skip(&mut self) -> Result<(), MsgpackError> {
        let mut pending: u64 = 1;
        while pending > 0 {
            pending = pending.saturating_sub(1);
            let at = self.pos;
            let m = self.byte()?;
            let add: u64 = match m {
                0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => 0,
                0x80..=0x8f => u64::from(m & 0x0f).saturating_mul(2),
                0x90..=0x9f => u64::from(m & 0x0f),
                0xa0..=0xbf => {
                    self.take(usize::from(m & 0x1f))?;
                    0
                }
                0xc4 | 0xd9 => {
                    let n = self.len_u8()?;
                    self.take(n)?;
                    0
                }
                0xc5 | 0xda => {
                    let n = self.len_u16()?;
                    self.take(n)?;
                    0
                }
                0xc6 | 0xdb => {
                    let n = self.len_u32()?;
                    self.take(n)?;
                    0
                }
                0xc7 => {
                    let n = self.len_u8()?;
                    self.take(n.saturating_add(1))?;
                    0
                }
                0xc8 => {
                    let n = self.len_u16()?;
                    self.take(n.saturating_add(1))?;
                    0
                }
                0xc9 => {
                    let n = self.len_u32()?;
                    self.take(n.saturating_add(1))?;
                    0
                }
                0xca => {
                    self.take(4)?;
                    0
                }
                0xcb => {
                    self.take(8)?;
                    0
                }
                0xcc | 0xd0 => {
                    self.take(1)?;
                    0
                }
                0xcd | 0xd1 => {
                    self.take(2)?;
                    0
                }
                0xce | 0xd2 => {
                    self.take(4)?;
                    0
                }
                0xcf | 0xd3 => {
                    self.take(8)?;
                    0
                }
                0xd4 => {
                    self.take(2)?;
                    0
                }
                0xd5 => {
                    self.take(3)?;
                    0
                }
                0xd6 => {
                    self.take(5)?;
                    0
                }
                0xd7 => {
                    self.take(9)?;
                    0
                }
                0xd8 => {
                    self.take(17)?;
                    0
                }
                0xdc => self.len_u16()? as u64,
                0xdd => self.len_u32()? as u64,
                0xde => (self.len_u16()? as u64).saturating_mul(2),
                0xdf => (self.len_u32()? as u64).saturating_mul(2),
                0xc1 => return Err(self.err(at, MsgpackErrorKind::InvalidMarker(m))),
            };
            // Every pending item takes at least one byte: a count beyond what is left is truncation.
            pending = pending.saturating_add(add);
            if pending > self.buf.len().saturating_sub(self.pos) as u64 {
                return Err(self.err(self.pos, MsgpackErrorKind::Truncated));
            }
        }
        Ok(())
    }
}

/// Appends msgpack values to a buffer, in the shortest forms (as msgspec writes them).
#[derive(Debug, Default, Clone)]
pub struct Writer {
    pub out: Vec<u8>,
}

impl Writer {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn into_inner(self) -> Vec<u8> {
        self.out
    }

    fn len_header(&mut self, n: usize, fix: u8, fix_max: usize, m16: u8, m32: u8) {
        if n <= fix_max {
            self.out.push(fix | (n as u8));
        } else if let Ok(v) = u16::try_from(n) {
            self.out.push(m16);
            self.out.extend_from_slice(&v.to_be_bytes());
        } else {
            self.out.push(m32);
            self.out.extend_from_slice(&u32::try_from(n).unwrap_or(u32::MAX).to_be_bytes());
        }
    }

    pub fn array(&mut self, n: usize) {
        self.len_header(n, 0x90, 15, 0xdc, 0xdd);
    }

    pub fn map(&mut self, n: usize) {
        self.len_header(n, 0x80, 15, 0xde, 0xdf);
    }

    pub fn nil(&mut self) {
        self.out.push(0xc0);
    }

    pub fn bool(&mut self, b: bool) {
        self.out.push(if b { 0xc3 } else { 0xc2 });
    }

    pub fn uint(&mut self, v: u64) {
        if v < 128 {
            self.out.push(v as u8);
        } else if let Ok(b) = u8::try_from(v) {
            self.out.extend_from_slice(&[0xcc, b]);
        } else if let Ok(b) = u16::try_from(v) {
            self.out.push(0xcd);
            self.out.extend_from_slice(&b.to_be_bytes());
        } else if let Ok(b) = u32::try_from(v) {
            self.out.push(0xce);
            self.out.extend_from_slice(&b.to_be_bytes());
        } else {
            self.out.push(0xcf);
            self.out.extend_from_slice(&v.to_be_bytes());
        }
    }

    pub fn int(&mut self, v: i64) {
        if let Ok(u) = u64::try_from(v) {
            self.uint(u);
        } else if v >= -32 {
            self.out.push(v as i8 as u8);
        } else if let Ok(b) = i8::try_from(v) {
            self.out.extend_from_slice(&[0xd0, b as u8]);
        } else if let Ok(b) = i16::try_from(v) {
            self.out.push(0xd1);
            self.out.extend_from_slice(&b.to_be_bytes());
        } else if let Ok(b) = i32::try_from(v) {
            self.out.push(0xd2);
            self.out.extend_from_slice(&b.to_be_bytes());
        } else {
            self.out.push(0xd3);
            self.out.extend_from_slice(&v.to_be_bytes());
        }
    }

    pub fn f64(&mut self, v: f64) {
        self.out.push(0xcb);
        self.out.extend_from_slice(&v.to_be_bytes());
    }

    pub fn str(&mut self, s: &str) {
        let n = s.len();
        if n <= 31 {
            self.out.push(0xa0 | (n as u8));
        } else if let Ok(b) = u8::try_from(n) {
            self.out.extend_from_slice(&[0xd9, b]);
        } else {
            self.len_header(n, 0, 0, 0xda, 0xdb);
        }
        self.out.extend_from_slice(s.as_bytes());
    }

    pub fn bin(&mut self, b: &[u8]) {
        let n = b.len();
        if let Ok(l) = u8::try_from(n) {
            self.out.extend_from_slice(&[0xc4, l]);
        } else if let Ok(l) = u16::try_from(n) {
            self.out.push(0xc5);
            self.out.extend_from_slice(&l.to_be_bytes());
        } else {
            self.out.push(0xc6);
            self.out.extend_from_slice(&u32::try_from(n).unwrap_or(u32::MAX).to_be_bytes());
        }
        self.out.extend_from_slice(b);
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
    }

    #[test]
    fn skip_nested_and_truncated() {
        // [ {"a": [1, "x"]}, bin(2) ]
        let data = [0x92, 0x81, 0xa1, b'a', 0x92, 0x01, 0xa1, b'x', 0xc4, 0x02, 9, 9, 0x07];
        let mut r = Reader::new(&data);
        assert_eq!(r.skip(), Ok(()));
        assert_eq!(r.read_u64(), Ok(7));
        let mut r = Reader::new(&data[..6]);
        assert_eq!(r.skip().map_err(|e| e.kind), Err(MsgpackErrorKind::Truncated));
        // An array claiming 2^32-1 items in 5 bytes is refused at once.
        let mut r = Reader::new(&[0xdd, 0xff, 0xff, 0xff, 0xff]);
        assert_eq!(r.skip().map_err(|e| e.kind), Err(MsgpackErrorKind::Truncated));
    }

    #[test]
    fn type_errors_name_both_sides() {
        let mut r = Reader::new(&[0xa1, b'x']);
        let e = r.read_array_len().err();
        assert_eq!(e.map(|e| e.to_string()).as_deref(), Some("expected array, found string at byte 0"));
        assert_eq!(r.read_str(), Ok("x"));
    }
}
