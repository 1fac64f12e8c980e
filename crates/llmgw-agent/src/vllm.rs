//! The vLLM flags and environment that make a replica publish what this agent expects.

use crate::config::{parse_tcp, Config, DiscoveryConfig, HashConfig, Mode, ReplicaConfig, Sources};
use serde_json::json;

/// Flags and environment for one replica (rank 0; vLLM offsets the ports of other ranks).
#[derive(Debug, Clone, PartialEq)]
pub struct VllmArgs {
    pub replica: String,
    pub env: Vec<(String, String)>,
    pub args: Vec<String>,
}

fn is_loopback(host: &str) -> bool {
    matches!(host, "127.0.0.1" | "localhost" | "[::ffff:127.0.0.1]")
}

/// vLLM binds its PUB when the endpoint has `*` or `::`, and connects otherwise.
fn publisher_endpoint(r: &ReplicaConfig) -> String {
    let Ok((host, port)) = parse_tcp(&r.endpoint) else { return r.endpoint.clone() };
    match r.mode {
        // The agent binds: vLLM must connect, so no `*` or `::` in the address.
        Mode::Bind => {
            let host = if host.contains("::ffff:127.0.0.1") { "127.0.0.1".to_owned() } else { host };
            format!("tcp://{host}:{port}")
        }
        // The agent connects: vLLM must bind; the IPv4-mapped loopback form binds 127.0.0.1 only.
        Mode::Connect if is_loopback(&host) => format!("tcp://[::ffff:127.0.0.1]:{port}"),
        Mode::Connect => format!("tcp://*:{port}"),
    }
}

/// vLLM always binds the replay ROUTER.
fn replay_endpoint(e: &str) -> String {
    match parse_tcp(e) {
        Ok((host, port)) if is_loopback(&host) => format!("tcp://{host}:{port}"),
        Ok((_, port)) => format!("tcp://*:{port}"),
        Err(_) => e.to_owned(),
    }
}

pub fn for_replica(cfg: &Config, r: &ReplicaConfig) -> VllmArgs {
    let hash = r.hash.as_ref().unwrap_or(&cfg.hash);
    let replay = r.replay_endpoint.as_deref().map(replay_endpoint);
    flags(&r.name, hash, publisher_endpoint(r), replay, &r.topic)
}

/// vLLM's default publisher and replay ports, used for discovered replicas whose configuration
/// names none (`sources = "kv_event_sources"` reads the ports back from each replica).
pub const DEFAULT_EVENTS_PORT: u16 = 5557;
pub const DEFAULT_REPLAY_PORT: u16 = 5558;

/// Flags for every replica behind a `[[discovery]]` name: the publisher and the replay socket
/// bound on all interfaces (each agent that resolves the name connects to them).
pub fn for_discovery(cfg: &Config, d: &DiscoveryConfig) -> VllmArgs {
    let hash = d.hash.as_ref().unwrap_or(&cfg.hash);
    let (events, replay) = match d.sources {
        Sources::Static => (d.events_port.unwrap_or(DEFAULT_EVENTS_PORT), d.replay_port),
        Sources::KvEventSources => {
            (d.events_port.unwrap_or(DEFAULT_EVENTS_PORT), Some(d.replay_port.unwrap_or(DEFAULT_REPLAY_PORT)))
        }
    };
    let replay = replay.map(|p| format!("tcp://*:{p}"));
    flags(&d.name, hash, format!("tcp://*:{events}"), replay, &d.topic)
}

fn flags(name: &str, hash: &HashConfig, endpoint: String, replay: Option<String>, topic: &str) -> VllmArgs {
    // Keys in sorted order whatever serde_json's map keeps (another crate of the build may turn
    // on its preserve_order): the manifests hold this text as printed.
    let mut kv = std::collections::BTreeMap::new();
    kv.insert("enable_kv_cache_events", json!(true));
    kv.insert("publisher", json!("zmq"));
    kv.insert("endpoint", json!(endpoint));
    kv.insert("topic", json!(topic));
    if let Some(rep) = replay {
        kv.insert("replay_endpoint", json!(rep));
    }
    let kv = serde_json::to_string(&kv).unwrap_or_default();
    let mut env = Vec::new();
    if let Some(seed) = &hash.seed {
        env.push(("PYTHONHASHSEED".to_owned(), seed.clone()));
    }
    let args = vec![
        "--enable-prefix-caching".to_owned(),
        "--prefix-caching-hash-algo".to_owned(),
        hash.algo.name().to_owned(),
        "--block-size".to_owned(),
        hash.block_size.to_string(),
        "--kv-events-config".to_owned(),
        kv,
    ];
    VllmArgs { replica: name.to_owned(), env, args }
}

