//! The filter's configuration (JSON in Envoy's plugin `configuration`), validated at load with
//! errors that name the offending field, then compiled ([`compiled`]) into what a request needs.

mod compiled;
pub use compiled::{Compiled, CompiledProfile, HashPins, MemoSettings};

use crate::hash::{defaults, HashAlgo, HashSpec, MAX_LOOKAHEAD};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::fmt;

/// Why a configuration was refused: the field's path (`profiles[0].block_size`) and the reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub field: String,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.field.is_empty() || self.field == "." {
            write!(f, "invalid llmgw configuration: {}", self.message)
        } else {
            write!(f, "invalid llmgw configuration: field `{}`: {}", self.field, self.message)
        }
    }
}

impl std::error::Error for ConfigError {}

/// The destination header when the configuration names none: the Gateway API Inference
/// Extension's. The filter also removes it from every request, configured or not.
pub const DEFAULT_DESTINATION_HEADER: &str = "x-gateway-destination-endpoint";
fn default_header() -> String {
    DEFAULT_DESTINATION_HEADER.to_owned()
}
fn default_agent_cluster() -> String {
    "llmgw_agent".to_owned()
}
fn default_body_limit() -> u64 {
    32 * 1024 * 1024
}
/// A field that is present (its value may be `null`), as opposed to absent (`None`).
fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Option<String>>, D::Error> {
    Option::<String>::deserialize(d).map(Some)
}
fn default_timeout() -> u32 {
    500
}
fn default_true() -> bool {
    true
}
fn default_tokenizer_cluster() -> String {
    "llmgw_tokenizer".to_owned()
}
fn default_feed_idle_timeout() -> u32 {
    15_000
}
fn default_max_salt() -> u32 {
    1024
}
fn default_loads_stale() -> u32 {
    5_000
}
fn default_index_stale() -> u32 {
    60_000
}
/// Leading prompt bytes the approximate fallback hashes when no profile says otherwise.
pub const DEFAULT_APPROX_PREFIX_BYTES: u32 = 1024;
fn default_approx_prefix_bytes() -> u32 {
    DEFAULT_APPROX_PREFIX_BYTES
}
fn default_tokenizer_cache_bytes() -> u64 {
    4 * 1024 * 1024
}
fn default_tokenizer_cache_ttl_ms() -> u32 {
    60_000
}

/// How the filter obtains a request's token ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TokenizerEndpoint {
    /// `POST /tokenize`.
    Tokenize,
    /// `POST /v1/completions/render` and `/v1/chat/completions/render` (exact engine tokens).
    Render,
}

/// One model profile.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    pub name: String,
    /// Model names (as in requests' `model`) this profile serves. `"*"` matches any.
    pub models: Vec<String>,
    /// Exact routing from KV events (opt-in): needs the replicas to publish events.
    #[serde(default)]
    pub kv_events: bool,
    /// Tokens per block. Absent: what the feed says each replica uses (else 16). Set: a
    /// replica the feed shows with another value is a hash-settings mismatch.
    #[serde(default)]
    pub block_size: Option<u32>,
    /// vLLM's `--prefix-caching-hash-algo`; absent: from the feed (else `sha256_cbor`).
    #[serde(default)]
    pub hash_algo: Option<HashAlgo>,
    /// The replicas' `PYTHONHASHSEED` (`null`: they run without one); absent: from the feed
    /// (else unset).
    #[serde(default, deserialize_with = "present")]
    pub seed: Option<Option<String>>,
    /// vLLM's lookahead hashing: tokens after each block its hash covers (1 for EAGLE and
    /// EAGLE3 with prefix caching, `num_speculative_tokens` for multi-module MTP, 0 when the
    /// engines run without it or with `disable_lookahead_block_hashes`). Absent: from the feed
    /// (else 0).
    #[serde(default)]
    pub lookahead_tokens: Option<u32>,
    #[serde(default = "default_tokenizer")]
    pub tokenizer: TokenizerEndpoint,
    #[serde(default = "default_timeout")]
    pub tokenizer_timeout_ms: u32,
    /// A dedicated tokenizer (`IP:PORT`), e.g. `vllm launch render MODEL_DIR` beside the
    /// gateway: it never queues behind generation. Tokenizer calls go there first, and to the
    /// least-loaded replica while it is failing. Absent: the least-loaded replica.
    #[serde(default)]
    pub tokenizer_address: Option<String>,
    #[serde(default)]
    pub weights: Weights,
    /// LoRA adapters served under this profile: adapter name (as requests name it in `model`)
    /// → the path the engines loaded it from (vLLM mixes both into every block hash).
    #[serde(default)]
    pub lora_adapters: BTreeMap<String, String>,
    /// How many leading bytes of the prompt text the approximate fallback hashes.
    #[serde(default = "default_approx_prefix_bytes")]
    pub approx_prefix_bytes: u32,
}

