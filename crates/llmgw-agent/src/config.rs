//! The agent's configuration: a TOML file, validated so that every error names the field.
//!
//! ```toml
//! [feed]
//! listen = "127.0.0.1:7070"        # gRPC feed (llmgw.feed.v1.Feed/Subscribe)
//! [http]
//! listen = "127.0.0.1:9464"        # /metrics, /healthz, /debug/replicas
//! [hash]
//! algo = "sha256_cbor"             # vLLM's --prefix-caching-hash-algo
//! seed = "0"                       # the replicas' PYTHONHASHSEED (omit when unset)
//! block_size = 16
//!
//! [[replicas]]
//! name = "r0"
//! address = "10.0.0.5:8000"        # ip:port the filter routes to
//! models = ["meta-llama/Llama-3.1-8B-Instruct"]
//! endpoint = "tcp://10.0.0.5:5557" # vLLM started with tcp://*:5557: the agent connects
//! mode = "connect"                 # or "bind": the agent binds a loopback port, vLLM connects
//! replay_endpoint = "tcp://10.0.0.5:5558"
//! topic = "kv-events"
//! dp_ranks = 1                     # vLLM adds the rank to both ports
//! ```

use llmgw_core::hash::{BlockHasher, HashAlgo};
use serde::Deserialize;
use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::time::Duration;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default)]
    pub feed: FeedConfig,
    #[serde(default)]
    pub http: HttpConfig,
    #[serde(default)]
    pub hash: HashConfig,
    #[serde(default)]
    pub zmq: ZmqConfig,
    #[serde(default)]
    pub load: LoadConfig,
    #[serde(default)]
    pub parity: ParityConfig,
    #[serde(default)]
    pub replicas: Vec<ReplicaConfig>,
    #[serde(default)]
    pub discovery: Vec<DiscoveryConfig>,
}

/// Where a discovered replica's event endpoints come from.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Sources {
    /// vLLM's `GET /kv_event_sources` (per rank: endpoint, replay endpoint, topic).
    KvEventSources,
    /// Fixed ports (`events_port`, `replay_port`), the same on every replica.
    Static,
}

/// Replicas found by re-resolving a DNS name (e.g. a Kubernetes headless Service).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiscoveryConfig {
    /// Prefix of the replicas' names (`{name}-{ip}`).
    pub name: String,
    /// Host name resolved every `refresh_ms`; each address is a replica.
    pub dns: String,
    /// HTTP port of each replica's OpenAI server.
    pub port: u16,
    #[serde(default)]
    pub models: Vec<String>,
    #[serde(default = "default_refresh")]
    pub refresh_ms: u64,
    #[serde(default = "default_sources")]
    pub sources: Sources,
    /// With `sources = "static"`: the publisher port of rank 0 (vLLM started with tcp://*:PORT).
    #[serde(default)]
    pub events_port: Option<u16>,
    /// With `sources = "static"`: the replay port of rank 0.
    #[serde(default)]
    pub replay_port: Option<u16>,
    #[serde(default)]
    pub topic: String,
    #[serde(default = "default_dp")]
    pub dp_ranks: u32,
    /// Scrape load from `http://{ip}:{port}/metrics`.
    #[serde(default = "default_true")]
    pub scrape: bool,
    #[serde(default)]
    pub hash: Option<HashConfig>,
}

