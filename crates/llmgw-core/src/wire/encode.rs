//! vLLM's msgpack form of a batch, written with `rmp` (shortest forms, as msgspec writes them).
//! Used by the simulator, tests and benchmarks; the filter and the agent only decode.

use super::batch::{Encoding, HashForm, WireBatch, WireEvent, WireValue};
use rmp::encode::{self as re, ByteBuf, ValueWriteError};
use std::convert::Infallible;

/// Appends msgpack values to a growable buffer, which cannot fail.
struct Writer(ByteBuf);

/// `rmp`'s results for an in-memory buffer: the error type is `Infallible`, so there is none.
fn done<T>(r: Result<T, ValueWriteError<Infallible>>) {
    match r {
        Ok(_) => {}
        Err(ValueWriteError::InvalidMarkerWrite(e) | ValueWriteError::InvalidDataWrite(e)) => match e {},
    }
}

/// An array or map length as msgpack carries it (32 bits; a longer one would be clamped).
/// Nothing the simulator, tests or benchmarks write comes near 2³² items.
fn len32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

impl Writer {
    fn array(&mut self, n: usize) {
        done(re::write_array_len(&mut self.0, len32(n)));
    }
    fn map(&mut self, n: usize) {
        done(re::write_map_len(&mut self.0, len32(n)));
    }
    fn nil(&mut self) {
        let Ok(()) = re::write_nil(&mut self.0);
    }
    fn bool(&mut self, b: bool) {
        let Ok(()) = re::write_bool(&mut self.0, b);
    }
    fn uint(&mut self, v: u64) {
        done(re::write_uint(&mut self.0, v));
    }
    fn int(&mut self, v: i64) {
        done(re::write_sint(&mut self.0, v));
    }
    fn f64(&mut self, v: f64) {
        done(re::write_f64(&mut self.0, v));
    }
    fn str(&mut self, s: &str) {
        done(re::write_str(&mut self.0, s));
    }
    fn bin(&mut self, b: &[u8]) {
        done(re::write_bin(&mut self.0, b));
    }
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
    let mut w = Writer(ByteBuf::new());
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
    w.0.into_vec()
}
