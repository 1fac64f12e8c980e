//! The agent's shared state: one mirror per engine, the feed subscribers and the counters.
//!
//! Engine threads apply batches here; every net change is pushed, under the same lock, to each
//! subscriber's bounded queue with that subscription's next sequence number. A new subscriber,
//! or one whose queue overflowed, is marked `resync`: while marked it receives nothing, and its
//! stream task then builds the replica table and snapshot under the hub lock, so the snapshot
//! and the deltas that follow it are consistent.

use crate::config::EngineSpec;
use llmgw_core::event::EventBatch;
use llmgw_core::feed::{
    BlockDelta, Body, FeedMessage, LoadReport, Replica, ReplicaLoad, ReplicaReset, ReplicaTable, SnapshotChunk,
    SnapshotComplete,
};
use llmgw_core::mirror::{EngineMirror, NetChange};
use serde_json::{json, Value};
use std::collections::{BTreeMap, VecDeque};
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Instant;
use tokio::sync::Notify;

/// Largest number of blocks in one snapshot chunk.
pub const CHUNK_BLOCKS: usize = 65_536;

/// Per-engine counters.
#[derive(Debug, Default, Clone)]
pub struct EngineCounters {
    /// Live batches received from the SUB socket.
    pub received: u64,
    /// Batches (live or replayed) applied to the mirror.
    pub applied: u64,
    /// Batches not applied, by reason.
    pub skipped: BTreeMap<&'static str, u64>,
    pub gaps: u64,
    pub replays_complete: u64,
    pub replays_incomplete: u64,
    pub replayed_batches: u64,
    pub resets: BTreeMap<String, u64>,
    pub disconnects: u64,
    pub connects: u64,
    pub block_limit_hits: u64,
}

/// Who judges a replica's health.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Health {
    /// Its HTTP /metrics answers.
    Http,
    /// Its event publisher is connected.
    Publisher,
}

pub struct EngineState {
    pub spec: EngineSpec,
    pub mirror: EngineMirror,
    /// Up = reachable over HTTP and the publisher connected (each within its grace period).
    pub up: bool,
    pub http_ok: bool,
    pub publisher_ok: bool,
    pub connected: bool,
    pub last_seq: Option<u64>,
    pub last_event: Option<Instant>,
    pub load: Option<ReplicaLoad>,
    pub counters: EngineCounters,
    pub parity_warned: bool,
    /// Removed by discovery: no longer in the table; its id is never reused.
    pub gone: bool,
    /// Tells the engine's thread to stop (discovery removed it).
    pub stop: Arc<AtomicBool>,
    /// Set when the engine thread must forget its sequence position and rebuild by replay.
    pub rebuild: Arc<AtomicBool>,
}

struct SubQueue {
    msgs: VecDeque<FeedMessage>,
    next_seq: u64,
    resync: bool,
    resyncs: u64,
}

/// One feed subscription.
pub struct Subscriber {
    pub name: String,
    queue: Mutex<SubQueue>,
    pub notify: Notify,
}

impl Subscriber {
    fn queue(&self) -> MutexGuard<'_, SubQueue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn push(q: &mut SubQueue, body: Body) {
        let seq = q.next_seq;
        q.next_seq = q.next_seq.saturating_add(1);
        q.msgs.push_back(FeedMessage { seq, body: Some(body) });
    }

    /// The next message for this subscription, building a fresh table and snapshot first if
    /// it is new or fell behind. `None` when nothing is queued (wait on `notify`).
    pub fn pop(&self, hub: &Hub) -> Option<FeedMessage> {
        {
            let mut q = self.queue();
            if !q.resync {
                return q.msgs.pop_front();
            }
        }
        let st = hub.state();
        let mut q = self.queue();
        if q.resync {
            q.msgs.clear();
            for body in st.snapshot_bodies() {
                Self::push(&mut q, body);
            }
            q.resync = false;
            q.resyncs = q.resyncs.saturating_add(1);
        }
        q.msgs.pop_front()
    }

    /// How many times this subscriber got a table and snapshot (1 = only the initial one).
    pub fn snapshots_sent(&self) -> u64 {
        self.queue().resyncs
    }
}

/// Counters not tied to one engine.
#[derive(Debug, Default, Clone)]
pub struct FeedCounters {
    pub subscriptions: u64,
    pub messages: u64,
    pub overflows: u64,
    pub rejected_token: u64,
}

pub struct HubState {
    pub engines: Vec<EngineState>,
    subscribers: Vec<Weak<Subscriber>>,
    pub max_queue: usize,
    pub max_blocks: usize,
    pub feed: FeedCounters,
    changes: Vec<NetChange>,
}

