//! A worker VM's decision with the gateway's shared records filled against the same decision
//! with them empty, measured in the same run: 256 replicas, 16 worker VMs each with requests in
//! flight to every replica (4,096 in-flight records), a health and a tokenizer-health record
//! per replica, learned rates per replica and a full speculative table. Each iteration reads the
//! shared records once (as `on_body` does) and decides for a 4,096-token prompt given as ids.
//!
//! `cargo bench -p llmgw --features bench-internals --bench decision` (or `./build.sh bench
//! decision`). The ratio filled / empty is the figure (target: within 1.5).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::arithmetic_side_effects
)]

use criterion::{criterion_group, criterion_main, Criterion};
use llmgw::bench_support::Decision;
use llmgw_core::hash::{BlockHasher, HashAlgo, RequestExtras};

const REPLICAS: u32 = 256;
const VMS: u32 = 16;
const TOKENS: u32 = 4096;

fn decisions(c: &mut Criterion) {
    let tokens: Vec<u32> = (0..TOKENS).collect();
    let mut hasher = BlockHasher::new(HashAlgo::Sha256Cbor, Some("0")).unwrap();
    let held: Vec<u64> =
        hasher.hash_request(&tokens, 16, &RequestExtras::default()).unwrap().iter().map(|b| b.key.0).collect();
    let mut g = c.benchmark_group("decision_256_replicas_16_vms");
    for (name, filled) in [("empty_shared_state", false), ("shared_records_filled", true)] {
        let mut d = Decision::new(REPLICAS, VMS, filled, &tokens, &held).unwrap();
        assert!(d.decide(), "{name}: the decision routes");
        eprintln!("{name}: {} bytes of shared records", d.shared_bytes());
        g.bench_function(name, |b| b.iter(|| assert!(d.decide())));
    }
    g.finish();
}

criterion_group!(benches, decisions);
criterion_main!(benches);
