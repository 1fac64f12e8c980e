//! The schema layer: `KVEventBatch` fields onto [`WireBatch`], in both encodings. Unknown
//! fields and event types are skipped. A count read from the wire reserves at most
//! [`capacity`] items: no more than the bytes left (every item takes one at least), and no more
//! than a fixed bound, so a lying header costs nothing before the bytes run out.

use super::batch::{WireBatch, WireBlockRemoved, WireBlockStored, WireEvent, WireValue};
use super::error::{DecodeError, DecodeErrorKind, MsgpackError, MsgpackErrorKind};
use super::reader::{Int, Kind, Reader};
use crate::hash::key_of_bytes;

/// Builds errors with the current location.
#[derive(Clone, Copy)]
struct Ctx {
    event: Option<usize>,
    field: Option<&'static str>,
}

impl Ctx {
    fn err(self, kind: DecodeErrorKind) -> DecodeError {
        DecodeError { event: self.event, field: self.field, kind }
    }
    fn field(self, f: &'static str) -> Ctx {
        Ctx { field: Some(f), ..self }
    }
}

trait At<T> {
    fn at(self, c: Ctx) -> Result<T, DecodeError>;
}

impl<T> At<T> for Result<T, MsgpackError> {
    fn at(self, c: Ctx) -> Result<T, DecodeError> {
        self.map_err(|e| c.err(DecodeErrorKind::Msgpack(e)))
    }
}

const MAX_DEPTH: u32 = 16;

/// The most items reserved ahead for one wire count; longer sequences grow as they are read.
const MAX_RESERVE: usize = 4096;

/// What to reserve for `n` items announced by the wire, with the reader where they start.
fn capacity(n: usize, r: &Reader<'_>) -> usize {
    n.min(r.remaining()).min(MAX_RESERVE)
}

/// Decodes one `KVEventBatch` payload (the third frame of a ZMQ message).
pub fn decode_batch(payload: &[u8]) -> Result<WireBatch, DecodeError> {
    let mut r = Reader::new(payload);
    let c = Ctx { event: None, field: None };
    let n = r.read_array_len().at(c)?;
    if n < 2 {
        return Err(c.err(DecodeErrorKind::BatchTooShort(n)));
    }
    let ts = r.read_f64().at(c.field("ts"))?;
    let ce = c.field("events");
    let n_events = r.read_array_len().at(ce)?;
    let mut events = Vec::with_capacity(capacity(n_events, &r));
    for i in 0..n_events {
        events.push(decode_event(&mut r, Ctx { event: Some(i), field: None })?);
    }
    let mut data_parallel_rank = None;
    if n >= 3 {
        let cr = c.field("data_parallel_rank");
        if !r.try_nil().at(cr)? {
            data_parallel_rank = Some(r.read_i64().at(cr)?);
        }
        for _ in 3..n {
            r.skip().at(c)?;
        }
    }
    if !r.is_at_end() {
        return Err(c.err(DecodeErrorKind::TrailingBytes(payload.len().saturating_sub(r.position()))));
    }
    Ok(WireBatch { ts, events, data_parallel_rank })
}

/// Which event a tag names.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Tag {
    Stored,
    Removed,
    Cleared,
    Unknown,
}

fn tag_of(s: &str) -> Tag {
    match s {
        "BlockStored" => Tag::Stored,
        "BlockRemoved" => Tag::Removed,
        "AllBlocksCleared" => Tag::Cleared,
        _ => Tag::Unknown,
    }
}

/// Every field of every event kind, filled as they are met.
#[derive(Default)]
struct Fields {
    stored: WireBlockStored,
    has_hashes: bool,
    has_tokens: bool,
    has_block_size: bool,
}

fn decode_event(r: &mut Reader<'_>, c: Ctx) -> Result<WireEvent, DecodeError> {
    match r.peek_kind().at(c)? {
        Kind::Map => decode_tagged(r, c),
        Kind::Array => decode_positional(r, c),
        other => Err(c.err(DecodeErrorKind::Msgpack(MsgpackError {
            at: r.position(),
            kind: MsgpackErrorKind::Unexpected { expected: "event (map or array)", found: other.name() },
        }))),
    }
}