fn default_refresh() -> u64 {
    10_000
}
fn default_sources() -> Sources {
    Sources::KvEventSources
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FeedConfig {
    #[serde(default = "default_feed_listen")]
    pub listen: SocketAddr,
    /// Must be set to listen on a non-loopback address.
    #[serde(default)]
    pub allow_non_loopback: bool,
    /// Shared token subscribers must present (required on a non-loopback listener).
    #[serde(default)]
    pub token: Option<String>,
    /// Messages queued per subscriber before it is considered too far behind and resynced.
    #[serde(default = "default_queue")]
    pub max_queue: usize,
    /// Seconds between heartbeats.
    #[serde(default = "default_heartbeat")]
    pub heartbeat_secs: f64,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpConfig {
    #[serde(default = "default_http_listen")]
    pub listen: SocketAddr,
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct HashConfig {
    #[serde(default = "default_algo")]
    pub algo: String,
    /// PYTHONHASHSEED of the replicas; absent when unset.
    #[serde(default)]
    pub seed: Option<String>,
    #[serde(default = "default_block_size")]
    pub block_size: u32,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ZmqConfig {
    /// SUB receive high-water mark (messages).
    #[serde(default = "default_rcvhwm")]
    pub rcvhwm: i32,
    /// Upper bound of libzmq's reconnect backoff, milliseconds.
    #[serde(default = "default_reconnect_max")]
    pub reconnect_ivl_max_ms: i32,
    /// How long to wait for each replay reply before giving up, milliseconds.
    #[serde(default = "default_replay_timeout")]
    pub replay_timeout_ms: u64,
    /// A publisher disconnected (or never connected) for this long marks its replica down and
    /// its blocks leave; 0 disables the check.
    #[serde(default = "default_publisher_down")]
    pub down_after_disconnect_ms: u64,
    /// When a publisher reconnects, ask its replay socket for the last batch applied here: a
    /// different or missing batch means the engine restarted, and its blocks leave at once
    /// (instead of when its next batch arrives). On by default; needs a replay endpoint.
    #[serde(default = "default_true")]
    pub verify_on_reconnect: bool,
    /// Blocks one engine may hold; past it the engine's mirror is reset (flood bound).
    #[serde(default = "default_max_blocks")]
    pub max_blocks_per_engine: usize,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoadConfig {
    /// Scrape each replica's /metrics (running, waiting, KV-cache usage).
    #[serde(default = "default_true")]
    pub enabled: bool,
    #[serde(default = "default_interval")]
    pub interval_ms: u64,
    /// A replica whose /metrics fails for this long is marked down and its blocks leave.
    #[serde(default = "default_down_after")]
    pub down_after_ms: u64,
    #[serde(default = "default_scrape_timeout")]
    pub timeout_ms: u64,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParityConfig {
    /// Share of verified blocks whose hash mismatched above which a warning is logged.
    #[serde(default = "default_parity_threshold")]
    pub warn_mismatch_ratio: f64,
    /// Verified blocks needed before the ratio is judged.
    #[serde(default = "default_parity_min")]
    pub min_verified: u64,
}

#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// The replica binds (`tcp://*:PORT`); the agent connects.
    Connect,
    /// The agent binds a loopback port; the replica connects to it.
    Bind,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplicaConfig {
    pub name: String,
    /// `ip:port` of the replica's OpenAI server, as the filter routes to it.
    pub address: String,
    #[serde(default)]
    pub models: Vec<String>,
    /// ZMQ endpoint of the event publisher (rank 0), `tcp://host:port`.
    pub endpoint: String,
    #[serde(default = "default_mode")]
    pub mode: Mode,
    /// ZMQ endpoint of the replay ROUTER (rank 0); vLLM always binds it, the agent connects.
    #[serde(default)]
    pub replay_endpoint: Option<String>,
    #[serde(default)]
    pub topic: String,
    /// Data-parallel ranks; rank r publishes on port + r (both endpoints).
    #[serde(default = "default_dp")]
    pub dp_ranks: u32,
    /// Where to scrape load; defaults to `http://{address}/metrics`. Empty disables scraping.
    #[serde(default)]
    pub metrics_url: Option<String>,
    /// Overrides the global hash settings for this replica.
    #[serde(default)]
    pub hash: Option<HashConfig>,
}

fn default_feed_listen() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 7070))
}
fn default_http_listen() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 9464))
}
fn default_queue() -> usize {
    4096
}
fn default_heartbeat() -> f64 {
    5.0
}
fn default_algo() -> String {
    "sha256_cbor".into()
}
fn default_block_size() -> u32 {
    16
}
fn default_rcvhwm() -> i32 {
    100_000
}
fn default_reconnect_max() -> i32 {
    1000
}
fn default_replay_timeout() -> u64 {
    2000
}
fn default_publisher_down() -> u64 {
    30_000
}
fn default_max_blocks() -> usize {
    16 << 20
}
fn default_true() -> bool {
    true
}
fn default_interval() -> u64 {
    500
}
fn default_down_after() -> u64 {
    10_000
}
fn default_scrape_timeout() -> u64 {
    1000
}
fn default_parity_threshold() -> f64 {
    0.01
}
fn default_parity_min() -> u64 {
    16
}
fn default_mode() -> Mode {
    Mode::Connect
}
fn default_dp() -> u32 {
    1
}

