//! The configuration as requests use it, compiled once per (re)configure and replaced whole:
//! each profile carries its hash settings (checked once), its weights and its byte budgets
//! as the types the request path takes, so nothing is parsed, looked up by name or cloned per
//! request.
//!
//! Invariants (established by [`FilterConfig::validate`] before compiling): every profile has a
//! usable default hashing, a block size of at least 1 and at least one model; `destination_header` is a
//! lowercase header name.

use super::filter_config::{ConfigError, FilterConfig, TokenizerEndpoint};
use crate::hash::{HashAlgo, HashSpec};
use crate::policy::Weights;
use std::collections::BTreeMap;

/// The digest memo each profile's hashers keep (`BlockHasher::with_cache`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoSettings {
    /// Slots (56 bytes each).
    pub slots: usize,
    /// Secret key of the memo's tags (clients choose the tokens): random per VM.
    pub key: u64,
}

/// One profile, ready for requests. Immutable: how it hashes for a model, given what the
/// replicas publish, is the request path's hash plan.
pub struct CompiledProfile {
    pub name: String,
    models: Vec<String>,
    catch_all: bool,
    /// Exact routing from KV events.
    pub kv_events: bool,
    /// What the profile sets itself (the rest comes from the feed).
    pub pins: HashPins,
    /// The hashing where neither the profile nor the feed says anything.
    pub default_spec: HashSpec,
    pub tokenizer: TokenizerEndpoint,
    pub tokenizer_timeout_ms: u32,
    /// A dedicated tokenizer, tried before the replicas.
    pub tokenizer_address: Option<String>,
    pub weights: Weights,
    pub lora_adapters: BTreeMap<String, String>,
    /// Leading prompt bytes the approximate key reads.
    pub approx_prefix_bytes: usize,
}

/// The hash settings a profile sets itself; `None`: the feed's (else the default).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HashPins {
    pub algo: Option<HashAlgo>,
    /// `Some(None)`: pinned to "no seed".
    pub seed: Option<Option<String>>,
    pub block_size: Option<usize>,
    pub lookahead: Option<usize>,
}

impl CompiledProfile {
    /// The hashing to use when the replicas' feed says `feed`: the profile's own settings
    /// first, then the feed's, then the defaults.
    pub fn effective_spec(&self, feed: Option<&HashSpec>) -> HashSpec {
        let base = feed.unwrap_or(&self.default_spec);
        HashSpec {
            algo: self.pins.algo.unwrap_or(base.algo),
            seed: match &self.pins.seed {
                Some(s) => s.clone(),
                None => base.seed.clone(),
            },
            block_size: self.pins.block_size.unwrap_or(base.block_size),
            lookahead: self.pins.lookahead.unwrap_or(base.lookahead),
        }
    }

    /// The LoRA adapter `model` names under this profile, as vLLM mixes it into block hashes.
    pub fn lora(&self, model: Option<&str>) -> Option<(String, String)> {
        let m = model?;
        self.lora_adapters.get(m).map(|path| (m.to_owned(), path.clone()))
    }
}

/// The whole configuration, ready for requests.
pub struct Compiled {
    pub agent_cluster: String,
    pub tokenizer_cluster: String,
    pub agent_token: String,
    pub feed_idle_timeout_ms: u32,
    pub loads_stale_ns: u64,
    pub index_stale_ns: u64,
    pub destination_header: String,
    pub max_body_bytes: usize,
    /// Bytes of request bodies one VM holds at once (see `FilterConfig::body_budget_bytes`).
    pub body_budget_bytes: usize,
    pub max_cache_salt_bytes: usize,
    pub explain_header: bool,
    pub metrics: bool,
    /// Byte budget of the tokenization cache (0: off).
    pub tokenizer_cache_bytes: usize,
    pub tokenizer_cache_ttl_ns: u64,
    /// Route a chat request on an earlier request it extends (see `FilterConfig`).
    pub route_on_earlier_turns: bool,
    /// Route a chat request on what its siblings share (see `FilterConfig`).
    pub route_on_shared_prefixes: bool,
    /// Read a streamed request's token ids from its answer (see `FilterConfig`).
    pub tokens_from_answers: bool,
    /// Where requests and tokenizer calls may go.
    pub allow: crate::allow::Allowlist,
    pub profiles: Vec<CompiledProfile>,
    /// The digest memo each profile's hashers keep.
    pub memo: Option<MemoSettings>,
}

impl Compiled {
    /// Parses, validates and compiles (see [`FilterConfig::from_json`]).
    pub fn from_json(input: &[u8], memo: Option<MemoSettings>) -> Result<Compiled, ConfigError> {
        Self::compile(FilterConfig::from_json(input)?, memo)
    }