fn decode_tagged(r: &mut Reader<'_>, c: Ctx) -> Result<WireEvent, DecodeError> {
    let n = r.read_map_len().at(c)?;
    let mut f = Fields::default();
    let mut type_name: Option<String> = None;
    for _ in 0..n {
        if r.peek_kind().at(c)? != Kind::Str {
            // Not a field name vLLM would write: skip key and value.
            r.skip().at(c)?;
            r.skip().at(c)?;
            continue;
        }
        let key = r.read_str().at(c)?;
        if key == "type" {
            let ct = c.field("type");
            if r.peek_kind().at(ct)? != Kind::Str {
                return Err(ct.err(DecodeErrorKind::MissingType));
            }
            type_name = Some(r.read_str().at(ct)?.to_owned());
            continue;
        }
        read_field(r, c, key, &mut f)?;
    }
    let Some(type_name) = type_name else {
        return Err(c.err(DecodeErrorKind::MissingType));
    };
    finish(tag_of(&type_name), type_name, f, c)
}

/// Positional field order per event kind (vLLM 0.23; older versions stop earlier).
const STORED_ORDER: [&str; 11] = [
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
];
const REMOVED_ORDER: [&str; 3] = ["block_hashes", "medium", "group_idx"];

fn decode_positional(r: &mut Reader<'_>, c: Ctx) -> Result<WireEvent, DecodeError> {
    let n = r.read_array_len().at(c)?;
    if n == 0 || r.peek_kind().at(c)? != Kind::Str {
        return Err(c.err(DecodeErrorKind::MissingType));
    }
    let type_name = r.read_str().at(c.field("type"))?.to_owned();
    let tag = tag_of(&type_name);
    let order: &[&str] = match tag {
        Tag::Stored => &STORED_ORDER,
        Tag::Removed => &REMOVED_ORDER,
        Tag::Cleared | Tag::Unknown => &[],
    };
    let mut f = Fields::default();
    for i in 1..n {
        match order.get(i.saturating_sub(1)) {
            Some(key) => read_field(r, c, key, &mut f)?,
            None => r.skip().at(c)?,
        }
    }
    finish(tag, type_name, f, c)
}

fn finish(tag: Tag, type_name: String, f: Fields, c: Ctx) -> Result<WireEvent, DecodeError> {
    match tag {
        Tag::Stored => {
            for (present, name) in
                [(f.has_hashes, "block_hashes"), (f.has_tokens, "token_ids"), (f.has_block_size, "block_size")]
            {
                if !present {
                    return Err(c.field(name).err(DecodeErrorKind::MissingField));
                }
            }
            Ok(WireEvent::BlockStored(f.stored))
        }
        Tag::Removed => {
            if !f.has_hashes {
                return Err(c.field("block_hashes").err(DecodeErrorKind::MissingField));
            }
            let s = f.stored;
            Ok(WireEvent::BlockRemoved(WireBlockRemoved {
                block_hashes: s.block_hashes,
                medium: s.medium,
                group_idx: s.group_idx,
                locality: s.locality,
                ownership: s.ownership,
            }))
        }
        Tag::Cleared => Ok(WireEvent::AllBlocksCleared),
        Tag::Unknown => Ok(WireEvent::Unknown { type_name }),
    }
}

fn opt_str(r: &mut Reader<'_>, c: Ctx) -> Result<Option<String>, DecodeError> {
    if r.try_nil().at(c)? {
        return Ok(None);
    }
    Ok(Some(r.read_str().at(c)?.to_owned()))
}

fn opt_i64(r: &mut Reader<'_>, c: Ctx) -> Result<Option<i64>, DecodeError> {
    if r.try_nil().at(c)? {
        return Ok(None);
    }
    Ok(Some(r.read_i64().at(c)?))
}