pub struct Hub {
    state: Mutex<HubState>,
    pub started: Instant,
}

impl Hub {
    pub fn new(specs: Vec<EngineSpec>, max_queue: usize, max_blocks: usize) -> Arc<Hub> {
        let engines = specs.into_iter().map(EngineState::new).collect();
        Arc::new(Hub {
            state: Mutex::new(HubState {
                engines,
                subscribers: Vec::new(),
                max_queue,
                max_blocks,
                feed: FeedCounters::default(),
                changes: Vec::new(),
            }),
            started: Instant::now(),
        })
    }
}

impl EngineState {
    fn new(spec: EngineSpec) -> EngineState {
        EngineState {
            mirror: EngineMirror::new(spec.hasher()),
            spec,
            up: true,
            http_ok: true,
            publisher_ok: true,
            connected: false,
            last_seq: None,
            last_event: None,
            load: None,
            counters: EngineCounters::default(),
            parity_warned: false,
            rebuild: Arc::new(AtomicBool::new(false)),
            gone: false,
            stop: Arc::new(AtomicBool::new(false)),
        }
    }
}

impl Hub {
    pub fn state(&self) -> MutexGuard<'_, HubState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers a subscriber; its first messages will be the table and a snapshot.
    pub fn subscribe(&self, name: String) -> Arc<Subscriber> {
        let sub = Arc::new(Subscriber {
            name,
            queue: Mutex::new(SubQueue { msgs: VecDeque::new(), next_seq: 0, resync: true, resyncs: 0 }),
            notify: Notify::new(),
        });
        let mut st = self.state();
        st.subscribers.retain(|w| w.strong_count() > 0);
        st.subscribers.push(Arc::downgrade(&sub));
        st.feed.subscriptions = st.feed.subscriptions.saturating_add(1);
        drop(st);
        sub.notify.notify_one();
        sub
    }

    pub fn engine_count(&self) -> usize {
        self.state().engines.len()
    }

    pub fn rebuild_flag(&self, engine: usize) -> Option<Arc<AtomicBool>> {
        self.state().engines.get(engine).map(|e| e.rebuild.clone())
    }
}

impl HubState {
    fn engine(&mut self, id: usize) -> Option<&mut EngineState> {
        self.engines.get_mut(id)
    }

    /// Engines currently configured or discovered (removed ones excluded).
    pub fn live(&self) -> impl Iterator<Item = &EngineState> {
        self.engines.iter().filter(|e| !e.gone)
    }

    /// Adds an engine (discovery); its id is the next free one. Returns its index.
    pub fn add_engine(&mut self, mut spec: EngineSpec) -> usize {
        let idx = self.engines.len();
        spec.id = u32::try_from(idx).unwrap_or(u32::MAX);
        self.engines.push(EngineState::new(spec));
        let table = self.table();
        self.publish(Body::Replicas(table));
        idx
    }

    /// Removes an engine (discovery): its blocks leave, it leaves the table, its thread stops.
    pub fn remove_engine(&mut self, idx: usize) {
        let Some(e) = self.engines.get(idx) else { return };
        if e.gone {
            return;
        }
        self.reset(idx, "removed");
        if let Some(e) = self.engine(idx) {
            e.gone = true;
            e.up = false;
            e.load = None;
            e.stop.store(true, Ordering::SeqCst);
        }
        let table = self.table();
        self.publish(Body::Replicas(table));
    }

    /// (name, messages queued, snapshots sent) of every live subscriber.
    pub fn subscriber_lags(&self) -> Vec<(String, usize, u64)> {
        self.subscribers
            .iter()
            .filter_map(Weak::upgrade)
            .map(|s| {
                let q = s.queue();
                (s.name.clone(), q.msgs.len(), q.resyncs)
            })
            .collect()
    }

    pub fn live_subscribers(&self) -> usize {
        self.subscribers.iter().filter(|w| w.strong_count() > 0).count()
    }

    /// Sends one message body to every subscriber that is in sync.
    pub fn publish(&mut self, body: Body) {
        let max = self.max_queue;
        let mut sent: u64 = 0;
        let mut overflows: u64 = 0;
        self.subscribers.retain(|w| {
            let Some(sub) = w.upgrade() else { return false };
            let mut q = sub.queue();
            if q.resync {
                return true;
            }
            if q.msgs.len() >= max {
                // Too far behind: drop the backlog; a fresh table and snapshot replace it,
                // numbered from the first dropped message so the subscriber sees no gap.
                if let Some(first) = q.msgs.front() {
                    q.next_seq = first.seq;
                }
                q.msgs.clear();
                q.resync = true;
                overflows = overflows.saturating_add(1);
            } else {
                Subscriber::push(&mut q, body.clone());
                sent = sent.saturating_add(1);
            }
            drop(q);
            sub.notify.notify_one();
            true
        });
        self.feed.messages = self.feed.messages.saturating_add(sent);
        self.feed.overflows = self.feed.overflows.saturating_add(overflows);
    }