impl Profile {
    /// The hashing this profile assumes where the feed says nothing: its own settings, else
    /// the defaults.
    pub fn default_spec(&self) -> HashSpec {
        HashSpec {
            algo: self.hash_algo.unwrap_or(defaults::ALGO),
            seed: self.seed.clone().flatten(),
            block_size: usize::try_from(self.block_size.unwrap_or(defaults::BLOCK_SIZE)).unwrap_or(usize::MAX),
            lookahead: usize::try_from(self.lookahead_tokens.unwrap_or(0)).unwrap_or(usize::MAX),
        }
    }
}

fn default_tokenizer() -> TokenizerEndpoint {
    TokenizerEndpoint::Tokenize
}

/// How replicas that hold some of a request's blocks are compared (see `crate::policy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PolicyMode {
    /// The lowest predicted time to first token: the request's uncached tokens there plus
    /// `queued_prefill` × the prefill queued there, at `prefill_us_per_token`, plus
    /// `request_us` per request on the engine.
    Ttft,
    /// The highest blended score `prefix × share − load × load term`.
    Score,
}

/// Scoring weights. `policy` `ttft` (the default): predicted time to first token =
/// `prefill_us_per_token` × (uncached prompt tokens + `queued_prefill` × prefill tokens routed
/// there still awaiting their first token) + `request_us` × (max(in-flight, running +
/// waiting) + waiting). `score`: score = prefix × share −
/// load × (pressure / (pressure + load_scale) + kv_usage × kv cache usage), where pressure =
/// in-flight + running + 2 × waiting. Replicas past any `max_*` limit are overloaded and only
/// chosen when every replica is.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Weights {
    #[serde(default = "default_policy")]
    pub policy: PolicyMode,
    /// Prefill cost of one prompt token (µs), `ttft` policy.
    #[serde(default = "default_prefill_us_per_token")]
    pub prefill_us_per_token: f64,
    /// What each request already on a replica adds to a new request's time to first token
    /// (µs): the engine steps it takes and the batch slot it holds, `ttft` policy.
    #[serde(default = "default_request_us")]
    pub request_us: f64,
    /// The share of the prefill queued on a replica (its requests without a first token yet)
    /// a new request waits for, `ttft` policy: 1 when every queued token delays it (vLLM
    /// computes a step's tokens together, the step lasting longer for each), 0 when the engine
    /// computes prefills side by side (the simulator). Default 1: in front of real vLLM
    /// (`./build.sh bench vllm`) it cut multi-turn TTFT p50 by about a sixth against 0 (see the
    /// README's "Routing policy"); the demo and the simulator benchmark set 0.
    #[serde(default = "default_queued_prefill")]
    pub queued_prefill: f64,
    /// Predictions within this many µs are equal (`ttft` policy): the prompt's rendezvous
    /// order picks, as with `tie_margin`.
    #[serde(default = "default_tie_us")]
    pub tie_us: f64,
    #[serde(default = "one")]
    pub prefix: f64,
    #[serde(default = "half")]
    pub load: f64,
    /// Pressure at which the load term reaches half its weight.
    #[serde(default = "default_load_scale")]
    pub load_scale: f64,
    /// Weight of the engine's KV cache usage (0..1) inside the load term.
    #[serde(default = "default_kv_weight")]
    pub kv_usage: f64,
    #[serde(default = "default_max_waiting")]
    pub max_waiting: u32,
    #[serde(default = "default_max_in_flight")]
    pub max_in_flight: u32,
    #[serde(default = "default_max_kv_usage")]
    pub max_kv_usage: f64,
    /// Approximate fallback: a replica takes a prefix's request while its pressure stays within
    /// `spill_factor` × the mean pressure (+ `spill_slack`); past it the request spills to the
    /// next replica in the prefix's rendezvous order.
    #[serde(default = "default_spill_factor")]
    pub spill_factor: f64,
    #[serde(default = "default_spill_slack")]
    pub spill_slack: u32,
    /// A prefix the index shows no replica holds goes to the least loaded of its first
    /// `approx_choices` replicas in rendezvous order; every gateway computes the same order,
    /// and equal loads pick the first. 2 (the default): new prefixes spread by load rather than
    /// by hash luck, and a burst sharing one lands on at most two replicas; 1: always the
    /// first, load bound permitting. Fallbacks without exact data always take the first.
    #[serde(default = "default_approx_choices")]
    pub approx_choices: u32,
    /// Replicas holding a request's blocks whose scores differ by at most this much are equally
    /// good: the one the prompt's rendezvous order puts first wins. A difference of one request
    /// (0.5 × 1/9 at the defaults) is within it: engine-reported loads reach every gateway at a
    /// different instant, and without the margin gateways with the same index split on them.
    #[serde(default = "default_tie_margin")]
    pub tie_margin: f64,
    /// Replicas holding a request's blocks keep it while their pressure stays within
    /// `holder_spill_factor` × the mean pressure (+ 2 × `spill_slack`); when every holder is past
    /// that, the request goes where a new prefix would (outcome `spill`), so a hot prefix is
    /// replicated instead of queueing on one replica. 0 turns the bound off.
    #[serde(default = "default_holder_spill_factor")]
    pub holder_spill_factor: f64,
}