fn read_hash(r: &mut Reader<'_>, c: Ctx) -> Result<u64, DecodeError> {
    match r.peek_kind().at(c)? {
        Kind::Bin => {
            let b = r.read_bin().at(c)?;
            key_of_bytes(b).map(|k| k.0).ok_or_else(|| c.err(DecodeErrorKind::HashTooShort(b.len())))
        }
        _ => r.read_u64().at(c),
    }
}

fn read_tokens(r: &mut Reader<'_>, c: Ctx) -> Result<Vec<u32>, DecodeError> {
    let n = r.read_array_len().at(c)?;
    let mut v = Vec::with_capacity(capacity(n, r));
    for _ in 0..n {
        match r.read_u32() {
            Ok(t) => v.push(t),
            // Read again, wider, to name the token in the error.
            Err(e) if matches!(e.kind, MsgpackErrorKind::OutOfRange { .. }) => match r.read_u64() {
                Ok(t) => return Err(c.err(DecodeErrorKind::TokenOutOfRange(t))),
                Err(_) => return Err(c.err(DecodeErrorKind::Msgpack(e))),
            },
            Err(e) => return Err(c.err(DecodeErrorKind::Msgpack(e))),
        }
    }
    Ok(v)
}

fn read_value(r: &mut Reader<'_>, c: Ctx, depth: u32) -> Result<WireValue, DecodeError> {
    if depth > MAX_DEPTH {
        return Err(c.err(DecodeErrorKind::TooDeep));
    }
    Ok(match r.peek_kind().at(c)? {
        Kind::Nil => {
            r.try_nil().at(c)?;
            WireValue::Nil
        }
        Kind::Bool => WireValue::Bool(r.read_bool().at(c)?),
        Kind::Int => match r.read_int().at(c)? {
            Int::U(u) => WireValue::UInt(u),
            Int::I(i) => WireValue::Int(i),
        },
        Kind::Float => WireValue::Float(r.read_f64().at(c)?),
        Kind::Str => WireValue::Str(r.read_str().at(c)?.to_owned()),
        Kind::Bin => WireValue::Bin(r.read_bin().at(c)?.to_vec()),
        Kind::Array => {
            let n = r.read_array_len().at(c)?;
            let mut v = Vec::with_capacity(capacity(n, r));
            for _ in 0..n {
                v.push(read_value(r, c, depth.saturating_add(1))?);
            }
            WireValue::Array(v)
        }
        Kind::Map | Kind::Ext => {
            r.skip().at(c)?;
            WireValue::Other
        }
    })
}

fn read_field(r: &mut Reader<'_>, c: Ctx, key: &str, f: &mut Fields) -> Result<(), DecodeError> {
    let s = &mut f.stored;
    match key {
        "block_hashes" => {
            let c = c.field("block_hashes");
            let n = r.read_array_len().at(c)?;
            s.block_hashes = Vec::with_capacity(capacity(n, r));
            for _ in 0..n {
                s.block_hashes.push(read_hash(r, c)?);
            }
            f.has_hashes = true;
        }
        "parent_block_hash" => {
            let c = c.field("parent_block_hash");
            s.parent_block_hash = if r.try_nil().at(c)? { None } else { Some(read_hash(r, c)?) };
        }
        "token_ids" => {
            s.token_ids = read_tokens(r, c.field("token_ids"))?;
            f.has_tokens = true;
        }
        "block_size" => {
            s.block_size = r.read_u64().at(c.field("block_size"))?;
            f.has_block_size = true;
        }
        "lora_id" => s.lora_id = opt_i64(r, c.field("lora_id"))?,
        "medium" => s.medium = opt_str(r, c.field("medium"))?,
        "lora_name" => s.lora_name = opt_str(r, c.field("lora_name"))?,
        "extra_keys" => {
            let c = c.field("extra_keys");
            if r.try_nil().at(c)? {
                s.extra_keys = None;
            } else {
                let n = r.read_array_len().at(c)?;
                let mut all = Vec::with_capacity(capacity(n, r));
                for _ in 0..n {
                    if r.try_nil().at(c)? {
                        all.push(None);
                        continue;
                    }
                    match read_value(r, c, 1)? {
                        WireValue::Array(items) => all.push(Some(items)),
                        other => all.push(Some(vec![other])),
                    }
                }
                s.extra_keys = Some(all);
            }
        }
        "group_idx" => s.group_idx = opt_i64(r, c.field("group_idx"))?,
        "kv_cache_spec_kind" => s.kv_cache_spec_kind = opt_str(r, c.field("kv_cache_spec_kind"))?,
        "kv_cache_spec_sliding_window" => {
            s.kv_cache_spec_sliding_window = opt_i64(r, c.field("kv_cache_spec_sliding_window"))?
        }
        "locality" => s.locality = opt_str(r, c.field("locality"))?,
        "ownership" => s.ownership = opt_str(r, c.field("ownership"))?,
        "session_id" => s.session_id = opt_str(r, c.field("session_id"))?,
        "lookahead_token_ids" => {
            let c = c.field("lookahead_token_ids");
            if r.try_nil().at(c)? {
                s.lookahead_token_ids = None;
            } else {
                let n = r.read_array_len().at(c)?;
                let mut all = Vec::with_capacity(capacity(n, r));
                for _ in 0..n {
                    all.push(read_tokens(r, c)?);
                }
                s.lookahead_token_ids = Some(all);
            }
        }
        _ => r.skip().at(c)?,
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::arithmetic_side_effects)]
mod tests {
    use super::*;

