//! The VM's subscription to the agent's feed: a gRPC server stream
//! (`llmgw.feed.v1.Feed/Subscribe`) opened from the root context's tick, decoded with prost
//! and applied to the router's [`FeedView`](llmgw_core::feed::FeedView). On close it reconnects
//! with exponential backoff; a new subscription resyncs from the agent's snapshot while the
//! previous index keeps serving (the view's swap).

use crate::Shared;
use llmgw_core::feed::{Applied, FeedError, FeedMessage, SubscribeRequest};
use prost::Message;

use crate::host::Buffer;

pub const TICK_MS: u64 = 200;
const BACKOFF_MIN_MS: u64 = 250;
/// The longest wait between attempts: a restarted agent is subscribed to within about half a
/// second, whatever its outage lasted (at 5 s, a 3 s outage left the VMs without the agent's
/// index for a second after its return). An attempt costs one loopback or pod-local connect.
const BACKOFF_MAX_MS: u64 = 500;
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
    /// When the agent last said anything (any stream), and last reported loads.
    last_message_ns: Option<u64>,
    last_load_ns: Option<u64>,
    /// Staleness as last logged.
    stale_logged: (bool, bool),
}

impl FeedClient {
    /// Drops the current stream (e.g. the agent cluster changed); the next tick reconnects.
    pub fn reset(&mut self, s: &Shared) {
        if let Some(t) = self.stream.take() {
            s.host.cancel_grpc_stream(t);
        }
        self.connected = false;
        self.next_attempt_ns = 0;
    }

    fn schedule_retry(&mut self, now_ns: u64) {
        self.backoff_ms = self.backoff_ms.saturating_mul(2).clamp(BACKOFF_MIN_MS, BACKOFF_MAX_MS);
        self.next_attempt_ns = now_ns.saturating_add(self.backoff_ms.saturating_mul(MS));
    }

    /// Marks the serving index and loads stale when the agent has been silent too long.
    fn check_staleness(&mut self, s: &mut Shared, now: u64) {
        let cfg = s.router.config();
        let older = |at: Option<u64>, limit: u64| at.is_some_and(|t| now.saturating_sub(t) > limit);
        let index = older(self.last_message_ns, cfg.index_stale_ns);
        let loads = older(self.last_load_ns, cfg.loads_stale_ns);
        if (index, loads) != self.stale_logged {
            if index && !self.stale_logged.0 {
                log::warn!("llmgw: no word from the agent for index_stale_ms: the index is no longer credited");
            }
            if loads && !self.stale_logged.1 {
                log::warn!("llmgw: no load report for loads_stale_ms: replicas weighed by in-flight counts only");
            }
            self.stale_logged = (index, loads);
        }
        s.router.feed.set_staleness(index, loads);
    }

    pub fn on_tick(&mut self, s: &mut Shared) {
        let now = s.host.now_ns();
        self.check_staleness(s, now);
        s.metrics.shared_prefixes_evicted(s.router.take_shared_prefixes_evicted());
        s.metrics.earlier_prompts_evicted(s.router.take_earlier_prompts_evicted());
        s.metrics.wait_families_evicted(s.router.take_wait_families_evicted());
        let feed = s.router.feed.serving();
        let bytes = u64::try_from(feed.index.memory_bytes()).unwrap_or(u64::MAX);
        let refused = u64::try_from(feed.refused().len()).unwrap_or(u64::MAX);
        s.metrics.feed_state(self.connected, feed.index.entries(), bytes, refused);
        let learned = crate::rates::Learned::read(s.host.as_ref());
        for r in &feed.replicas {
            if let Some(rates) = learned.of(&r.address) {
                s.metrics.learned_rates(&r.address, &rates);
            }
        }
        let cfg = s.router.config();
        let idle_ns = u64::from(cfg.feed_idle_timeout_ms).saturating_mul(MS);
        if self.stream.is_some() && now.saturating_sub(self.last_activity_ns) > idle_ns {
            log::warn!("llmgw: feed silent for {} ms: reconnecting", cfg.feed_idle_timeout_ms);
            if self.connected {
                s.metrics.feed_disconnect();
            }
            self.reset(s);
            self.schedule_retry(now);
            return;
        }
        if self.stream.is_some() || now < self.next_attempt_ns {
            return;
        }
        let cluster = cfg.agent_cluster.as_str();
        match s.host.open_grpc_stream(cluster, "llmgw.feed.v1.Feed", "Subscribe") {
            Ok(token) => {
                let req = SubscribeRequest {
                    subscriber: format!("llmgw-vm-{}", s.vm_tag),
                    token: cfg.agent_token.clone(),
                    batches: true,
                };
                // Half-close after the request: a server-streaming call has exactly one request
                // message, and servers (tonic among them) wait for the end of it before replying.
                if s.host.send_grpc_stream_message(token, &req.encode_to_vec(), true).is_err() {
                    s.host.cancel_grpc_stream(token);
                    self.schedule_retry(now);
                    return;
                }
                self.stream = Some(token);
                self.fresh = true;
                self.last_activity_ns = now;
            }
            Err(e) => {
                log::warn!("llmgw: cannot open the feed stream to cluster `{cluster}`: {e:?}");
                self.schedule_retry(now);
            }
        }
    }

