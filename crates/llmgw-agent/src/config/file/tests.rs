//! Tests of `file.rs`.

use super::*;
use llmgw_core::hash::defaults;

pub(in crate::config) const OK: &str = r#"
[hash]
algo = "sha256_cbor"
seed = "0"

[[replicas]]
name = "a"
address = "127.0.0.1:8000"
models = ["m"]
endpoint = "tcp://127.0.0.1:5557"
replay_endpoint = "tcp://127.0.0.1:5558"
topic = "kv-events"
dp_ranks = 2

[[replicas]]
name = "b"
address = "127.0.0.1:8001"
endpoint = "tcp://127.0.0.1:6000"
mode = "bind"
metrics_url = ""
"#;

pub(in crate::config) fn error_of(text: &str) -> ConfigError {
    match Config::parse(text) {
        Ok(_) => panic!("config unexpectedly accepted:\n{text}"),
        Err(e) => e,
    }
}

#[test]
fn type_error_names_the_field() {
    let e = error_of(&OK.replace("mode = \"bind\"", "mode = \"sideways\""));
    assert_eq!(e.field, "replicas[1].mode", "{e}");
    let e = error_of(&OK.replace("dp_ranks = 2", "dp_ranks = \"two\""));
    assert_eq!(e.field, "replicas[0].dp_ranks", "{e}");
    let e = error_of(&OK.replace("topic = \"kv-events\"", "topik = \"kv-events\""));
    assert_eq!(e.field, "replicas[0].topik", "{e}");
    assert!(e.message.contains("unknown field"), "{e}");
}

#[test]
fn missing_field_is_named() {
    let e = error_of(&OK.replace("endpoint = \"tcp://127.0.0.1:6000\"", ""));
    assert_eq!(e.field, "replicas[1].endpoint", "{e}");
    assert!(e.message.contains("missing"), "{e}");
}

#[test]
fn syntax_error_is_reported() {
    let e = error_of("[[replicas]\nname=");
    assert!(!e.message.is_empty());
}

#[test]
fn hash_algorithm_is_read_once_and_defaults_come_from_the_core() {
    let cfg = Config::parse("").unwrap();
    assert_eq!(cfg.hash, HashConfig::default());
    assert_eq!(
        (cfg.hash.algo, cfg.hash.seed.as_deref(), cfg.hash.block_size),
        (defaults::ALGO, None, defaults::BLOCK_SIZE)
    );
    let cfg =
        Config::parse(&OK.replace("name = \"b\"", "name = \"b\"\nhash = { algo = \"xxhash\", seed = \"1\" }")).unwrap();
    let h = cfg.replicas[1].hash.as_ref().unwrap();
    assert_eq!((h.algo, h.block_size), (HashAlgo::Xxhash, defaults::BLOCK_SIZE));
    let e = error_of(&OK.replace("name = \"b\"", "name = \"b\"\nhash = { algo = \"md5\" }"));
    assert_eq!(e.field, "replicas[1].hash.algo", "{e}");
    assert!(e.message.contains("md5"), "{e}");
}
