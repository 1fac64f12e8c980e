//! vLLM's `KVEventBatch` msgpack payload, as it travels on the wire.
//!
//! The batch is always an array `[ts, events, data_parallel_rank]` (extra trailing elements are
//! ignored). Each event is either a map tagged by `"type"` (vLLM ≥ 0.24) or a positional array
//! `["BlockStored", field1, …]` (vLLM ≤ 0.23); both decode to the same [`WireEvent`]. Hashes may
//! be integers of any msgpack width or binaries (16 or 32 bytes), and are reduced to the published
//! u64 form. Unknown fields and unknown event types are skipped, never refused.
//!
//! These types mirror the wire one to one; [`crate::event`] holds the domain view.

use crate::hash::key_of_bytes;
use crate::msgpack::{Int, Kind, MsgpackError, MsgpackErrorKind, Reader, Writer};
use std::fmt;

/// Which encoding the events of a batch used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoding {
    /// Maps tagged by `"type"` (vLLM ≥ 0.24).
    Tagged,
    /// Positional arrays (vLLM ≤ 0.23).
    Positional,
}

/// A decoded batch.
#[derive(Debug, Clone, PartialEq)]
pub struct WireBatch {
    pub ts: f64,
    pub events: Vec<WireEvent>,
    pub data_parallel_rank: Option<i64>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum WireEvent {
    BlockStored(WireBlockStored),
    BlockRemoved(WireBlockRemoved),
    AllBlocksCleared,
    /// An event type this version does not know; its content was skipped.
    Unknown {
        type_name: String,
    },
}

impl WireEvent {
    pub fn type_name(&self) -> &str {
        match self {
            WireEvent::BlockStored(_) => "BlockStored",
            WireEvent::BlockRemoved(_) => "BlockRemoved",
            WireEvent::AllBlocksCleared => "AllBlocksCleared",
            WireEvent::Unknown { type_name } => type_name,
        }
    }
}

/// `BlockStored`, every field vLLM 0.33 publishes.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct WireBlockStored {
    pub block_hashes: Vec<u64>,
    pub parent_block_hash: Option<u64>,
    pub token_ids: Vec<u32>,
    pub block_size: u64,
    pub lora_id: Option<i64>,
    pub medium: Option<String>,
    pub lora_name: Option<String>,
    /// One entry per block hash: `None`, or the block's extra keys as published (untagged).
    pub extra_keys: Option<Vec<Option<Vec<WireValue>>>>,
    pub group_idx: Option<i64>,
    pub kv_cache_spec_kind: Option<String>,
    pub kv_cache_spec_sliding_window: Option<i64>,
    pub locality: Option<String>,
    pub ownership: Option<String>,
    pub session_id: Option<String>,
    pub lookahead_token_ids: Option<Vec<Vec<u32>>>,
}

/// `BlockRemoved`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct WireBlockRemoved {
    pub block_hashes: Vec<u64>,
    pub medium: Option<String>,
    pub group_idx: Option<i64>,
    pub locality: Option<String>,
    pub ownership: Option<String>,
}

/// A free-form value (the items of `extra_keys`).
#[derive(Debug, Clone, PartialEq)]
pub enum WireValue {
    Nil,
    Bool(bool),
    Int(i64),
    UInt(u64),
    Float(f64),
    Str(String),
    Bin(Vec<u8>),
    Array(Vec<WireValue>),
    /// A map or an extension value: kept only as a marker.
    Other,
}

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
    let mut events = Vec::with_capacity(n_events.min(payload.len()));
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
            key_of_bytes(b).ok_or_else(|| c.err(DecodeErrorKind::HashTooShort(b.len())))
        }
        _ => r.read_u64().at(c),
    }
}