    pub fn on_message(&mut self, token: u32, size: usize, s: &mut Shared) {
        if self.stream != Some(token) {
            return;
        }
        let now = s.host.now_ns();
        self.last_activity_ns = now;
        let body = s.host.buffer(Buffer::GrpcReceive, size);
        let msg = match FeedMessage::decode(body.as_slice()) {
            Ok(m) => m,
            Err(e) => {
                log::warn!("llmgw: undecodable feed message: {e}");
                s.metrics.feed_message(true);
                return;
            }
        };
        if self.fresh {
            self.fresh = false;
            self.connected = true;
            self.backoff_ms = 0;
            s.router.feed.begin_subscription();
            s.metrics.feed_connect();
            log::info!("llmgw: feed connected");
        }
        self.last_message_ns = Some(now);
        if matches!(msg.body, Some(llmgw_core::feed::Body::Load(_))) {
            self.last_load_ns = Some(now);
        }
        let applied = s.router.apply_feed(&msg, now);
        if applied.is_ok() && matches!(msg.body, Some(llmgw_core::feed::Body::Load(_))) {
            // This Envoy's requests on each replica as the report came: what the engine reports
            // beyond them is other requests' (`llmgw_core::policy::capacity`).
            let counts = crate::inflight::Counts::read(s.host.as_ref());
            s.router.feed.note_gateway_share(&|address| {
                let (requests, _) = counts.of(address);
                llmgw_core::fleet::GatewayShare { requests, blocks: counts.blocks(address) }
            });
        }
        if let Some(llmgw_core::feed::Body::Replicas(table)) = &msg.body {
            log_refused(s);
            if applied.is_ok() {
                crate::warm_view::remember_table(s.host.as_ref(), &s.router.config().agent_cluster, table);
            }
        }
        match applied {
            Ok(Applied::Applied) => s.metrics.feed_message(false),
            Ok(Applied::Swapped) => {
                s.metrics.feed_message(false);
                s.metrics.feed_snapshot_applied();
                log::info!("llmgw: resynced index now serving");
            }
            Err(FeedError::Gap { expected, got }) => {
                log::warn!("llmgw: feed gap (expected {expected}, got {got}): resubscribing");
                s.metrics.feed_message(true);
                self.reset(s);
            }
            Err(e) => {
                log::warn!("llmgw: feed message not applied: {e}");
                s.metrics.feed_message(true);
            }
        }
    }

    pub fn on_close(&mut self, token: u32, status: u32, s: &Shared) {
        if self.stream != Some(token) {
            return;
        }
        self.stream = None;
        if self.connected {
            s.metrics.feed_disconnect();
        }
        self.connected = false;
        log::info!("llmgw: feed stream closed (grpc status {status}); reconnecting with backoff");
        self.schedule_retry(s.host.now_ns());
    }
}

/// A table naming destinations outside the allowlist: said once per table (at most a few
/// addresses, each cut short: the agent chose them).
fn log_refused(s: &Shared) {
    let view = &s.router.feed;
    let state = view.resyncing_state().unwrap_or_else(|| view.serving());
    let refused = state.refused();
    if refused.is_empty() {
        return;
    }
    let names: Vec<String> = state
        .replicas
        .iter()
        .filter(|r| refused.contains(&u32::from(r.id)))
        .take(4)
        .map(|r| r.address.chars().take(64).collect())
        .collect();
    log::warn!(
        "llmgw: {} replica(s) of the feed's table are outside allowed_destinations and will not be routed to: {}",
        refused.len(),
        names.join(", ")
    );
}