    /// Compiles a validated configuration.
    pub fn compile(cfg: FilterConfig, memo: Option<MemoSettings>) -> Result<Compiled, ConfigError> {
        let allow = cfg
            .allowlist()
            .map_err(|(i, message)| ConfigError { field: format!("allowed_destinations[{i}]"), message })?;
        let mut profiles = Vec::with_capacity(cfg.profiles.len());
        for (i, p) in cfg.profiles.into_iter().enumerate() {
            let field = |name: &str| format!("profiles[{i}].{name}");
            let spec = p.default_spec();
            // The default hashing must be usable here (a profile's hasher is built from it).
            spec.hasher().map_err(|e| ConfigError { field: field("seed"), message: e.to_string() })?;
            let pins = HashPins {
                algo: p.hash_algo,
                seed: p.seed.clone(),
                block_size: p.block_size.map(|b| usize::try_from(b).unwrap_or(usize::MAX)),
                lookahead: p.lookahead_tokens.map(|l| usize::try_from(l).unwrap_or(usize::MAX)),
            };
            profiles.push(CompiledProfile {
                default_spec: spec,
                pins,
                catch_all: p.models.iter().any(|m| m == "*"),
                name: p.name,
                models: p.models,
                kv_events: p.kv_events,
                tokenizer: p.tokenizer,
                tokenizer_timeout_ms: p.tokenizer_timeout_ms,
                tokenizer_address: p.tokenizer_address,
                weights: p.weights.resolve(),
                lora_adapters: p.lora_adapters,
                approx_prefix_bytes: usize::try_from(p.approx_prefix_bytes).unwrap_or(usize::MAX),
            });
        }
        Ok(Compiled {
            agent_cluster: cfg.agent_cluster,
            tokenizer_cluster: cfg.tokenizer_cluster,
            agent_token: cfg.agent_token,
            feed_idle_timeout_ms: cfg.feed_idle_timeout_ms,
            loads_stale_ns: u64::from(cfg.loads_stale_ms).saturating_mul(1_000_000),
            index_stale_ns: u64::from(cfg.index_stale_ms).saturating_mul(1_000_000),
            destination_header: cfg.destination_header,
            max_body_bytes: usize::try_from(cfg.max_body_bytes).unwrap_or(usize::MAX),
            body_budget_bytes: usize::try_from(cfg.body_budget_bytes).unwrap_or(usize::MAX),
            max_cache_salt_bytes: usize::try_from(cfg.max_cache_salt_bytes).unwrap_or(usize::MAX),
            explain_header: cfg.explain_header,
            metrics: cfg.metrics,
            tokenizer_cache_bytes: usize::try_from(cfg.tokenizer_cache_bytes).unwrap_or(usize::MAX),
            tokenizer_cache_ttl_ns: u64::from(cfg.tokenizer_cache_ttl_ms).saturating_mul(1_000_000),
            route_on_earlier_turns: cfg.route_on_earlier_turns,
            route_on_shared_prefixes: cfg.route_on_shared_prefixes,
            tokens_from_answers: cfg.tokens_from_answers,
            allow,
            profiles,
            memo,
        })
    }

    /// The index of the profile serving `model`: one listing it by name first, then a `"*"` one.
    pub fn profile_for(&self, model: &str) -> Option<usize> {
        self.profiles
            .iter()
            .position(|p| p.models.iter().any(|m| m == model))
            .or_else(|| self.profiles.iter().position(|p| p.catch_all))
    }

    pub fn profile(&self, i: usize) -> Option<&CompiledProfile> {
        self.profiles.get(i)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::HashAlgo;

    #[test]
    fn profiles_compile_with_their_hashers_and_resolve_by_model() {
        let c = Compiled::from_json(
            br#"{"profiles":[
                {"name":"a","models":["m1"],"hash_algo":"sha256","seed":"0","block_size":32},
                {"name":"any","models":["*"]}]}"#,
            Some(MemoSettings { slots: 64, key: 7 }),
        )
        .unwrap();
        assert_eq!(c.profile_for("m1"), Some(0));
        assert_eq!(c.profile_for("other"), Some(1));
        let a = c.profile(0).unwrap();
        assert_eq!((a.default_spec.algo, a.default_spec.block_size), (HashAlgo::Sha256, 32));
        assert!(a.default_spec.hasher().is_ok());
        let any = c.profile(1).unwrap();
        assert_eq!((any.default_spec.algo, any.default_spec.block_size), (HashAlgo::Sha256Cbor, 16));
        assert_eq!(c.tokenizer_cache_ttl_ns, 60_000_000_000);
        assert_eq!(c.max_body_bytes, 32 << 20);
        assert_eq!(c.body_budget_bytes, 128 << 20);
        let only = Compiled::from_json(br#"{"profiles":[{"name":"a","models":["m1"]}]}"#, None).unwrap();
        assert_eq!(only.profile_for("m2"), None);
    }

    #[test]
    fn rates_forget_ms_sets_how_long_quiet_rates_are_kept() {
        let c = Compiled::from_json(
            br#"{"profiles":[
                {"name":"a","models":["m1"],"weights":{"rates_forget_ms":500}},
                {"name":"b","models":["m2"],"weights":{"rates_forget_ms":0}},
                {"name":"c","models":["*"]}]}"#,
            None,
        )
        .unwrap();
        let forget = |i| c.profile(i).unwrap().weights.ttft.learning.forget_ns;
        assert_eq!((forget(0), forget(1), forget(2)), (500_000_000, 0, crate::policy::rates::FORGET_NS));
        let e = Compiled::from_json(br#"{"profiles":[{"name":"a","weights":{"rates_forget_ms":-1}}]}"#, None)
            .err()
            .unwrap();
        assert!(e.field.contains("rates_forget_ms") || e.message.contains("rates_forget_ms"), "{e:?}");
    }

    #[test]
    fn a_profile_the_hasher_refuses_is_a_config_error_naming_the_field() {
        let e = Compiled::from_json(br#"{"profiles":[{"name":"a","models":["m"],"hash_algo":"xxhash"}]}"#, None)
            .err()
            .unwrap();
        assert_eq!(e.field, "profiles[0].seed");
    }
}
