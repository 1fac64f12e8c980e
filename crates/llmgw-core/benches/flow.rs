//! The request path's benchmarks: prefix scoring in growing batches against hashing and scoring
//! the whole prompt (the baseline, measured in the same run), and the router's decision for a
//! whole body (token ids, and a prompt whose tokenization is cached) against parsing the body
//! alone; and a streamed chat answer asked for its ids, rewritten chunk by chunk as the filter
//! hands it on (the prompt's ids read from its first chunk), against copying the same chunks.
//!
//! `cargo bench -p llmgw-core --bench flow` (or `./build.sh bench core`).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::arithmetic_side_effects
)]

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use llmgw_core::config::Compiled;
use llmgw_core::feed::{Body as Msg, FeedMessage, Replica, ReplicaTable, SnapshotChunk, SnapshotComplete};
use llmgw_core::flow::{prefix_scores, Body, Router, Scratch, Step, TokenizerReply};
use llmgw_core::hash::{BlockHasher, BlockKey, HashAlgo, RequestExtras};
use llmgw_core::index::ReplicaId;
use llmgw_core::index::ReplicaIndex;
use llmgw_core::request::{parse_request, AnswerStream, ApiKind};

const TOKENS: u32 = 4096;
const BS: usize = 16;
const REPLICAS: u32 = 16;
/// Blocks each replica holds besides the prompt's (so lookups probe a populated table).
const OTHER_BLOCKS: u64 = 50_000;

fn hasher() -> BlockHasher {
    BlockHasher::new(HashAlgo::Sha256Cbor, Some("0")).unwrap()
}

fn prompt(offset: u32) -> Vec<u32> {
    (offset..offset + TOKENS).collect()
}

fn keys(tokens: &[u32]) -> Vec<u64> {
    hasher().hash_request(tokens, BS, &RequestExtras::default()).unwrap().iter().map(|b| b.key.0).collect()
}

/// Replica 3 holds the whole prompt `held`; every replica holds unrelated blocks.
fn index(held: &[u64]) -> ReplicaIndex {
    let mut ix = ReplicaIndex::new();
    for r in 0..REPLICAS as u16 {
        for k in 0..OTHER_BLOCKS {
            ix.insert(ReplicaId(r), BlockKey(k.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ u64::from(r)));
        }
    }
    for &k in held {
        ix.insert(ReplicaId(3), BlockKey(k));
    }
    ix
}

fn scoring(c: &mut Criterion) {
    let held = prompt(0);
    let new = prompt(1_000_000);
    let ix = index(&keys(&held));
    let mut g = c.benchmark_group("prefix_scores_4096_tokens_16_replicas");
    for (name, tokens) in [("held_by_one", &held), ("held_by_none", &new)] {
        g.bench_function(format!("growing_batches/{name}"), |b| {
            let (mut h, mut s) = (hasher(), Scratch::default());
            b.iter(|| {
                prefix_scores(&ix, &mut h, BS, &RequestExtras::default(), black_box(tokens), &[], &mut s).unwrap();
                black_box(s.scores.leading.len())
            })
        });
        g.bench_function(format!("baseline_hash_all_then_score/{name}"), |b| {
            let mut h = hasher();
            b.iter(|| {
                let hs = h.hash_request(black_box(tokens), BS, &RequestExtras::default()).unwrap();
                let ks: Vec<BlockKey> = hs.iter().map(|b| b.key).collect();
                black_box(ix.score(&ks).leading.len())
            })
        });
    }
    g.finish();
}

fn router(held: &[u64]) -> Router {
    let json = br#"{"profiles":[{"name":"p","models":["m"],"kv_events":true,"seed":"0"}]}"#;
    let mut r = Router::new(Compiled::from_json(json, None).unwrap(), 7);
    let replicas = (0..REPLICAS)
        .map(|id| Replica {
            id,
            name: format!("r{id}"),
            address: format!("10.0.0.{id}:8000"),
            models: vec![],
            up: true,
            dp_rank: 0,
            hash: None,
            dp_size: 0,
            kv_groups: vec![],
            lora_adapters: vec![],
            mirror_incomplete: false,
        })
        .collect();
    r.feed.begin_subscription();
    let msgs = [
        Msg::Replicas(ReplicaTable { replicas }),
        Msg::Snapshot(SnapshotChunk { replica: 3, first: true, blocks: held.to_vec() }),
        Msg::SnapshotComplete(SnapshotComplete {}),
    ];
    for (seq, body) in msgs.into_iter().enumerate() {
        r.feed.apply(&FeedMessage { seq: seq as u64, body: Some(body) }).unwrap();
    }
    r
}

