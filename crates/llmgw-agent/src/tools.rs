//! Parity tools: compute the block hashes vLLM would publish for a token list, and decode a
//! captured event payload, so users can compare a replica with the router by hand.

use clap::Args;
use llmgw_core::event::{EventBatch, KvEvent};
use llmgw_core::hash::{defaults, hex, BlockHasher, HashAlgo, RequestExtras};
use llmgw_core::index::ReplicaIndex;
use llmgw_core::mirror::EngineMirror;
use llmgw_core::wire::{decode_batch, WireEvent, WireValue};
use serde_json::{json, Map, Value};
use std::io::{Read, Write};
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct HashArgs {
    /// vLLM's --prefix-caching-hash-algo: sha256_cbor, sha256, xxhash_cbor or xxhash.
    #[arg(long)]
    pub algo: String,
    /// The replicas' PYTHONHASHSEED (omit when unset).
    #[arg(long)]
    pub seed: Option<String>,
    /// Tokens per KV block.
    #[arg(long)]
    pub block_size: u32,
    /// The request's cache_salt.
    #[arg(long)]
    pub cache_salt: Option<String>,
    /// LoRA adapter name (needs --lora-path).
    #[arg(long, requires = "lora_path")]
    pub lora_name: Option<String>,
    /// LoRA adapter path, as the engine loaded it (needs --lora-name).
    #[arg(long, requires = "lora_name")]
    pub lora_path: Option<String>,
    /// vLLM's lookahead hashing (EAGLE-family speculative decoding with prefix caching): each
    /// block's hash also covers the next N tokens.
    #[arg(long, default_value_t = 0)]
    pub lookahead_tokens: u32,
}

#[derive(Args, Debug)]
pub struct DecodeArgs {
    /// Read hex text instead of raw bytes.
    #[arg(long)]
    pub hex: bool,
}

/// Why a tool failed.
#[derive(Debug, thiserror::Error)]
pub enum ToolError {
    #[error("cannot read stdin: {0}")]
    Stdin(std::io::Error),
    #[error("{0}")]
    Output(#[from] std::io::Error),
    #[error("{0}")]
    Json(#[from] serde_json::Error),
    #[error("--block-size must be at least 1")]
    BlockSizeZero,
    #[error("--block-size {0} does not fit this platform")]
    BlockSizeTooLarge(u32),
    #[error("--lookahead-tokens must be at most {}", llmgw_core::hash::MAX_LOOKAHEAD)]
    Lookahead,
    /// The hash settings or the hashing refused (the hasher's own message).
    #[error("{0}")]
    Hash(String),
    #[error("stdin must be a JSON array of token ids (0..2^32): {0}")]
    Tokens(serde_json::Error),
    #[error("hex input has an odd number of digits ({0})")]
    OddHex(usize),
    #[error("invalid hex digit pair at position {0}")]
    BadHex(usize),
    #[error("malformed payload: {0}")]
    Malformed(String),
    #[error("{}: {source}", path.display())]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{} line {line}: {source}", path.display())]
    Line { path: PathBuf, line: usize, source: serde_json::Error },
    #[error("{} line {line}: all_token_ids: {source}", path.display())]
    TokenIds { path: PathBuf, line: usize, source: serde_json::Error },
    #[error("capture line {0}: no payload_hex")]
    NoPayloadHex(usize),
    #[error(
        "{0} block hashes did not match: the engine's PYTHONHASHSEED or hash algorithm differs from --seed/--algo"
    )]
    ParityMismatch(u64),
}

fn hash_error(e: impl std::fmt::Display) -> ToolError {
    ToolError::Hash(e.to_string())
}

fn read_stdin() -> Result<Vec<u8>, ToolError> {
    let mut buf = Vec::new();
    std::io::stdin().read_to_end(&mut buf).map_err(ToolError::Stdin)?;
    Ok(buf)
}

fn print(v: &Value) -> Result<(), ToolError> {
    let mut out = std::io::stdout().lock();
    serde_json::to_writer(&mut out, v)?;
    Ok(writeln!(out)?)
}

