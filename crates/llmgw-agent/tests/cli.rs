//! The `hash` and `decode` tools, run as a user would, against vLLM 0.33.0 captures.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::arithmetic_side_effects
)]

use serde_json::Value;
use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};

fn data(name: &str) -> String {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../llmgw-core/tests/data/vllm-0.33.0").join(name);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// Runs the agent with `args`, feeding `stdin`; returns (success, stdout, stderr).
fn run(args: &[&str], stdin: &[u8]) -> (bool, String, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_llmgw-agent"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn llmgw-agent");
    // A command that refuses its arguments exits before reading stdin: a broken pipe is fine.
    let _ = child.stdin.take().expect("stdin").write_all(stdin);
    let out = child.wait_with_output().expect("wait");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn hash_matches_every_golden_case() {
    let mut checked = 0;
    for (file, seed) in [("golden_seed0.json", Some("0")), ("golden_noseed.json", None)] {
        let g: Value = serde_json::from_str(&data(file)).unwrap();
        for algo in ["sha256_cbor", "sha256"] {
            for case in g["algorithms"][algo]["cases"].as_array().unwrap() {
                if !case["mm"].is_null() {
                    continue; // the CLI takes no multimodal items
                }
                let mut args = vec!["hash", "--algo", algo, "--block-size", "16"];
                if let Some(s) = seed {
                    args.extend(["--seed", s]);
                }
                let salt = case["cache_salt"].as_str().map(str::to_owned);
                if let Some(s) = &salt {
                    args.extend(["--cache-salt", s]);
                }
                let lora = case["lora"].clone();
                if let (Some(n), Some(p)) = (lora["name"].as_str(), lora["path"].as_str()) {
                    args.extend(["--lora-name", n, "--lora-path", p]);
                }
                let (ok, out, err) = run(&args, case["token_ids"].to_string().as_bytes());
                assert!(ok, "{file} {algo} {}: {err}", case["name"]);
                let got: Value = serde_json::from_str(&out).unwrap();
                let want: Vec<Value> = case["blocks"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|b| serde_json::json!({"hash_hex": b["hash_hex"], "u64": b["event_u64"]}))
                    .collect();
                assert_eq!(got, serde_json::json!({ "blocks": want }), "{file} {algo} {}", case["name"]);
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 28);
}

#[test]
fn decode_matches_every_captured_payload() {
    for file in ["batches_native_seed0.jsonl", "batches_legacy_seed0.jsonl"] {
        for line in data(file).lines() {
            let rec: Value = serde_json::from_str(line).unwrap();
            let (ok, out, err) = run(&["decode", "--hex"], rec["payload_hex"].as_str().unwrap().as_bytes());
            assert!(ok, "{err}");
            let got: Value = serde_json::from_str(&out).unwrap();
            let dec = &rec["decoded"];
            assert_eq!(got["ts"], dec[0]);
            assert_eq!(got["dp_rank"], dec[2]);
            let events = got["events"].as_array().unwrap();
            assert_eq!(events.len(), dec[1].as_array().unwrap().len());
            for (e, w) in events.iter().zip(dec[1].as_array().unwrap()) {
                // Native events are maps, legacy ones arrays: compare the common fields.
                let (ty, hashes) = match w {
                    Value::Array(a) => (a[0].clone(), a.get(1).cloned().unwrap_or(Value::Null)),
                    _ => (w["type"].clone(), w["block_hashes"].clone()),
                };
                assert_eq!(e["type"], ty);
                if e["type"] != "AllBlocksCleared" {
                    assert_eq!(e["block_hashes"], hashes);
                    assert_eq!(e["medium"], "GPU");
                }
                if e["type"] == "BlockStored" {
                    let parent = match w {
                        Value::Array(a) => a[2].clone(),
                        _ => w["parent_block_hash"].clone(),
                    };
                    assert_eq!(e["parent"], parent);
                    for key in ["token_ids", "block_size", "lora_name", "extra_keys", "group_idx"] {
                        assert!(e.get(key).is_some(), "missing {key}");
                    }
                }
            }
            // Raw bytes on stdin give the same answer.
            let raw: Vec<u8> = {
                let h = rec["payload_hex"].as_str().unwrap();
                (0..h.len()).step_by(2).map(|i| u8::from_str_radix(&h[i..i + 2], 16).unwrap()).collect()
            };
            let (ok, out_raw, _) = run(&["decode"], &raw);
            assert!(ok);
            assert_eq!(out_raw, out);
        }
    }
}

#[test]
fn malformed_input_exits_nonzero_with_one_line() {
    for (args, input) in [
        (vec!["decode", "--hex"], "93 00".as_bytes()),
        (vec!["decode", "--hex"], "zz".as_bytes()),
        (vec!["decode"], &[0xc1u8][..]),
        (vec!["hash", "--algo", "sha256", "--block-size", "16"], "[1, -2]".as_bytes()),
        (vec!["hash", "--algo", "md5", "--block-size", "16"], "[1]".as_bytes()),
        (vec!["hash", "--algo", "xxhash", "--block-size", "16"], "[1]".as_bytes()),
        (vec!["hash", "--algo", "sha256", "--block-size", "0"], "[1]".as_bytes()),
    ] {
        let (ok, out, err) = run(&args, input);
        assert!(!ok, "{args:?} succeeded");
        assert!(out.is_empty(), "{args:?} printed {out}");
        assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: {err}");
    }
}