fn default_policy() -> PolicyMode {
    PolicyMode::Ttft
}
fn default_prefill_us_per_token() -> f64 {
    200.0
}
fn default_request_us() -> f64 {
    40_000.0
}
fn default_queued_prefill() -> f64 {
    1.0
}
fn default_tie_us() -> f64 {
    45_000.0
}
fn default_load_scale() -> f64 {
    8.0
}
fn default_kv_weight() -> f64 {
    0.25
}
fn default_max_waiting() -> u32 {
    64
}
fn default_max_in_flight() -> u32 {
    256
}
fn default_max_kv_usage() -> f64 {
    0.99
}
fn default_spill_factor() -> f64 {
    1.25
}
fn default_approx_choices() -> u32 {
    2
}
fn default_spill_slack() -> u32 {
    2
}
fn default_tie_margin() -> f64 {
    0.06
}
fn default_holder_spill_factor() -> f64 {
    1.5
}

fn one() -> f64 {
    1.0
}
fn half() -> f64 {
    0.5
}

impl Default for Weights {
    fn default() -> Self {
        Weights {
            policy: default_policy(),
            prefill_us_per_token: default_prefill_us_per_token(),
            request_us: default_request_us(),
            tie_us: default_tie_us(),
            queued_prefill: default_queued_prefill(),
            prefix: one(),
            load: half(),
            load_scale: default_load_scale(),
            kv_usage: default_kv_weight(),
            max_waiting: default_max_waiting(),
            max_in_flight: default_max_in_flight(),
            max_kv_usage: default_max_kv_usage(),
            spill_factor: default_spill_factor(),
            spill_slack: default_spill_slack(),
            approx_choices: default_approx_choices(),
            tie_margin: default_tie_margin(),
            holder_spill_factor: default_holder_spill_factor(),
        }
    }
}

