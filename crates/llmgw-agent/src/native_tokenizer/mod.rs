//! The native tokenizer beside Envoy: each configured model's tokenizer loaded at start (a
//! model that cannot be served exactly is refused with its reason, and its requests are
//! declined so the filter asks a replica), `/tokenize` answered natively ([`server`]), and the
//! answers checked against the replicas ([`verify`]): one difference switches the model off.

pub mod server;
pub mod verify;

use crate::config::TokenizerConfig;
use llmgw_tokenize::conversation::ContentFormat;
use llmgw_tokenize::{ModelOptions, ModelTokenizer};
use std::collections::HashMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;
use tracing::{error, info};

/// Counters of one model (monotonic).
#[derive(Debug, Default)]
pub struct ModelCounters {
    pub answered: AtomicU64,
    pub answered_tokens: AtomicU64,
    /// Declined: the request needs a replica (media, a per-request template) or was refused.
    pub declined: AtomicU64,
    /// Declined because the model is switched off after a mismatch.
    pub disabled: AtomicU64,
    pub verified: AtomicU64,
    pub mismatches: AtomicU64,
    /// Checks not made: too many in flight.
    pub verify_skipped: AtomicU64,
    /// Checks whose replica call failed or answered an error.
    pub verify_errors: AtomicU64,
    /// Microseconds spent tokenizing (sum), for the mean.
    pub busy_us: AtomicU64,
}

/// One configured model: loaded or refused, and whether it is still trusted.
pub struct NativeModel {
    /// The first configured name (metrics label).
    pub label: String,
    pub tokenizer: Result<Arc<ModelTokenizer>, String>,
    /// Set on the first difference from a replica: from then on every request is declined.
    pub disabled: AtomicBool,
    pub counters: ModelCounters,
}

/// All configured models, by every name requests may give.
pub struct NativeTokenizers {
    pub models: Vec<Arc<NativeModel>>,
    by_name: HashMap<String, usize>,
    pub config: TokenizerConfig,
}

impl NativeTokenizers {
    /// Loads every configured model, logging one line each (loaded with its size and load
    /// time, or refused with why).
    pub fn load(config: &TokenizerConfig) -> NativeTokenizers {
        let mut models = Vec::new();
        let mut by_name = HashMap::new();
        for (i, m) in config.models.iter().enumerate() {
            let label = m.names.first().cloned().unwrap_or_default();
            let opts = ModelOptions {
                cache_bytes: config.cache_bytes,
                content_format: match m.content_format.as_str() {
                    "string" => Some(ContentFormat::String),
                    "openai" => Some(ContentFormat::OpenAi),
                    _ => None,
                },
                default_template_kwargs: m.default_chat_template_kwargs.clone(),
                trust_unverified_class: m.trust_unverified_class,
            };
            let started = Instant::now();
            let tokenizer = ModelTokenizer::load(&m.dir, &opts).map(Arc::new).map_err(|e| e.to_string());
            match &tokenizer {
                Ok(t) => info!(
                    model = %label,
                    dir = %m.dir.display(),
                    tokenizer_json_bytes = t.file_bytes,
                    chat_template = t.has_chat_template(),
                    cache_bytes = config.cache_bytes,
                    load_ms = started.elapsed().as_millis() as u64,
                    "native tokenizer loaded"
                ),
                Err(e) => {
                    error!(model = %label, dir = %m.dir.display(), error = %e, "native tokenizer refused this model; its requests go to the replicas")
                }
            }
            for n in &m.names {
                by_name.insert(n.clone(), i);
            }
            models.push(Arc::new(NativeModel {
                label,
                tokenizer,
                disabled: AtomicBool::new(false),
                counters: ModelCounters::default(),
            }));
        }
        NativeTokenizers { models, by_name, config: config.clone() }
    }

    /// Every name a model is served under.
    pub fn names_of(&self, model: &NativeModel) -> Vec<String> {
        self.by_name
            .iter()
            .filter(|(_, &i)| self.models.get(i).is_some_and(|m| std::ptr::eq(m.as_ref(), model)))
            .map(|(n, _)| n.clone())
            .collect()
    }

    /// The model a request names; with no name, the only model if there is one.
    pub fn model(&self, name: Option<&str>) -> Option<&Arc<NativeModel>> {
        match name {
            Some(n) => self.by_name.get(n).and_then(|&i| self.models.get(i)),
            None if self.models.len() == 1 => self.models.first(),
            None => None,
        }
    }