    /// The replica table as the feed sends it.
    pub fn table(&self) -> ReplicaTable {
        ReplicaTable {
            replicas: self
                .live()
                .map(|e| Replica {
                    id: e.spec.id,
                    name: e.spec.replica.clone(),
                    address: e.spec.address.clone(),
                    models: e.spec.models.clone(),
                    up: e.up,
                    dp_rank: e.spec.dp_rank,
                })
                .collect(),
        }
    }

    /// Table, snapshot chunks of every engine (the first one flagged, at most
    /// [`CHUNK_BLOCKS`] blocks each), SnapshotComplete, and the latest loads.
    pub fn snapshot_bodies(&self) -> Vec<Body> {
        let mut out = vec![Body::Replicas(self.table())];
        for e in self.live() {
            let keys = if e.up { e.mirror.keys() } else { Vec::new() };
            if keys.is_empty() {
                out.push(Body::Snapshot(SnapshotChunk { replica: e.spec.id, first: true, blocks: Vec::new() }));
            }
            for (i, chunk) in keys.chunks(CHUNK_BLOCKS).enumerate() {
                out.push(Body::Snapshot(SnapshotChunk { replica: e.spec.id, first: i == 0, blocks: chunk.to_vec() }));
            }
        }
        out.push(Body::SnapshotComplete(SnapshotComplete {}));
        let loads: Vec<ReplicaLoad> = self.live().filter_map(|e| e.load.clone()).collect();
        if !loads.is_empty() {
            out.push(Body::Load(LoadReport { loads }));
        }
        out
    }

    fn publish_changes(&mut self, id: u32) {
        if self.changes.is_empty() {
            return;
        }
        let changes = std::mem::take(&mut self.changes);
        for part in changes.chunks(CHUNK_BLOCKS) {
            self.publish(Body::Delta(BlockDelta::from_changes(id, part)));
        }
        self.changes = changes;
        self.changes.clear();
    }

    /// Counts a live batch received.
    pub fn received(&mut self, engine: usize) {
        if let Some(e) = self.engine(engine) {
            e.counters.received = e.counters.received.saturating_add(1);
            e.last_event = Some(Instant::now());
        }
    }

    pub fn skipped(&mut self, engine: usize, reason: &'static str) {
        if let Some(e) = self.engine(engine) {
            let c = e.counters.skipped.entry(reason).or_insert(0);
            *c = c.saturating_add(1);
        }
    }

    /// Applies one batch (live or replayed, `seq` is the publisher's) to an engine's mirror
    /// and publishes the net changes.
    pub fn apply(&mut self, engine: usize, seq: u64, batch: &EventBatch) {
        let max_blocks = self.max_blocks;
        let mut changes = std::mem::take(&mut self.changes);
        let Some(e) = self.engines.get_mut(engine) else { return };
        e.last_seq = Some(seq);
        if e.gone {
            return;
        }
        if !e.up {
            let c = e.counters.skipped.entry("replica_down").or_insert(0);
            *c = c.saturating_add(1);
            self.changes = changes;
            return;
        }
        e.mirror.apply(batch, &mut changes);
        e.counters.applied = e.counters.applied.saturating_add(1);
        let over = e.mirror.len() > max_blocks;
        let id = e.spec.id;
        self.changes = changes;
        self.publish_changes(id);
        if over {
            if let Some(e) = self.engine(engine) {
                e.counters.block_limit_hits = e.counters.block_limit_hits.saturating_add(1);
            }
            self.reset(engine, "block_limit");
        }
    }

    /// Drops an engine's blocks and tells subscribers.
    pub fn reset(&mut self, engine: usize, reason: &str) {
        let mut changes = std::mem::take(&mut self.changes);
        let Some(e) = self.engines.get_mut(engine) else { return };
        e.mirror.reset(&mut changes);
        changes.clear();
        self.changes = changes;
        let c = e.counters.resets.entry(reason.to_owned()).or_insert(0);
        *c = c.saturating_add(1);
        let id = e.spec.id;
        self.publish(Body::Reset(ReplicaReset { replica: id, reason: reason.to_owned() }));
    }

