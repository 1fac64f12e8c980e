//! Every case captured from vLLM 0.33.0 (`tests/data/vllm-0.33.0/`), matched exactly:
//! golden block hashes for every algorithm and both seed settings, the requests behind the
//! captured event stream, and every captured payload in both encodings.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::arithmetic_side_effects
)]

use llmgw_core::event::{EventBatch, KvEvent};
use llmgw_core::hash::BlockKey;
use llmgw_core::hash::{hex, BlockHasher, Digest, ExtraKey, HashAlgo, MmFeature, RequestExtras};
use llmgw_core::mirror::{EngineMirror, NetChange};
use llmgw_core::wire::{decode_batch, WireEvent};
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

fn data(name: &str) -> String {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/vllm-0.33.0").join(name);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

fn tokens(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|t| u32::try_from(t.as_u64().unwrap()).unwrap()).collect()
}

fn extras_of(case: &Value) -> RequestExtras {
    RequestExtras {
        cache_salt: case["cache_salt"].as_str().map(str::to_owned),
        lora: case["lora"]
            .as_object()
            .map(|l| (l["name"].as_str().unwrap().to_owned(), l["path"].as_str().unwrap().to_owned())),
        mm: case["mm"]
            .as_array()
            .map(|items| {
                items
                    .iter()
                    .map(|m| MmFeature {
                        identifier: m["identifier"].as_str().unwrap().to_owned(),
                        offset: m["offset"].as_u64().unwrap(),
                        length: m["length"].as_u64().unwrap(),
                    })
                    .collect()
            })
            .unwrap_or_default(),
        lookahead: case["lookahead_tokens"].as_u64().map_or(0, |l| l as usize),
    }
}

/// The tagged extra keys a golden block lists, in our form.
fn expected_extra(v: &Value) -> Vec<ExtraKey> {
    let Some(items) = v.as_array() else { return Vec::new() };
    items
        .iter()
        .map(|it| {
            let a = it.as_array().unwrap();
            match a[0].as_str().unwrap() {
                "lora" => ExtraKey::Lora { name: a[1].as_str().unwrap().into(), path: a[2].as_str().unwrap().into() },
                "mm" => ExtraKey::Mm { identifier: a[1].as_str().unwrap().into(), offset: a[2].as_i64().unwrap() },
                "cache_salt" => ExtraKey::CacheSalt(a[1].as_str().unwrap().into()),
                other => panic!("unexpected extra key tag {other}"),
            }
        })
        .collect()
}

/// Golden hashes: returns the number of checked values.
fn check_golden(file: &str, seed: Option<&str>) -> usize {
    let g: Value = serde_json::from_str(&data(file)).unwrap();
    let block_size = g["block_size"].as_u64().unwrap() as usize;
    let mut checked = 0;
    for (algo_name, algo_v) in g["algorithms"].as_object().unwrap() {
        let algo = HashAlgo::parse(algo_name).unwrap();
        let mut h = BlockHasher::new(algo, seed).unwrap();
        assert_eq!(h.root().to_hex(), algo_v["none_hash_hex"].as_str().unwrap(), "{file} {algo_name} root");
        checked += 1;
        for case in algo_v["cases"].as_array().unwrap() {
            let name = case["name"].as_str().unwrap();
            let toks = tokens(&case["token_ids"]);
            let extras = extras_of(case);
            let got = h.hash_request(&toks, block_size, &extras).unwrap();
            let want = case["blocks"].as_array().unwrap();
            assert_eq!(got.len(), want.len(), "{file} {algo_name} {name}: block count");
            assert_eq!(got.len() as u64, case["num_full_blocks"].as_u64().unwrap());
            let mut parent = h.root();
            for (b, w) in got.iter().zip(want) {
                let ctx = format!("{file} {algo_name} {name} block {}", w["index"]);
                assert_eq!(parent.to_hex(), w["parent_hash_hex"].as_str().unwrap(), "{ctx}: parent");
                let extra = expected_extra(&w["extra_keys_hashed"]);
                let idx = w["index"].as_u64().unwrap() as usize;
                let block = &toks[idx * block_size..(idx + 1) * block_size];
                if let Some(pre) = w["preimage_cbor_hex"].as_str() {
                    assert_eq!(hex(&h.preimage(&parent, block, &extra)), pre, "{ctx}: preimage");
                    checked += 1;
                }
                assert_eq!(h.hash_block(&parent, block, &extra), b.digest, "{ctx}: extra keys");
                assert_eq!(b.digest.to_hex(), w["hash_hex"].as_str().unwrap(), "{ctx}: digest");
                assert_eq!(b.key, BlockKey(w["event_u64"].as_u64().unwrap()), "{ctx}: event u64");
                checked += 3;
                parent = b.digest;
            }
        }
    }
    checked
}

