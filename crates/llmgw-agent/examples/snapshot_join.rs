//! Warm-start benchmark (not a test): what a new agent pays to know ENGINES engines of BLOCKS
//! blocks each from their sidecars' snapshots, against learning the same blocks from the
//! engines' batches (the replay path, were the replay buffers long enough), in the same run;
//! and how long a sidecar's event ingestion waits while a snapshot copies its ledger.
//!
//! `cargo run --release -p llmgw-agent --example snapshot_join [ENGINES] [BLOCKS_PER_ENGINE]`
//! (defaults 16 and 100000). HTTP transfer is not included (about 9 bytes per block).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::arithmetic_side_effects
)]

use llmgw_agent::snapshot::ledger::Ledger;
use llmgw_core::event::EventBatch;
use llmgw_core::mirror::EngineMirror;
use llmgw_core::wire::{encode_batch, Encoding, HashForm, WireBatch, WireBlockStored, WireEvent};
use std::time::{Duration, Instant};

/// One engine step storing `n` blocks from `first` on (a 16-block prompt per step, as payload).
fn payload(first: u64, n: u64) -> Vec<u8> {
    let ev = WireEvent::BlockStored(WireBlockStored {
        block_hashes: (first..first + n).map(|k| k.wrapping_mul(0x9E37_79B9_7F4A_7C15)).collect(),
        block_size: 16,
        ..Default::default()
    });
    encode_batch(&WireBatch { ts: 1.0, events: vec![ev], data_parallel_rank: Some(0) }, Encoding::Tagged, HashForm::Int)
}

fn main() {
    let args: Vec<u64> = std::env::args().skip(1).map(|a| a.parse().expect("a number")).collect();
    let engines = args.first().copied().unwrap_or(16);
    let blocks = args.get(1).copied().unwrap_or(100_000);
    let per_step = 16;
    // Each engine's history as batches (what its sidecar saw), and its sidecar's ledger.
    let mut histories = Vec::new();
    let mut ledgers = Vec::new();
    for e in 0..engines {
        let base = e << 40;
        let batches: Vec<Vec<u8>> = (0..blocks / per_step).map(|s| payload(base + s * per_step, per_step)).collect();
        let mut ledger = Ledger::new(usize::MAX);
        for (seq, p) in batches.iter().enumerate() {
            ledger.apply(seq as u64, &EventBatch::decode(p).unwrap());
        }
        histories.push(batches);
        ledgers.push(ledger);
    }

    // Baseline: every batch decoded and applied, as replay from batch 0 would.
    let t = Instant::now();
    let mut held = 0;
    for batches in &histories {
        let (mut m, mut out) = (EngineMirror::new(None), Vec::new());
        for p in batches {
            m.apply(&EventBatch::decode(p).unwrap(), &mut out);
            out.clear();
        }
        held += m.len();
    }
    let replay = t.elapsed();
    assert_eq!(held as u64, engines * (blocks / per_step) * per_step);

    // Snapshots: the sidecar's copy under its lock, its encoding, and the agent's decode + apply.
    let (mut copy_max, mut encode, mut join, mut bytes) = (Duration::ZERO, Duration::ZERO, Duration::ZERO, 0);
    let mut held = 0;
    for ledger in &ledgers {
        let t = Instant::now();
        let copy = ledger.copy();
        copy_max = copy_max.max(t.elapsed());
        let t = Instant::now();
        let snap = copy.encode(0).unwrap();
        encode += t.elapsed();
        bytes += snap.payload.len();
        let t = Instant::now();
        let (mut m, mut out) = (EngineMirror::new(None), Vec::new());
        m.apply(&EventBatch::decode(&snap.payload).unwrap(), &mut out);
        join += t.elapsed();
        held += m.len();
    }
    assert_eq!(held as u64, engines * (blocks / per_step) * per_step);
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!("{engines} engines x {blocks} blocks ({per_step} per batch)");
    println!("replay from batch 0 (baseline): decode + apply   {:>9.1} ms", ms(replay));
    println!("snapshots: sidecar encode                          {:>9.1} ms", ms(encode));
    println!("snapshots: agent decode + apply                    {:>9.1} ms", ms(join));
    println!("snapshot join / replay                             {:>9.2}", join.as_secs_f64() / replay.as_secs_f64());
    println!(
        "snapshot bytes                                     {:>9} ({:.1} per block)",
        bytes,
        bytes as f64 / (engines * blocks) as f64
    );
    println!("longest ingestion wait for a copy (one engine)     {:>9.3} ms", ms(copy_max));
}
