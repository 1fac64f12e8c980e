//! Why a `KVEventBatch` payload could not be decoded: the msgpack layer's errors and the
//! schema layer's.

use std::fmt;

/// Why a payload could not be decoded, and where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeError {
    /// Index of the event in the batch, when the error is inside one.
    pub event: Option<usize>,
    /// The field being read.
    pub field: Option<&'static str>,
    pub kind: DecodeErrorKind,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DecodeErrorKind {
    Msgpack(MsgpackError),
    /// The batch array has fewer than 2 elements.
    BatchTooShort(usize),
    /// An event has no `type` key, or its tag is not a string.
    MissingType,
    /// A required field is absent.
    MissingField,
    /// A hash given as binary is shorter than 8 bytes.
    HashTooShort(usize),
    /// A token id does not fit 32 bits.
    TokenOutOfRange(u64),
    /// Values nested deeper than any vLLM field.
    TooDeep,
    /// Bytes after the batch.
    TrailingBytes(usize),
}

/// Where and why the msgpack layer could not read a value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MsgpackError {
    /// Byte offset in the payload of the value that could not be read.
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

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.event, self.field) {
            (Some(e), Some(fl)) => write!(f, "event {e}, field {fl}: ")?,
            (Some(e), None) => write!(f, "event {e}: ")?,
            (None, Some(fl)) => write!(f, "batch {fl}: ")?,
            (None, None) => f.write_str("batch: ")?,
        }
        match &self.kind {
            DecodeErrorKind::Msgpack(e) => write!(f, "{e}"),
            DecodeErrorKind::BatchTooShort(n) => write!(f, "batch array has {n} elements, expected [ts, events, rank]"),
            DecodeErrorKind::MissingType => f.write_str("event has no string \"type\""),
            DecodeErrorKind::MissingField => f.write_str("required field is missing"),
            DecodeErrorKind::HashTooShort(n) => write!(f, "hash is {n} bytes, expected at least 8"),
            DecodeErrorKind::TokenOutOfRange(t) => write!(f, "token id {t} does not fit 32 bits"),
            DecodeErrorKind::TooDeep => f.write_str("values nested too deeply"),
            DecodeErrorKind::TrailingBytes(n) => write!(f, "{n} bytes after the batch"),
        }
    }
}

impl std::error::Error for DecodeError {}