/// The filter's whole configuration.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FilterConfig {
    /// Envoy cluster of the llmgw agent's feed.
    #[serde(default = "default_agent_cluster")]
    pub agent_cluster: String,
    /// Envoy cluster for tokenizer callouts: an `ORIGINAL_DST` cluster honouring
    /// `destination_header`, so each callout goes to the replica the filter names.
    #[serde(default = "default_tokenizer_cluster")]
    pub tokenizer_cluster: String,
    /// Token sent in the feed subscription (the agent requires one off loopback).
    #[serde(default)]
    pub agent_token: String,
    /// A feed stream silent for this long (no message, not even a heartbeat) is dropped and
    /// reopened.
    #[serde(default = "default_feed_idle_timeout")]
    pub feed_idle_timeout_ms: u32,
    /// Engine-reported loads older than this (no load report from the agent) are ignored:
    /// replicas are weighed by this Envoy's in-flight counts only.
    #[serde(default = "default_loads_stale")]
    pub loads_stale_ms: u32,
    /// An index the agent has said nothing about for this long (no message, not even a
    /// heartbeat: the agent is away) is no longer credited; requests go by the fallbacks
    /// (`reason="stale"`) until a new snapshot. The replica table keeps serving: it is the only
    /// list of destinations, and passive health covers replicas that died meanwhile.
    #[serde(default = "default_index_stale")]
    pub index_stale_ms: u32,
    #[serde(default = "default_header")]
    pub destination_header: String,
    #[serde(default = "default_body_limit")]
    pub max_body_bytes: u64,
    /// A request whose `cache_salt` is longer is routed by the fallbacks
    /// (`reason="salt_too_long"`): its salt is neither hashed nor cached.
    #[serde(default = "default_max_salt")]
    pub max_cache_salt_bytes: u32,
    /// Adds a response header explaining each decision.
    #[serde(default)]
    pub explain_header: bool,
    #[serde(default = "default_true")]
    pub metrics: bool,
    /// Memory per VM for recent tokenizations (token ids and block hashes, about 7 bytes per
    /// prompt token): a prompt sent again within `tokenizer_cache_ttl_ms` is routed without a
    /// tokenizer call. 0 turns the cache off.
    #[serde(default = "default_tokenizer_cache_bytes")]
    pub tokenizer_cache_bytes: u64,
    /// How long a cached tokenization is trusted (a chat template or tokenizer changed on the
    /// replicas takes effect within this time).
    #[serde(default = "default_tokenizer_cache_ttl_ms")]
    pub tokenizer_cache_ttl_ms: u32,
    /// Networks (CIDR, optionally `:PORT` or `:LO-HI`) the filter may send requests and
    /// tokenizer calls to; a replica the feed names elsewhere is never routed to (counted in
    /// `llmgw_destinations_refused`). Absent: loopback and private networks
    /// ([`crate::allow::DEFAULT`]).
    #[serde(default)]
    pub allowed_destinations: Option<Vec<String>>,
    pub profiles: Vec<Profile>,
}

