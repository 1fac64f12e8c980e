//! The agent's configuration: a TOML file, validated so that every error names the field.
//!
//! ```toml
//! [feed]
//! listen = "127.0.0.1:7070"        # gRPC feed (llmgw.feed.v1.Feed/Subscribe)
//! [http]
//! listen = "127.0.0.1:9464"        # /metrics, /healthz, /debug/replicas
//! [hash]
//! algo = "sha256_cbor"             # vLLM's --prefix-caching-hash-algo
//! seed_env = "LLMGW_HASH_SEED"      # the replicas' PYTHONHASHSEED, read from this variable
//!                                  # (or seed_file = PATH; seed = "N" written here, not secret)
//! block_size = 16
//! lookahead_tokens = 0             # EAGLE-family lookahead hashing (vLLM 0.33); 0 without it
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
//!
//! * [`file`]: the file's sections and fields, with their defaults.
//! * [`validate`]: the checks serde cannot make (addresses, endpoints, uniqueness, listener
//!   safety).
//! * [`tokenizer`]: the native tokenizer's section.
//! * [`epp`]: the endpoint picker's section.
//! * [`seed`]: where the hash seed is read from (the file, a variable, a file of its own).
//! * [`snapshot_bucket`]: `[jetstream.snapshots]`, engines' snapshots in an object-store bucket.
//! * [`engine`]: the engines a configuration describes (replica × data-parallel rank) and the
//!   `tcp://host:port` endpoint rules they follow.

mod engine;
mod epp;
mod file;
pub mod seed;
#[cfg(test)]
mod seed_tests;
mod snapshot_bucket;
mod tokenizer;
mod validate;

pub use engine::{offset_port, parse_tcp, subject, EndpointError, EngineSpec, EventSource};
pub use epp::{EppConfig, MAX_FALLBACKS};
pub use file::{
    Config, ConfigError, DiscoveryConfig, Events, FeedConfig, HashConfig, HttpConfig, JetStreamConfig, LoadConfig,
    Mode, ParityConfig, ReplicaConfig, Sources, ZmqConfig,
};
pub use snapshot_bucket::{SnapshotBucketConfig, MAX_SNAPSHOT_BYTES};
pub use tokenizer::{TokenizerConfig, TokenizerModelConfig};