impl Default for FeedConfig {
    fn default() -> Self {
        Self {
            listen: default_feed_listen(),
            allow_non_loopback: false,
            token: None,
            max_queue: default_queue(),
            heartbeat_secs: default_heartbeat(),
        }
    }
}
impl Default for HttpConfig {
    fn default() -> Self {
        Self { listen: default_http_listen() }
    }
}
impl Default for HashConfig {
    fn default() -> Self {
        Self { algo: default_algo(), seed: None, block_size: default_block_size() }
    }
}
impl Default for ZmqConfig {
    fn default() -> Self {
        Self {
            rcvhwm: default_rcvhwm(),
            reconnect_ivl_max_ms: default_reconnect_max(),
            replay_timeout_ms: default_replay_timeout(),
            max_blocks_per_engine: default_max_blocks(),
            down_after_disconnect_ms: default_publisher_down(),
            verify_on_reconnect: true,
        }
    }
}
impl Default for LoadConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            interval_ms: default_interval(),
            down_after_ms: default_down_after(),
            timeout_ms: default_scrape_timeout(),
        }
    }
}
impl Default for ParityConfig {
    fn default() -> Self {
        Self { warn_mismatch_ratio: default_parity_threshold(), min_verified: default_parity_min() }
    }
}

/// A configuration error; `field` is the path of the offending field (`replicas[1].mode`).
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigError {
    pub field: String,
    pub message: String,
}

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.field.is_empty() || self.field == "." {
            write!(f, "{}", self.message)
        } else {
            write!(f, "{}: {}", self.field, self.message)
        }
    }
}

fn err(field: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError { field: field.into(), message: message.into() }
}

/// One engine: a replica's data-parallel rank, with its endpoints already offset.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineSpec {
    /// Dense id used on the feed.
    pub id: u32,
    pub replica: String,
    pub address: String,
    pub models: Vec<String>,
    pub dp_rank: u32,
    pub mode: Mode,
    pub endpoint: String,
    pub replay_endpoint: Option<String>,
    pub topic: String,
    pub hash: HashConfig,
    pub metrics_url: Option<String>,
}

impl EngineSpec {
    /// The hasher parity checks use (validated at load).
    pub fn hasher(&self) -> Option<BlockHasher> {
        let algo = HashAlgo::parse(&self.hash.algo).ok()?;
        BlockHasher::new(algo, self.hash.seed.as_deref()).ok()
    }

    /// Display name: the replica, with `#rank` when it has several ranks.
    pub fn label(&self) -> String {
        format!("{}#{}", self.replica, self.dp_rank)
    }
}