impl FilterConfig {
    /// Parses and validates. An empty input selects the defaults with one catch-all profile.
    pub fn from_json(input: &[u8]) -> Result<FilterConfig, ConfigError> {
        let trimmed = input.iter().all(|b| b.is_ascii_whitespace());
        let input: &[u8] = if trimmed { br#"{"profiles":[{"name":"default","models":["*"]}]}"# } else { input };
        let de = &mut serde_json::Deserializer::from_slice(input);
        let cfg: FilterConfig = serde_path_to_error::deserialize(de)
            .map_err(|e| ConfigError { field: e.path().to_string(), message: e.inner().to_string() })?;
        cfg.validate()?;
        Ok(cfg)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let bad = |field: String, message: &str| Err(ConfigError { field, message: message.to_owned() });
        if self.agent_cluster.is_empty() {
            return bad("agent_cluster".into(), "must not be empty");
        }
        if self.feed_idle_timeout_ms == 0 {
            return bad("feed_idle_timeout_ms".into(), "must be positive");
        }
        if self.loads_stale_ms == 0 {
            return bad("loads_stale_ms".into(), "must be positive");
        }
        if self.index_stale_ms == 0 {
            return bad("index_stale_ms".into(), "must be positive");
        }
        if self.tokenizer_cluster.is_empty() {
            return bad("tokenizer_cluster".into(), "must not be empty");
        }
        if self.destination_header.is_empty()
            || !self.destination_header.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        {
            return bad("destination_header".into(), "must be a lowercase HTTP header name");
        }
        if self.max_body_bytes == 0 {
            return bad("max_body_bytes".into(), "must be positive");
        }
        if self.tokenizer_cache_bytes > 1 << 32 {
            return bad("tokenizer_cache_bytes".into(), "must be at most 4 GiB (it is allocated in every VM)");
        }
        if self.tokenizer_cache_ttl_ms == 0 {
            return bad("tokenizer_cache_ttl_ms".into(), "must be positive");
        }
        if let Err((i, m)) = self.allowlist() {
            return bad(format!("allowed_destinations[{i}]"), &m);
        }
        if self.profiles.is_empty() {
            return bad("profiles".into(), "at least one profile is required");
        }
        for (i, p) in self.profiles.iter().enumerate() {
            let f = |name: &str| format!("profiles[{i}].{name}");
            if p.name.is_empty() {
                return bad(f("name"), "must not be empty");
            }
            if p.models.is_empty() || p.models.iter().any(String::is_empty) {
                return bad(f("models"), "must list at least one non-empty model name");
            }
            if p.block_size == Some(0) {
                return bad(f("block_size"), "must be at least 1");
            }
            if p.lookahead_tokens.is_some_and(|l| usize::try_from(l).map_or(true, |l| l > MAX_LOOKAHEAD)) {
                return bad(f("lookahead_tokens"), &format!("must be at most {MAX_LOOKAHEAD}"));
            }
            if let Err(e) = p.default_spec().hasher() {
                return bad(f("seed"), &e.to_string());
            }
            if p.tokenizer_timeout_ms == 0 {
                return bad(f("tokenizer_timeout_ms"), "must be positive");
            }
            if p.tokenizer_address.as_ref().is_some_and(|a| a.parse::<std::net::SocketAddr>().is_err()) {
                return bad(f("tokenizer_address"), "must be IP:PORT (IPv6 in brackets)");
            }
            let w = &p.weights;
            for (name, v) in [
                ("weights.prefix", w.prefix),
                ("weights.load", w.load),
                ("weights.kv_usage", w.kv_usage),
                ("weights.max_kv_usage", w.max_kv_usage),
                ("weights.prefill_us_per_token", w.prefill_us_per_token),
                ("weights.request_us", w.request_us),
                ("weights.tie_us", w.tie_us),
                ("weights.queued_prefill", w.queued_prefill),
            ] {
                if !v.is_finite() || v < 0.0 {
                    return bad(f(name), "must be a finite, non-negative number");
                }
            }
            if !w.load_scale.is_finite() || w.load_scale <= 0.0 {
                return bad(f("weights.load_scale"), "must be a finite, positive number");
            }
            if w.approx_choices == 0 {
                return bad(f("weights.approx_choices"), "must be at least 1");
            }
            if !w.spill_factor.is_finite() || w.spill_factor < 1.0 {
                return bad(f("weights.spill_factor"), "must be a finite number of at least 1");
            }
            if p.lora_adapters.keys().any(String::is_empty) {
                return bad(f("lora_adapters"), "adapter names must not be empty");
            }
        }
        Ok(())
    }

    /// The compiled destination allowlist (the default networks when none is configured).
    pub fn allowlist(&self) -> Result<crate::allow::Allowlist, (usize, String)> {
        match &self.allowed_destinations {
            Some(list) => crate::allow::Allowlist::parse(list),
            None => Ok(crate::allow::Allowlist::default_networks()),
        }
    }

    /// The profile serving `model` (exact name first, then a `"*"` profile).
    pub fn profile_for(&self, model: &str) -> Option<&Profile> {
        self.profiles
            .iter()
            .find(|p| p.models.iter().any(|m| m == model))
            .or_else(|| self.profiles.iter().find(|p| p.models.iter().any(|m| m == "*")))
    }
}

#[cfg(test)]
#[allow(clippy::arithmetic_side_effects)]
mod tests {
    use super::*;

    fn err(j: &str) -> String {
        FilterConfig::from_json(j.as_bytes()).unwrap_err().to_string()
    }

