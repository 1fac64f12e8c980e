//! The vLLM flags and environment that make a replica publish what this agent expects.

use crate::config::{parse_tcp, Config, DiscoveryConfig, HashConfig, Mode, ReplicaConfig, Sources};
use serde_json::json;

/// vLLM's `--kv-events-config` `buffer_steps` default: the batches its replay socket can answer
/// with. An agent that was away (restarted, disconnected) for longer than this many batches of a
/// replica cannot catch up by replay and resets that replica's mirror instead.
pub const DEFAULT_BUFFER_STEPS: u32 = 10_000;

/// What `vllm-args` adds beyond the agent's configuration: settings of the filter and of the
/// replicas' publisher that the agent cannot read from its own file.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Options {
    /// The filter tokenizes through vLLM's render endpoints (`tokenizer = "render"`, which
    /// multimodal chats need): `vllm serve` must be started with `--enable-scale-out`, else it
    /// answers them 403.
    pub render: bool,
    /// The replay buffer, in batches (`buffer_steps` in `--kv-events-config`).
    pub buffer_steps: u32,
}

impl Default for Options {
    fn default() -> Self {
        Options { render: false, buffer_steps: DEFAULT_BUFFER_STEPS }
    }
}

/// Flags and environment for one replica (rank 0; vLLM offsets the ports of other ranks).
#[derive(Debug, Clone, PartialEq)]
pub struct VllmArgs {
    pub replica: String,
    /// The environment with its values, where known (`launch` starts vLLM with it).
    pub env: Vec<(String, String)>,
    /// The environment as a shell line sets it: a seed read from a variable or a file (a
    /// Secret's) as a reference to it (`PYTHONHASHSEED="$LLMGW_HASH_SEED"`), never its value.
    pub env_shown: Vec<String>,
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

pub fn for_replica(cfg: &Config, r: &ReplicaConfig, opts: &Options) -> VllmArgs {
    let hash = r.hash.as_ref().unwrap_or(&cfg.hash);
    let replay = r.replay_endpoint.as_deref().map(replay_endpoint);
    flags(&r.name, hash, publisher_endpoint(r), replay, &r.topic, opts)
}

/// vLLM's default publisher and replay ports, used for discovered replicas whose configuration
/// names none (`sources = "kv_event_sources"` reads the ports back from each replica).
pub const DEFAULT_EVENTS_PORT: u16 = 5557;
pub const DEFAULT_REPLAY_PORT: u16 = 5558;

/// Flags for every replica behind a `[[discovery]]` name: the publisher and the replay socket
/// bound on all interfaces (each agent that resolves the name connects to them).
pub fn for_discovery(cfg: &Config, d: &DiscoveryConfig, opts: &Options) -> VllmArgs {
    let hash = d.hash.as_ref().unwrap_or(&cfg.hash);
    let (events, replay) = match d.sources {
        Sources::Static => (d.events_port.unwrap_or(DEFAULT_EVENTS_PORT), d.replay_port),
        Sources::KvEventSources => {
            (d.events_port.unwrap_or(DEFAULT_EVENTS_PORT), Some(d.replay_port.unwrap_or(DEFAULT_REPLAY_PORT)))
        }
    };
    let replay = replay.map(|p| format!("tcp://*:{p}"));
    flags(&d.name, hash, format!("tcp://*:{events}"), replay, &d.topic, opts)
}

fn flags(
    name: &str,
    hash: &HashConfig,
    endpoint: String,
    replay: Option<String>,
    topic: &str,
    opts: &Options,
) -> VllmArgs {
    // Keys in sorted order whatever serde_json's features (the tokenizer crate turns on
    // `preserve_order`): the printed flags are compared with the shipped manifests.
    let mut obj = std::collections::BTreeMap::new();
    obj.insert("enable_kv_cache_events", json!(true));
    obj.insert("publisher", json!("zmq"));
    obj.insert("endpoint", json!(endpoint));
    obj.insert("topic", json!(topic));
    obj.insert("buffer_steps", json!(opts.buffer_steps));
    if let Some(rep) = replay {
        obj.insert("replay_endpoint", json!(rep));
    }
    let kv = json!(obj);
    let mut env = Vec::new();
    let mut env_shown = Vec::new();
    if let Some(seed) = &hash.seed {
        env.push(("PYTHONHASHSEED".to_owned(), seed.clone()));
    }
    match (hash.seed_source.shell_reference(), &hash.seed) {
        (Some(reference), _) => env_shown.push(format!("PYTHONHASHSEED={reference}")),
        (None, Some(seed)) => env_shown.push(format!("PYTHONHASHSEED={}", shell_quote(seed))),
        (None, None) => {}
    }
    let mut args = vec![
        "--enable-prefix-caching".to_owned(),
        "--prefix-caching-hash-algo".to_owned(),
        hash.algo.name().to_owned(),
        "--block-size".to_owned(),
        hash.block_size.to_string(),
        "--kv-events-config".to_owned(),
        kv.to_string(),
    ];
    if opts.render {
        args.push("--enable-scale-out".to_owned());
    }
    VllmArgs { replica: name.to_owned(), env, env_shown, args }
}

fn shell_quote(s: &str) -> String {
    if !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_./:=@,+".contains(&b)) {
        s.to_owned()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

fn line(out: &mut String, a: &VllmArgs, model: Option<&String>) {
    let env = &a.env_shown;
    let args: Vec<String> = a.args.iter().map(|s| shell_quote(s)).collect();
    let model = model.map(|m| shell_quote(m)).unwrap_or_else(|| "MODEL".to_owned());
    let mut l = env.join(" ");
    if !l.is_empty() {
        l.push(' ');
    }
    l.push_str(&format!("vllm serve {model} {}\n", args.join(" ")));
    out.push_str(&l);
}

/// What the flags cannot say about the hash settings, as comment lines. (An xxhash algorithm
/// without a seed never gets here: the configuration refuses it, vLLM seeding every process at
/// random then.)
fn hash_notes(out: &mut String, hash: &HashConfig) {
    if hash.lookahead_tokens > 0 {
        out.push_str(&format!(
            "# lookahead_tokens = {}: the replicas' --speculative-config must make vLLM hash {} token(s) past each block (EAGLE/EAGLE3: 1; MTP: num_speculative_tokens)\n",
            hash.lookahead_tokens, hash.lookahead_tokens
        ));
    }
}

/// Shell lines for every replica and every discovered pool.
pub fn render(cfg: &Config, opts: &Options) -> String {
    let mut out = String::new();
    for r in &cfg.replicas {
        out.push_str(&format!(
            "# replica {} ({} data-parallel rank(s); vLLM adds the rank to both ports)\n",
            r.name, r.dp_ranks
        ));
        hash_notes(&mut out, r.hash.as_ref().unwrap_or(&cfg.hash));
        line(&mut out, &for_replica(cfg, r, opts), r.models.first());
    }
    for d in &cfg.discovery {
        out.push_str(&format!(
            "# every replica behind {} (discovery {}; vLLM adds the data-parallel rank to both ports)\n",
            d.dns, d.name
        ));
        hash_notes(&mut out, d.hash.as_ref().unwrap_or(&cfg.hash));
        line(&mut out, &for_discovery(cfg, d, opts), d.models.first());
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
        let a = for_replica(&cfg, &cfg.replicas[0], &Options::default());
        assert_eq!(a.env, vec![("PYTHONHASHSEED".to_owned(), "0".to_owned())]);
        assert_eq!(
            a.args[..5],
            ["--enable-prefix-caching", "--prefix-caching-hash-algo", "sha256_cbor", "--block-size", "16"]
        );
        let kv: serde_json::Value = serde_json::from_str(&a.args[6]).unwrap();
        assert_eq!(kv["endpoint"], "tcp://*:5557");
        assert_eq!(kv["replay_endpoint"], "tcp://*:5558");
        assert_eq!(kv["topic"], "kv-events");
        assert_eq!(kv["enable_kv_cache_events"], true);
        // Printed with its keys sorted (what the shipped manifests hold), also in a build where
        // serde_json preserves insertion order.
        assert_eq!(
            a.args[6],
            r#"{"buffer_steps":10000,"enable_kv_cache_events":true,"endpoint":"tcp://*:5557","publisher":"zmq","replay_endpoint":"tcp://*:5558","topic":"kv-events"}"#
        );
        let b = for_replica(&cfg, &cfg.replicas[1], &Options::default());
        let kv: serde_json::Value = serde_json::from_str(&b.args[6]).unwrap();
        assert_eq!(kv["endpoint"], "tcp://127.0.0.1:6000");
        let c = for_replica(&cfg, &cfg.replicas[2], &Options::default());
        let kv: serde_json::Value = serde_json::from_str(&c.args[6]).unwrap();
        assert_eq!(kv["endpoint"], "tcp://[::ffff:127.0.0.1]:6100");
        let text = render(&cfg, &Options::default());
        assert!(text.contains("PYTHONHASHSEED=0 vllm serve m --enable-prefix-caching"), "{text}");
    }

    #[test]
    fn a_secret_seed_is_printed_as_where_to_read_it() {
        let text = r#"
[hash]
seed_env = "LLMGW_HASH_SEED"
[[discovery]]
name = "pool"
dns = "vllm.ns.svc.cluster.local"
port = 8000
models = ["m"]
"#;
        // vllm-args reads no variable: the line names it.
        let cfg = Config::parse_with(text, crate::config::seed::SeedLookup::Defer).unwrap();
        let a = for_discovery(&cfg, &cfg.discovery[0], &Options::default());
        assert!(a.env.is_empty(), "{:?}", a.env);
        let out = render(&cfg, &Options::default());
        assert!(out.contains("PYTHONHASHSEED=\"$LLMGW_HASH_SEED\" vllm serve m --enable-prefix-caching"), "{out}");
        // Read (launch): the child gets the value, the printed line still only the reference.
        let env = |_: &str| Some("2718281828".to_owned());
        let cfg = Config::parse_with(text, crate::config::seed::SeedLookup::Read(&env)).unwrap();
        let a = for_discovery(&cfg, &cfg.discovery[0], &Options::default());
        assert_eq!(a.env, vec![("PYTHONHASHSEED".to_owned(), "2718281828".to_owned())]);
        let out = render(&cfg, &Options::default());
        assert!(!out.contains("2718281828") && out.contains("$LLMGW_HASH_SEED"), "{out}");
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
        let a = for_discovery(&cfg, &cfg.discovery[0], &Options::default());
        assert_eq!(a.env, vec![("PYTHONHASHSEED".to_owned(), "7".to_owned())]);
        assert_eq!(a.args[4], "32");
        let kv: serde_json::Value = serde_json::from_str(&a.args[6]).unwrap();
        assert_eq!(kv["endpoint"], "tcp://*:5557");
        assert_eq!(kv["replay_endpoint"], "tcp://*:5558");
        let b = for_discovery(&cfg, &cfg.discovery[1], &Options::default());
        let kv: serde_json::Value = serde_json::from_str(&b.args[6]).unwrap();
        assert_eq!(kv["endpoint"], "tcp://*:6000");
        assert!(kv.get("replay_endpoint").is_none(), "{kv}");
        assert_eq!(kv["topic"], "t");
        let text = render(&cfg, &Options::default());
        assert!(text.contains("# every replica behind vllm.ns.svc.cluster.local"), "{text}");
        assert!(text.contains("PYTHONHASHSEED=7 vllm serve m --enable-prefix-caching"), "{text}");
    }

    #[test]
    fn render_adds_scale_out_and_buffer_steps_goes_into_the_events_config() {
        let cfg = Config::parse(
            r#"
[hash]
seed = "0"
[[discovery]]
name = "pool"
dns = "vllm.ns.svc.cluster.local"
port = 8000
models = ["m"]
"#,
        )
        .unwrap();
        let plain = for_discovery(&cfg, &cfg.discovery[0], &Options::default());
        assert!(!plain.args.iter().any(|a| a == "--enable-scale-out"), "{:?}", plain.args);
        let kv: serde_json::Value = serde_json::from_str(&plain.args[6]).unwrap();
        assert_eq!(kv["buffer_steps"], DEFAULT_BUFFER_STEPS);
        let opts = Options { render: true, buffer_steps: 50_000 };
        let rendered = for_discovery(&cfg, &cfg.discovery[0], &opts);
        assert_eq!(rendered.args.iter().filter(|a| *a == "--enable-scale-out").count(), 1, "{:?}", rendered.args);
        let kv: serde_json::Value = serde_json::from_str(&rendered.args[6]).unwrap();
        assert_eq!(kv["buffer_steps"], 50_000);
        assert!(render(&cfg, &opts).contains("--enable-scale-out"));
    }

    #[test]
    fn lookahead_hashing_is_printed_as_a_note() {
        let cfg = |lookahead: u32| {
            Config::parse(&format!(
                r#"
[hash]
seed = "0"
lookahead_tokens = {lookahead}
[[replicas]]
name = "a"
address = "10.0.0.5:8000"
models = ["m"]
endpoint = "tcp://10.0.0.5:5557"
"#
            ))
            .unwrap()
        };
        let text = render(&cfg(1), &Options::default());
        assert!(text.contains("# lookahead_tokens = 1: the replicas' --speculative-config"), "{text}");
        let text = render(&cfg(0), &Options::default());
        assert!(!text.contains("lookahead_tokens"), "{text}");
    }
}
