//! The filter's configuration as it is written (JSON in Envoy's plugin `configuration`):
//! parsed and validated at load, with errors that name the offending field.

use super::weights::WeightsConfig;
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
fn default_body_budget() -> u64 {
    128 * 1024 * 1024
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
    pub weights: WeightsConfig,
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
    /// Bytes of request bodies one VM holds at once (each counted twice: its copy, then its
    /// parsed prompt and tokenizer call while it waits): a body past it is routed by its leading
    /// bytes as if it were past `max_body_bytes` (`llmgw_body_budget_exhausted_total`).
    #[serde(default = "default_body_budget")]
    pub body_budget_bytes: u64,
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
    /// Routes the next turn of a conversation (a chat request whose messages are an earlier
    /// one's plus two) on the earlier request's cached tokens at once, and calls the tokenizer
    /// for it after it is routed (the answer is cached for the turn after it); and a text
    /// prompt that begins with an earlier one, on its tokens. Needs the tokenization cache.
    /// False: every new prompt waits for its tokenizer call.
    #[serde(default = "default_true")]
    pub route_on_earlier_turns: bool,
    /// Routes a chat request at once on the tokens its siblings share (earlier requests with
    /// the same messages but the last, such as a system prompt): when at most one replica holds
    /// all of them, no replica can hold more of the request, and its tokenizer call is made
    /// after routing. Needs the tokenization cache and at least two siblings that differ. A
    /// text prompt sharing leading text with an earlier one is routed the same way.
    #[serde(default = "default_true")]
    pub route_on_shared_prefixes: bool,
    /// A streamed request routed before its tokenizer answered asks the replica for its
    /// prompt's token ids (`return_token_ids`), read from the stream's first chunk and taken out
    /// of every chunk before the client sees it, instead of a tokenizer call after routing.
    /// False: the call is made.
    #[serde(default = "default_true")]
    pub tokens_from_answers: bool,
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
        if self.body_budget_bytes == 0 {
            return bad("body_budget_bytes".into(), "must be positive");
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
            if let Err(e) = p.weights.resolve().validate() {
                return bad(f(&format!("weights.{}", e.field)), e.message);
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
        // Every weight is validated, those of the policy not in use too.
        for (weights, field) in [
            (r#"{"tie_margin":-0.1}"#, "tie_margin"),
            (r#"{"tie_us":-1}"#, "tie_us"),
            (r#"{"holder_spill_factor":0.5}"#, "holder_spill_factor"),
            (r#"{"max_in_flight":0}"#, "max_in_flight"),
            (r#"{"policy":"score","prefill_us_per_token":-1}"#, "prefill_us_per_token"),
            (r#"{"policy":"ttft","prefix":-1}"#, "prefix"),
            (r#"{"max_kv_usage":-1}"#, "max_kv_usage"),
        ] {
            let e = err(&format!(r#"{{"profiles":[{{"name":"a","models":["m"],"weights":{weights}}}]}}"#));
            assert!(e.contains(&format!("`profiles[0].weights.{field}`")), "{weights}: {e}");
        }
        assert!(err(r#"{"profiles":[{"name":"a","models":["m"],"weights":{"colour":1}}]}"#).contains("colour"));
        assert!(FilterConfig::from_json(
            br#"{"profiles":[{"name":"a","models":["m"],"weights":{"holder_spill_factor":0}}]}"#
        )
        .is_ok());
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
        let w = p.weights.resolve();
        assert_eq!(w.score.prefix, 1.0);
        assert_eq!(w.score.load, 1.0);
        assert_eq!(w.limits.max_waiting, 64);
    }
}