    pub fn count_gap(&mut self, engine: usize) {
        if let Some(e) = self.engine(engine) {
            e.counters.gaps = e.counters.gaps.saturating_add(1);
        }
    }

    pub fn count_replay(&mut self, engine: usize, complete: bool, batches: u64) {
        if let Some(e) = self.engine(engine) {
            let c = &mut e.counters;
            if complete {
                c.replays_complete = c.replays_complete.saturating_add(1);
            } else {
                c.replays_incomplete = c.replays_incomplete.saturating_add(1);
            }
            c.replayed_batches = c.replayed_batches.saturating_add(batches);
        }
    }

    pub fn connection(&mut self, engine: usize, connected: bool) {
        if let Some(e) = self.engine(engine) {
            e.connected = connected;
            let c = &mut e.counters;
            if connected {
                c.connects = c.connects.saturating_add(1);
            } else {
                c.disconnects = c.disconnects.saturating_add(1);
            }
        }
    }

    /// Records one health source's verdict. The engine is up when every source is fine. Going
    /// down: its blocks leave (a ReplicaReset with `reason`). Coming up: it starts clean and
    /// rebuilds from its publisher's replay buffer. Returns whether `up` changed.
    pub fn set_health(&mut self, engine: usize, source: Health, ok: bool, reason: &str) -> bool {
        let Some(e) = self.engine(engine) else { return false };
        match source {
            Health::Http => e.http_ok = ok,
            Health::Publisher => e.publisher_ok = ok,
        }
        let up = e.http_ok && e.publisher_ok;
        if e.up == up {
            return false;
        }
        e.up = up;
        if !up {
            e.load = None;
            self.reset(engine, reason);
        } else if let Some(e) = self.engine(engine) {
            e.rebuild.store(true, Ordering::SeqCst);
        }
        let table = self.table();
        self.publish(Body::Replicas(table));
        true
    }

    pub fn set_load(&mut self, engine: usize, load: ReplicaLoad) {
        if let Some(e) = self.engine(engine) {
            e.load = Some(load);
        }
    }

    /// Publishes the current loads of all up engines.
    pub fn publish_loads(&mut self) {
        let loads: Vec<ReplicaLoad> = self.live().filter(|e| e.up).filter_map(|e| e.load.clone()).collect();
        if !loads.is_empty() {
            self.publish(Body::Load(LoadReport { loads }));
        }
    }

    /// Parity judgement per engine: returns (label, ratio, matched, mismatched) for engines that
    /// crossed above the threshold since the last call.
    pub fn parity_alarms(&mut self, threshold: f64, min_verified: u64) -> Vec<(String, f64, u64, u64)> {
        let mut out = Vec::new();
        for e in self.engines.iter_mut().filter(|e| !e.gone) {
            let p = &e.mirror.stats().parity;
            let verified = p.matched.saturating_add(p.mismatched);
            if verified < min_verified || verified == 0 {
                continue;
            }
            let ratio = p.mismatched as f64 / verified as f64;
            let bad = ratio > threshold;
            if bad && !e.parity_warned {
                out.push((e.spec.label(), ratio, p.matched, p.mismatched));
            }
            e.parity_warned = bad;
        }
        out
    }

    /// `/debug/replicas`.
    pub fn debug_json(&self) -> Value {
        let now = Instant::now();
        let engines: Vec<Value> = self
            .live()
            .map(|e| {
                let s = e.mirror.stats();
                let p = &s.parity;
                let mut blocks = e.mirror.keys();
                blocks.truncate(100_000);
                json!({
                    "id": e.spec.id,
                    "replica": e.spec.replica,
                    "dp_rank": e.spec.dp_rank,
                    "address": e.spec.address,
                    "models": e.spec.models,
                    "endpoint": e.spec.endpoint,
                    "mode": match e.spec.mode { crate::config::Mode::Bind => "bind", crate::config::Mode::Connect => "connect" },
                    "up": e.up,
                    "http_ok": e.http_ok,
                    "publisher_ok": e.publisher_ok,
                    "connected": e.connected,
                    "blocks": e.mirror.len(),
                    "block_keys": blocks,
                    "last_seq": e.last_seq,
                    "last_event_age_secs": e.last_event.map(|t| now.saturating_duration_since(t).as_secs_f64()),
                    "parity": {
                        "matched": p.matched,
                        "mismatched": p.mismatched,
                        "unverifiable": p.unverifiable,
                        "match_ratio": p.match_ratio(),
                        "last_mismatch": p.last_mismatch.map(|(a, b)| json!({"published": a, "recomputed": b})),
                    },
                    "received": e.counters.received,
                    "applied": e.counters.applied,
                    "skipped": e.counters.skipped,
                    "gaps": e.counters.gaps,
                    "replays": {"complete": e.counters.replays_complete, "incomplete": e.counters.replays_incomplete, "batches": e.counters.replayed_batches},
                    "resets": e.counters.resets,
                    "disconnects": e.counters.disconnects,
                    "clears": s.clears,
                    "load": e.load.as_ref().map(|l| json!({"running": l.running, "waiting": l.waiting, "kv_cache_usage": l.kv_cache_usage})),
                })
            })
            .collect();
        let subs: Vec<Value> = self
            .subscriber_lags()
            .into_iter()
            .map(|(name, queued, snapshots)| json!({"name": name, "queued": queued, "snapshots": snapshots}))
            .collect();
        json!({ "replicas": engines, "subscribers": self.live_subscribers(), "feed": subs })
    }

