//! `llmgw-agent run`, `check-config`, `vllm-args` and `install-filter` as a user runs them:
//! configuration errors name the field, and the feed refuses a non-loopback listener without the
//! flag and a token.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::arithmetic_side_effects
)]

use std::path::PathBuf;
use std::process::Command;

fn write(name: &str, text: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("llmgw-agent-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

fn agent(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_llmgw-agent")).args(args).output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

const CFG: &str = r#"
[hash]
algo = "sha256_cbor"
seed = "0"

[[replicas]]
name = "r0"
address = "10.0.0.5:8000"
models = ["m"]
endpoint = "tcp://10.0.0.5:5557"
replay_endpoint = "tcp://10.0.0.5:5558"
topic = "kv-events"
dp_ranks = 2
"#;

#[test]
fn run_reports_the_bad_field() {
    let p = write("bad.toml", &CFG.replace("dp_ranks = 2", "dp_ranks = -1"));
    let (ok, _, err) = agent(&["run", "--config", p.to_str().unwrap()]);
    assert!(!ok);
    assert!(err.contains("replicas[0].dp_ranks"), "{err}");
}

#[test]
fn non_loopback_feed_needs_flag_tls_and_token() {
    let p = write("ok.toml", CFG);
    let path = p.to_str().unwrap();
    let (ok, _, err) = agent(&["run", "--config", path, "--feed-listen", "0.0.0.0:0"]);
    assert!(!ok);
    assert!(err.contains("feed.listen") && err.contains("allow_non_loopback"), "{err}");
    let (ok, _, err) = agent(&["run", "--config", path, "--feed-listen", "0.0.0.0:0", "--feed-allow-non-loopback"]);
    assert!(!ok);
    assert!(err.contains("feed.tls_cert"), "{err}");
}

#[test]
fn check_config_lists_engines_with_offset_ports() {
    let p = write("ok2.toml", CFG);
    let (ok, out, err) = agent(&["check-config", "--config", p.to_str().unwrap()]);
    assert!(ok, "{err}");
    assert!(out.contains("r0#0 id=0 10.0.0.5:8000 Connect tcp://10.0.0.5:5557 replay=tcp://10.0.0.5:5558"), "{out}");
    assert!(out.contains("r0#1 id=1 10.0.0.5:8000 Connect tcp://10.0.0.5:5558 replay=tcp://10.0.0.5:5559"), "{out}");
}

#[test]
fn vllm_args_prints_matching_flags_and_seed() {
    let p = write("ok3.toml", CFG);
    let (ok, out, err) = agent(&["vllm-args", "--config", p.to_str().unwrap()]);
    assert!(ok, "{err}");
    assert!(out.contains("PYTHONHASHSEED=0 vllm serve m --enable-prefix-caching --prefix-caching-hash-algo sha256_cbor --block-size 16 --kv-events-config"), "{out}");
    assert!(out.contains(r#""endpoint":"tcp://*:5557""#), "{out}");
    assert!(out.contains(r#""replay_endpoint":"tcp://*:5558""#), "{out}");
    assert!(out.contains(r#""topic":"kv-events""#), "{out}");
}

#[test]
fn vllm_args_adds_scale_out_for_render_and_the_buffer_steps_asked_for() {
    let p = write("ok4.toml", CFG);
    let (ok, out, err) = agent(&["vllm-args", "--config", p.to_str().unwrap()]);
    assert!(ok, "{err}");
    assert!(!out.contains("--enable-scale-out"), "{out}");
    assert!(out.contains(r#""buffer_steps":10000"#), "{out}");
    let (ok, out, err) = agent(&["vllm-args", "--config", p.to_str().unwrap(), "--render", "--buffer-steps", "40000"]);
    assert!(ok, "{err}");
    assert!(out.trim_end().ends_with("--enable-scale-out"), "{out}");
    assert!(out.contains(r#""buffer_steps":40000"#), "{out}");
    let (ok, _, err) = agent(&["vllm-args", "--config", p.to_str().unwrap(), "--buffer-steps", "0"]);
    assert!(!ok && err.contains("buffer-steps"), "{err}");
}

#[test]
fn install_filter_copies_a_module_and_refuses_anything_else() {
    let module = b"\0asm\x01\0\0\0rest of the module";
    let from = write("filter.wasm", "");
    std::fs::write(&from, module).unwrap();
    let to = from.with_file_name("installed.wasm");
    let _ = std::fs::remove_file(&to);
    let (ok, out, err) = agent(&["install-filter", "--from", from.to_str().unwrap(), "--to", to.to_str().unwrap()]);
    assert!(ok, "{err}");
    assert!(out.contains("installed.wasm"), "{out}");
    assert_eq!(std::fs::read(&to).unwrap(), module);
    let text = write("not-a-module.wasm", "<html>404</html>");
    let other = from.with_file_name("other.wasm");
    let (ok, _, err) = agent(&["install-filter", "--from", text.to_str().unwrap(), "--to", other.to_str().unwrap()]);
    assert!(!ok && err.contains("not a WebAssembly module"), "{err}");
    assert!(!other.exists());
    let (ok, _, err) = agent(&["install-filter", "--from", "/nonexistent/llmgw.wasm", "--to", other.to_str().unwrap()]);
    assert!(!ok && err.contains("/nonexistent/llmgw.wasm"), "{err}");
}
