//! Scale benchmark of one filter VM's index (not a test; `./build.sh bench scale` runs it):
//! index memory and decision time at 16, 64, 256 and 1,024 replicas × 100,000 blocks each.
//!
//! Every size is built the way a filter VM builds it (the feed's replica table, then one
//! snapshot per replica, through `Router::feed`), all sizes are alive at once, and the timing
//! rounds interleave the sizes, so each round's ratio against 16 replicas is measured under the
//! same machine load.
//!
//! Cases, each on the real request path:
//! * `decide_token_ids`: `Router::on_body` for a completions body of token ids (parse, hash,
//!   score, choose);
//! * `decide_cached_text`: `Router::on_body` for a text prompt whose tokenization (and block
//!   digests) the VM has cached (score and choose, no hashing, no parse);
//! * `parse_only`: parsing the token-id body alone (what `decide_token_ids` spends outside the
//!   index);
//! * `prefix_scores`: hashing in growing batches and scoring (`flow::prefix_scores`);
//! * `score`: `ReplicaIndex::score_into` over the prompt's precomputed keys (scoring alone).
//!
//! Scenarios: `one` (one replica holds the whole prompt: the usual follow-up turn), `all`
//! (every replica holds the whole prompt: a fleet-wide system prompt, the worst case for a
//! layout that probes one table per page of replicas), `none` (a new prompt). Eight distinct
//! prompts per scenario are used in turn, so that one prompt's slots are not kept hot in the
//! L1/L2 caches between its calls.
//!
//! `cargo run --release -p llmgw-core --example scale_index -- [--sizes 16,64,256,1024]
//!  [--blocks 100000] [--rounds 5] [--case-ms 40]` prints one JSON object per line.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::arithmetic_side_effects,
    clippy::print_stdout
)]

use llmgw_core::config::Compiled;
use llmgw_core::feed::{Body as Msg, FeedMessage, Replica, ReplicaTable, SnapshotChunk, SnapshotComplete};
use llmgw_core::flow::{prefix_scores, Body, Router, Scratch, Step, TokenizerReply};
use llmgw_core::hash::{BlockHasher, BlockKey, HashAlgo, RequestExtras};
use llmgw_core::request::{parse_request, ApiKind};
use std::hint::black_box;
use std::time::Instant;

const BS: usize = 16;
const LENGTHS: [usize; 3] = [1024, 4096, 16384];
const MAX_TOKENS: usize = 16384;
const PROMPTS: usize = 8;
const SCENARIOS: [&str; 3] = ["one", "all", "none"];

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn hasher() -> BlockHasher {
    BlockHasher::new(HashAlgo::Sha256Cbor, Some("0")).unwrap()
}

/// Prompt `j` of scenario `s`: 16,384 distinct token ids.
fn tokens(s: usize, j: usize) -> Vec<u32> {
    let base = ((s * PROMPTS + j) * MAX_TOKENS) as u64;
    (0..MAX_TOKENS as u64).map(|i| (splitmix(base + i) % 128_000) as u32).collect()
}

fn keys(t: &[u32]) -> Vec<u64> {
    hasher().hash_request(t, BS, &RequestExtras::default()).unwrap().iter().map(|b| b.key.0).collect()
}

struct Fleet {
    replicas: usize,
    router: Router,
    build_s: f64,
    /// Per scenario and prompt: the token-id body of its first 4,096 tokens, a text body whose
    /// tokenization is cached.
    token_bodies: Vec<Vec<Vec<u8>>>,
    text_bodies: Vec<Vec<Vec<u8>>>,
}

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    statm.split_whitespace().nth(1).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0) * 4096
}