    /// `/metrics` in Prometheus text format.
    pub fn metrics_text(&self) -> String {
        let mut s = String::new();
        let lbl = |e: &EngineState| format!("replica=\"{}\",dp_rank=\"{}\"", esc(&e.spec.replica), e.spec.dp_rank);
        let mut counter = |name: &str, help: &str, kind: &str, rows: Vec<(String, f64)>| {
            let _ = writeln!(s, "# HELP llmgw_agent_{name} {help}");
            let _ = writeln!(s, "# TYPE llmgw_agent_{name} {kind}");
            for (labels, v) in rows {
                if labels.is_empty() {
                    let _ = writeln!(s, "llmgw_agent_{name} {v}");
                } else {
                    let _ = writeln!(s, "llmgw_agent_{name}{{{labels}}} {v}");
                }
            }
        };
        let per = |f: &dyn Fn(&EngineState) -> u64| -> Vec<(String, f64)> {
            self.live().map(|e| (lbl(e), f(e) as f64)).collect()
        };
        counter(
            "events_received_total",
            "Live event batches received from the publisher.",
            "counter",
            per(&|e| e.counters.received),
        );
        counter(
            "events_applied_total",
            "Event batches (live or replayed) applied to the mirror.",
            "counter",
            per(&|e| e.counters.applied),
        );
        let mut skipped = Vec::new();
        for e in self.live() {
            for (reason, n) in &e.counters.skipped {
                skipped.push((format!("{},reason=\"{reason}\"", lbl(e)), *n as f64));
            }
        }
        counter("events_skipped_total", "Event batches not applied, by reason.", "counter", skipped);
        counter("gaps_total", "Sequence gaps detected.", "counter", per(&|e| e.counters.gaps));
        let mut replays = Vec::new();
        for e in self.live() {
            replays.push((format!("{},result=\"complete\"", lbl(e)), e.counters.replays_complete as f64));
            replays.push((format!("{},result=\"incomplete\"", lbl(e)), e.counters.replays_incomplete as f64));
        }
        counter("replays_total", "Replay requests, by whether they covered the missing range.", "counter", replays);
        counter(
            "replayed_batches_total",
            "Batches applied from replay.",
            "counter",
            per(&|e| e.counters.replayed_batches),
        );
        let mut resets = Vec::new();
        for e in self.live() {
            for (reason, n) in &e.counters.resets {
                resets.push((format!("{},reason=\"{}\"", lbl(e), esc(reason)), *n as f64));
            }
        }
        counter("resets_total", "Mirror resets, by reason.", "counter", resets);
        counter(
            "publisher_disconnects_total",
            "Publisher connections lost.",
            "counter",
            per(&|e| e.counters.disconnects),
        );
        counter(
            "block_limit_hits_total",
            "Resets because an engine exceeded the block limit.",
            "counter",
            per(&|e| e.counters.block_limit_hits),
        );
        counter(
            "parity_matched_total",
            "Stored blocks whose recomputed hash matched.",
            "counter",
            per(&|e| e.mirror.stats().parity.matched),
        );
        counter(
            "parity_mismatched_total",
            "Stored blocks whose recomputed hash differed.",
            "counter",
            per(&|e| e.mirror.stats().parity.mismatched),
        );
        counter(
            "parity_unverifiable_total",
            "Stored blocks whose hash could not be recomputed.",
            "counter",
            per(&|e| e.mirror.stats().parity.unverifiable),
        );
        let ratio: Vec<(String, f64)> =
            self.live().filter_map(|e| e.mirror.stats().parity.match_ratio().map(|r| (lbl(e), r))).collect();
        counter("parity_match_ratio", "Share of verified blocks whose hash matched.", "gauge", ratio);
        counter("blocks", "Blocks held per engine.", "gauge", per(&|e| e.mirror.len() as u64));
        counter("replica_up", "1 when the replica is up.", "gauge", per(&|e| u64::from(e.up)));
        counter(
            "publisher_connected",
            "1 while the publisher connection is up.",
            "gauge",
            per(&|e| u64::from(e.connected)),
        );
        let last: Vec<(String, f64)> = self.live().filter_map(|e| e.last_seq.map(|q| (lbl(e), q as f64))).collect();
        counter("last_seq", "Last publisher sequence number applied.", "gauge", last);
        counter(
            "subscribers",
            "Live feed subscribers.",
            "gauge",
            vec![(String::new(), self.live_subscribers() as f64)],
        );
        counter(
            "feed_subscriptions_total",
            "Feed subscriptions accepted.",
            "counter",
            vec![(String::new(), self.feed.subscriptions as f64)],
        );
        counter(
            "feed_messages_total",
            "Feed messages queued to subscribers (after their snapshot).",
            "counter",
            vec![(String::new(), self.feed.messages as f64)],
        );
        counter(
            "feed_overflows_total",
            "Subscribers that fell behind and were sent a fresh snapshot.",
            "counter",
            vec![(String::new(), self.feed.overflows as f64)],
        );
        counter(
            "feed_rejected_total",
            "Subscriptions rejected for a bad token.",
            "counter",
            vec![(String::new(), self.feed.rejected_token as f64)],
        );
        s
    }
}