/// `--block-size`, which must be at least 1.
fn block_size(n: u32) -> Result<usize, ToolError> {
    match usize::try_from(n) {
        Ok(0) => Err(ToolError::BlockSizeZero),
        Ok(n) => Ok(n),
        Err(_) => Err(ToolError::BlockSizeTooLarge(n)),
    }
}

pub fn hash(a: &HashArgs) -> Result<(), ToolError> {
    let algo = HashAlgo::parse(&a.algo).map_err(hash_error)?;
    let block_size = block_size(a.block_size)?;
    let input = read_stdin()?;
    let tokens: Vec<u32> = serde_json::from_slice(&input).map_err(ToolError::Tokens)?;
    let mut hasher = BlockHasher::new(algo, a.seed.as_deref()).map_err(hash_error)?;
    let extras = RequestExtras {
        cache_salt: a.cache_salt.clone(),
        lora: a.lora_name.clone().zip(a.lora_path.clone()),
        mm: Vec::new(),
        lookahead: usize::try_from(a.lookahead_tokens)
            .ok()
            .filter(|&l| l <= llmgw_core::hash::MAX_LOOKAHEAD)
            .ok_or(ToolError::Lookahead)?,
    };
    let blocks = hasher.hash_request(&tokens, block_size, &extras).map_err(hash_error)?;
    let blocks: Vec<Value> = blocks.iter().map(|b| json!({"hash_hex": b.digest.to_hex(), "u64": b.key})).collect();
    print(&json!({ "blocks": blocks }))
}

fn parse_hex(text: &[u8]) -> Result<Vec<u8>, ToolError> {
    let digits: Vec<u8> = text.iter().copied().filter(|b| !b.is_ascii_whitespace()).collect();
    if !digits.len().is_multiple_of(2) {
        return Err(ToolError::OddHex(digits.len()));
    }
    digits
        .chunks(2)
        .enumerate()
        .map(|(i, pair)| {
            std::str::from_utf8(pair)
                .ok()
                .and_then(|s| u8::from_str_radix(s, 16).ok())
                .ok_or(ToolError::BadHex(i.saturating_mul(2)))
        })
        .collect()
}

fn value_json(v: &WireValue) -> Value {
    match v {
        WireValue::Nil | WireValue::Other => Value::Null,
        WireValue::Bool(b) => json!(b),
        WireValue::Int(i) => json!(i),
        WireValue::UInt(u) => json!(u),
        WireValue::Float(f) => json!(f),
        WireValue::Str(s) => json!(s),
        WireValue::Bin(b) => json!(hex(b)),
        WireValue::Array(a) => Value::Array(a.iter().map(value_json).collect()),
    }
}

/// The JSON form of one event; `None` for an unknown type.
pub fn event_json(ev: &WireEvent) -> Option<Value> {
    Some(match ev {
        WireEvent::BlockStored(s) => {
            let mut m = Map::new();
            m.insert("type".into(), json!("BlockStored"));
            m.insert("block_hashes".into(), json!(s.block_hashes));
            m.insert("parent".into(), json!(s.parent_block_hash));
            m.insert("token_ids".into(), json!(s.token_ids));
            m.insert("block_size".into(), json!(s.block_size));
            m.insert("medium".into(), json!(s.medium));
            m.insert("lora_name".into(), json!(s.lora_name));
            m.insert(
                "extra_keys".into(),
                match &s.extra_keys {
                    None => Value::Null,
                    Some(all) => Value::Array(
                        all.iter()
                            .map(|e| {
                                e.as_ref()
                                    .map_or(Value::Null, |items| Value::Array(items.iter().map(value_json).collect()))
                            })
                            .collect(),
                    ),
                },
            );
            m.insert("group_idx".into(), json!(s.group_idx));
            // Further fields only when the engine set them.
            let optional = [
                ("lora_id", s.lora_id.map(|v| json!(v))),
                ("kv_cache_spec_kind", s.kv_cache_spec_kind.as_ref().map(|v| json!(v))),
                ("kv_cache_spec_sliding_window", s.kv_cache_spec_sliding_window.map(|v| json!(v))),
                ("locality", s.locality.as_ref().map(|v| json!(v))),
                ("ownership", s.ownership.as_ref().map(|v| json!(v))),
                ("session_id", s.session_id.as_ref().map(|v| json!(v))),
                ("lookahead_token_ids", s.lookahead_token_ids.as_ref().map(|v| json!(v))),
            ];
            for (k, v) in optional {
                if let Some(v) = v {
                    m.insert(k.into(), v);
                }
            }
            Value::Object(m)
        }
        WireEvent::BlockRemoved(r) => {
            let mut m = Map::new();
            m.insert("type".into(), json!("BlockRemoved"));
            m.insert("block_hashes".into(), json!(r.block_hashes));
            m.insert("medium".into(), json!(r.medium));
            for (k, v) in [
                ("group_idx", r.group_idx.map(|v| json!(v))),
                ("locality", r.locality.as_ref().map(|v| json!(v))),
                ("ownership", r.ownership.as_ref().map(|v| json!(v))),
            ] {
                if let Some(v) = v {
                    m.insert(k.into(), v);
                }
            }
            Value::Object(m)
        }
        WireEvent::AllBlocksCleared => json!({"type": "AllBlocksCleared"}),
        WireEvent::Unknown { .. } => return None,
    })
}

