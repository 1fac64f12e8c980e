//! The bytes CPython's `pickle.dumps(obj, protocol=5)` produces for the values vLLM's default
//! `sha256` block hash pickles: tuples, `bytes`, `str`, `int` and `None`.
//!
//! Protocol 5 details reproduced here: the `PROTO 5` header, one `FRAME` around everything that
//! follows (a new frame starts when the current one reaches 64 KiB, checked before each object),
//! `MEMOIZE` after every str, bytes and tuple, `BINGET` when the *same object* is pickled twice
//! (vLLM's tag constants such as `"mm"` are one interned object, so a block overlapping two
//! multimodal items pickles the second `"mm"` as a memo reference), and CPython's integer opcodes
//! (`BININT1`/`BININT2`/`BININT` for 32-bit values, `LONG1` otherwise).

const PROTO: u8 = 0x80;
const FRAME: u8 = 0x95;
const STOP: u8 = b'.';
const NONE: u8 = b'N';
const BININT: u8 = b'J';
const BININT1: u8 = b'K';
const BININT2: u8 = b'M';
const LONG1: u8 = 0x8a;
const SHORT_BINUNICODE: u8 = 0x8c;
const BINUNICODE: u8 = b'X';
const SHORT_BINBYTES: u8 = b'C';
const BINBYTES: u8 = b'B';
const MARK: u8 = b'(';
const TUPLE: u8 = b't';
const TUPLE1: u8 = 0x85;
const TUPLE2: u8 = 0x86;
const TUPLE3: u8 = 0x87;
const EMPTY_TUPLE: u8 = b')';
const MEMOIZE: u8 = 0x94;
const BINGET: u8 = b'h';
const LONG_BINGET: u8 = b'j';

const FRAME_HEADER: usize = 9;
const FRAME_SIZE_MIN: usize = 4;
const FRAME_SIZE_TARGET: usize = 64 * 1024;

