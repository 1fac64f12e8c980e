//! The agent's configuration file as written: its sections and fields, each section's `Default`,
//! and the loading and parsing that [`super::validate`] completes. The values a field left out
//! takes are in `field_defaults`, but for the two of this file's own enums (`Sources`, `Mode`),
//! kept beside them so that `field_defaults` needs nothing from here.

use super::seed::SeedLookup;
use field_defaults::*;
use llmgw_core::hash::HashAlgo;
use serde::Deserialize;
use std::net::SocketAddr;
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
    /// Events through NATS JetStream (replicas with `events = "jetstream"`, and `publish`).
    #[serde(default)]
    pub jetstream: Option<JetStreamConfig>,
    /// The native tokenizer (`[tokenizer]`, see [`super::tokenizer`]).
    #[serde(default)]
    pub tokenizer: Option<super::tokenizer::TokenizerConfig>,
    /// The endpoint picker (`[epp]`, see [`super::epp`]).
    #[serde(default)]
    pub epp: Option<super::epp::EppConfig>,
}

/// Where a replica's KV events come from.
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Events {
    /// The replica's ZMQ publisher (`endpoint`, `replay_endpoint`).
    #[default]
    Zmq,
    /// The `[jetstream]` stream, on the subject derived from the replica's address and rank
    /// (`llmgw-agent publish` beside the replica puts them there).
    Jetstream,
}