    /// The Prometheus text of the native tokenizer's metrics.
    pub fn metrics_text(&self) -> String {
        let mut out = String::new();
        let mut family = |name: &str, kind: &str, help: &str, value: &dyn Fn(&NativeModel) -> u64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
            for m in &self.models {
                let _ = writeln!(out, "{name}{{model=\"{}\"}} {}", escape(&m.label), value(m));
            }
        };
        let c = |f: fn(&ModelCounters) -> &AtomicU64| move |m: &NativeModel| f(&m.counters).load(Ordering::Relaxed);
        let cache = |f: fn(&llmgw_tokenize::piece_cache::CacheCounters) -> &AtomicU64| {
            move |m: &NativeModel| {
                m.tokenizer.as_ref().map_or(0, |t| f(&t.encoder.cache.counters).load(Ordering::Relaxed))
            }
        };
        family(
            "llmgw_native_tokenizer_up",
            "gauge",
            "1 while the model is loaded and trusted; 0 when refused at load or switched off after a mismatch",
            &|m| u64::from(m.tokenizer.is_ok() && !m.disabled.load(Ordering::Relaxed)),
        );
        family("llmgw_native_tokenizer_answered_total", "counter", "Requests answered natively", &c(|c| &c.answered));
        family(
            "llmgw_native_tokenizer_answered_tokens_total",
            "counter",
            "Tokens in native answers",
            &c(|c| &c.answered_tokens),
        );
        family(
            "llmgw_native_tokenizer_busy_microseconds_total",
            "counter",
            "Time spent tokenizing natively",
            &c(|c| &c.busy_us),
        );
        family(
            "llmgw_native_tokenizer_declined_total",
            "counter",
            "Requests declined to the replicas (media, a request's own template, a refused model, an error)",
            &c(|c| &c.declined),
        );
        family(
            "llmgw_native_tokenizer_disabled_total",
            "counter",
            "Requests declined because the model was switched off after a mismatch",
            &c(|c| &c.disabled),
        );
        family(
            "llmgw_native_tokenizer_verified_total",
            "counter",
            "Native answers checked against a replica's answer to the same request",
            &c(|c| &c.verified),
        );
        family(
            "llmgw_native_tokenizer_mismatches_total",
            "counter",
            "Checks whose tokens differed from the replica's (the model is switched off at the first)",
            &c(|c| &c.mismatches),
        );
        family(
            "llmgw_native_tokenizer_verify_skipped_total",
            "counter",
            "Checks skipped: too many in flight",
            &c(|c| &c.verify_skipped),
        );
        family(
            "llmgw_native_tokenizer_verify_errors_total",
            "counter",
            "Checks whose replica call failed or answered an error",
            &c(|c| &c.verify_errors),
        );
        family(
            "llmgw_native_tokenizer_cache_hits_total",
            "counter",
            "Prompt pieces found in the piece cache",
            &cache(|c| &c.hits),
        );
        family(
            "llmgw_native_tokenizer_cache_misses_total",
            "counter",
            "Prompt pieces tokenized (not in the piece cache)",
            &cache(|c| &c.misses),
        );
        family(
            "llmgw_native_tokenizer_cache_hit_tokens_total",
            "counter",
            "Tokens taken from the piece cache",
            &cache(|c| &c.hit_tokens),
        );
        family(
            "llmgw_native_tokenizer_cache_miss_tokens_total",
            "counter",
            "Tokens the tokenizer model produced",
            &cache(|c| &c.miss_tokens),
        );
        family(
            "llmgw_native_tokenizer_cache_evictions_total",
            "counter",
            "Pieces evicted from the piece cache",
            &cache(|c| &c.evictions),
        );
        family(
            "llmgw_native_tokenizer_cache_too_large_total",
            "counter",
            "Pieces not cached: one alone over an eighth of the budget",
            &cache(|c| &c.too_large),
        );
        family(
            "llmgw_native_tokenizer_cache_bytes",
            "gauge",
            "Bytes held by the piece cache (bounded by tokenizer.cache_bytes)",
            &|m| m.tokenizer.as_ref().map_or(0, |t| t.encoder.cache.usage().0 as u64),
        );
        out
    }
}

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_manual_lists_every_native_tokenizer_metric() {
        let manual = include_str!("../../../../docs/src/operations.md");
        let start = manual.find("### The native tokenizer (agent metrics)").expect("the native tokenizer's section");
        let section = &manual[start..];
        let section = &section[..section.find("\n## ").unwrap_or(section.len())];
        let cfg = crate::config::Config::parse("[tokenizer]\n").unwrap();
        let native = NativeTokenizers::load(cfg.tokenizer.as_ref().unwrap());
        let text = native.metrics_text();
        let names: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("# TYPE ")).collect();
        assert!(names.len() > 10, "{names:?}");
        for line in names {
            let name = line.split(' ').next().unwrap();
            let short = name.trim_start_matches("llmgw_native_tokenizer");
            assert!(
                section.contains(&format!("`{name}`")) || section.contains(&format!("`{short}`")),
                "{name} is not in docs/src/operations.md"
            );
        }
    }
}