pub fn decode(a: &DecodeArgs) -> Result<(), ToolError> {
    let input = read_stdin()?;
    let payload = if a.hex { parse_hex(&input)? } else { input };
    let batch = decode_batch(&payload).map_err(|e| ToolError::Malformed(e.to_string()))?;
    let mut events = Vec::new();
    let mut skipped = Vec::new();
    for (i, ev) in batch.events.iter().enumerate() {
        match event_json(ev) {
            Some(v) => events.push(v),
            None => skipped.push(json!({"index": i, "type": ev.type_name()})),
        }
    }
    let mut out = json!({"ts": batch.ts, "dp_rank": batch.data_parallel_rank, "events": events});
    if !skipped.is_empty() {
        if let Some(m) = out.as_object_mut() {
            m.insert("skipped".into(), Value::Array(skipped));
        }
    }
    print(&out)
}

#[derive(Args, Debug)]
pub struct ReplayArgs {
    /// Capture: JSON lines, each with "payload_hex" (and optionally "seq").
    #[arg(long)]
    pub capture: PathBuf,
    /// Requests to score: JSON lines with "request_id", "all_token_ids", optional "cache_salt".
    #[arg(long)]
    pub requests: Option<PathBuf>,
    /// The engine's --prefix-caching-hash-algo, for parity checks.
    #[arg(long, default_value = defaults::ALGO.name())]
    pub algo: String,
    /// The engine's PYTHONHASHSEED (omit when unset).
    #[arg(long)]
    pub seed: Option<String>,
    /// Tokens per KV block.
    #[arg(long, default_value_t = defaults::BLOCK_SIZE)]
    pub block_size: u32,
}

struct Request {
    id: String,
    keys: Vec<llmgw_core::BlockKey>,
    best: u32,
    best_seq: Option<u64>,
}

/// The 1-based line number of the `i`th line.
fn line_no(i: usize) -> usize {
    i.saturating_add(1)
}

fn read_jsonl(path: &PathBuf) -> Result<Vec<Value>, ToolError> {
    let text = std::fs::read_to_string(path).map_err(|source| ToolError::Read { path: path.clone(), source })?;
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            serde_json::from_str(l).map_err(|source| ToolError::Line { path: path.clone(), line: line_no(i), source })
        })
        .collect()
}