/// A Python value as vLLM's hash input holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PyValue<'a> {
    None,
    Int(i64),
    /// A `str`. `interned` marks a code constant (vLLM's tags such as `"lora"` or `"mm"`):
    /// every occurrence is the same object, so the pickler memoizes it once.
    Str {
        s: &'a str,
        interned: bool,
    },
    Bytes(&'a [u8]),
    Tuple(Vec<PyValue<'a>>),
    /// A tuple of non-negative ints (a block's token ids), kept unboxed for speed.
    UIntTuple(&'a [u32]),
}

/// A protocol-5 pickler writing into a reusable buffer.
#[derive(Default)]
pub struct Pickler {
    out: Vec<u8>,
    frame_start: Option<usize>,
    memo_len: u32,
    interned: Vec<(String, u32)>,
}

impl Pickler {
    pub fn new() -> Self {
        Self::default()
    }

    /// Pickles `v` and returns the bytes (valid until the next call).
    pub fn dumps(&mut self, v: &PyValue<'_>) -> &[u8] {
        self.out.clear();
        self.memo_len = 0;
        self.interned.clear();
        self.out.push(PROTO);
        self.out.push(5);
        self.frame_start = None;
        self.save(v);
        self.write(&[STOP]);
        self.commit_frame();
        &self.out
    }

    fn start_frame_if_needed(&mut self) {
        if self.frame_start.is_none() {
            self.frame_start = Some(self.out.len());
            self.out.extend_from_slice(&[0u8; FRAME_HEADER]);
        }
    }

    fn write(&mut self, b: &[u8]) {
        self.start_frame_if_needed();
        self.out.extend_from_slice(b);
    }

    fn commit_frame(&mut self) {
        let Some(start) = self.frame_start.take() else {
            return;
        };
        let body_start = start.saturating_add(FRAME_HEADER);
        let frame_len = self.out.len().saturating_sub(body_start);
        if frame_len >= FRAME_SIZE_MIN {
            let mut header = [0u8; FRAME_HEADER];
            header[0] = FRAME;
            if let Some(dst) = header.get_mut(1..) {
                dst.copy_from_slice(&(frame_len as u64).to_le_bytes());
            }
            if let Some(dst) = self.out.get_mut(start..body_start) {
                dst.copy_from_slice(&header);
            }
        } else {
            // Too short for a frame: drop the reserved header.
            self.out.drain(start..body_start.min(self.out.len()));
        }
    }

    fn boundary(&mut self) {
        if let Some(start) = self.frame_start {
            if self.out.len().saturating_sub(start.saturating_add(FRAME_HEADER)) >= FRAME_SIZE_TARGET {
                self.commit_frame();
            }
        }
    }

    fn memoize(&mut self) -> u32 {
        self.write(&[MEMOIZE]);
        let idx = self.memo_len;
        self.memo_len = self.memo_len.saturating_add(1);
        idx
    }

    fn get(&mut self, idx: u32) {
        if let Ok(small) = u8::try_from(idx) {
            self.write(&[BINGET, small]);
        } else {
            self.write(&[LONG_BINGET]);
            self.write(&idx.to_le_bytes());
        }
    }

    fn save(&mut self, v: &PyValue<'_>) {
        self.boundary();
        match v {
            PyValue::None => self.write(&[NONE]),
            PyValue::Int(i) => self.save_int(*i),
            PyValue::Str { s, interned } => {
                if *interned {
                    // Only code constants are marked interned, so equal text means the same object.
                    if let Some(idx) = self.interned.iter().find(|(t, _)| t == s).map(|(_, i)| *i) {
                        self.get(idx);
                        return;
                    }
                    self.save_str(s);
                    let idx = self.memoize();
                    self.interned.push(((*s).to_owned(), idx));
                } else {
                    self.save_str(s);
                    self.memoize();
                }
            }
            PyValue::Bytes(b) => {
                if let Ok(n) = u8::try_from(b.len()) {
                    self.write(&[SHORT_BINBYTES, n]);
                } else {
                    self.write(&[BINBYTES]);
                    self.write(&(b.len() as u32).to_le_bytes());
                }
                self.write(b);
                self.memoize();
            }
            PyValue::Tuple(items) => {
                self.save_tuple_with(items.len(), |p| {
                    for it in items {
                        p.save(it);
                    }
                });
            }
            PyValue::UIntTuple(items) => {
                self.save_tuple_with(items.len(), |p| {
                    for &t in items.iter() {
                        p.boundary();
                        p.save_int(i64::from(t));
                    }
                });
            }
        }
    }

    fn save_tuple_with(&mut self, n: usize, body: impl FnOnce(&mut Self)) {
        if n == 0 {
            self.write(&[EMPTY_TUPLE]);
            return;
        }
        if n <= 3 {
            body(self);
            let op = match n {
                1 => TUPLE1,
                2 => TUPLE2,
                _ => TUPLE3,
            };
            self.write(&[op]);
        } else {
            self.write(&[MARK]);
            body(self);
            self.write(&[TUPLE]);
        }
        self.memoize();
    }

    fn save_str(&mut self, s: &str) {
        if let Ok(n) = u8::try_from(s.len()) {
            self.write(&[SHORT_BINUNICODE, n]);
        } else {
            self.write(&[BINUNICODE]);
            self.write(&(s.len() as u32).to_le_bytes());
        }
        self.write(s.as_bytes());
    }

    fn save_int(&mut self, v: i64) {
        if let Ok(v32) = i32::try_from(v) {
            let le = v32.to_le_bytes();
            if le[2] != 0 || le[3] != 0 {
                self.write(&[BININT, le[0], le[1], le[2], le[3]]);
            } else if le[1] != 0 {
                self.write(&[BININT2, le[0], le[1]]);
            } else {
                self.write(&[BININT1, le[0]]);
            }
            return;
        }
        // LONG1: little-endian two's complement, CPython's length rule:
        // nbytes = bit_length(|v|) / 8 + 1, minus one for negatives whose top byte is redundant.
        let abs_bits = 64u32.saturating_sub(v.unsigned_abs().leading_zeros());
        let mut nbytes = (abs_bits / 8).saturating_add(1) as usize;
        let le = i128::from(v).to_le_bytes();
        if v < 0 && nbytes > 1 {
            let top = le.get(nbytes.saturating_sub(1)).copied().unwrap_or(0);
            let below = le.get(nbytes.saturating_sub(2)).copied().unwrap_or(0);
            if top == 0xff && below & 0x80 != 0 {
                nbytes = nbytes.saturating_sub(1);
            }
        }
        let n = nbytes.min(le.len());
        self.write(&[LONG1, n as u8]);
        if let Some(body) = le.get(..n) {
            let body = body.to_vec();
            self.write(&body);
        }
    }
}

#[cfg(test)]
#[allow(clippy::arithmetic_side_effects)]
mod tests {
    use super::*;

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    fn s(s: &str) -> PyValue<'_> {
        PyValue::Str { s, interned: false }
    }

    fn tag(s: &str) -> PyValue<'_> {
        PyValue::Str { s, interned: true }
    }

    // Every expected string below is CPython's `pickle.dumps(obj, 5).hex()`.
    #[test]
    fn seed_string() {
        let mut p = Pickler::new();
        assert_eq!(hex(p.dumps(&s("0"))), "80059505000000000000008c0130942e");
    }

    #[test]
    fn int_opcodes() {
        let vals = [
            0,
            255,
            256,
            65535,
            65536,
            -1,
            -12,
            (1 << 31) - 1,
            1 << 31,
            -(1 << 31),
            -(1 << 31) - 1,
            -(1 << 40),
            i64::MAX,
            i64::MIN,
        ];
        let t = PyValue::Tuple(vals.iter().map(|v| PyValue::Int(*v)).collect());
        let mut p = Pickler::new();
        assert_eq!(
            hex(p.dumps(&t)),
            "8005955100000000000000284b004bff4d00014dffff4a000001004affffffff4af4ffffff4affffff7f8a0500000080004a000000808a05ffffff7fff8a060000000000ff8a08ffffffffffffff7f8a08000000000000008074942e"
        );
    }

    #[test]
    fn repeated_tag_is_a_memo_reference() {
        let parent = [1u8; 32];
        let toks = [1u32, 2, 3];
        let t = PyValue::Tuple(vec![
            PyValue::Bytes(&parent),
            PyValue::UIntTuple(&toks),
            PyValue::Tuple(vec![
                PyValue::Tuple(vec![tag("mm"), s("a"), PyValue::Int(4)]),
                PyValue::Tuple(vec![tag("mm"), s("b"), PyValue::Int(-12)]),
            ]),
        ]);
        let mut p = Pickler::new();
        assert_eq!(
            hex(p.dumps(&t)),
            "8005954a0000000000000043200101010101010101010101010101010101010101010101010101010101010101944b014b024b0387948c026d6d948c0161944b04879468028c0162944af4ffffff8794869487942e"
        );
    }

    #[test]
    fn block_of_sixteen_tokens() {
        let parent = [1u8; 32];
        let toks: Vec<u32> = (1000..1016).collect();
        let t = PyValue::Tuple(vec![PyValue::Bytes(&parent), PyValue::UIntTuple(&toks), PyValue::None]);
        let mut p = Pickler::new();
        assert_eq!(
            hex(p.dumps(&t)),
            "8005955a000000000000004320010101010101010101010101010101010101010101010101010101010101010194284de8034de9034dea034deb034dec034ded034dee034def034df0034df1034df2034df3034df4034df5034df6034df70374944e87942e"
        );
    }

    #[test]
    fn long_string_uses_binunicode() {
        let long = "x".repeat(300);
        let mut p = Pickler::new();
        assert!(hex(p.dumps(&s(&long))).starts_with("8005953301000000000000582c01000078787878"));
    }
}
