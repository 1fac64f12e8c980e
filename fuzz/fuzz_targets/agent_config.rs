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
    // The flags with and without the render tokenizer, at a replay depth taken from the input.
    let depth = u32::try_from(data.len()).unwrap_or(u32::MAX).max(1);
    for opts in [vllm::Options::default(), vllm::Options { render: true, buffer_steps: depth }] {
        for r in &cfg.replicas {
            let _ = vllm::for_replica(&cfg, r, &opts);
        }
        for d in &cfg.discovery {
            let _ = vllm::for_discovery(&cfg, d, &opts);
        }
        let _ = vllm::render(&cfg, &opts);
    }
    let _ = cfg.replay_timeout();
});
