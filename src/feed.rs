//! The VM's subscription to the agent's feed: a gRPC server stream
//! (`llmgw.feed.v1.Feed/Subscribe`) opened from the root context's tick, decoded with prost
//! and applied to the VM's `FeedState`. On close it reconnects with exponential backoff; a
//! new subscription resyncs from the agent's snapshot while the previous index keeps serving.

use crate::{now_ns, Shared};
use llmgw_core::feed::{FeedError, FeedMessage, FeedState, SubscribeRequest};
use prost::Message;
use proxy_wasm::hostcalls;
use proxy_wasm::types::BufferType;
use std::cell::RefCell;
use std::rc::Rc;

pub const TICK_MS: u64 = 200;
const BACKOFF_MIN_MS: u64 = 250;
const BACKOFF_MAX_MS: u64 = 5_000;
const MS: u64 = 1_000_000;

#[derive(Debug, Default)]
pub struct FeedClient {
    stream: Option<u32>,
    /// No message received yet on the current stream.
    fresh: bool,
    connected: bool,
    backoff_ms: u64,
    next_attempt_ns: u64,
    /// When the current stream last showed life (opened or delivered a message).
    last_activity_ns: u64,
}

impl FeedClient {
    /// Drops the current stream (e.g. the agent cluster changed); the next tick reconnects.
    pub fn reset(&mut self) {
        if let Some(t) = self.stream.take() {
            let _ = hostcalls::cancel_grpc_stream(t);
        }
        self.connected = false;
        self.next_attempt_ns = 0;
    }

    fn schedule_retry(&mut self) {
        self.backoff_ms = self.backoff_ms.saturating_mul(2).clamp(BACKOFF_MIN_MS, BACKOFF_MAX_MS);
        self.next_attempt_ns = now_ns().saturating_add(self.backoff_ms.saturating_mul(MS));
    }

    pub fn on_tick(&mut self, shared: &Rc<RefCell<Shared>>, vm_tag: &str) {
        let Ok(s) = shared.try_borrow() else { return };
        let bytes = u64::try_from(s.feed.index.memory_bytes()).unwrap_or(u64::MAX);
        s.metrics.feed_state(self.connected, s.feed.index.entries(), bytes);
        let now = now_ns();
        let idle_ns = u64::from(s.config.feed_idle_timeout_ms).saturating_mul(MS);
        if self.stream.is_some() && now.saturating_sub(self.last_activity_ns) > idle_ns {
            log::warn!("llmgw: feed silent for {} ms: reconnecting", s.config.feed_idle_timeout_ms);
            if self.connected {
                s.metrics.feed_disconnect();
            }
            self.reset();
            self.schedule_retry();
            return;
        }
        if self.stream.is_some() || now < self.next_attempt_ns {
            return;
        }
        let cluster = s.config.agent_cluster.clone();
        let agent_token = s.config.agent_token.clone();
        drop(s);
        match hostcalls::open_grpc_stream(&cluster, "llmgw.feed.v1.Feed", "Subscribe", Vec::new()) {
            Ok(token) => {
                let req = SubscribeRequest { subscriber: format!("llmgw-vm-{vm_tag}"), token: agent_token };
                // Half-close after the request: a server-streaming call has exactly one request
                // message, and servers (tonic among them) wait for the end of it before replying.
                if hostcalls::send_grpc_stream_message(token, Some(&req.encode_to_vec()), true).is_err() {
                    let _ = hostcalls::cancel_grpc_stream(token);
                    self.schedule_retry();
                    return;
                }
                self.stream = Some(token);
                self.fresh = true;
                self.last_activity_ns = now;
            }
            Err(e) => {
                log::warn!("llmgw: cannot open the feed stream to cluster `{cluster}`: {e:?}");
                self.schedule_retry();
            }
        }
    }

    pub fn on_message(&mut self, token: u32, size: usize, shared: &Rc<RefCell<Shared>>) {
        if self.stream != Some(token) {
            return;
        }
        self.last_activity_ns = now_ns();
        let Ok(mut s) = shared.try_borrow_mut() else { return };
        let body = hostcalls::get_buffer(BufferType::GrpcReceiveBuffer, 0, size).ok().flatten().unwrap_or_default();
        let msg = match FeedMessage::decode(body.as_slice()) {
            Ok(m) => m,
            Err(e) => {
                log::warn!("llmgw: undecodable feed message: {e}");
                s.metrics.feed_message(true);
                return;
            }
        };
        if self.fresh {
            // A new subscription: the agent starts over with its table and snapshot. A VM that
            // had a complete index keeps serving it until the new snapshot is complete.
            self.fresh = false;
            self.connected = true;
            self.backoff_ms = 0;
            if s.feed.synced {
                s.resync = Some(FeedState::default());
            } else {
                s.resync = None;
                s.feed = FeedState::default();
            }
            s.metrics.feed_connect();
            log::info!("llmgw: feed connected");
        }
        let shared_state = &mut *s;
        let serving_synced = shared_state.feed.synced;
        let target = match shared_state.resync.as_mut() {
            Some(r) => r,
            None => &mut shared_state.feed,
        };
        match target.apply(&msg) {
            Ok(()) => {
                s.metrics.feed_message(false);
                if s.resync.as_ref().is_some_and(|r| r.synced) {
                    if let Some(r) = s.resync.take() {
                        s.feed = r;
                    }
                }
            }
            Err(FeedError::Gap { expected, got }) => {
                log::warn!("llmgw: feed gap (expected {expected}, got {got}): resubscribing");
                // The serving index misses a few changes but stays more useful than none.
                if s.resync.take().is_none() {
                    s.feed.synced = serving_synced;
                }
                s.metrics.feed_message(true);
                drop(s);
                self.reset();
            }
            Err(e) => {
                log::warn!("llmgw: feed message not applied: {e}");
                s.metrics.feed_message(true);
            }
        }
    }

    pub fn on_close(&mut self, token: u32, status: u32, shared: &Rc<RefCell<Shared>>) {
        if self.stream != Some(token) {
            return;
        }
        self.stream = None;
        if self.connected {
            if let Ok(s) = shared.try_borrow() {
                s.metrics.feed_disconnect();
            }
        }
        self.connected = false;
        log::info!("llmgw: feed stream closed (grpc status {status}); reconnecting with backoff");
        self.schedule_retry();
    }
}
