//! Native tokenization, with and without the piece cache: completion prompts of about 1k, 4k
//! and 32k tokens, and a chat whose earlier turns are cached plus a new turn of about 200
//! tokens. The model is a real tokenizer fetched by `dev/tokenizer_families.py fetch`:
//! `LLMGW_BENCH_TOKENIZER` names its directory (`./build.sh bench tokenizer` sets it to the
//! Llama 3.1 family's).
//!
//! "uncached" encodes with a cache of 0 bytes; "cached" after the same text (completions) or
//! the conversation's earlier turns (chat) went through once, as a conversation's next turn or a
//! shared system prompt meets it.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::arithmetic_side_effects
)]

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use llmgw_tokenize::{ModelOptions, ModelTokenizer, TokenizeRequest};
use std::path::PathBuf;

/// Deterministic English-like text of about `words` words.
fn text(words: usize, seed: u64) -> String {
    const W: [&str; 24] = [
        "the", "cache", "router", "replica", "prompt", "token", "engine", "block", "prefix", "request", "system",
        "answer", "question", "fleet", "latency", "first", "model", "serving", "memory", "hit", "Envoy", "vLLM",
        "quickly", "because",
    ];
    let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
    let mut out = String::new();
    for i in 0..words {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        out.push_str(W[(x >> 33) as usize % W.len()]);
        out.push(if i % 17 == 16 { '.' } else { ' ' });
    }
    out
}

fn model(cache_bytes: usize) -> Option<ModelTokenizer> {
    let dir = PathBuf::from(std::env::var_os("LLMGW_BENCH_TOKENIZER")?);
    match ModelTokenizer::load(&dir, &ModelOptions { cache_bytes, ..ModelOptions::default() }) {
        Ok(m) => Some(m),
        Err(e) => panic!("{}: {e}", dir.display()),
    }
}

fn completion(prompt: &str) -> TokenizeRequest {
    serde_json::from_value(serde_json::json!({ "prompt": prompt })).unwrap()
}

/// A chat of `turns` earlier exchanges of about `words` words each, then a new user turn.
fn chat(turns: usize, words: usize, new_turn: &str) -> TokenizeRequest {
    let mut messages = vec![serde_json::json!({"role": "system", "content": text(words * 4, 99)})];
    for t in 0..turns {
        messages.push(serde_json::json!({"role": "user", "content": text(words, t as u64 * 2)}));
        messages.push(serde_json::json!({"role": "assistant", "content": text(words, t as u64 * 2 + 1)}));
    }
    messages.push(serde_json::json!({"role": "user", "content": new_turn}));
    serde_json::from_value(serde_json::json!({ "messages": messages })).unwrap()
}

fn bench(c: &mut Criterion) {
    let (Some(cold), Some(warm)) = (model(0), model(256 << 20)) else {
        eprintln!("LLMGW_BENCH_TOKENIZER is not set: run ./build.sh bench tokenizer");
        return;
    };
    let mut g = c.benchmark_group("completion");
    // About 0.75 words a token for this text with the Llama 3 vocabulary.
    for (label, words) in [("1k", 750), ("4k", 3_000), ("32k", 24_000)] {
        let req = completion(&text(words, 7));
        let n = cold.tokenize(&req).map(|t| t.len()).unwrap_or(0);
        eprintln!("completion {label}: {n} tokens");
        g.throughput(Throughput::Elements(n as u64));
        g.bench_with_input(BenchmarkId::new("uncached", label), &req, |b, r| b.iter(|| cold.tokenize(r)));
        let _ = warm.tokenize(&req);
        g.bench_with_input(BenchmarkId::new("cached", label), &req, |b, r| b.iter(|| warm.tokenize(r)));
    }
    g.finish();
    let mut g = c.benchmark_group("chat_next_turn");
    for (label, turns) in [("1k", 2), ("4k", 8), ("32k", 64)] {
        let earlier = chat(turns, 90, "");
        let _ = warm.tokenize(&earlier);
        // Each iteration a turn the cache has not seen: ~200 tokens of new text.
        let mut i = 0u64;
        let n = cold.tokenize(&chat(turns, 90, &text(150, 1_000))).map(|t| t.len()).unwrap_or(0);
        eprintln!("chat {label}: {n} tokens with the new turn");
        g.throughput(Throughput::Elements(n as u64));
        g.bench_function(BenchmarkId::new("uncached", label), |b| {
            b.iter_batched(
                || {
                    i += 1;
                    chat(turns, 90, &text(150, 1_000 + i))
                },
                |r| cold.tokenize(&r),
                criterion::BatchSize::SmallInput,
            )
        });
        g.bench_function(BenchmarkId::new("cached_prefix", label), |b| {
            b.iter_batched(
                || {
                    i += 1;
                    chat(turns, 90, &text(150, 1_000 + i))
                },
                |r| warm.tokenize(&r),
                criterion::BatchSize::SmallInput,
            )
        });
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20).measurement_time(std::time::Duration::from_secs(3));
    targets = bench
}
criterion_main!(benches);