pub fn replay(a: &ReplayArgs) -> Result<(), ToolError> {
    let algo = HashAlgo::parse(&a.algo).map_err(hash_error)?;
    let block_size = block_size(a.block_size)?;
    let mut hasher = BlockHasher::new(algo, a.seed.as_deref()).map_err(hash_error)?;
    let mut mirror = EngineMirror::new(Some(BlockHasher::new(algo, a.seed.as_deref()).map_err(hash_error)?));
    let mut index = ReplicaIndex::new();
    let mut requests = Vec::new();
    if let Some(p) = &a.requests {
        for (i, r) in read_jsonl(p)?.iter().enumerate() {
            let tokens: Vec<u32> = serde_json::from_value(r["all_token_ids"].clone())
                .map_err(|source| ToolError::TokenIds { path: p.clone(), line: line_no(i), source })?;
            let extras =
                RequestExtras { cache_salt: r["cache_salt"].as_str().map(str::to_owned), ..Default::default() };
            let keys = hasher.hash_request(&tokens, block_size, &extras).map_err(hash_error)?;
            requests.push(Request {
                id: r["request_id"].as_str().unwrap_or("?").to_owned(),
                keys: keys.iter().map(|b| b.key).collect(),
                best: 0,
                best_seq: None,
            });
        }
    }
    let mut out = std::io::stdout().lock();
    let w = |out: &mut std::io::StdoutLock<'_>, s: String| writeln!(out, "{s}");
    w(
        &mut out,
        format!(
            "{:>5} {:>6} {:>7} {:>8} {:>7} {:>7} {:>6}  parity",
            "seq", "events", "stored", "removed", "+held", "-held", "held"
        ),
    )?;
    let mut changes = Vec::new();
    let mut last_seq: Option<u64> = None;
    for (i, rec) in read_jsonl(&a.capture)?.iter().enumerate() {
        let seq = rec["seq"].as_u64().unwrap_or(i as u64);
        if let Some(prev) = last_seq {
            if seq != prev.saturating_add(1) {
                w(&mut out, format!("  sequence jump {prev} -> {seq}: a live agent would replay or reset here"))?;
            }
        }
        last_seq = Some(seq);
        let hexs = rec["payload_hex"].as_str().ok_or(ToolError::NoPayloadHex(line_no(i)))?;
        let payload = parse_hex(hexs.as_bytes())?;
        let batch = match EventBatch::decode(&payload) {
            Ok(b) => b,
            Err(e) => {
                w(&mut out, format!("{seq:>5} malformed payload skipped: {e}"))?;
                continue;
            }
        };
        let (mut stored, mut removed) = (0usize, 0usize);
        for ev in &batch.events {
            match ev {
                KvEvent::Stored(s) => stored = stored.saturating_add(s.hashes.len()),
                KvEvent::Removed(r) => removed = removed.saturating_add(r.hashes.len()),
                _ => {}
            }
        }
        changes.clear();
        mirror.apply(&batch, &mut changes);
        index.apply(llmgw_core::ReplicaId(0), &changes);
        let added = changes.iter().filter(|c| matches!(c, llmgw_core::NetChange::Added(_))).count();
        let p = &mirror.stats().parity;
        w(
            &mut out,
            format!(
                "{seq:>5} {:>6} {stored:>7} {removed:>8} {added:>7} {:>7} {:>6}  {}/{} match",
                batch.events.len(),
                changes.len().saturating_sub(added),
                mirror.len(),
                p.matched,
                p.matched.saturating_add(p.mismatched)
            ),
        )?;
        for r in &mut requests {
            let got = index.score(&r.keys).leading.first().copied().unwrap_or(0);
            if got > r.best {
                r.best = got;
                r.best_seq = Some(seq);
            }
        }
    }
    let st = mirror.stats();
    let ratio = st.parity.match_ratio().map_or("n/a".to_owned(), |r| format!("{:.1}%", r * 100.0));
    w(
        &mut out,
        format!(
            "\nparity: {} of {} recomputed block hashes match vLLM's ({ratio}); {} unverifiable; \
             {} blocks stored, {} removed, {} clears; {} held at the end",
            st.parity.matched,
            st.parity.matched.saturating_add(st.parity.mismatched),
            st.parity.unverifiable,
            st.blocks_stored,
            st.blocks_removed,
            st.clears,
            mirror.len()
        ),
    )?;
    if !requests.is_empty() {
        w(&mut out, format!("\n{:<10} {:>7} {:>14} {:>8}", "request", "blocks", "best prefix", "at seq"))?;
        for r in &requests {
            let at = r.best_seq.map_or("-".to_owned(), |s| s.to_string());
            w(
                &mut out,
                format!(
                    "{:<10} {:>7} {:>8} ({:>3.0}%) {:>8}",
                    r.id,
                    r.keys.len(),
                    r.best,
                    100.0 * f64::from(r.best) / r.keys.len().max(1) as f64,
                    at
                ),
            )?;
        }
    }
    if st.parity.mismatched > 0 {
        return Err(ToolError::ParityMismatch(st.parity.mismatched));
    }
    Ok(())
}