/// Requests behind the event stream: returns (checked values, algorithm that matched).
fn check_requests() -> usize {
    let mut checked = 0;
    let mut h = BlockHasher::new(HashAlgo::Sha256Cbor, Some("0")).unwrap();
    for line in data("requests_seed0.jsonl").lines() {
        let r: Value = serde_json::from_str(line).unwrap();
        let toks = tokens(&r["all_token_ids"]);
        let extras = RequestExtras { cache_salt: r["cache_salt"].as_str().map(str::to_owned), ..Default::default() };
        let got = h.hash_request(&toks, 16, &extras).unwrap();
        let want_hex: Vec<&str> =
            r["block_hashes_hex"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
        let want_u64: Vec<u64> =
            r["block_hashes_u64"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
        let id = r["request_id"].as_str().unwrap();
        assert_eq!(got.iter().map(|b| b.digest.to_hex()).collect::<Vec<_>>(), want_hex, "{id}");
        assert_eq!(got.iter().map(|b| b.key.0).collect::<Vec<_>>(), want_u64, "{id}");
        checked += 2 * got.len();
    }
    checked
}

fn json_u64s(v: &Value) -> Vec<u64> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect()
}

/// Compares a decoded event with Python's decoding of the same payload.
fn check_event(ev: &WireEvent, want: &Value, ctx: &str) -> usize {
    // Legacy events are positional arrays: name their fields.
    let want = match want {
        Value::Array(a) => {
            let names: &[&str] = match a[0].as_str().unwrap() {
                "BlockStored" => &[
                    "block_hashes",
                    "parent_block_hash",
                    "token_ids",
                    "block_size",
                    "lora_id",
                    "medium",
                    "lora_name",
                    "extra_keys",
                    "group_idx",
                    "kv_cache_spec_kind",
                    "kv_cache_spec_sliding_window",
                ],
                "BlockRemoved" => &["block_hashes", "medium", "group_idx"],
                _ => &[],
            };
            let mut m = serde_json::Map::new();
            m.insert("type".into(), a[0].clone());
            for (n, v) in names.iter().zip(a.iter().skip(1)) {
                m.insert((*n).into(), v.clone());
            }
            Value::Object(m)
        }
        other => other.clone(),
    };
    assert_eq!(ev.type_name(), want["type"].as_str().unwrap(), "{ctx}");
    match ev {
        WireEvent::BlockStored(s) => {
            assert_eq!(s.block_hashes, json_u64s(&want["block_hashes"]), "{ctx}");
            assert_eq!(s.parent_block_hash, want["parent_block_hash"].as_u64(), "{ctx}");
            assert_eq!(s.token_ids, tokens(&want["token_ids"]), "{ctx}");
            assert_eq!(s.block_size, want["block_size"].as_u64().unwrap(), "{ctx}");
            assert_eq!(s.lora_id, want["lora_id"].as_i64(), "{ctx}");
            assert_eq!(s.medium.as_deref(), want["medium"].as_str(), "{ctx}");
            assert_eq!(s.lora_name.as_deref(), want["lora_name"].as_str(), "{ctx}");
            assert_eq!(s.group_idx, want["group_idx"].as_i64(), "{ctx}");
            assert_eq!(s.kv_cache_spec_kind.as_deref(), want["kv_cache_spec_kind"].as_str(), "{ctx}");
            let ek = s.extra_keys.as_ref().unwrap();
            let wk = want["extra_keys"].as_array().unwrap();
            assert_eq!(ek.len(), wk.len(), "{ctx}");
            for (e, w) in ek.iter().zip(wk) {
                match (e, w) {
                    (None, Value::Null) => {}
                    (Some(items), Value::Array(ws)) => {
                        assert_eq!(items.len(), ws.len(), "{ctx}");
                        for (i, w) in items.iter().zip(ws) {
                            assert_eq!(format!("{i:?}"), format!("Str({:?})", w.as_str().unwrap()), "{ctx}");
                        }
                    }
                    _ => panic!("{ctx}: extra keys {e:?} vs {w}"),
                }
            }
            10
        }
        WireEvent::BlockRemoved(r) => {
            assert_eq!(r.block_hashes, json_u64s(&want["block_hashes"]), "{ctx}");
            assert_eq!(r.medium.as_deref(), want["medium"].as_str(), "{ctx}");
            assert_eq!(r.group_idx, want["group_idx"].as_i64(), "{ctx}");
            3
        }
        WireEvent::AllBlocksCleared => 1,
        WireEvent::Unknown { type_name } => panic!("{ctx}: unknown event {type_name}"),
    }
}

/// Decodes every payload of a capture, checks it against Python's decoding, replays it
/// through a mirror with parity on, and checks the mirror against the events step by step.
fn check_stream(file: &str) -> (usize, Vec<Vec<NetChange>>) {
    let mut checked = 0;
    let mut mirror = EngineMirror::new(Some(BlockHasher::new(HashAlgo::Sha256Cbor, Some("0")).unwrap()));
    let mut naive: BTreeMap<u64, u32> = BTreeMap::new();
    let mut all_changes = Vec::new();
    for (n, line) in data(file).lines().enumerate() {
        let rec: Value = serde_json::from_str(line).unwrap();
        let ctx = format!("{file} line {n} seq {}", rec["seq"]);
        let payload = unhex(rec["payload_hex"].as_str().unwrap());
        let wire = decode_batch(&payload).unwrap_or_else(|e| panic!("{ctx}: {e}"));
        let dec = &rec["decoded"];
        assert_eq!(wire.ts, dec[0].as_f64().unwrap(), "{ctx}: ts");
        assert_eq!(wire.data_parallel_rank, dec[2].as_i64(), "{ctx}: rank");
        let want_events = dec[1].as_array().unwrap();
        assert_eq!(wire.events.len(), want_events.len(), "{ctx}");
        for (i, (e, w)) in wire.events.iter().zip(want_events).enumerate() {
            checked += check_event(e, w, &format!("{ctx} event {i}"));
        }
        // Naive model of the engine's cache.
        let before: BTreeSet<u64> = naive.keys().copied().collect();
        let batch = EventBatch::from(wire);
        for ev in &batch.events {
            match ev {
                KvEvent::Stored(s) => s.hashes.iter().for_each(|k| *naive.entry(k.0).or_default() += 1),
                KvEvent::Removed(r) => r.hashes.iter().for_each(|k| {
                    if let Some(c) = naive.get_mut(&k.0) {
                        *c -= 1;
                        if *c == 0 {
                            naive.remove(&k.0);
                        }
                    }
                }),
                KvEvent::AllCleared => naive.clear(),
                KvEvent::Unknown(_) => {}
            }
        }
        let after: BTreeSet<u64> = naive.keys().copied().collect();
        let mut changes = Vec::new();
        mirror.apply(&batch, &mut changes);
        let added: BTreeSet<u64> =
            changes.iter().filter(|c| matches!(c, NetChange::Added(_))).map(|c| c.key().0).collect();
        let removed: BTreeSet<u64> =
            changes.iter().filter(|c| matches!(c, NetChange::Removed(_))).map(|c| c.key().0).collect();
        assert_eq!(added, after.difference(&before).copied().collect(), "{ctx}: added");
        assert_eq!(removed, before.difference(&after).copied().collect(), "{ctx}: removed");
        assert_eq!(mirror.keys(), after.iter().copied().map(BlockKey).collect::<Vec<_>>(), "{ctx}: mirror");
        for (k, c) in &naive {
            assert_eq!(mirror.count(BlockKey(*k)), *c, "{ctx}: count of {k}");
        }
        checked += 3;
        all_changes.push(changes);
    }
    let st = mirror.stats();
    assert_eq!(st.parity.mismatched, 0, "{file}: parity mismatches {:?}", st.parity);
    assert!(st.parity.matched > 0, "{file}: nothing verified");
    assert_eq!(st.clears, 1, "{file}: the capture ends with AllBlocksCleared");
    assert!(mirror.is_empty());
    eprintln!("{file}: parity matched {} unverifiable {}", st.parity.matched, st.parity.unverifiable);
    (checked, all_changes)
}

#[test]
fn every_vllm_fixture_case_matches() {
    let golden_seed0 = check_golden("golden_seed0.json", Some("0"));
    let golden_noseed = check_golden("golden_noseed.json", None);
    let requests = check_requests();
    let (native, native_changes) = check_stream("batches_native_seed0.jsonl");
    let (legacy, legacy_changes) = check_stream("batches_legacy_seed0.jsonl");
    assert_eq!(native_changes, legacy_changes, "both encodings must yield the same net changes");
    let total = golden_seed0 + golden_noseed + requests + native + legacy;
    println!(
        "vLLM 0.33.0 fixtures: {total} values checked (golden seed=0: {golden_seed0}, golden unset seed: {golden_noseed}, \
         requests: {requests}, native batches: {native}, legacy batches: {legacy})"
    );
    assert!(total > 1000);
}

#[test]
fn a_wrong_seed_is_reported_as_parity_mismatch() {
    let mut mirror = EngineMirror::new(Some(BlockHasher::new(HashAlgo::Sha256Cbor, Some("1")).unwrap()));
    let mut changes = Vec::new();
    for line in data("batches_native_seed0.jsonl").lines() {
        let rec: Value = serde_json::from_str(line).unwrap();
        mirror.apply(&EventBatch::decode(&unhex(rec["payload_hex"].as_str().unwrap())).unwrap(), &mut changes);
    }
    let p = &mirror.stats().parity;
    assert_eq!(p.matched, 0);
    assert!(p.mismatched > 0);
    assert!(p.match_ratio() == Some(0.0));
}

#[test]
fn the_default_sha256_is_not_what_the_capture_used() {
    // The capture ran with sha256_cbor: checking it as pickle-sha256 must fail (the parity
    // check really distinguishes algorithms).
    let mut mirror = EngineMirror::new(Some(BlockHasher::new(HashAlgo::Sha256, Some("0")).unwrap()));
    let mut changes = Vec::new();
    let first = data("batches_native_seed0.jsonl").lines().next().map(str::to_owned).unwrap();
    let rec: Value = serde_json::from_str(&first).unwrap();
    mirror.apply(&EventBatch::decode(&unhex(rec["payload_hex"].as_str().unwrap())).unwrap(), &mut changes);
    assert_eq!(mirror.stats().parity.matched, 0);
    assert!(mirror.stats().parity.mismatched > 0);
    let _ = Digest::from_slice(&[0; 32]);
}

#[test]
fn reencoding_reproduces_vllm_payloads() {
    // Our encoder writes what msgspec wrote, up to map header widths: decode(ours) == decode(theirs).
    use llmgw_core::wire::{encode_batch, Encoding, HashForm};
    for (file, enc) in
        [("batches_native_seed0.jsonl", Encoding::Tagged), ("batches_legacy_seed0.jsonl", Encoding::Positional)]
    {
        for line in data(file).lines() {
            let rec: Value = serde_json::from_str(line).unwrap();
            let theirs = unhex(rec["payload_hex"].as_str().unwrap());
            let batch = decode_batch(&theirs).unwrap();
            for form in [HashForm::Int, HashForm::Bytes] {
                let ours = encode_batch(&batch, enc, form);
                assert_eq!(decode_batch(&ours).unwrap(), batch, "{file}");
            }
            if enc == Encoding::Positional {
                assert_eq!(encode_batch(&batch, enc, HashForm::Int), theirs, "{file}: positional bytes");
            }
        }
    }
}

/// EAGLE-family lookahead hashing (vLLM 0.33 `num_hash_lookahead_tokens`): golden hashes from
/// vLLM's own request block hasher (`golden_lookahead_seed0.json`, written by
/// `conformance/golden_lookahead.py`), for both sha256 algorithms; lookahead 1 (EAGLE), 2 and 3
/// (multi-module MTP), with a cache salt and a LoRA adapter, and a prompt whose last full block
/// is not hashed yet (its lookahead token does not exist).
#[test]
fn lookahead_hashes_match_vllms_and_lookahead_events_verify() {
    let doc: Value = serde_json::from_str(&data("golden_lookahead_seed0.json")).unwrap();
    assert_eq!(doc["vllm_version"], "0.33.0");
    let mut checked = 0;
    for (algo_name, algo) in doc["algorithms"].as_object().unwrap() {
        let algo_v = HashAlgo::parse(algo_name).unwrap();
        let mut h = BlockHasher::new(algo_v, Some("0")).unwrap();
        assert_eq!(h.root().to_hex(), algo["none_hash_hex"].as_str().unwrap());
        for case in algo["cases"].as_array().unwrap() {
            let name = case["name"].as_str().unwrap();
            let toks = tokens(&case["token_ids"]);
            let ex = extras_of(case);
            let got = h.hash_request(&toks, 16, &ex).unwrap();
            let want: Vec<String> =
                case["hash_hex"].as_array().unwrap().iter().map(|v| v.as_str().unwrap().to_owned()).collect();
            let got_hex: Vec<String> = got.iter().map(|b| b.digest.to_hex()).collect();
            assert_eq!(got_hex, want, "{algo_name} {name}");
            assert_eq!(got.iter().map(|b| b.key.0).collect::<Vec<_>>(), json_u64s(&case["event_u64"]));
            assert_eq!(ex.hashed_blocks(toks.len(), 16), Some(want.len()), "{name}: blocks the engine hashes");
            checked += want.len();
            // The lookahead changes every hash: plain hashing of the same tokens matches none.
            if ex.lookahead > 0 {
                let plain = h.hash_request(&toks, 16, &RequestExtras { lookahead: 0, ..ex.clone() }).unwrap();
                assert!(plain.iter().zip(&got).all(|(a, b)| a.key != b.key), "{name}");
            }
            // The agent's parity check recomputes a lookahead engine's stored blocks from the
            // lookahead tokens its events carry (plain prompts: no extra keys to rebuild).
            if ex.lookahead > 0 && ex.cache_salt.is_none() && ex.lora.is_none() && algo_v == HashAlgo::Sha256Cbor {
                let la: Vec<Vec<u32>> = case["lookahead_token_ids"].as_array().unwrap().iter().map(tokens).collect();
                let stored = llmgw_core::wire::WireBlockStored {
                    block_hashes: got.iter().map(|b| b.key.0).collect(),
                    token_ids: toks[..got.len() * 16].to_vec(),
                    block_size: 16,
                    lookahead_token_ids: Some(la),
                    ..Default::default()
                };
                let batch = llmgw_core::wire::WireBatch {
                    ts: 1.0,
                    events: vec![WireEvent::BlockStored(stored)],
                    data_parallel_rank: Some(0),
                };
                let bytes = llmgw_core::wire::encode_batch(
                    &batch,
                    llmgw_core::wire::Encoding::Tagged,
                    llmgw_core::wire::HashForm::Int,
                );
                let mut mirror = EngineMirror::new(Some(BlockHasher::new(algo_v, Some("0")).unwrap()));
                mirror.apply(&EventBatch::decode(&bytes).unwrap(), &mut Vec::new());
                let p = &mirror.stats().parity;
                assert_eq!((p.matched, p.mismatched, p.unverifiable), (got.len() as u64, 0, 0), "{name}");
                assert_eq!(mirror.stats().lookahead_tokens, Some(ex.lookahead), "{name}");
            }
        }
    }
    assert!(checked >= 30, "{checked}");
}