impl Config {
    /// Parses and validates TOML text.
    pub fn parse(text: &str) -> Result<Config, ConfigError> {
        let de = toml::Deserializer::parse(text).map_err(|e| err("", e.to_string().trim_end().to_owned()))?;
        let cfg: Config = serde_path_to_error::deserialize(de).map_err(|e| {
            let path = e.path().to_string();
            err(path, e.into_inner().message().to_owned())
        })?;
        cfg.validate()?;
        Ok(cfg)
    }

    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text =
            std::fs::read_to_string(path).map_err(|e| err("", format!("cannot read {}: {e}", path.display())))?;
        Config::parse(&text)
    }

    /// Checks everything serde cannot: addresses, endpoints, uniqueness, listener safety.
    pub fn validate(&self) -> Result<(), ConfigError> {
        check_hash("hash", &self.hash)?;
        if !self.feed.listen.ip().is_loopback() {
            if !self.feed.allow_non_loopback {
                return Err(err(
                    "feed.listen",
                    format!("{} is not a loopback address; set feed.allow_non_loopback = true (or --feed-allow-non-loopback) and a token", self.feed.listen),
                ));
            }
            if self.feed.token.as_deref().unwrap_or("").is_empty() {
                return Err(err("feed.token", "a non-loopback feed listener needs a shared token"));
            }
        }
        if self.feed.max_queue < 16 {
            return Err(err("feed.max_queue", "must be at least 16"));
        }
        if !(self.feed.heartbeat_secs > 0.0 && self.feed.heartbeat_secs <= 3600.0) {
            return Err(err("feed.heartbeat_secs", "must be in (0, 3600]"));
        }
        if self.zmq.rcvhwm < 0 {
            return Err(err("zmq.rcvhwm", "must be >= 0"));
        }
        if self.zmq.reconnect_ivl_max_ms < 0 {
            return Err(err("zmq.reconnect_ivl_max_ms", "must be >= 0"));
        }
        if self.load.interval_ms == 0 {
            return Err(err("load.interval_ms", "must be at least 1"));
        }
        if !(0.0..=1.0).contains(&self.parity.warn_mismatch_ratio) {
            return Err(err("parity.warn_mismatch_ratio", "must be between 0 and 1"));
        }
        let mut names = BTreeSet::new();
        for (i, r) in self.replicas.iter().enumerate() {
            let f = |name: &str| format!("replicas[{i}].{name}");
            if r.name.is_empty() {
                return Err(err(f("name"), "must not be empty"));
            }
            if !names.insert(r.name.as_str()) {
                return Err(err(f("name"), format!("duplicate replica name {:?}", r.name)));
            }
            r.address
                .parse::<SocketAddr>()
                .map_err(|_| err(f("address"), format!("{:?} is not ip:port", r.address)))?;
            if r.dp_ranks == 0 || r.dp_ranks > 1024 {
                return Err(err(f("dp_ranks"), "must be between 1 and 1024"));
            }
            let (host, port) = parse_tcp(&r.endpoint).map_err(|m| err(f("endpoint"), m))?;
            let last = u32::from(port).saturating_add(r.dp_ranks).saturating_sub(1);
            if port == 0 || last > u32::from(u16::MAX) {
                return Err(err(f("endpoint"), "port must be non-zero and port + dp_ranks - 1 must fit in 65535"));
            }
            if r.mode == Mode::Bind && !is_loopback_host(&host) {
                return Err(err(
                    f("endpoint"),
                    format!("bind mode binds a loopback address only, got {host:?} (use tcp://127.0.0.1:PORT)"),
                ));
            }
            if r.mode == Mode::Connect && host == "*" {
                return Err(err(f("endpoint"), "connect mode needs the replica's host, not *"));
            }
            if let Some(rep) = &r.replay_endpoint {
                let (rhost, rport) = parse_tcp(rep).map_err(|m| err(f("replay_endpoint"), m))?;
                if rhost == "*" {
                    return Err(err(
                        f("replay_endpoint"),
                        "the agent connects to the replay socket: give the replica's host, not *",
                    ));
                }
                if rport == 0 || u32::from(rport).saturating_add(r.dp_ranks).saturating_sub(1) > u32::from(u16::MAX) {
                    return Err(err(
                        f("replay_endpoint"),
                        "port must be non-zero and port + dp_ranks - 1 must fit in 65535",
                    ));
                }
            }
            if let Some(h) = &r.hash {
                check_hash(&f("hash"), h)?;
            }
            if let Some(u) = &r.metrics_url {
                if !u.is_empty() && !u.starts_with("http://") {
                    return Err(err(f("metrics_url"), "must start with http:// (or be empty to disable scraping)"));
                }
            }
        }
        for (i, d) in self.discovery.iter().enumerate() {
            let f = |name: &str| format!("discovery[{i}].{name}");
            if d.name.is_empty() || names.contains(d.name.as_str()) {
                return Err(err(f("name"), "must be non-empty and differ from every replica name"));
            }
            if d.dns.is_empty() {
                return Err(err(f("dns"), "must name a host"));
            }
            if d.port == 0 {
                return Err(err(f("port"), "must be non-zero"));
            }
            if d.refresh_ms < 100 {
                return Err(err(f("refresh_ms"), "must be at least 100"));
            }
            if d.dp_ranks == 0 || d.dp_ranks > 1024 {
                return Err(err(f("dp_ranks"), "must be between 1 and 1024"));
            }
            if d.sources == Sources::Static && d.events_port.is_none_or(|p| p == 0) {
                return Err(err(f("events_port"), "sources = \"static\" needs the publisher port"));
            }
            if let Some(h) = &d.hash {
                check_hash(&f("hash"), h)?;
            }
        }
        // Two engines on one endpoint would mix two publishers' sequences (or fail to bind).
        let mut seen: std::collections::BTreeMap<String, usize> = std::collections::BTreeMap::new();
        for (i, r) in self.replicas.iter().enumerate() {
            for rank in 0..r.dp_ranks {
                let ep = offset_port(&r.endpoint, rank).unwrap_or_else(|| r.endpoint.clone());
                if let Some(j) = seen.insert(ep.clone(), i) {
                    return Err(err(
                        format!("replicas[{i}].endpoint"),
                        format!("{ep} is already used by replicas[{j}] (data-parallel ranks use port + rank)"),
                    ));
                }
            }
        }
        let engines: u64 = self.replicas.iter().map(|r| u64::from(r.dp_ranks)).sum();
        if engines > 65_535 {
            return Err(err("replicas", "too many engines (replicas x dp_ranks > 65535)"));
        }
        Ok(())
    }

    /// Every engine (replica x rank), with dense ids in configuration order.
    pub fn engines(&self) -> Vec<EngineSpec> {
        let mut out = Vec::new();
        let mut id: u32 = 0;
        for r in &self.replicas {
            for rank in 0..r.dp_ranks {
                let metrics_url = match &r.metrics_url {
                    Some(u) if u.is_empty() => None,
                    Some(u) => Some(u.clone()),
                    None => Some(format!("http://{}/metrics", r.address)),
                };
                out.push(EngineSpec {
                    id,
                    replica: r.name.clone(),
                    address: r.address.clone(),
                    models: r.models.clone(),
                    dp_rank: rank,
                    mode: r.mode,
                    endpoint: offset_port(&r.endpoint, rank).unwrap_or_else(|| r.endpoint.clone()),
                    replay_endpoint: r
                        .replay_endpoint
                        .as_ref()
                        .map(|e| offset_port(e, rank).unwrap_or_else(|| e.clone())),
                    topic: r.topic.clone(),
                    hash: r.hash.clone().unwrap_or_else(|| self.hash.clone()),
                    metrics_url,
                });
                id = id.saturating_add(1);
            }
        }
        out
    }

    pub fn replay_timeout(&self) -> Duration {
        Duration::from_millis(self.zmq.replay_timeout_ms)
    }
}