fn decisions(c: &mut Criterion) {
    let tokens = prompt(0);
    let mut r = router(&keys(&tokens));
    let ids = format!(r#"{{"model":"m","prompt":{tokens:?}}}"#).into_bytes();
    let text = br#"{"model":"m","prompt":"a prompt whose tokenization is cached"}"#.to_vec();
    // Prime the tokenization cache for the text prompt.
    let Step::Tokenize(call) = r.on_body(&Body { path: "/v1/completions", bytes: &text, too_large: false }, &(), 0)
    else {
        panic!("expected a tokenizer call")
    };
    let answer = format!(r#"{{"count":{TOKENS},"max_model_len":8192,"tokens":{tokens:?}}}"#).into_bytes();
    let read = || answer.clone();
    let reply = TokenizerReply::Answered { status: Some(b"200"), body: &read };
    assert!(matches!(r.on_tokenizer_reply(*call.pending, &reply, &(), 0), Step::Route(_)));
    let mut g = c.benchmark_group("router_on_body_4096_tokens_16_replicas");
    for (name, body) in [("token_ids", &ids), ("cached_text_prompt", &text)] {
        g.bench_function(format!("decide/{name}"), |b| {
            b.iter(|| {
                let step =
                    r.on_body(&Body { path: "/v1/completions", bytes: black_box(body), too_large: false }, &(), 1);
                assert!(matches!(step, Step::Route(_)));
            })
        });
        g.bench_function(format!("baseline_parse_only/{name}"), |b| {
            b.iter(|| black_box(parse_request(ApiKind::Completions, black_box(body)).is_ok()))
        });
    }
    g.finish();
}

/// A chat answer of 128 tokens as vLLM 0.33 streams it when asked for the ids: the first chunk
/// with the prompt's 700 ids, then a chunk per token with its id, one in eight carrying no text
/// yet (sent only for its id, and dropped for the client).
fn answer_chunks() -> Vec<Vec<u8>> {
    let head = r#"data: {"id":"chatcmpl-b","object":"chat.completion.chunk","created":1,"model":"tiny","choices":[{"index":0,"#;
    // Written as vLLM writes them: no spaces between the ids.
    let ids = format!("{:?}", (1000..1700).collect::<Vec<u32>>()).replace(' ', "");
    let mut chunks = vec![format!(
        r#"{head}"delta":{{"role":"assistant","content":""}},"logprobs":null,"finish_reason":null}}],"prompt_token_ids":{ids},"prompt_text":null}}

"#
    )
    .into_bytes()];
    for i in 0..128u32 {
        let delta = if i % 8 == 7 { "{}".to_owned() } else { format!(r#"{{"content":" word{i}"}}"#) };
        chunks.push(
            format!(
                r#"{head}"delta":{delta},"logprobs":null,"finish_reason":null,"token_ids":[{}],"weight_versions":null}}]}}

"#,
                300 + i
            )
            .into_bytes(),
        );
    }
    chunks
}

fn answer_stream(c: &mut Criterion) {
    let chunks = answer_chunks();
    let mut g = c.benchmark_group("answer_stream_129_chunks");
    g.bench_function("baseline_copy_each_chunk", |b| {
        b.iter(|| chunks.iter().map(|ch| black_box(ch.to_vec()).len()).sum::<usize>())
    });
    g.bench_function("rewrite_each_chunk", |b| {
        b.iter(|| {
            // As the filter does: the prompt's ids are read after the first chunk went on.
            let mut s = AnswerStream::default();
            let sent = chunks.iter().map(|ch| black_box(s.feed(ch, false)).len()).sum::<usize>();
            (sent, black_box(s.take_first()))
        })
    });
    g.finish();
}

criterion_group!(benches, scoring, decisions, answer_stream);
criterion_main!(benches);