fn read_tokens(r: &mut Reader<'_>, c: Ctx) -> Result<Vec<u32>, DecodeError> {
    let n = r.read_array_len().at(c)?;
    let mut v = Vec::with_capacity(n.min(1 << 20));
    for _ in 0..n {
        let t = r.read_u64().at(c)?;
        v.push(u32::try_from(t).map_err(|_| c.err(DecodeErrorKind::TokenOutOfRange(t)))?);
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
            let mut v = Vec::with_capacity(n.min(64));
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
            s.block_hashes = Vec::with_capacity(n.min(1 << 16));
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
                let mut all = Vec::with_capacity(n.min(1 << 16));
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
                let mut all = Vec::with_capacity(n.min(1 << 16));
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

/// How block hashes are written by [`encode_batch`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HashForm {
    /// Unsigned integers (vLLM's default, `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`).
    Int,
    /// 32-byte binaries whose last 8 bytes are the key (the leading 24 bytes are zero here).
    Bytes,
}

fn write_hash(w: &mut Writer, h: u64, form: HashForm) {
    match form {
        HashForm::Int => w.uint(h),
        HashForm::Bytes => {
            let mut b = [0u8; 32];
            if let Some(tail) = b.get_mut(24..) {
                tail.copy_from_slice(&h.to_be_bytes());
            }
            w.bin(&b);
        }
    }
}

fn write_opt_str(w: &mut Writer, v: &Option<String>) {
    match v {
        Some(s) => w.str(s),
        None => w.nil(),
    }
}

fn write_opt_i64(w: &mut Writer, v: Option<i64>) {
    match v {
        Some(i) => w.int(i),
        None => w.nil(),
    }
}

fn write_value(w: &mut Writer, v: &WireValue) {
    match v {
        WireValue::Nil | WireValue::Other => w.nil(),
        WireValue::Bool(b) => w.bool(*b),
        WireValue::Int(i) => w.int(*i),
        WireValue::UInt(u) => w.uint(*u),
        WireValue::Float(f) => w.f64(*f),
        WireValue::Str(s) => w.str(s),
        WireValue::Bin(b) => w.bin(b),
        WireValue::Array(a) => {
            w.array(a.len());
            a.iter().for_each(|x| write_value(w, x));
        }
    }
}

fn write_tokens(w: &mut Writer, t: &[u32]) {
    w.array(t.len());
    t.iter().for_each(|&x| w.uint(u64::from(x)));
}

fn write_extra_keys(w: &mut Writer, v: &Option<Vec<Option<Vec<WireValue>>>>) {
    match v {
        None => w.nil(),
        Some(all) => {
            w.array(all.len());
            for e in all {
                match e {
                    None => w.nil(),
                    Some(items) => {
                        w.array(items.len());
                        items.iter().for_each(|x| write_value(w, x));
                    }
                }
            }
        }
    }
}

/// Encodes a batch as vLLM does: `Tagged` is vLLM ≥ 0.24 (maps; optional fields omitted when
/// `None`), `Positional` is vLLM ≤ 0.23 (full-length arrays). Fields newer than 0.23
/// (`locality`, `ownership`, `session_id`, `lookahead_token_ids`) exist only in the tagged form.
pub fn encode_batch(b: &WireBatch, enc: Encoding, form: HashForm) -> Vec<u8> {
    let mut w = Writer::new();
    w.array(3);
    w.f64(b.ts);
    w.array(b.events.len());
    for ev in &b.events {
        match (ev, enc) {
            (WireEvent::BlockStored(s), Encoding::Tagged) => {
                let optional: [(&str, bool); 8] = [
                    ("extra_keys", s.extra_keys.is_some()),
                    ("group_idx", s.group_idx.is_some()),
                    ("kv_cache_spec_kind", s.kv_cache_spec_kind.is_some()),
                    ("kv_cache_spec_sliding_window", s.kv_cache_spec_sliding_window.is_some()),
                    ("locality", s.locality.is_some()),
                    ("ownership", s.ownership.is_some()),
                    ("session_id", s.session_id.is_some()),
                    ("lookahead_token_ids", s.lookahead_token_ids.is_some()),
                ];
                let present = optional.iter().filter(|(_, p)| *p).count();
                w.map(8usize.saturating_add(present));
                w.str("type");
                w.str("BlockStored");
                w.str("block_hashes");
                w.array(s.block_hashes.len());
                s.block_hashes.iter().for_each(|&h| write_hash(&mut w, h, form));
                w.str("parent_block_hash");
                match s.parent_block_hash {
                    Some(h) => write_hash(&mut w, h, form),
                    None => w.nil(),
                }
                w.str("token_ids");
                write_tokens(&mut w, &s.token_ids);
                w.str("block_size");
                w.uint(s.block_size);
                w.str("lora_id");
                write_opt_i64(&mut w, s.lora_id);
                w.str("medium");
                write_opt_str(&mut w, &s.medium);
                w.str("lora_name");
                write_opt_str(&mut w, &s.lora_name);
                if s.extra_keys.is_some() {
                    w.str("extra_keys");
                    write_extra_keys(&mut w, &s.extra_keys);
                }
                if let Some(g) = s.group_idx {
                    w.str("group_idx");
                    w.int(g);
                }
                if let Some(v) = &s.kv_cache_spec_kind {
                    w.str("kv_cache_spec_kind");
                    w.str(v);
                }
                if let Some(v) = s.kv_cache_spec_sliding_window {
                    w.str("kv_cache_spec_sliding_window");
                    w.int(v);
                }
                for (k, v) in [("locality", &s.locality), ("ownership", &s.ownership), ("session_id", &s.session_id)] {
                    if let Some(v) = v {
                        w.str(k);
                        w.str(v);
                    }
                }
                if let Some(la) = &s.lookahead_token_ids {
                    w.str("lookahead_token_ids");
                    w.array(la.len());
                    la.iter().for_each(|t| write_tokens(&mut w, t));
                }
            }
            (WireEvent::BlockStored(s), Encoding::Positional) => {
                w.array(12);
                w.str("BlockStored");
                w.array(s.block_hashes.len());
                s.block_hashes.iter().for_each(|&h| write_hash(&mut w, h, form));
                match s.parent_block_hash {
                    Some(h) => write_hash(&mut w, h, form),
                    None => w.nil(),
                }
                write_tokens(&mut w, &s.token_ids);
                w.uint(s.block_size);
                write_opt_i64(&mut w, s.lora_id);
                write_opt_str(&mut w, &s.medium);
                write_opt_str(&mut w, &s.lora_name);
                write_extra_keys(&mut w, &s.extra_keys);
                write_opt_i64(&mut w, s.group_idx);
                write_opt_str(&mut w, &s.kv_cache_spec_kind);
                write_opt_i64(&mut w, s.kv_cache_spec_sliding_window);
            }
            (WireEvent::BlockRemoved(r), Encoding::Tagged) => {
                let present =
                    [r.group_idx.is_some(), r.locality.is_some(), r.ownership.is_some()].iter().filter(|p| **p).count();
                w.map(3usize.saturating_add(present));
                w.str("type");
                w.str("BlockRemoved");
                w.str("block_hashes");
                w.array(r.block_hashes.len());
                r.block_hashes.iter().for_each(|&h| write_hash(&mut w, h, form));
                w.str("medium");
                write_opt_str(&mut w, &r.medium);
                if let Some(g) = r.group_idx {
                    w.str("group_idx");
                    w.int(g);
                }
                for (k, v) in [("locality", &r.locality), ("ownership", &r.ownership)] {
                    if let Some(v) = v {
                        w.str(k);
                        w.str(v);
                    }
                }
            }
            (WireEvent::BlockRemoved(r), Encoding::Positional) => {
                w.array(4);
                w.str("BlockRemoved");
                w.array(r.block_hashes.len());
                r.block_hashes.iter().for_each(|&h| write_hash(&mut w, h, form));
                write_opt_str(&mut w, &r.medium);
                write_opt_i64(&mut w, r.group_idx);
            }
            (WireEvent::AllBlocksCleared, Encoding::Tagged) => {
                w.map(1);
                w.str("type");
                w.str("AllBlocksCleared");
            }
            (WireEvent::AllBlocksCleared, Encoding::Positional) => {
                w.array(1);
                w.str("AllBlocksCleared");
            }
            (WireEvent::Unknown { type_name }, Encoding::Tagged) => {
                w.map(1);
                w.str("type");
                w.str(type_name);
            }
            (WireEvent::Unknown { type_name }, Encoding::Positional) => {
                w.array(1);
                w.str(type_name);
            }
        }
    }
    write_opt_i64(&mut w, b.data_parallel_rank);
    w.into_inner()
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
}