fn build(replicas: usize, blocks: u64, prompts: &[Vec<Vec<u32>>], prompt_keys: &[Vec<Vec<u64>>]) -> Fleet {
    let t0 = Instant::now();
    let json = br#"{"profiles":[{"name":"p","models":["m"],"kv_events":true,"seed":"0"}]}"#;
    let mut r = Router::new(Compiled::from_json(json, None).unwrap(), 7);
    let table = (0..replicas as u32)
        .map(|id| Replica {
            id,
            name: format!("r{id}"),
            address: format!("10.{}.{}.{}:8000", id >> 16, (id >> 8) & 255, id & 255),
            models: vec![],
            up: true,
            dp_rank: 0,
            ..Default::default()
        })
        .collect();
    r.feed.begin_subscription();
    let mut seq = 0u64;
    let mut send = |r: &mut Router, body: Msg| {
        r.feed.apply(&FeedMessage { seq, body: Some(body) }).unwrap();
        seq += 1;
    };
    send(&mut r, Msg::Replicas(ReplicaTable { replicas: table }));
    for id in 0..replicas {
        // 100,000 blocks of its own (distinct from every other replica's: the most distinct
        // blocks per page, so the most memory per entry), plus the prompts it holds.
        let mut held: Vec<u64> = (0..blocks).map(|i| splitmix(((id as u64) << 32) | i)).collect();
        for (j, k) in prompt_keys[0].iter().enumerate() {
            if id == (3 + j * 5) % replicas {
                held.extend_from_slice(k);
            }
        }
        for k in &prompt_keys[1] {
            held.extend_from_slice(k);
        }
        for (i, chunk) in held.chunks(65_536).enumerate() {
            send(&mut r, Msg::Snapshot(SnapshotChunk { replica: id as u32, first: i == 0, blocks: chunk.to_vec() }));
        }
    }
    send(&mut r, Msg::SnapshotComplete(SnapshotComplete {}));
    assert!(r.feed.usable());
    let build_s = t0.elapsed().as_secs_f64();

    let mut token_bodies = Vec::new();
    let mut text_bodies = Vec::new();
    for (s, ps) in prompts.iter().enumerate() {
        let mut tb = Vec::new();
        let mut xb = Vec::new();
        for (j, t) in ps.iter().enumerate() {
            let t4 = &t[..4096];
            tb.push(format!(r#"{{"model":"m","prompt":{t4:?}}}"#).into_bytes());
            let text =
                format!(r#"{{"model":"m","prompt":"scenario {s} prompt {j}, tokenization cached"}}"#).into_bytes();
            let Step::Tokenize(call) =
                r.on_body(&Body { path: "/v1/completions", bytes: &text, too_large: false }, &(), 0)
            else {
                panic!("expected a tokenizer call")
            };
            let answer = format!(r#"{{"count":4096,"max_model_len":32768,"tokens":{t4:?}}}"#).into_bytes();
            let read = || answer.clone();
            let reply = TokenizerReply::Answered { status: Some(b"200"), body: &read };
            assert!(matches!(r.on_tokenizer_reply(*call.pending, &reply, &(), 0), Step::Route(_)));
            xb.push(text);
        }
        token_bodies.push(tb);
        text_bodies.push(xb);
    }
    Fleet { replicas, router: r, build_s, token_bodies, text_bodies }
}

/// Mean ns per call of `f(i)` (i = call number), over at least `ms` milliseconds.
fn time(ms: f64, mut f: impl FnMut(usize)) -> f64 {
    for i in 0..PROMPTS {
        f(i);
    }
    let t = Instant::now();
    let mut n = 0usize;
    loop {
        for _ in 0..PROMPTS {
            f(n);
            n += 1;
        }
        let e = t.elapsed().as_secs_f64() * 1e3;
        if e >= ms {
            return e * 1e6 / n as f64;
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
    let sizes: Vec<usize> =
        arg("--sizes").unwrap_or_else(|| "16,64,256,1024".into()).split(',').map(|s| s.parse().unwrap()).collect();
    let blocks: u64 = arg("--blocks").map_or(100_000, |v| v.parse().unwrap());
    let rounds: usize = arg("--rounds").map_or(5, |v| v.parse().unwrap());
    let case_ms: f64 = arg("--case-ms").map_or(40.0, |v| v.parse().unwrap());

    let prompts: Vec<Vec<Vec<u32>>> =
        (0..SCENARIOS.len()).map(|s| (0..PROMPTS).map(|j| tokens(s, j)).collect()).collect();
    let prompt_keys: Vec<Vec<Vec<u64>>> = prompts.iter().map(|ps| ps.iter().map(|t| keys(t)).collect()).collect();

    let mut fleets = Vec::new();
    for &n in &sizes {
        let before = rss_bytes();
        let f = build(n, blocks, &prompts, &prompt_keys);
        let after = rss_bytes();
        let ix = &f.router.feed.serving().index;
        println!(
            "{{\"kind\":\"memory\",\"replicas\":{n},\"blocks_per_replica\":{blocks},\"entries\":{},\"index_bytes\":{},\"bytes_per_entry\":{:.3},\"rss_delta_bytes\":{},\"build_s\":{:.2}}}",
            ix.entries(),
            ix.memory_bytes(),
            ix.memory_bytes() as f64 / ix.entries() as f64,
            after.saturating_sub(before),
            f.build_s
        );
        eprintln!(
            "built {n} replicas x {blocks} blocks in {:.1} s: {:.1} MB, {:.2} bytes per (block, replica)",
            f.build_s,
            ix.memory_bytes() as f64 / 1e6,
            ix.memory_bytes() as f64 / ix.entries() as f64
        );
        fleets.push(f);
    }

    // Keys per scenario, prompt and length.
    let ks: Vec<Vec<Vec<BlockKey>>> =
        prompt_keys.iter().map(|ps| ps.iter().map(|k| k.iter().map(|&x| BlockKey(x)).collect()).collect()).collect();
    for round in 0..rounds {
        for f in fleets.iter_mut() {
            let n = f.replicas;
            let emit = |case: &str, scen: &str, len: usize, ns: f64| {
                println!(
                    "{{\"kind\":\"time\",\"round\":{round},\"replicas\":{n},\"case\":\"{case}\",\"scenario\":\"{scen}\",\"tokens\":{len},\"ns\":{ns:.1}}}"
                );
            };
            for (s, scen) in SCENARIOS.iter().enumerate() {
                for &len in &LENGTHS {
                    let ix = &f.router.feed.serving().index;
                    let (mut h, mut sc) = (hasher(), Scratch::default());
                    let ns = time(case_ms, |i| {
                        let t = &prompts[s][i % PROMPTS][..len];
                        prefix_scores(ix, &mut h, BS, &RequestExtras::default(), black_box(t), &[], &mut sc).unwrap();
                        black_box(sc.scores.leading.len());
                    });
                    emit("prefix_scores", scen, len, ns);
                    let mut out = llmgw_core::index::Scores::default();
                    let ns = time(case_ms, |i| {
                        let k = &ks[s][i % PROMPTS][..len / BS];
                        ix.score_into(black_box(k), &mut out);
                        black_box(out.leading.len());
                    });
                    emit("score", scen, len, ns);
                }
                let r = &mut f.router;
                let bodies = &f.token_bodies[s];
                let ns = time(case_ms, |i| {
                    let b = &bodies[i % PROMPTS];
                    let step =
                        r.on_body(&Body { path: "/v1/completions", bytes: black_box(b), too_large: false }, &(), 1);
                    assert!(matches!(step, Step::Route(_)));
                });
                emit("decide_token_ids", scen, 4096, ns);
                let texts = &f.text_bodies[s];
                let ns = time(case_ms, |i| {
                    let b = &texts[i % PROMPTS];
                    let step =
                        r.on_body(&Body { path: "/v1/completions", bytes: black_box(b), too_large: false }, &(), 1);
                    assert!(matches!(step, Step::Route(_)));
                });
                emit("decide_cached_text", scen, 4096, ns);
                if s == 0 {
                    let ns = time(case_ms, |i| {
                        black_box(parse_request(ApiKind::Completions, black_box(&bodies[i % PROMPTS])).is_ok());
                    });
                    emit("parse_only", scen, 4096, ns);
                }
            }
        }
        eprintln!("round {}/{rounds} done", round + 1);
    }
}
