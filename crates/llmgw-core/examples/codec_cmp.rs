//! Old vs new codecs measured interleaved (each round times the new then the old code) and
//! reported as the best round of 1,000: robust to the load of a shared machine, where
//! criterion's sequential runs drift. Temporary, with the `legacy-codec` feature.
//! `cargo run --release -p llmgw-core --features legacy-codec --example codec_cmp`
#![allow(clippy::all, clippy::unwrap_used, clippy::indexing_slicing, clippy::arithmetic_side_effects)]
use std::time::Instant;
fn load(name: &str) -> Vec<Vec<u8>> {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/vllm-0.33.0").join(name);
    std::fs::read_to_string(p)
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            let h = v["payload_hex"].as_str().unwrap();
            (0..h.len()).step_by(2).map(|i| u8::from_str_radix(&h[i..i + 2], 16).unwrap()).collect()
        })
        .collect()
}
fn main() {
    let synth: Vec<Vec<u8>> = {
        use llmgw_core::wire::*;
        (0..200u64)
            .map(|i| {
                let n = 4 + (i * 7919 % 60) as usize;
                let ev = WireEvent::BlockStored(WireBlockStored {
                    block_hashes: (0..n as u64).map(|k| k.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ i).collect(),
                    token_ids: (0..n as u32 * 16).collect(),
                    block_size: 16,
                    medium: Some("GPU".into()),
                    extra_keys: Some(vec![None; n]),
                    group_idx: Some(0),
                    kv_cache_spec_kind: Some("full_attention".into()),
                    ..Default::default()
                });
                let rm = WireEvent::BlockRemoved(WireBlockRemoved {
                    block_hashes: vec![i.wrapping_mul(0x9E37_79B9_7F4A_7C15)],
                    medium: Some("GPU".into()),
                    group_idx: Some(0),
                    ..Default::default()
                });
                encode_batch(
                    &WireBatch { ts: 1.0, events: vec![rm.clone(), rm, ev], data_parallel_rank: Some(0) },
                    Encoding::Tagged,
                    HashForm::Int,
                )
            })
            .collect()
    };
    for (f, ps) in [
        ("tagged", load("batches_native_seed0.jsonl")),
        ("positional", load("batches_legacy_seed0.jsonl")),
        ("synthetic", synth),
    ] {
        let (mut a, mut b) = (f64::MAX, f64::MAX);
        for _ in 0..1000 {
            let t = Instant::now();
            for _ in 0..20 {
                for p in &ps {
                    std::hint::black_box(llmgw_core::wire::decode_batch(std::hint::black_box(p)).unwrap());
                }
            }
            a = a.min(t.elapsed().as_secs_f64() / 20.0);
            let t = Instant::now();
            for _ in 0..20 {
                for p in &ps {
                    std::hint::black_box(llmgw_core::legacy::decode::decode_batch(std::hint::black_box(p)).unwrap());
                }
            }
            b = b.min(t.elapsed().as_secs_f64() / 20.0);
        }
        println!("{f}: new {:.1} µs old {:.1} µs ratio {:.3}", a * 1e6, b * 1e6, a / b);
    }

    use llmgw_core::hash::{BlockHasher, HashAlgo, RequestExtras};
    let tokens: Vec<u32> = (0..4096u32).map(|i| i.wrapping_mul(2_654_435_761) % 128_000).collect();
    let mut h = BlockHasher::new(HashAlgo::Sha256Cbor, Some("0")).unwrap();
    let (mut a, mut b) = (f64::MAX, f64::MAX);
    let mut out = Vec::new();
    let mut old = Vec::new();
    let mut buf = Vec::new();
    for _ in 0..1000 {
        let t = Instant::now();
        for _ in 0..10 {
            out.clear();
            h.hash_request_into(std::hint::black_box(&tokens), 16, &RequestExtras::default(), &mut out).unwrap();
        }
        a = a.min(t.elapsed().as_secs_f64() / 10.0);
        let t = Instant::now();
        for _ in 0..10 {
            old.clear();
            llmgw_core::legacy::hash_chain(&mut buf, h.root(), std::hint::black_box(&tokens), 16, &mut old);
        }
        b = b.min(t.elapsed().as_secs_f64() / 10.0);
    }
    println!("sha256_cbor 4096: new {:.1} µs old {:.1} µs ratio {:.3}", a * 1e6, b * 1e6, a / b);
}