    fn unhex(s: &str) -> Vec<u8> {
        let s: String = s.split_whitespace().collect();
        (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
    }

    /// The worked example of vLLM 0.33's wire form (msgspec output).
    const EXAMPLE: &str = "93 cb3ff8000000000000 93
        de000b a474797065 ab426c6f636b53746f726564
          ac626c6f636b5f686173686573 92 0b cfffffffffffffffff
          b1706172656e745f626c6f636b5f68617368 c0
          a9746f6b656e5f696473 94 01020304
          aa626c6f636b5f73697a65 02
          a76c6f72615f6964 c0 a66d656469756d a3475055 a96c6f72615f6e616d65 c0
          aa65787472615f6b657973 92 c0c0
          a967726f75705f696478 00
          b26b765f63616368655f737065635f6b696e64 ae66756c6c5f617474656e74696f6e
        84 a474797065 ac426c6f636b52656d6f766564 ac626c6f636b5f686173686573 91 0b a66d656469756d a3475055 a967726f75705f696478 00
        81 a474797065 b0416c6c426c6f636b73436c6561726564
        00";

    #[test]
    fn decodes_the_documented_example() {
        let b = decode_batch(&unhex(EXAMPLE)).unwrap();
        assert_eq!(b.ts, 1.5);
        assert_eq!(b.data_parallel_rank, Some(0));
        assert_eq!(b.events.len(), 3);
        let WireEvent::BlockStored(s) = &b.events[0] else { panic!("not stored") };
        assert_eq!(s.block_hashes, vec![11, u64::MAX]);
        assert_eq!(s.parent_block_hash, None);
        assert_eq!(s.token_ids, vec![1, 2, 3, 4]);
        assert_eq!(s.block_size, 2);
        assert_eq!(s.medium.as_deref(), Some("GPU"));
        assert_eq!(s.extra_keys, Some(vec![None, None]));
        assert_eq!(s.group_idx, Some(0));
        assert_eq!(s.kv_cache_spec_kind.as_deref(), Some("full_attention"));
        assert_eq!(
            b.events[1],
            WireEvent::BlockRemoved(WireBlockRemoved {
                block_hashes: vec![11],
                medium: Some("GPU".into()),
                group_idx: Some(0),
                ..Default::default()
            })
        );
        assert_eq!(b.events[2], WireEvent::AllBlocksCleared);
    }

    #[test]
    fn every_truncation_is_an_error_not_a_panic() {
        let full = unhex(EXAMPLE);
        for n in 0..full.len() {
            assert!(decode_batch(&full[..n]).is_err(), "prefix of {n} bytes decoded");
        }
        let mut extra = full.clone();
        extra.push(0xc0);
        assert_eq!(decode_batch(&extra).unwrap_err().kind, DecodeErrorKind::TrailingBytes(1));
    }

    #[test]
    fn unknown_types_and_fields_are_skipped() {
        // [0, [{"type":"Future","x":[1,2]}, {"type":"AllBlocksCleared","new":{"a":1}}], nil, "extra"]
        let p = unhex("94 00 92 82 a474797065 a6467574757265 a178 920102 82 a474797065 b0416c6c426c6f636b73436c6561726564 a36e6577 81a16101 c0 a56578747261");
        let b = decode_batch(&p).unwrap();
        assert_eq!(b.events, vec![WireEvent::Unknown { type_name: "Future".into() }, WireEvent::AllBlocksCleared]);
        assert_eq!(b.data_parallel_rank, None);
    }

    #[test]
    fn binary_hashes_reduce_to_the_last_eight_bytes() {
        let mut p = unhex("93 00 91 83 a474797065 ac426c6f636b52656d6f766564 ac626c6f636b5f686173686573 91 c420");
        p.extend((0u8..32).collect::<Vec<_>>());
        p.extend(unhex("a66d656469756d c0 00"));
        let b = decode_batch(&p).unwrap();
        let WireEvent::BlockRemoved(rm) = &b.events[0] else { panic!() };
        assert_eq!(rm.block_hashes, vec![u64::from_be_bytes([24, 25, 26, 27, 28, 29, 30, 31])]);
    }

    #[test]
    fn missing_required_field_is_named() {
        // {"type":"BlockStored","block_hashes":[1]} (no token_ids)
        let p = unhex("93 00 91 82 a474797065 ab426c6f636b53746f726564 ac626c6f636b5f686173686573 9101 00");
        let e = decode_batch(&p).unwrap_err();
        assert_eq!(e.to_string(), "event 0, field token_ids: required field is missing");
    }

    #[test]
    fn announced_counts_reserve_what_the_bytes_can_hold() {
        let tail = [0u8; 100];
        let r = Reader::new(&tail);
        assert_eq!(capacity(u32::MAX as usize, &r), 100);
        let big = vec![0u8; 1 << 20];
        assert_eq!(capacity(u32::MAX as usize, &Reader::new(&big)), MAX_RESERVE);
        // 2^32-1 events announced in a 7-byte payload: an error, nothing reserved for them.
        let e = decode_batch(&[0x93, 0x00, 0xdd, 0xff, 0xff, 0xff, 0xff]).unwrap_err();
        assert_eq!(
            (e.event, e.kind),
            (Some(0), DecodeErrorKind::Msgpack(MsgpackError { at: 7, kind: MsgpackErrorKind::Truncated }))
        );
    }

    #[test]
    fn token_ids_must_fit_32_bits() {
        // {"type":"BlockStored","block_hashes":[1],"token_ids":[1, 2^32],"block_size":2}
        let stored = "a474797065 ab426c6f636b53746f726564 ac626c6f636b5f686173686573 9101 a9746f6b656e5f696473";
        let p = unhex(&format!("93 00 91 84 {stored} 92 01 cf0000000100000000 aa626c6f636b5f73697a65 02 00"));
        let e = decode_batch(&p).unwrap_err();
        assert_eq!((e.field, e.kind), (Some("token_ids"), DecodeErrorKind::TokenOutOfRange(1 << 32)));
        let p = unhex(&format!("93 00 91 84 {stored} 92 01 ff aa626c6f636b5f73697a65 02 00"));
        let e = decode_batch(&p).unwrap_err();
        assert!(matches!(
            e.kind,
            DecodeErrorKind::Msgpack(MsgpackError { kind: MsgpackErrorKind::OutOfRange { .. }, .. })
        ));
        let p = unhex(&format!("93 00 91 84 {stored} 92 01 ce ffffffff aa626c6f636b5f73697a65 02 00"));
        let Ok(b) = decode_batch(&p) else { panic!("u32::MAX is a token") };
        let WireEvent::BlockStored(s) = &b.events[0] else { panic!() };
        assert_eq!(s.token_ids, vec![1, u32::MAX]);
    }
}
