//! Ingest benchmark (not a test): decode + mirror + feed, in blocks per second on one core with
//! one subscriber draining the feed, and memory per mirrored block.
//!
//! `cargo run --release -p llmgw-agent --example ingest_bench [BATCHES] [BLOCKS_PER_BATCH]`
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::arithmetic_side_effects
)]

use llmgw_agent::config::Config;
use llmgw_agent::hub::Hub;
use llmgw_core::event::EventBatch;
use llmgw_core::wire::{encode_batch, Encoding, HashForm, WireBatch, WireBlockRemoved, WireBlockStored, WireEvent};
use std::time::Instant;

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm.split_whitespace().nth(1).and_then(|v| v.parse().ok()).unwrap_or(0);
    pages * 4096
}

fn hub() -> std::sync::Arc<Hub> {
    let cfg = Config::parse(
        "[hash]\nalgo = \"sha256_cbor\"\nseed = \"0\"\n[[replicas]]\nname = \"r0\"\naddress = \"127.0.0.1:8000\"\nendpoint = \"tcp://127.0.0.1:5557\"\n",
    )
    .expect("config");
    Hub::new(cfg.engines(), 1 << 16, usize::MAX)
}

fn ingest(batches: u64, per: u64, parity: bool) {
    // Payloads as vLLM publishes them: each batch stores `per` new blocks (token ids included, so
    // parity runs for chains starting at block 0) and removes the `per` stored 4 batches earlier.
    let mut payloads = Vec::new();
    for b in 0..batches {
        let base = b * per + 1;
        let mut events = vec![WireEvent::BlockStored(WireBlockStored {
            block_hashes: (base..base + per).map(|k| k.wrapping_mul(0x9E37_79B9_7F4A_7C15)).collect(),
            parent_block_hash: if parity { None } else { Some(1) },
            token_ids: vec![7; (16 * per) as usize],
            block_size: 16,
            medium: Some("GPU".into()),
            ..Default::default()
        })];
        if b >= 4 {
            let old = (b - 4) * per + 1;
            events.push(WireEvent::BlockRemoved(WireBlockRemoved {
                block_hashes: (old..old + per).map(|k| k.wrapping_mul(0x9E37_79B9_7F4A_7C15)).collect(),
                medium: Some("GPU".into()),
                ..Default::default()
            }));
        }
        let w = WireBatch { ts: 1.0, events, data_parallel_rank: Some(0) };
        payloads.push(encode_batch(&w, Encoding::Tagged, HashForm::Int));
    }
    let bytes: usize = payloads.iter().map(Vec::len).sum();

    let h = hub();
    let sub = h.subscribe("bench".into());
    while sub.pop(&h).is_some() {}
    let mut delivered = 0u64;
    let t = Instant::now();
    for (seq, p) in payloads.iter().enumerate() {
        let batch = EventBatch::decode(p).expect("decode");
        h.state().apply(0, seq as u64, &batch);
        if seq % 32 == 0 {
            while let Some(m) = sub.pop(&h) {
                delivered += u64::from(m.body.is_some());
            }
        }
    }
    while let Some(m) = sub.pop(&h) {
        delivered += u64::from(m.body.is_some());
    }
    let secs = t.elapsed().as_secs_f64();
    let blocks = batches * per + batches.saturating_sub(4) * per;
    let mode = if parity {
        "parity on: chains from block 0, each block re-hashed (sha256_cbor)"
    } else {
        "parity off: parent unknown"
    };
    println!(
        "ingest ({mode}): {batches} batches, {blocks} block events ({:.1} MB payload) in {secs:.3} s = {:.2} M blocks/s, {delivered} feed messages",
        bytes as f64 / 1e6,
        blocks as f64 / secs / 1e6
    );
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let batches: u64 = args.get(1).and_then(|v| v.parse().ok()).unwrap_or(20_000);
    let per: u64 = args.get(2).and_then(|v| v.parse().ok()).unwrap_or(64);

    for parity in [false, true] {
        ingest(batches, per, parity);
    }

    // Memory: fill a fresh mirror with N distinct blocks, compare RSS.
    let n: u64 = 4_000_000;
    let h2 = hub();
    let before = rss_bytes();
    let chunk = 4096u64;
    let mut seq = 0u64;
    let mut k = 0u64;
    while k < n {
        let w = WireBatch {
            ts: 1.0,
            events: vec![WireEvent::BlockStored(WireBlockStored {
                block_hashes: (k..k + chunk).map(|x| (x + 1).wrapping_mul(0xD6E8_FEB8_6659_FD93)).collect(),
                block_size: 16,
                ..Default::default()
            })],
            data_parallel_rank: None,
        };
        let b = EventBatch::decode(&encode_batch(&w, Encoding::Tagged, HashForm::Int)).expect("decode");
        h2.state().apply(0, seq, &b);
        seq += 1;
        k += chunk;
    }
    let after = rss_bytes();
    let held = h2.state().engines[0].mirror.len() as u64;
    println!(
        "memory: {held} blocks mirrored, RSS +{:.1} MB = {:.1} bytes per block",
        (after.saturating_sub(before)) as f64 / 1e6,
        after.saturating_sub(before) as f64 / held as f64
    );
}