fn check_hash(field: &str, h: &HashConfig) -> Result<(), ConfigError> {
    let algo = HashAlgo::parse(&h.algo).map_err(|e| err(format!("{field}.algo"), e.to_string()))?;
    BlockHasher::new(algo, h.seed.as_deref()).map_err(|e| err(format!("{field}.seed"), e.to_string()))?;
    if h.block_size == 0 {
        return Err(err(format!("{field}.block_size"), "must be at least 1"));
    }
    Ok(())
}

fn is_loopback_host(host: &str) -> bool {
    let h = host.trim_start_matches('[').trim_end_matches(']');
    match h.parse::<IpAddr>() {
        Ok(IpAddr::V4(a)) => a.is_loopback(),
        Ok(IpAddr::V6(a)) => a.is_loopback() || a.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback()),
        Err(_) => h == "localhost",
    }
}

/// Splits `tcp://host:port`.
pub fn parse_tcp(endpoint: &str) -> Result<(String, u16), String> {
    let rest = endpoint
        .strip_prefix("tcp://")
        .ok_or_else(|| format!("{endpoint:?}: only tcp://host:port endpoints are supported"))?;
    let (host, port) = rest.rsplit_once(':').ok_or_else(|| format!("{endpoint:?}: missing :port"))?;
    if host.is_empty() {
        return Err(format!("{endpoint:?}: missing host"));
    }
    let port = port.parse::<u16>().map_err(|_| format!("{endpoint:?}: bad port {port:?}"))?;
    Ok((host.to_owned(), port))
}

