//! Writes the seed corpora `fuzz/seeds/<target>/` (except `decode/`, vLLM 0.33.0's captured
//! payloads). Run from `fuzz/`: `cargo run --example seeds`. Every seed comes from the
//! project's own fixtures and tests, named in the comments below; the files are committed, so
//! this only needs running again when the shapes change.
#![allow(clippy::unwrap_used)]

use llmgw_core::feed::{BlockDelta, Body as Msg, FeedMessage, Heartbeat, ReplicaReset};
use llmgw_fuzz::{encode_frames, fixture_feed, keys, ROUTER_CONFIG};
use prost::Message;
use std::fs;
use std::path::Path;

fn write(target: &str, name: &str, bytes: &[u8]) {
    let dir = Path::new("seeds").join(target);
    fs::create_dir_all(&dir).unwrap();
    fs::write(dir.join(name), bytes).unwrap();
}

/// Request bodies: the shapes of `crates/llmgw-core/src/request/{body,leading,call}.rs`'s tests.
const BODIES: [(u8, &str); 12] = [
    (0, r#"{"model":"m","prompt":"The quick brown fox","max_tokens":8}"#),
    (0, r#"{"model":"m","prompt":[1,2,3,4,5,6,7,8,9],"stream":true,"cache_salt":"s"}"#),
    (0, r#"{"model":"m","prompt":["a","b"]}"#),
    (0, r#"{"model":"m","prompt":[[1,2],[3]]}"#),
    (1, r#"{"model":"m","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"hi"}]}"#),
    (
        1,
        r#"{"model":"m","messages":[{"content":"x","role":"user"},"not an object",{"role":"user","content":null,"name":"n"}]}"#,
    ),
    (
        1,
        r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a\nb\u00e9\ud83d\ude00"},{"type":"image_url","image_url":{"url":"data:x"}},{"text":"c"}]}],"add_generation_prompt":true}"#,
    ),
    (
        1,
        r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"chat_template":"{{x}}","chat_template_kwargs":{"k":1},"tools":[{"type":"function"}],"continue_final_message":false,"add_special_tokens":true}"#,
    ),
    (1, r#"{"model":3,"messages":[]}"#),
    (1, r#"{"messages":"x"}"#),
    (2, r#"{"model":"m","input":"embed me"}"#),
    (0, r#"{"model":"plain","prompt":"hello","cache_salt":""}"#),
];

fn main() {
    // events: vLLM 0.33.0's captured payloads (seeds/decode/, from
    // crates/llmgw-core/tests/data/vllm-0.33.0/) as streams, in capture order, per encoding.
    for enc in ["native", "legacy"] {
        let mut parts: Vec<Vec<u8>> = Vec::new();
        for i in 0..17 {
            parts.push(fs::read(format!("seeds/decode/{enc}-{i:02}.msgpack")).unwrap());
        }
        write("events", &format!("{enc}-stream"), &encode_frames(&parts));
        // Stored then removed again: the second half replays the first.
        let twice: Vec<Vec<u8>> = parts.iter().chain(parts.iter()).cloned().collect();
        write("events", &format!("{enc}-twice"), &encode_frames(&twice));
    }

    // request: the selector byte is the API (0 completions, 1 chat, 2 other) plus 3 x (max / 4).
    for (i, (api, body)) in BODIES.iter().enumerate() {
        let mut b = vec![api + 3 * 16];
        b.extend_from_slice(body.as_bytes());
        write("request", &format!("body-{i:02}"), &b);
    }

    // router: selector (path, too large, tokenizer reply), body, NUL, tokenizer answer.
    for (i, (api, body)) in BODIES.iter().enumerate() {
        write("router", &format!("body-{i:02}"), &[&[*api][..], body.as_bytes()].concat());
    }
    let answers: [&[u8]; 3] = [
        br#"{"count":5,"max_model_len":64,"tokens":[1,2,3,4,5],"token_strs":null}"#,
        br#"{"request_id":"x","token_ids":[1,2,3,4,5,6,7,8,9,10,11,12,13],"features":{"mm_hashes":{"image":["abc"]},"mm_placeholders":{"image":[{"offset":4,"length":4}]}}}"#,
        br#"{"error":{"code":500}}"#,
    ];
    for (i, a) in answers.iter().enumerate() {
        let body = br#"{"model":"m","prompt":"The quick brown fox"}"#;
        write("router", &format!("answer-{i}"), &[&[0u8][..], body, &[0], a].concat());
    }
    write("router", "reset", &[&[2u8 << 3][..], BODIES[4].1.as_bytes()].concat());
    write("router", "too-large", &[&[4u8][..], BODIES[1].1.as_bytes()].concat());

    // answer: crates/llmgw-core/src/request/answer.rs's tests.
    let answer_seeds: [&[u8]; 10] = [
        br#"{"count":3,"max_model_len":9,"tokens":[1,2,3],"token_strs":null}"#,
        br#"{"request_id":"x","token_ids":[4,5]}"#,
        br#"[{"token_ids":[6]},{"token_ids":[7]}]"#,
        br#"{"error":{"code":404}}"#,
        br#"{"tokens" : [ 1 , 22,333 ] }"#,
        br#"{"tokens":[4294967295,0,7]}"#,
        br#"{"a":"x\"tokens\":[9]","tokens":[1]}"#,
        br#"{"tokens":[1,2,3,4,5,6,7,8,9,10"#,
        br#"{"token_ids":[1,2,3,4,5,6,7,8],"features":{"mm_hashes":{"image":["h1","h2"]},"mm_placeholders":{"image":[{"offset":0,"length":2},{"offset":4,"length":2}]}}}"#,
        br#"{"tokens":[1.5]}"#,
    ];
    for (i, a) in answer_seeds.iter().enumerate() {
        write("answer", &format!("answer-{i:02}"), a);
    }
    // seeds/answer/crash-fast-path-ignored-rest is not written here: it is the input the
    // fuzzer found (see request::answer::tests::fast_path_only_where_the_full_parse_agrees).

    // feed: the fixture subscription (llmgw_fuzz::fixture_feed, as in
    // crates/llmgw-core/src/flow/tests.rs), then deltas, a reset, a heartbeat; and one with a gap.
    let mut msgs = fixture_feed();
    let n = msgs.len() as u64;
    let more = [
        Msg::Delta(BlockDelta { replica: 0, added: keys(&(1..=8).collect::<Vec<u32>>()), removed: vec![] }),
        Msg::Delta(BlockDelta { replica: 1, added: vec![], removed: keys(&(1..=4).collect::<Vec<u32>>()) }),
        Msg::Reset(ReplicaReset { replica: 1, reason: "restart".into() }),
        Msg::Heartbeat(Heartbeat {}),
    ];
    msgs.extend(more.into_iter().enumerate().map(|(i, body)| FeedMessage { seq: n + i as u64, body: Some(body) }));
    let encoded: Vec<Vec<u8>> = msgs.iter().map(Message::encode_to_vec).collect();
    write("feed", "subscription", &encode_frames(&encoded));
    let mut gap = encoded.clone();
    gap.insert(2, FeedMessage { seq: 40, body: Some(Msg::Heartbeat(Heartbeat {})) }.encode_to_vec());
    gap.extend(encoded.iter().cloned());
    write("feed", "gap-resync", &encode_frames(&gap));

    // filter_config: the fixture router's, envoy/llmgw-local.yaml's, and
    // crates/llmgw-core/src/config/mod.rs's tests.
    let configs: [&str; 5] = [
        ROUTER_CONFIG,
        r#"{"agent_cluster":"llmgw_agent","tokenizer_cluster":"llmgw_tokenizer","destination_header":"x-gateway-destination-endpoint","explain_header":false,"max_body_bytes":33554432,"profiles":[{"name":"default","models":["*"],"kv_events":true,"block_size":16,"hash_algo":"sha256_cbor","seed":"0","tokenizer":"tokenize","tokenizer_timeout_ms":500}]}"#,
        r#"{"profiles":[{"name":"a","models":["m1"],"kv_events":true,"seed":"0"}]}"#,
        r#"{"profiles":[{"name":"a","models":["m"],"hash_algo":"xxhash"}]}"#,
        "",
    ];
    for (i, c) in configs.iter().enumerate() {
        write("filter_config", &format!("config-{i}"), c.as_bytes());
    }

    // agent_config: the configuration reference in crates/llmgw-agent/README.md and the
    // accepted configuration the configuration tests start from (crates/llmgw-agent/src/config/file/tests.rs).
    let readme = fs::read_to_string("../crates/llmgw-agent/README.md").unwrap();
    let toml = readme.split("```toml\n").nth(1).and_then(|s| s.split("```").next()).unwrap();
    write("agent_config", "readme", toml.as_bytes());
    let tests = fs::read_to_string("../crates/llmgw-agent/src/config/file/tests.rs").unwrap();
    let ok = tests.split("const OK: &str = r#\"").nth(1).and_then(|s| s.split("\"#;").next()).unwrap();
    write("agent_config", "tests-ok", ok.as_bytes());

    // discovery: crates/llmgw-agent/src/discovery.rs's tests (first byte: the replica address).
    let sources: [&str; 4] = [
        r#"{"0":{"endpoint":"tcp://*:5557","replay_endpoint":"tcp://10.0.0.7:5558"}}"#,
        r#"{"1":{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5558","replay_endpoint":"tcp://*:5601","topic":"kv-events"},"0":{"endpoint":"tcp://[::]:5557"}}"#,
        r#"{"0":{"enable_kv_cache_events":false,"publisher":"null","endpoint":"tcp://*:5557"}}"#,
        r#"{"0":{"endpoint":"tcp://localhost:5557","replay_endpoint":"tcp://127.0.0.1:5558"}}"#,
    ];
    for (i, s) in sources.iter().enumerate() {
        write("discovery", &format!("sources-{i}"), &[&[i as u8][..], s.as_bytes()].concat());
    }

    // load: crates/llmgw-agent/src/load.rs's tests (first byte: the rank).
    let pages: [&str; 3] = [
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine=\"0\",model_name=\"m\"} 3.0\nvllm:num_requests_running{engine=\"1\",model_name=\"m\"} 5.0\nvllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 2.0\nvllm:num_requests_waiting{engine=\"1\",model_name=\"m\"} 0.0\nvllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.25\nvllm:kv_cache_usage_perc{engine=\"1\",model_name=\"m\"} 0.5\nvllm:num_requests_running_other 99\n",
        "vllm:num_requests_running 4\nvllm:num_requests_waiting 1\nvllm:kv_cache_usage_perc 0.1\n",
        "garbage{\n{}\nvllm:num_requests_running{x=\"1\"} NaN\n",
    ];
    for (i, p) in pages.iter().enumerate() {
        write("load", &format!("page-{i}"), &[&[(i % 2) as u8][..], p.as_bytes()].concat());
    }
}
