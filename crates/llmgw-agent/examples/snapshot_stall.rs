//! Snapshot stall benchmark (not a test): how long ingestion waits for the hub lock while a
//! subscriber's table and snapshot are built, with the snapshot built all at once under the
//! lock (the fallback) and engine by engine (what a resync does), in the same run.
//!
//! `cargo run --release -p llmgw-agent --example snapshot_stall [ENGINES] [BLOCKS_PER_ENGINE]`
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
use llmgw_core::wire::{encode_batch, Encoding, HashForm, WireBatch, WireBlockStored, WireEvent};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn batch(first: u64, n: u64) -> EventBatch {
    let ev = WireEvent::BlockStored(WireBlockStored {
        block_hashes: (first..first + n).map(|k| k.wrapping_mul(0x9E37_79B9_7F4A_7C15)).collect(),
        parent_block_hash: Some(1),
        block_size: 16,
        ..Default::default()
    });
    let w = WireBatch { ts: 1.0, events: vec![ev], data_parallel_rank: None };
    EventBatch::decode(&encode_batch(&w, Encoding::Tagged, HashForm::Int)).unwrap()
}

/// Applies small batches to engine 0 until `stop`, returning each one's wait for the lock.
fn ingest(h: Arc<Hub>, stop: Arc<AtomicBool>, base: u64) -> Vec<Duration> {
    let mut waits = Vec::new();
    let mut seq = 1_000_000u64;
    while !stop.load(Ordering::SeqCst) {
        let b = batch(base + seq * 4, 4);
        let t = Instant::now();
        let mut st = h.state();
        waits.push(t.elapsed());
        st.apply(0, seq, &b);
        drop(st);
        seq += 1;
        std::thread::sleep(Duration::from_micros(200));
    }
    waits
}

fn stats(name: &str, mut w: Vec<Duration>, took: Duration) -> Duration {
    w.sort_unstable();
    let q = |p: f64| w[((w.len() - 1) as f64 * p) as usize];
    let max = *w.last().unwrap();
    println!(
        "{name:<16} snapshot {:>7.1} ms   ingest waits: n={:<6} p50 {:>8.3} ms  p99 {:>8.3} ms  max {:>8.3} ms",
        took.as_secs_f64() * 1e3,
        w.len(),
        q(0.5).as_secs_f64() * 1e3,
        q(0.99).as_secs_f64() * 1e3,
        max.as_secs_f64() * 1e3
    );
    max
}

fn main() {
    let args: Vec<u64> = std::env::args().skip(1).map(|a| a.parse().unwrap()).collect();
    let engines = args.first().copied().unwrap_or(64);
    let per = args.get(1).copied().unwrap_or(100_000);
    let mut text = String::new();
    for i in 0..engines {
        text.push_str(&format!(
            "[[replicas]]\nname = \"r{i}\"\naddress = \"127.0.0.1:{}\"\nendpoint = \"tcp://127.0.0.1:{}\"\n",
            10_000 + i,
            20_000 + i
        ));
    }
    let h = Hub::new(Config::parse(&text).unwrap().engines(), 1 << 20, usize::MAX);
    for e in 0..engines {
        for c in 0..per / 10_000 {
            h.state().apply(e as usize, c, &batch(e * per + c * 10_000 + 1, 10_000));
        }
    }
    println!("{engines} engines x {per} blocks");
    let mut maxes = Vec::new();
    for (name, incremental) in [("under the lock", false), ("engine by engine", true)] {
        let stop = Arc::new(AtomicBool::new(false));
        let t = {
            let (h, stop) = (h.clone(), stop.clone());
            std::thread::spawn(move || ingest(h, stop, u64::MAX / 2 + u64::from(incremental) * (1 << 40)))
        };
        std::thread::sleep(Duration::from_millis(100));
        let t0 = Instant::now();
        if incremental {
            let sub = h.subscribe("bench".into());
            sub.prepare(&h);
        } else {
            let bodies = h.state().snapshot_bodies();
            assert!(bodies.len() > engines as usize);
        }
        let took = t0.elapsed();
        std::thread::sleep(Duration::from_millis(100));
        stop.store(true, Ordering::SeqCst);
        maxes.push(stats(name, t.join().unwrap(), took));
    }
    println!(
        "longest ingest wait, engine by engine / under the lock: {:.3}",
        maxes[1].as_secs_f64() / maxes[0].as_secs_f64()
    );
}