    #[test]
    fn defaults_and_profiles() {
        let c = FilterConfig::from_json(b"").unwrap();
        assert_eq!(c.destination_header, "x-gateway-destination-endpoint");
        assert_eq!((c.tokenizer_cache_bytes, c.tokenizer_cache_ttl_ms), (4 << 20, 60_000));
        assert_eq!(c.profile_for("anything").map(|p| p.name.as_str()), Some("default"));
        let c = FilterConfig::from_json(br#"{"profiles":[{"name":"a","models":["m1"],"kv_events":true,"seed":"0"}]}"#)
            .unwrap();
        assert!(c.profile_for("m1").is_some_and(|p| p.kv_events && p.default_spec().block_size == 16));
        assert_eq!(c.profile_for("m1").map(|p| p.seed.clone()), Some(Some(Some("0".to_owned()))));
        // Absent and null are different: null pins "no seed", absent takes the feed's.
        let c = FilterConfig::from_json(br#"{"profiles":[{"name":"a","models":["m1"],"seed":null}]}"#).unwrap();
        assert_eq!(c.profiles[0].seed, Some(None));
        let c = FilterConfig::from_json(br#"{"profiles":[{"name":"a","models":["m1"]}]}"#).unwrap();
        assert_eq!((c.profiles[0].seed.clone(), c.profiles[0].block_size, c.profiles[0].hash_algo), (None, None, None));
        assert!(c.profile_for("m2").is_none());
    }

    #[test]
    fn errors_name_the_field() {
        assert!(
            err(r#"{"profiles":[{"name":"a","models":["m"],"block_size":0}]}"#).contains("`profiles[0].block_size`")
        );
        assert!(
            err(r#"{"profiles":[{"name":"a","models":["m"],"block_size":"x"}]}"#).contains("profiles[0].block_size")
        );
        assert!(
            err(r#"{"profiles":[{"name":"a","models":["m"],"hash_algo":"md5"}]}"#).contains("profiles[0].hash_algo")
        );
        assert!(err(r#"{"profiles":[{"name":"a","models":["m"],"hash_algo":"xxhash"}]}"#).contains("profiles[0].seed"));
        assert!(err(r#"{"profiles":[{"name":"a","models":["m"],"colour":1}]}"#).contains("colour"));
        assert!(err(r#"{"profiles":[]}"#).contains("`profiles`"));
        assert!(err(r#"{"destination_header":"X Bad","profiles":[{"name":"a","models":["m"]}]}"#)
            .contains("destination_header"));
        assert!(err("{not json").contains("invalid llmgw configuration"));
        assert!(err(r#"{"profiles":[{"name":"a","models":["m"],"weights":{"spill_factor":0.5}}]}"#)
            .contains("`profiles[0].weights.spill_factor`"));
        assert!(err(r#"{"profiles":[{"name":"a","models":["m"],"weights":{"load_scale":0}}]}"#)
            .contains("`profiles[0].weights.load_scale`"));
        assert!(
            err(r#"{"tokenizer_cluster":"","profiles":[{"name":"a","models":["m"]}]}"#).contains("`tokenizer_cluster`")
        );
        assert!(err(r#"{"tokenizer_cache_ttl_ms":0,"profiles":[{"name":"a","models":["m"]}]}"#)
            .contains("`tokenizer_cache_ttl_ms`"));
        assert!(err(r#"{"tokenizer_cache_bytes":-1,"profiles":[{"name":"a","models":["m"]}]}"#)
            .contains("tokenizer_cache_bytes"));
        assert!(err(
            r#"{"allowed_destinations":["10.0.0.0/8","10.0.0.0/40"],"profiles":[{"name":"a","models":["m"]}]}"#
        )
        .contains("`allowed_destinations[1]`"));
        let c = FilterConfig::from_json(
            br#"{"profiles":[{"name":"a","models":["m","ad"],"lora_adapters":{"ad":"/l/ad"},"weights":{"load":1}}]}"#,
        )
        .unwrap();
        let p = c.profile_for("ad").unwrap();
        assert_eq!(p.lora_adapters.get("ad").map(String::as_str), Some("/l/ad"));
        assert_eq!(p.weights.prefix, 1.0);
        assert_eq!(p.weights.max_waiting, 64);
    }
}
