//! The `[epp]` section: the agent as a Gateway API Inference Extension endpoint picker (see
//! [`crate::epp`]), answering Envoy's ext_proc stream with the same routing core as the filter.
//!
//! ```toml
//! [epp]
//! listen = "127.0.0.1:9002"        # gRPC: envoy.service.ext_proc.v3.ExternalProcessor and grpc.health.v1
//! routing = "llmgw-routing.json"   # the filter's JSON configuration (profiles, weights, limits)
//! max_streams = 1024               # ext_proc streams served at once; more are refused (counted)
//! max_fallbacks = 2                # endpoints after the primary in the ordered fallback list
//! avoid_ms = 10000                 # a primary the gateway could not use is avoided this long
//! ```

use serde::Deserialize;
use std::net::SocketAddr;
use std::path::PathBuf;

/// Most endpoints a fallback list may name after the primary.
pub const MAX_FALLBACKS: usize = 16;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EppConfig {
    #[serde(default = "default_listen")]
    pub listen: SocketAddr,
    /// Must be set to listen on a non-loopback address (as in a Kubernetes pod).
    #[serde(default)]
    pub allow_non_loopback: bool,
    /// The filter's JSON configuration (the same document Envoy hands llmgw.wasm). Absent: the
    /// filter's defaults (one catch-all profile, approximate routing only).
    #[serde(default)]
    pub routing: Option<PathBuf>,
    #[serde(default = "default_max_streams")]
    pub max_streams: usize,
    #[serde(default = "default_max_fallbacks")]
    pub max_fallbacks: usize,
    #[serde(default = "default_avoid_ms")]
    pub avoid_ms: u64,
}

impl EppConfig {
    /// The checks serde cannot make: `(field, message)`.
    pub fn validate(&self) -> Result<(), (&'static str, String)> {
        if !self.listen.ip().is_loopback() && !self.allow_non_loopback {
            return Err((
                "epp.listen",
                format!("{} is not a loopback address; set epp.allow_non_loopback = true", self.listen),
            ));
        }
        if self.max_streams == 0 {
            return Err(("epp.max_streams", "must be at least 1".to_owned()));
        }
        if self.max_fallbacks > MAX_FALLBACKS {
            return Err(("epp.max_fallbacks", format!("must be at most {MAX_FALLBACKS}")));
        }
        Ok(())
    }
}

fn default_listen() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 9002))
}
fn default_max_streams() -> usize {
    1024
}
fn default_max_fallbacks() -> usize {
    2
}
fn default_avoid_ms() -> u64 {
    10_000
}
