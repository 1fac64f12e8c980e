//! Helpers shared by the fuzz targets (`fuzz_targets/`) and the seed generator
//! (`examples/seeds.rs`): the framing of multi-message inputs, and a router in a known state.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]

use llmgw_core::config::{Compiled, MemoSettings};
use llmgw_core::feed::{
    Body as Msg, FeedMessage, LoadReport, Replica, ReplicaLoad, ReplicaTable, SnapshotChunk, SnapshotComplete,
};
use llmgw_core::flow::{
    EarlierTurns, InFlightCounts, LearnedRates, ReplicaAvoidance, Router, SpeculativeEntries, TokenizerCalls,
};
use llmgw_core::hash::{BlockHasher, HashAlgo, RequestExtras};

/// Splits `data` into frames, each a 2-byte little-endian length then that many bytes (the last
/// one cut short if the input ends first). Used by the targets that take a sequence of messages.
pub fn frames(mut data: &[u8]) -> impl Iterator<Item = &[u8]> {
    std::iter::from_fn(move || {
        if data.len() < 2 {
            return None;
        }
        let n = usize::from(u16::from_le_bytes([data[0], data[1]]));
        let rest = &data[2..];
        let (frame, tail) = rest.split_at(n.min(rest.len()));
        data = tail;
        Some(frame)
    })
}

/// The inverse of [`frames`].
pub fn encode_frames<T: AsRef<[u8]>>(parts: &[T]) -> Vec<u8> {
    let mut out = Vec::new();
    for p in parts {
        let p = p.as_ref();
        out.extend_from_slice(&u16::try_from(p.len()).unwrap().to_le_bytes());
        out.extend_from_slice(p);
    }
    out
}

/// Splits at the first NUL byte (which no JSON text contains unescaped): what comes before and,
/// if there was one, what follows.
pub fn split_nul(data: &[u8]) -> (&[u8], Option<&[u8]>) {
    match data.iter().position(|&b| b == 0) {
        Some(i) => (&data[..i], Some(&data[i + 1..])),
        None => (data, None),
    }
}

pub const A: &str = "127.0.0.1:8001";
pub const B: &str = "127.0.0.1:8002";
/// Block size of the fixture profile (small, so short prompts span blocks).
pub const BS: usize = 4;

/// The filter configuration of the fixture router: model `m` routed exactly on KV events
/// (blocks of 4, seed "0"), model `plain` approximately, a small tokenization cache.
pub const ROUTER_CONFIG: &str = r#"{"tokenizer_cache_bytes":65536,
  "profiles":[{"name":"p","models":["m"],"kv_events":true,"block_size":4,"seed":"0","approx_prefix_bytes":64},
              {"name":"off","models":["plain"]}]}"#;

/// Digest memo of the fixture routers: small, so building one per input stays cheap.
pub const MEMO: MemoSettings = MemoSettings { slots: 64, key: 1 };

/// Block keys of `tokens` under the fixture profile's hashing.
pub fn keys(tokens: &[u32]) -> Vec<u64> {
    let mut h = BlockHasher::new(HashAlgo::Sha256Cbor, Some("0")).unwrap();
    h.hash_request(tokens, BS, &RequestExtras::default()).unwrap().iter().map(|b| b.key.0).collect()
}

fn replica(id: u32, address: &str) -> Replica {
    Replica {
        id,
        name: format!("r{id}"),
        address: address.into(),
        models: vec![],
        up: true,
        dp_rank: 0,
        hash: None,
        dp_size: 0,
        kv_groups: vec![],
        lora_adapters: vec![],
        mirror_incomplete: false,
    }
}

/// The messages that bring a fresh subscription to the fixture state: replicas A and B up, B
/// holding the first blocks of tokens 1..=12, loads for both, the snapshot complete.
pub fn fixture_feed() -> Vec<FeedMessage> {
    let bodies = [
        Msg::Replicas(ReplicaTable { replicas: vec![replica(0, A), replica(1, B)] }),
        Msg::Snapshot(SnapshotChunk { replica: 1, first: true, blocks: keys(&(1..=12).collect::<Vec<u32>>()) }),
        Msg::Load(LoadReport {
            loads: vec![
                ReplicaLoad { replica: 0, running: 1, waiting: 0, kv_cache_usage: 0.25, gpu_blocks: 0 },
                ReplicaLoad { replica: 1, running: 2, waiting: 1, kv_cache_usage: 0.5, gpu_blocks: 0 },
            ],
        }),
        Msg::SnapshotComplete(SnapshotComplete {}),
    ];
    bodies.into_iter().enumerate().map(|(seq, body)| FeedMessage { seq: seq as u64, body: Some(body) }).collect()
}

/// A router on [`ROUTER_CONFIG`] whose feed is in the fixture state.
pub fn fixture_router() -> Router {
    let mut r = Router::new(Compiled::from_json(ROUTER_CONFIG.as_bytes(), Some(MEMO)).unwrap(), 2);
    r.feed.begin_subscription();
    for m in fixture_feed() {
        r.feed.apply(&m).unwrap();
    }
    r
}

/// Requests in flight: a fixed count per address, and one address avoided.
pub struct Counts;

impl InFlightCounts for Counts {
    fn in_flight(&self, address: &str) -> u32 {
        u32::try_from(address.len() % 3).unwrap_or(0)
    }
}

impl ReplicaAvoidance for Counts {
    fn avoided(&self, address: &str) -> bool {
        address.ends_with(":9")
    }
}

impl SpeculativeEntries for Counts {}
impl LearnedRates for Counts {}
impl TokenizerCalls for Counts {}
impl EarlierTurns for Counts {}