fn shell_quote(s: &str) -> String {
    if !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_./:=@,+".contains(&b)) {
        s.to_owned()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

fn line(out: &mut String, a: &VllmArgs, model: Option<&String>) {
    let env: Vec<String> = a.env.iter().map(|(k, v)| format!("{k}={}", shell_quote(v))).collect();
    let args: Vec<String> = a.args.iter().map(|s| shell_quote(s)).collect();
    let model = model.map(|m| shell_quote(m)).unwrap_or_else(|| "MODEL".to_owned());
    let mut l = env.join(" ");
    if !l.is_empty() {
        l.push(' ');
    }
    l.push_str(&format!("vllm serve {model} {}\n", args.join(" ")));
    out.push_str(&l);
}

/// Shell lines for every replica and every discovered pool.
pub fn render(cfg: &Config) -> String {
    let mut out = String::new();
    for r in &cfg.replicas {
        out.push_str(&format!(
            "# replica {} ({} data-parallel rank(s); vLLM adds the rank to both ports)\n",
            r.name, r.dp_ranks
        ));
        line(&mut out, &for_replica(cfg, r), r.models.first());
    }
    for d in &cfg.discovery {
        out.push_str(&format!(
            "# every replica behind {} (discovery {}; vLLM adds the data-parallel rank to both ports)\n",
            d.dns, d.name
        ));
        line(&mut out, &for_discovery(cfg, d), d.models.first());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_match_modes() {
        let cfg = Config::parse(
            r#"
[hash]
seed = "0"
[[replicas]]
name = "a"
address = "10.0.0.5:8000"
models = ["m"]
endpoint = "tcp://10.0.0.5:5557"
replay_endpoint = "tcp://10.0.0.5:5558"
topic = "kv-events"
[[replicas]]
name = "b"
address = "127.0.0.1:8001"
endpoint = "tcp://127.0.0.1:6000"
mode = "bind"
[[replicas]]
name = "c"
address = "127.0.0.1:8002"
endpoint = "tcp://127.0.0.1:6100"
"#,
        )
        .unwrap();
        let a = for_replica(&cfg, &cfg.replicas[0]);
        assert_eq!(a.env, vec![("PYTHONHASHSEED".to_owned(), "0".to_owned())]);
        assert_eq!(
            a.args[..5],
            ["--enable-prefix-caching", "--prefix-caching-hash-algo", "sha256_cbor", "--block-size", "16"]
        );
        // Sorted keys, as the manifests hold it, whether or not serde_json preserves order.
        assert_eq!(
            a.args[6],
            r#"{"enable_kv_cache_events":true,"endpoint":"tcp://*:5557","publisher":"zmq","replay_endpoint":"tcp://*:5558","topic":"kv-events"}"#
        );
        let kv: serde_json::Value = serde_json::from_str(&a.args[6]).unwrap();
        assert_eq!(kv["endpoint"], "tcp://*:5557");
        assert_eq!(kv["replay_endpoint"], "tcp://*:5558");
        assert_eq!(kv["topic"], "kv-events");
        assert_eq!(kv["enable_kv_cache_events"], true);
        let b = for_replica(&cfg, &cfg.replicas[1]);
        let kv: serde_json::Value = serde_json::from_str(&b.args[6]).unwrap();
        assert_eq!(kv["endpoint"], "tcp://127.0.0.1:6000");
        let c = for_replica(&cfg, &cfg.replicas[2]);
        let kv: serde_json::Value = serde_json::from_str(&c.args[6]).unwrap();
        assert_eq!(kv["endpoint"], "tcp://[::ffff:127.0.0.1]:6100");
        let text = render(&cfg);
        assert!(text.contains("PYTHONHASHSEED=0 vllm serve m --enable-prefix-caching"), "{text}");
    }

    #[test]
    fn discovered_replicas_bind_publisher_and_replay() {
        let cfg = Config::parse(
            r#"
[hash]
seed = "7"
block_size = 32
[[discovery]]
name = "pool"
dns = "vllm.ns.svc.cluster.local"
port = 8000
models = ["m"]
[[discovery]]
name = "fixed"
dns = "other.ns.svc.cluster.local"
port = 8000
sources = "static"
events_port = 6000
topic = "t"
"#,
        )
        .unwrap();
        let a = for_discovery(&cfg, &cfg.discovery[0]);
        assert_eq!(a.env, vec![("PYTHONHASHSEED".to_owned(), "7".to_owned())]);
        assert_eq!(a.args[4], "32");
        // Sorted keys, as the manifests hold it, whether or not serde_json preserves order.
        assert_eq!(
            a.args[6],
            r#"{"enable_kv_cache_events":true,"endpoint":"tcp://*:5557","publisher":"zmq","replay_endpoint":"tcp://*:5558","topic":""}"#
        );
        let kv: serde_json::Value = serde_json::from_str(&a.args[6]).unwrap();
        assert_eq!(kv["endpoint"], "tcp://*:5557");
        assert_eq!(kv["replay_endpoint"], "tcp://*:5558");
        let b = for_discovery(&cfg, &cfg.discovery[1]);
        let kv: serde_json::Value = serde_json::from_str(&b.args[6]).unwrap();
        assert_eq!(kv["endpoint"], "tcp://*:6000");
        assert!(kv.get("replay_endpoint").is_none(), "{kv}");
        assert_eq!(kv["topic"], "t");
        let text = render(&cfg);
        assert!(text.contains("# every replica behind vllm.ns.svc.cluster.local"), "{text}");
        assert!(text.contains("PYTHONHASHSEED=7 vllm serve m --enable-prefix-caching"), "{text}");
    }
}
