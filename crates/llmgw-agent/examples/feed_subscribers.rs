//! N feed subscribers in one process, as N filter VMs would subscribe (not a test;
//! `bench/scale.py` drives it). Each opens `llmgw.feed.v1.Feed/Subscribe` over its own HTTP/2
//! connection and counts messages, encoded bytes (protobuf length plus the 5-byte gRPC frame
//! prefix) and delta blocks. Measures after every subscriber's snapshot is complete.
//!
//! `cargo run --release -p llmgw-agent --example feed_subscribers -- --agent http://127.0.0.1:7070
//!  --count 8 --warmup 5 --secs 10` prints one JSON line after the warm-up and one at the end
//! (counts over the measured window only). `--batches` subscribes as the filter does, taking the
//! changes gathered into `BlockDeltas`; without it, one message per change.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::arithmetic_side_effects,
    clippy::print_stdout
)]

use llmgw_agent::feed::service::feed_client::FeedClient;
use llmgw_core::feed::{Body, SubscribeRequest};
use prost::Message;
use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Default)]
struct Counts {
    msgs: AtomicU64,
    bytes: AtomicU64,
    delta_blocks: AtomicU64,
    snapshot_blocks: AtomicU64,
    connected: AtomicU64,
    synced: AtomicU64,
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str, d: &str| {
        args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned().unwrap_or_else(|| d.to_owned())
    };
    let agent = arg("--agent", "http://127.0.0.1:7070");
    let count: usize = arg("--count", "1").parse().unwrap();
    let warmup: f64 = arg("--warmup", "5").parse().unwrap();
    let secs: f64 = arg("--secs", "10").parse().unwrap();
    let batches = args.iter().any(|a| a == "--batches");
    let sync_timeout: f64 = arg("--sync-timeout", "30").parse().unwrap();
    let counts = Arc::new(Counts::default());
    for i in 0..count {
        let c = counts.clone();
        let agent = agent.clone();
        tokio::spawn(async move {
            let mut client = FeedClient::connect(agent).await.unwrap();
            let req = SubscribeRequest { subscriber: format!("bench-{i}"), token: String::new(), batches };
            let mut stream = client.subscribe(req).await.unwrap().into_inner();
            c.connected.fetch_add(1, Relaxed);
            while let Ok(Some(m)) = stream.message().await {
                c.msgs.fetch_add(1, Relaxed);
                c.bytes.fetch_add(m.encoded_len() as u64 + 5, Relaxed);
                match &m.body {
                    Some(Body::Delta(d)) => {
                        c.delta_blocks.fetch_add((d.added.len() + d.removed.len()) as u64, Relaxed);
                    }
                    Some(Body::Deltas(ds)) => {
                        let n: usize = ds.deltas.iter().map(|d| d.added.len() + d.removed.len()).sum();
                        c.delta_blocks.fetch_add(n as u64, Relaxed);
                    }
                    Some(Body::Snapshot(s)) => {
                        c.snapshot_blocks.fetch_add(s.blocks.len() as u64, Relaxed);
                    }
                    Some(Body::SnapshotComplete(_)) => {
                        c.synced.fetch_add(1, Relaxed);
                    }
                    _ => {}
                }
            }
        });
    }
    let snap = |c: &Counts| {
        [c.msgs.load(Relaxed), c.bytes.load(Relaxed), c.delta_blocks.load(Relaxed), c.snapshot_blocks.load(Relaxed)]
    };
    // Every subscriber's snapshot complete (at most `--sync-timeout` s), then the warm-up.
    let t0 = Instant::now();
    while (counts.synced.load(Relaxed) as usize) < count && t0.elapsed().as_secs_f64() < sync_timeout {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let synced_s = t0.elapsed().as_secs_f64();
    let snapshot_bytes = counts.bytes.load(Relaxed);
    tokio::time::sleep(Duration::from_secs_f64(warmup)).await;
    let a = snap(&counts);
    let t = Instant::now();
    println!(
        "{{\"event\":\"measure_start\",\"connected\":{},\"synced\":{},\"synced_s\":{synced_s:.3},\"snapshot_bytes\":{snapshot_bytes}}}",
        counts.connected.load(Relaxed),
        counts.synced.load(Relaxed)
    );
    std::io::stdout().flush().unwrap();
    tokio::time::sleep(Duration::from_secs_f64(secs)).await;
    let b = snap(&counts);
    let e = t.elapsed().as_secs_f64();
    println!(
        "{{\"event\":\"measure_end\",\"subscribers\":{count},\"connected\":{},\"secs\":{e:.3},\"msgs\":{},\"bytes\":{},\"delta_blocks\":{},\"snapshot_blocks\":{}}}",
        counts.connected.load(Relaxed),
        b[0] - a[0],
        b[1] - a[1],
        b[2] - a[2],
        b[3] - a[3]
    );
    std::io::stdout().flush().unwrap();
}