fn esc(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use llmgw_core::feed::FeedState;
    use llmgw_core::wire::{encode_batch, Encoding, HashForm, WireBatch, WireBlockRemoved, WireBlockStored, WireEvent};

    fn hub(engines: u32, max_queue: usize) -> Arc<Hub> {
        let mut text = String::new();
        for i in 0..engines {
            text.push_str(&format!(
                "[[replicas]]\nname = \"r{i}\"\naddress = \"127.0.0.1:{}\"\nendpoint = \"tcp://127.0.0.1:{}\"\n",
                8000 + i,
                5000 + i
            ));
        }
        let cfg = Config::parse(&text).unwrap();
        Hub::new(cfg.engines(), max_queue, 1 << 30)
    }

    fn stored(hashes: Vec<u64>) -> WireEvent {
        WireEvent::BlockStored(WireBlockStored { block_hashes: hashes, block_size: 16, ..Default::default() })
    }

    fn removed(hashes: Vec<u64>) -> WireEvent {
        WireEvent::BlockRemoved(WireBlockRemoved { block_hashes: hashes, ..Default::default() })
    }

    fn batch(events: Vec<WireEvent>) -> EventBatch {
        let w = WireBatch { ts: 1.0, events, data_parallel_rank: None };
        EventBatch::decode(&encode_batch(&w, Encoding::Tagged, HashForm::Int)).unwrap()
    }

    fn drain(sub: &Subscriber, hub: &Hub) -> Vec<FeedMessage> {
        std::iter::from_fn(|| sub.pop(hub)).collect()
    }

    /// A small deterministic generator (no dependency needed).
    struct Lcg(u64);
    impl Lcg {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            self.0 >> 33
        }
    }

    fn state_of(st: &FeedState, engines: u32) -> Vec<Vec<u64>> {
        (0..engines)
            .map(|r| {
                let mut v: Vec<u64> = (1..=64u64).filter(|k| st.index.score(&[*k]).leading[r as usize] == 1).collect();
                v.sort_unstable();
                v
            })
            .collect()
    }

    #[test]
    fn snapshot_is_table_chunks_complete_and_seq_counts_up() {
        let h = hub(2, 64);
        h.state().apply(0, 0, &batch(vec![stored(vec![1, 2, 3])]));
        let sub = h.subscribe("t".into());
        let msgs = drain(&sub, &h);
        let seqs: Vec<u64> = msgs.iter().map(|m| m.seq).collect();
        assert_eq!(seqs, vec![0, 1, 2, 3]);
        assert!(matches!(&msgs[0].body, Some(Body::Replicas(t)) if t.replicas.len() == 2));
        assert_eq!(
            msgs[1].body,
            Some(Body::Snapshot(SnapshotChunk { replica: 0, first: true, blocks: vec![1, 2, 3] }))
        );
        assert_eq!(msgs[2].body, Some(Body::Snapshot(SnapshotChunk { replica: 1, first: true, blocks: vec![] })));
        assert_eq!(msgs[3].body, Some(Body::SnapshotComplete(SnapshotComplete {})));
        h.state().apply(1, 0, &batch(vec![stored(vec![9])]));
        h.state().reset(0, "restart");
        let msgs = drain(&sub, &h);
        assert_eq!(msgs.len(), 2);
        assert_eq!(msgs[0].seq, 4);
        assert_eq!(msgs[0].body, Some(Body::Delta(BlockDelta { replica: 1, added: vec![9], removed: vec![] })));
        assert_eq!(msgs[1].seq, 5);
        assert!(matches!(&msgs[1].body, Some(Body::Reset(r)) if r.replica == 0 && r.reason == "restart"));
    }

    #[test]
    fn large_snapshot_is_chunked() {
        let h = hub(1, 64);
        let keys: Vec<u64> = (1..=(CHUNK_BLOCKS as u64 * 2 + 5)).collect();
        h.state().apply(0, 0, &batch(vec![stored(keys.clone())]));
        let sub = h.subscribe("t".into());
        let chunks: Vec<SnapshotChunk> = drain(&sub, &h)
            .into_iter()
            .filter_map(|m| match m.body {
                Some(Body::Snapshot(c)) => Some(c),
                _ => None,
            })
            .collect();
        assert_eq!(chunks.len(), 3);
        assert!(chunks[0].first && !chunks[1].first && !chunks[2].first);
        assert!(chunks.iter().all(|c| c.blocks.len() <= CHUNK_BLOCKS));
        let all: Vec<u64> = chunks.into_iter().flat_map(|c| c.blocks).collect();
        assert_eq!(all, keys);
    }

    #[test]
    fn late_subscriber_snapshot_plus_deltas_equal_agent_state_after_random_stream() {
        let engines = 3u32;
        let h = hub(engines, 1 << 20);
        let mut rng = Lcg(7);
        let mut early = h.subscribe("early".into());
        let mut early_state = FeedState::default();
        let mut late: Option<(Arc<Subscriber>, FeedState)> = None;
        for step in 0..3000u64 {
            let e = (rng.next() % u64::from(engines)) as usize;
            let n = 1 + rng.next() % 4;
            let keys: Vec<u64> = (0..n).map(|_| 1 + rng.next() % 64).collect();
            let ev = match rng.next() % 20 {
                0 => WireEvent::AllBlocksCleared,
                1..=9 => removed(keys),
                _ => stored(keys),
            };
            {
                let mut st = h.state();
                if rng.next().is_multiple_of(200) {
                    st.reset(e, "test");
                } else {
                    st.apply(e, step, &batch(vec![ev]));
                }
            }
            if step == 1500 {
                late = Some((h.subscribe("late".into()), FeedState::default()));
            }
            if step.is_multiple_of(97) {
                for m in drain(&early, &h) {
                    early_state.apply(&m).unwrap();
                }
            }
        }
        let (late_sub, mut late_state) = late.unwrap();
        for m in drain(&late_sub, &h) {
            late_state.apply(&m).unwrap();
        }
        for m in drain(&early, &h) {
            early_state.apply(&m).unwrap();
        }
        let truth: Vec<Vec<u64>> = h.state().engines.iter().map(|e| e.mirror.keys()).collect();
        assert!(late_state.synced && early_state.synced);
        assert_eq!(state_of(&late_state, engines), truth);
        assert_eq!(state_of(&early_state, engines), truth);
        assert!(truth.iter().any(|t| !t.is_empty()));
        early = late_sub;
        assert_eq!(early.snapshots_sent(), 1);
    }

    #[test]
    fn lagging_subscriber_gets_fresh_snapshot_not_a_backlog() {
        let h = hub(1, 16);
        let sub = h.subscribe("slow".into());
        let mut fs = FeedState::default();
        for m in drain(&sub, &h) {
            fs.apply(&m).unwrap();
        }
        for i in 0..100u64 {
            h.state().apply(0, i, &batch(vec![stored(vec![i + 1])]));
        }
        assert_eq!(h.state().feed.overflows, 1);
        let msgs = drain(&sub, &h);
        // Table + one chunk + complete: no backlog of 100 deltas.
        assert!(msgs.len() <= 4, "{}", msgs.len());
        // Numbered right after what the subscriber had received.
        assert_eq!(msgs[0].seq, 3);
        for m in &msgs {
            fs.apply(m).unwrap();
        }
        assert!(matches!(&msgs[0].body, Some(Body::Replicas(_))));
        assert_eq!(state_of(&fs, 1)[0], (1..=64).collect::<Vec<u64>>());
        assert_eq!(sub.snapshots_sent(), 2);
    }

    #[test]
    fn down_replica_leaves_and_comes_back_clean() {
        let h = hub(2, 64);
        h.state().apply(0, 0, &batch(vec![stored(vec![1, 2])]));
        let sub = h.subscribe("t".into());
        let mut fs = FeedState::default();
        for m in drain(&sub, &h) {
            fs.apply(&m).unwrap();
        }
        assert!(h.state().set_health(0, Health::Http, false, "unreachable"));
        h.state().apply(0, 1, &batch(vec![stored(vec![3])]));
        for m in drain(&sub, &h) {
            fs.apply(&m).unwrap();
        }
        assert_eq!(state_of(&fs, 2)[0], Vec::<u64>::new());
        assert!(!fs.replicas[0].up);
        // Both sources must agree before it is up again.
        assert!(!h.state().set_health(0, Health::Publisher, false, "publisher_gone"));
        assert!(!h.state().set_health(0, Health::Http, true, "reachable"));
        assert!(!h.state().engines[0].up);
        assert!(h.state().set_health(0, Health::Publisher, true, "publisher_back"));
        assert!(h.state().engines[0].rebuild.load(Ordering::SeqCst));
        for m in drain(&sub, &h) {
            fs.apply(&m).unwrap();
        }
        assert!(fs.replicas[0].up);
        assert_eq!(h.state().engines[0].mirror.len(), 0);
    }

    #[test]
    fn discovered_engines_join_and_leave_the_table() {
        let h = hub(1, 64);
        let sub = h.subscribe("t".into());
        let mut fs = FeedState::default();
        for m in drain(&sub, &h) {
            fs.apply(&m).unwrap();
        }
        let mut spec = h.state().engines[0].spec.clone();
        spec.replica = "pool-10.0.0.7".into();
        let idx = h.state().add_engine(spec);
        assert_eq!(idx, 1);
        h.state().apply(idx, 0, &batch(vec![stored(vec![5, 6])]));
        for m in drain(&sub, &h) {
            fs.apply(&m).unwrap();
        }
        assert_eq!(fs.replicas.len(), 2);
        assert_eq!(fs.replicas[1].id, 1);
        assert_eq!(state_of(&fs, 2)[1], vec![5, 6]);
        h.state().remove_engine(idx);
        assert!(h.state().engines[idx].stop.load(Ordering::SeqCst));
        for m in drain(&sub, &h) {
            fs.apply(&m).unwrap();
        }
        assert_eq!(fs.replicas.len(), 1);
        assert_eq!(state_of(&fs, 2)[1], Vec::<u64>::new());
        // Late events for a removed engine change nothing; a new engine gets a fresh id.
        h.state().apply(idx, 1, &batch(vec![stored(vec![7])]));
        assert_eq!(h.state().engines[idx].mirror.len(), 0);
        let spec = h.state().engines[0].spec.clone();
        assert_eq!(h.state().add_engine(spec), 2);
        assert!(!h.state().metrics_text().contains("pool-10.0.0.7"));
    }

    #[test]
    fn flood_past_the_block_limit_resets_the_engine() {
        let cfg =
            Config::parse("[[replicas]]\nname = \"r\"\naddress = \"127.0.0.1:1\"\nendpoint = \"tcp://127.0.0.1:2\"\n")
                .unwrap();
        let h = Hub::new(cfg.engines(), 64, 10);
        h.state().apply(0, 0, &batch(vec![stored((1..=10).collect())]));
        assert_eq!(h.state().engines[0].mirror.len(), 10);
        h.state().apply(0, 1, &batch(vec![stored(vec![11])]));
        let st = h.state();
        assert_eq!(st.engines[0].mirror.len(), 0);
        assert_eq!(st.engines[0].counters.block_limit_hits, 1);
        assert_eq!(st.engines[0].counters.resets.get("block_limit"), Some(&1));
    }

    #[test]
    fn metrics_name_every_engine() {
        let h = hub(2, 64);
        h.state().apply(1, 0, &batch(vec![stored(vec![1, 2])]));
        h.state().skipped(0, "malformed");
        let text = h.state().metrics_text();
        assert!(text.contains("llmgw_agent_blocks{replica=\"r1\",dp_rank=\"0\"} 2"), "{text}");
        assert!(text.contains("llmgw_agent_events_skipped_total{replica=\"r0\",dp_rank=\"0\",reason=\"malformed\"} 1"));
        assert!(text.contains("llmgw_agent_subscribers 0"));
    }
}
