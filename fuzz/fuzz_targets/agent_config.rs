//! Fuzzes the agent's TOML configuration: parse and validate, then everything derived from an
//! accepted one (engine specs and their hashers, the vLLM flags rendered for it). No panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use llmgw_agent::config::Config;
use llmgw_agent::vllm;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let Ok(cfg) = Config::parse(text) else { return };
    for spec in cfg.engines() {
        let _ = spec.hasher();
        let _ = spec.label();
    }
    for r in &cfg.replicas {
        let _ = vllm::for_replica(&cfg, r);
    }
    for d in &cfg.discovery {
        let _ = vllm::for_discovery(&cfg, d);
    }
    let _ = vllm::render(&cfg);
    let _ = cfg.replay_timeout();
});
