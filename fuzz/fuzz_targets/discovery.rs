//! Fuzzes the reading of a replica's `GET /kv_event_sources` answer, for an IPv4, an IPv6 and
//! a loopback replica address (first byte), and the engine specs made from what it accepts:
//! no panic, at most `MAX_RANKS` sources, each endpoint on the replica's own address.
#![no_main]

use libfuzzer_sys::fuzz_target;
use llmgw_agent::config::Config;
use llmgw_agent::discovery::{parse_sources, specs, MAX_RANKS};
use std::net::IpAddr;
use std::sync::OnceLock;

/// An agent configuration with one discovery entry (the specs' template).
fn config() -> &'static Config {
    static CFG: OnceLock<Config> = OnceLock::new();
    CFG.get_or_init(|| {
        Config::parse(
            r#"
[[discovery]]
name = "fleet"
dns = "vllm.example"
port = 8000
models = ["m"]
"#,
        )
        .expect("fixture configuration")
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&which, body)) = data.split_first() else { return };
    let Ok(body) = std::str::from_utf8(body) else { return };
    let ip: IpAddr = match which % 3 {
        0 => [10, 0, 0, 7].into(),
        1 => "fd00::7".parse().unwrap(),
        _ => [127, 0, 0, 1].into(),
    };
    if let Ok(sources) = parse_sources(ip, body) {
        assert!(sources.len() <= MAX_RANKS);
        let cfg = config();
        let Some(d) = cfg.discovery.first() else { return };
        for spec in specs(cfg, d, ip, &sources) {
            assert!(spec.endpoint.starts_with("tcp://"), "{}", spec.endpoint);
            let _ = spec.label();
            let _ = spec.hasher();
        }
    }
});