/// vLLM's rule for data-parallel ranks: a tcp endpoint's port grows by the rank.
pub fn offset_port(endpoint: &str, rank: u32) -> Option<String> {
    let (host, port) = parse_tcp(endpoint).ok()?;
    if rank == 0 || port == 0 {
        return Some(endpoint.to_owned());
    }
    let p = u16::try_from(u32::from(port).checked_add(rank)?).ok()?;
    Some(format!("tcp://{host}:{p}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const OK: &str = r#"
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

    fn error_of(text: &str) -> ConfigError {
        match Config::parse(text) {
            Ok(_) => panic!("config unexpectedly accepted:\n{text}"),
            Err(e) => e,
        }
    }

    #[test]
    fn valid_config_expands_ranks_and_offsets_both_ports() {
        let cfg = Config::parse(OK).unwrap();
        let e = cfg.engines();
        assert_eq!(e.len(), 3);
        assert_eq!((e[0].id, e[0].dp_rank, e[0].endpoint.as_str()), (0, 0, "tcp://127.0.0.1:5557"));
        assert_eq!((e[1].id, e[1].dp_rank, e[1].endpoint.as_str()), (1, 1, "tcp://127.0.0.1:5558"));
        assert_eq!(e[1].replay_endpoint.as_deref(), Some("tcp://127.0.0.1:5559"));
        assert_eq!(e[2].mode, Mode::Bind);
        assert_eq!(e[2].metrics_url, None);
        assert_eq!(e[0].metrics_url.as_deref(), Some("http://127.0.0.1:8000/metrics"));
        assert_eq!(e[0].hash.seed.as_deref(), Some("0"));
        assert!(e[0].hasher().is_some());
        assert_eq!(cfg.feed.listen, default_feed_listen());
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
        assert_eq!(e.field, "replicas[1]", "{e}");
        assert!(e.message.contains("endpoint"), "{e}");
    }

    #[test]
    fn semantic_errors_name_the_field() {
        let cases = [
            (OK.replace("algo = \"sha256_cbor\"", "algo = \"md5\""), "hash.algo"),
            (OK.replace("address = \"127.0.0.1:8001\"", "address = \"replica-b\""), "replicas[1].address"),
            (OK.replace("name = \"b\"", "name = \"a\""), "replicas[1].name"),
            (OK.replace("tcp://127.0.0.1:6000", "tcp://10.1.2.3:6000"), "replicas[1].endpoint"),
            (OK.replace("tcp://127.0.0.1:5557", "ipc:///tmp/x"), "replicas[0].endpoint"),
            (OK.replace("tcp://127.0.0.1:5558", "tcp://*:5558"), "replicas[0].replay_endpoint"),
            (OK.replace("dp_ranks = 2", "dp_ranks = 0"), "replicas[0].dp_ranks"),
            // Rank 1 of replica a is on 5558; b may not use it.
            (OK.replace("tcp://127.0.0.1:6000", "tcp://127.0.0.1:5558"), "replicas[1].endpoint"),
            (OK.replace("tcp://127.0.0.1:5557", "tcp://127.0.0.1:65535"), "replicas[0].endpoint"),
            (format!("[feed]\nlisten = \"0.0.0.0:7070\"\n{OK}"), "feed.listen"),
            (format!("[feed]\nlisten = \"0.0.0.0:7070\"\nallow_non_loopback = true\n{OK}"), "feed.token"),
        ];
        for (text, field) in cases {
            let e = error_of(&text);
            assert_eq!(e.field, field, "{e}");
            assert!(e.to_string().starts_with(field), "{e}");
        }
        let ok = format!("[feed]\nlisten = \"0.0.0.0:7070\"\nallow_non_loopback = true\ntoken = \"s\"\n{OK}");
        assert!(Config::parse(&ok).is_ok());
    }

    #[test]
    fn syntax_error_is_reported() {
        let e = error_of("[[replicas]\nname=");
        assert!(!e.message.is_empty());
    }

    #[test]
    fn loopback_forms() {
        assert!(is_loopback_host("127.0.0.1"));
        assert!(is_loopback_host("[::ffff:127.0.0.1]"));
        assert!(is_loopback_host("[::1]"));
        assert!(is_loopback_host("localhost"));
        assert!(!is_loopback_host("*"));
        assert!(!is_loopback_host("10.0.0.1"));
        assert_eq!(offset_port("tcp://h:5557", 3).as_deref(), Some("tcp://h:5560"));
        assert_eq!(offset_port("tcp://[::ffff:127.0.0.1]:5557", 1).as_deref(), Some("tcp://[::ffff:127.0.0.1]:5558"));
    }
}
