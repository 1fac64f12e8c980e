//! llmgw.wasm: the Envoy (proxy-wasm) filter that routes each OpenAI-style request to the vLLM
//! replica holding the longest cached prefix of its prompt.
//!
//! Per VM (Envoy runs one per worker plus two on the main thread, and configures each):
//! * the root context ([`Root`]) compiles the configuration, keeps the VM's router and
//!   subscribes to the agent's feed ([`feed`]), reconnecting with backoff;
//! * each request ([`http::Request`]) buffers the body, hands it to the core's router and acts
//!   on the step it returns: set the destination header, answer 503, or call the tokenizer on
//!   a replica and hand its reply back.
//!
//! All decisions live in `llmgw-core` (`flow`); this crate is glue, and every host call goes
//! through [`host::Host`], so the glue is tested natively against a fake host. Nothing here may
//! panic.

mod body_budget;
mod decision_log;
mod earlier_prompts;
mod earlier_turns;
mod feed;
mod gateway_state;
mod health;
mod hold_times;
mod host;
mod http;
mod inflight;
mod metrics;
mod phases;
mod rates;
mod recent;
mod returns;
mod shared_records;
mod speculative;
mod tokenizer_times;
mod warm_view;

#[cfg(feature = "bench-internals")]
pub mod bench_support;
#[cfg(any(test, feature = "bench-internals"))]
#[allow(dead_code)]
mod fake;
#[cfg(test)]
mod tests;

use host::{Buffer, Host, ProxyWasm};
use llmgw_core::config::{Compiled, MemoSettings};
use llmgw_core::flow::Router;
use metrics::Metrics;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{ContextType, LogLevel};
use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root::new(Rc::new(ProxyWasm))) });
}}

/// Block digests each profile's hasher remembers (56 bytes each, about 460 KB per profile and
/// VM): 131,072 tokens of recent prompts at block size 16. A prefix seen again (a shared
/// system prompt, a conversation's history) skips its sha256s.
const DIGEST_MEMO_SLOTS: usize = 8192;

/// Everything a VM's requests share: the host, the router (configuration, feed view, caches)
/// and metrics.
pub(crate) struct Shared {
    pub host: Rc<dyn Host>,
    pub router: Router,
    pub metrics: Metrics,
    /// This VM's tag (metrics, explain header, feed subscriber name).
    pub vm_tag: String,
    /// This VM's id in the shared in-flight records.
    pub vm: inflight::VmId,
    /// The KV blocks this VM's requests in flight hold per replica.
    pub held: RefCell<llmgw_core::flow::HeldBlocks>,
}

/// A random value per VM (`RandomState` draws from the host's WASI random source).
fn random(salt: u64) -> u64 {
    use std::hash::BuildHasher;
    std::collections::hash_map::RandomState::new().hash_one(salt)
}

pub(crate) struct Root {
    host: Rc<dyn Host>,
    raw_config: Option<Vec<u8>>,
    shared: Option<Rc<RefCell<Shared>>>,
    vm_tag: String,
    /// Secret keys of the digest memo's and the tokenization cache's tags (clients choose the
    /// tokens and bodies they are taken over).
    memo_key: u64,
    tokcache_key: u64,
    feed: feed::FeedClient,
}

impl Root {
    pub(crate) fn new(host: Rc<dyn Host>) -> Root {
        Root {
            host,
            raw_config: None,
            shared: None,
            // A short tag naming this VM in per-VM gauges (there is no worker-index API).
            vm_tag: format!("{:08x}", random(0x6c6c_6d67) & 0xffff_ffff),
            memo_key: random(0x6d65_6d6f),
            tokcache_key: random(0x746f_6b73),
            feed: feed::FeedClient::default(),
        }
    }
}

impl Root {
    /// A request's context. (Native tests use it directly: a `dyn HttpContext` would bring in
    /// the SDK's default methods, which call the host's imports.)
    pub(crate) fn request(&self) -> http::Request {
        http::Request::new(self.host.clone(), self.shared.clone())
    }
}

impl Context for Root {
    fn on_grpc_stream_message(&mut self, token_id: u32, message_size: usize) {
        if let Some(Ok(mut s)) = self.shared.as_ref().map(|s| s.try_borrow_mut()) {
            self.feed.on_message(token_id, message_size, &mut s);
        }
    }

    fn on_grpc_stream_close(&mut self, token_id: u32, status_code: u32) {
        if let Some(Ok(s)) = self.shared.as_ref().map(|s| s.try_borrow()) {
            self.feed.on_close(token_id, status_code, &s);
        }
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        let raw = self.host.buffer(Buffer::PluginConfiguration, usize::MAX);
        // Envoy configures every VM (and may configure one again): the same configuration
        // changes nothing, so state is built once.
        if self.shared.is_some() && self.raw_config.as_deref() == Some(raw.as_slice()) {
            return true;
        }
        let memo = MemoSettings { slots: DIGEST_MEMO_SLOTS, key: self.memo_key };
        let compiled = match Compiled::from_json(&raw, Some(memo)) {
            Ok(c) => c,
            Err(e) => {
                log::error!("{e}");
                return false;
            }
        };
        log::info!("llmgw: configured {} profile(s), vm {}", compiled.profiles.len(), self.vm_tag);
        match &self.shared {
            Some(shared) => {
                let Ok(mut s) = shared.try_borrow_mut() else { return false };
                if s.router.config().agent_cluster != compiled.agent_cluster {
                    self.feed.reset(&s);
                }
                s.router.reconfigure(compiled);
            }
            None => {
                let metrics = Metrics::define(self.host.clone(), compiled.metrics, &self.vm_tag);
                let view = warm_view::initial_view(self.host.as_ref(), &compiled.agent_cluster);
                let mut router = Router::new(compiled, self.tokcache_key);
                // The filter's HTTP context outlives the routing: a tokenizer call can follow it,
                // and its tokens are kept for every VM under tags of one secret.
                router.set_background_calls(earlier_turns::shared_key(self.host.as_ref(), self.tokcache_key));
                if let Some(view) = view {
                    router.feed = view;
                    // Checked against this configuration's allowlist, not the one it came with.
                    let allow = router.config().allow.clone();
                    router.feed.set_allowlist(&allow);
                }
                let shared = Rc::new(RefCell::new(Shared {
                    host: self.host.clone(),
                    router,
                    metrics,
                    vm_tag: self.vm_tag.clone(),
                    vm: inflight::VmId(u32::from_str_radix(&self.vm_tag, 16).unwrap_or_default()),
                    held: RefCell::default(),
                }));
                warm_view::register_root(&shared);
                self.shared = Some(shared);
            }
        }
        self.raw_config = Some(raw);
        // The feed is opened from the first tick: the main thread's base VM gets no ticks,
        // and `envoy --mode validate` opens no connections.
        self.host.set_tick_period(Duration::from_millis(feed::TICK_MS));
        true
    }

    fn on_tick(&mut self) {
        if let Some(Ok(mut s)) = self.shared.as_ref().map(|s| s.try_borrow_mut()) {
            self.feed.on_tick(&mut s);
            if inflight::heartbeat(self.host.as_ref(), s.vm, self.host.now_ns()).is_none() {
                s.metrics.shared_update_failed([host::SharedKind::Heartbeat]);
            }
        }
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(self.request()))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