/// The NATS JetStream stream KV events go through (see [`crate::jetstream`]).
///
/// ```toml
/// [jetstream]
/// url = "nats://nats.llmgw:4222"   # tls://… for TLS
/// stream = "LLMGW_KV"
/// subject_prefix = "llmgw.kv"      # an engine's subject: {prefix}.{address}.{rank}
/// ```
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JetStreamConfig {
    pub url: String,
    #[serde(default = "default_js_stream")]
    pub stream: String,
    #[serde(default = "default_js_prefix")]
    pub subject_prefix: String,
    /// The broker's authorization token.
    #[serde(default)]
    pub token: Option<String>,
    /// A NATS user and its password, in place of `token`: with a user per publisher, the
    /// broker's permissions let each replica publish on its own subject only.
    #[serde(default)]
    pub user: Option<String>,
    #[serde(default)]
    pub password: Option<String>,
    /// CA (PEM) the broker's certificate is checked against; setting it requires TLS.
    #[serde(default)]
    pub tls_ca: Option<std::path::PathBuf>,
    /// Batches the stream keeps per engine: what a restarted agent rebuilds a mirror from
    /// (vLLM's own replay buffer keeps 10,000 by default).
    #[serde(default = "default_js_per_subject")]
    pub max_messages_per_subject: i64,
    /// Bytes the whole stream keeps at most (-1: no limit but the per-engine count).
    #[serde(default = "default_js_max_bytes")]
    pub max_bytes: i64,
    /// Seconds a batch is kept at most (0: no limit).
    #[serde(default)]
    pub max_age_secs: u64,
    /// Keep the stream in the broker's memory instead of on its disk.
    #[serde(default)]
    pub memory_storage: bool,
    /// Bytes of batches the consumer may have asked for and not yet applied: the pull batch is
    /// this over the broker's `max_payload` (at most 500 messages, at least 1).
    #[serde(default = "default_queued_bytes")]
    pub max_queued_bytes: i64,
    /// Engines' snapshots in an object-store bucket (`[jetstream.snapshots]`); absent: none.
    #[serde(default)]
    pub snapshots: Option<super::snapshot_bucket::SnapshotBucketConfig>,
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
    /// The port of each replica's `llmgw-agent publish --snapshot-listen` sidecar, if any
    /// (`http://{ip}:{snapshot_port}`, see `replicas[].snapshot_url`).
    #[serde(default)]
    pub snapshot_port: Option<u16>,
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
    /// Shared token subscribers must present (required on a non-loopback listener, unless
    /// `client_ca` authenticates them).
    #[serde(default)]
    pub token: Option<String>,
    /// TLS for the feed (PEM files): the server's certificate chain and private key. Required
    /// on a non-loopback listener.
    #[serde(default)]
    pub tls_cert: Option<std::path::PathBuf>,
    #[serde(default)]
    pub tls_key: Option<std::path::PathBuf>,
    /// Mutual TLS: subscribers must present a certificate issued by this CA (PEM).
    #[serde(default)]
    pub client_ca: Option<std::path::PathBuf>,
    /// Messages queued per subscriber before it is considered too far behind and resynced.
    #[serde(default = "default_queue")]
    pub max_queue: usize,
    /// Bytes queued per subscriber (block keys at 8 bytes each, plus a little per message)
    /// before it is considered too far behind and resynced: a subscriber that stops reading
    /// costs at most this much.
    #[serde(default = "default_backlog_bytes")]
    pub max_backlog_bytes: usize,
    /// Live subscriptions at most (each filter VM holds one: workers + 2 per Envoy); more are
    /// refused (RESOURCE_EXHAUSTED) and counted.
    #[serde(default = "default_max_subscribers")]
    pub max_subscribers: usize,
    /// Seconds between heartbeats.
    #[serde(default = "default_heartbeat")]
    pub heartbeat_secs: f64,
    /// Milliseconds a subscriber that batches (llmgw's filter) waits, after its queue was
    /// emptied, before its next messages go: the block changes and load reports published
    /// meanwhile travel as one message. Bounds the messages each filter VM takes to about
    /// 1000 / gather_ms a second (plus tables, snapshots, resets and heartbeats) whatever the
    /// fleet's size, for at most this much delay on a change; a change after a quiet spell
    /// goes at once. 0: no wait (changes still join a message that has not left yet).
    #[serde(default = "default_gather_ms")]
    pub gather_ms: u64,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpConfig {
    #[serde(default = "default_http_listen")]
    pub listen: SocketAddr,
    /// `/debug/replicas` (every engine's block keys) answers loopback clients only, unless this
    /// token is set and the request carries it as `Authorization: Bearer TOKEN`.
    #[serde(default)]
    pub debug_token: Option<String>,
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct HashConfig {
    /// vLLM's `--prefix-caching-hash-algo`, read by its flag name.
    #[serde(default = "default_algo")]
    pub algo: HashAlgo,
    /// PYTHONHASHSEED of the replicas; absent when unset. Written here only where it is no
    /// secret (tests, one machine): deployments name where to read it instead.
    #[serde(default)]
    pub seed: Option<String>,
    /// The environment variable holding the seed (a Secret's key in the container's env).
    #[serde(default)]
    pub seed_env: Option<String>,
    /// The file holding the seed (a mounted Secret's key).
    #[serde(default)]
    pub seed_file: Option<std::path::PathBuf>,
    /// Where the seed came from (set when the configuration is loaded).
    #[serde(skip)]
    pub seed_source: super::seed::SeedSource,
    #[serde(default = "default_block_size")]
    pub block_size: u32,
    /// vLLM's lookahead hashing (EAGLE-family speculative decoding with prefix caching): the
    /// tokens after each block its hash covers; 0 without it.
    #[serde(default)]
    pub lookahead_tokens: u32,
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
    /// The largest event message accepted from a publisher, bytes (libzmq drops the connection
    /// of a peer sending more, before allocating it; it reconnects, and the lost batches are a
    /// gap). vLLM's largest batches are well under 1 MiB per 100,000 prompt tokens.
    #[serde(default = "default_max_message_bytes")]
    pub max_message_bytes: i64,
    /// Bytes one engine's receive queue may hold: libzmq queues whole messages and counts them,
    /// so the queue is bounded to this over `max_message_bytes` messages (and `rcvhwm`).
    /// Messages past it are dropped by libzmq and come back as a gap (`gaps_total`), filled from
    /// the replay socket.
    #[serde(default = "default_queued_bytes")]
    pub max_queued_bytes: i64,
}

impl ZmqConfig {
    /// The SUB socket's high-water mark: `rcvhwm` (0: no count limit), within the byte bound.
    pub fn receive_hwm(&self) -> i32 {
        let by_bytes = self.max_queued_bytes.checked_div(self.max_message_bytes.max(1)).unwrap_or(1).max(1);
        let by_bytes = i32::try_from(by_bytes).unwrap_or(i32::MAX);
        if self.rcvhwm > 0 {
            self.rcvhwm.min(by_bytes)
        } else {
            by_bytes
        }
    }
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
    /// How often each replica's `/v1/models` is read (0: never), for replicas whose
    /// configuration names no model: the feed then says they serve what they list.
    #[serde(default = "default_models_interval")]
    pub models_interval_ms: u64,
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
    /// Where its events come from: its ZMQ publisher (default) or the `[jetstream]` stream.
    #[serde(default)]
    pub events: Events,
    /// ZMQ endpoint of the event publisher (rank 0), `tcp://host:port` (not with
    /// `events = "jetstream"`).
    #[serde(default)]
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
    /// The base URL (`http://host:port`) of the replica's `llmgw-agent publish --snapshot-listen`
    /// sidecar: an engine first heard after its start joins from its snapshot.
    #[serde(default)]
    pub snapshot_url: Option<String>,
}

fn default_mode() -> Mode {
    Mode::Connect
}

impl Default for FeedConfig {
    fn default() -> Self {
        Self {
            listen: default_feed_listen(),
            allow_non_loopback: false,
            token: None,
            tls_cert: None,
            tls_key: None,
            client_ca: None,
            max_queue: default_queue(),
            max_backlog_bytes: default_backlog_bytes(),
            max_subscribers: default_max_subscribers(),
            heartbeat_secs: default_heartbeat(),
            gather_ms: default_gather_ms(),
        }
    }
}
impl Default for HttpConfig {
    fn default() -> Self {
        Self { listen: default_http_listen(), debug_token: None }
    }
}
impl HashConfig {
    /// Fills `seed` from `seed_env` or `seed_file` (see [`super::seed::resolve`]) and records
    /// where it came from. `field`: the section's path (`hash`, `replicas[0].hash`).
    pub(super) fn resolve_seed(&mut self, field: &str, lookup: SeedLookup<'_>) -> Result<(), ConfigError> {
        self.seed_source = super::seed::resolve(&mut self.seed, &mut self.seed_env, &mut self.seed_file, lookup)
            .map_err(|(f, m)| err(format!("{field}.{f}"), m))?;
        Ok(())
    }

    /// Whether the seed is still to be read (loaded with [`SeedLookup::Defer`]): then `seed` is
    /// `None` though the replicas run with one.
    pub fn seed_deferred(&self) -> bool {
        self.seed.is_none() && self.seed_source.is_secret()
    }

    /// The settings as the core names them (the feed carries them to the filters).
    pub fn spec(&self) -> llmgw_core::hash::HashSpec {
        llmgw_core::hash::HashSpec {
            algo: self.algo,
            seed: self.seed.clone(),
            block_size: usize::try_from(self.block_size).unwrap_or(usize::MAX),
            lookahead: usize::try_from(self.lookahead_tokens).unwrap_or(usize::MAX),
        }
    }
}

impl Default for HashConfig {
    fn default() -> Self {
        Self {
            algo: default_algo(),
            seed: None,
            seed_env: None,
            seed_file: None,
            seed_source: super::seed::SeedSource::Written,
            block_size: default_block_size(),
            lookahead_tokens: 0,
        }
    }
}
impl Default for ZmqConfig {
    fn default() -> Self {
        Self {
            rcvhwm: default_rcvhwm(),
            reconnect_ivl_max_ms: default_reconnect_max(),
            replay_timeout_ms: default_replay_timeout(),
            max_blocks_per_engine: default_max_blocks(),
            max_message_bytes: default_max_message_bytes(),
            max_queued_bytes: default_queued_bytes(),
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
            models_interval_ms: default_models_interval(),
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

pub(super) fn err(field: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError { field: field.into(), message: message.into() }
}

impl Config {
    /// Parses and validates TOML text; hash seeds named by `seed_env` or `seed_file` are read
    /// from this process's environment and files.
    pub fn parse(text: &str) -> Result<Config, ConfigError> {
        Config::parse_with(text, SeedLookup::Read(&super::seed::process_env))
    }

    /// [`Config::parse`], reading hash seeds as `seeds` says.
    pub fn parse_with(text: &str, seeds: SeedLookup<'_>) -> Result<Config, ConfigError> {
        let de = toml::Deserializer::parse(text).map_err(|e| err("", e.to_string().trim_end().to_owned()))?;
        let mut cfg: Config = serde_path_to_error::deserialize(de).map_err(|e| {
            let path = e.path().to_string();
            err(path, e.into_inner().message().to_owned())
        })?;
        cfg.hash.resolve_seed("hash", seeds)?;
        for (i, r) in cfg.replicas.iter_mut().enumerate() {
            if let Some(h) = r.hash.as_mut() {
                h.resolve_seed(&format!("replicas[{i}].hash"), seeds)?;
            }
        }
        for (i, d) in cfg.discovery.iter_mut().enumerate() {
            if let Some(h) = d.hash.as_mut() {
                h.resolve_seed(&format!("discovery[{i}].hash"), seeds)?;
            }
        }
        cfg.validate()?;
        Ok(cfg)
    }

    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        Config::load_with(path, SeedLookup::Read(&super::seed::process_env))
    }

    /// [`Config::load`], reading hash seeds as `seeds` says.
    pub fn load_with(path: &Path, seeds: SeedLookup<'_>) -> Result<Config, ConfigError> {
        let text =
            std::fs::read_to_string(path).map_err(|e| err("", format!("cannot read {}: {e}", path.display())))?;
        Config::parse_with(&text, seeds)
    }

    pub fn replay_timeout(&self) -> Duration {
        Duration::from_millis(self.zmq.replay_timeout_ms)
    }
}

pub(super) mod field_defaults;

#[cfg(test)]
pub(super) mod tests;
