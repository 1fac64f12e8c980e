//! llmgw.wasm: the Envoy (proxy-wasm) filter that routes each OpenAI-style request to the vLLM
//! replica holding the longest cached prefix of its prompt.
//!
//! Per VM (Envoy runs one per worker plus two on the main thread, and configures each):
//! * the root context ([`Root`]) validates the configuration, keeps the VM's state and
//!   subscribes to the agent's feed ([`feed`]), reconnecting with backoff;
//! * each request ([`http::Request`]) buffers the body, calls the tokenizer on a replica,
//!   hashes the token blocks, scores the replicas and sets the destination header.
//!
//! All decisions live in `llmgw-core`; this crate is glue. Nothing here may panic: host calls
//! are made through `proxy_wasm::hostcalls` and their errors handled.

mod feed;
mod http;
mod inflight;
mod metrics;

use llmgw_core::config::FilterConfig;
use llmgw_core::feed::FeedState;
use llmgw_core::hash::{BlockHash, BlockHasher, HashAlgo};
use llmgw_core::index::Scores;
use llmgw_core::tokcache::TokenCache;
use metrics::Metrics;
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{BufferType, ContextType, LogLevel};
use std::cell::RefCell;
use std::rc::Rc;
use std::time::{Duration, UNIX_EPOCH};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root::new()) });
}}

/// Nanoseconds since the epoch from the host clock (0 if unavailable).
pub(crate) fn now_ns() -> u64 {
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// Reusable buffers for one request's hashing and scoring.
#[derive(Default)]
pub(crate) struct Scratch {
    pub hashes: Vec<BlockHash>,
    pub keys: Vec<u64>,
    pub scores: Scores,
    /// One hashing batch's scores (see `http::Request::exact_scores`).
    pub batch: Scores,
}

/// Everything a VM's requests share: configuration, hashers, the feed's index, metrics.
pub(crate) struct Shared {
    pub config: Rc<FilterConfig>,
    /// One hasher per profile (same order as `config.profiles`).
    pub hashers: Vec<Option<BlockHasher>>,
    /// The state requests are served from.
    pub feed: FeedState,
    /// A new subscription's state while it receives its snapshot; replaces `feed` once complete,
    /// so the previous index keeps serving during the resync (memory doubles meanwhile).
    pub resync: Option<FeedState>,
    pub metrics: Metrics,
    /// Recent tokenizations: a prompt sent again skips the tokenizer call.
    pub tokcache: TokenCache,
    pub scratch: Scratch,
    /// This VM's tag (metrics, explain header).
    pub vm_tag: String,
}

impl Shared {
    pub fn index_usable(&self) -> bool {
        self.feed.synced
    }
}

/// Block digests each profile's hasher remembers (56 bytes each, about 460 KB per profile and
/// VM): 131,072 tokens of recent prompts at block size 16. A prefix seen again (a shared
/// system prompt, a conversation's history) skips its sha256s.
const DIGEST_MEMO_SLOTS: usize = 8192;

fn hashers(cfg: &FilterConfig) -> Vec<Option<BlockHasher>> {
    use std::hash::BuildHasher;
    // A secret key per VM for the memo's tags (clients choose the tokens).
    let key = std::collections::hash_map::RandomState::new().hash_one(0x6d65_6d6f_u64);
    cfg.profiles
        .iter()
        .map(|p| {
            HashAlgo::parse(&p.hash_algo)
                .ok()
                .and_then(|a| BlockHasher::new(a, p.seed.as_deref()).ok())
                .map(|h| h.with_cache(DIGEST_MEMO_SLOTS, key))
        })
        .collect()
}

fn token_cache(cfg: &FilterConfig) -> TokenCache {
    use std::hash::BuildHasher;
    // Secret per VM: clients choose the bodies the tags are taken over.
    let key = std::collections::hash_map::RandomState::new().hash_one(0x746f_6b73_u64);
    let budget = usize::try_from(cfg.tokenizer_cache_bytes).unwrap_or(usize::MAX);
    TokenCache::new(budget, u64::from(cfg.tokenizer_cache_ttl_ms).saturating_mul(1_000_000), key)
}

/// A short random tag naming this VM in per-VM gauges (there is no worker-index API).
fn vm_tag() -> String {
    use std::hash::BuildHasher;
    let v = std::collections::hash_map::RandomState::new().hash_one(0x6c6c_6d67_u64);
    format!("{:08x}", v & 0xffff_ffff)
}

pub(crate) struct Root {
    raw_config: Option<Vec<u8>>,
    shared: Option<Rc<RefCell<Shared>>>,
    vm_tag: String,
    feed: feed::FeedClient,
}

impl Root {
    fn new() -> Root {
        Root { raw_config: None, shared: None, vm_tag: vm_tag(), feed: feed::FeedClient::default() }
    }
}

impl Context for Root {
    fn on_grpc_stream_message(&mut self, token_id: u32, message_size: usize) {
        if let Some(shared) = &self.shared {
            self.feed.on_message(token_id, message_size, shared);
        }
    }

    fn on_grpc_stream_close(&mut self, token_id: u32, status_code: u32) {
        if let Some(shared) = &self.shared {
            self.feed.on_close(token_id, status_code, shared);
        }
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        let raw =
            hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX).ok().flatten().unwrap_or_default();
        // Envoy configures every VM (and may configure one again): the same configuration
        // changes nothing, so state is built once.
        if self.shared.is_some() && self.raw_config.as_deref() == Some(raw.as_slice()) {
            return true;
        }
        let cfg = match FilterConfig::from_json(&raw) {
            Ok(cfg) => cfg,
            Err(e) => {
                log::error!("{e}");
                return false;
            }
        };
        log::info!("llmgw: configured {} profile(s), vm {}", cfg.profiles.len(), self.vm_tag);
        let cfg = Rc::new(cfg);
        match &self.shared {
            Some(shared) => {
                let mut s = shared.borrow_mut();
                if s.config.agent_cluster != cfg.agent_cluster {
                    self.feed.reset();
                }
                s.hashers = hashers(&cfg);
                // Profiles may have changed what a tokenization means: start afresh.
                s.tokcache = token_cache(&cfg);
                s.config = cfg;
            }
            None => {
                self.shared = Some(Rc::new(RefCell::new(Shared {
                    hashers: hashers(&cfg),
                    metrics: Metrics::define(cfg.metrics, &self.vm_tag),
                    tokcache: token_cache(&cfg),
                    config: cfg,
                    feed: FeedState::default(),
                    resync: None,
                    scratch: Scratch::default(),
                    vm_tag: self.vm_tag.clone(),
                })));
            }
        }
        self.raw_config = Some(raw);
        // The feed is opened from the first tick: the main thread's base VM gets no ticks,
        // and `envoy --mode validate` opens no connections.
        let _ = hostcalls::set_tick_period(Duration::from_millis(feed::TICK_MS));
        true
    }

    fn on_tick(&mut self) {
        if let Some(shared) = &self.shared {
            self.feed.on_tick(shared, &self.vm_tag);
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(http::Request::new(context_id, self.shared.clone())))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
