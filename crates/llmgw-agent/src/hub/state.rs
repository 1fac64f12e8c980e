//! Engines in the hub: each one's mirror, health and counters, and the replica table.
//!
//! Every change to an engine's blocks or to the table is published to the subscribers' queues
//! ([`super::queue`]) under the same lock that made it, so subscribers see changes in the order
//! they happened.

use super::queue::{approx_bytes, snapshot_chunks, FeedCounters, Offered, Subscriber, CHUNK_BLOCKS};
use crate::config::EngineSpec;
use llmgw_core::event::EventBatch;
use llmgw_core::feed::{
    BlockDelta, Body, HashSettings, KvCacheGroup, LoadReport, LoraAdapter, Replica, ReplicaLoad, ReplicaReset,
    ReplicaTable, SnapshotComplete,
};
use llmgw_core::mirror::{EngineMirror, NetChange};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Instant;

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
    /// Times the mirror (re)started without the engine's earlier batches (see
    /// [`EngineState::incomplete_from`]).
    pub incomplete_starts: u64,
    /// Times the mirror started from a sidecar's snapshot.
    pub snapshot_joins: u64,
    /// Snapshots asked for and not had, by reason.
    pub snapshot_failures: BTreeMap<&'static str, u64>,
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
    /// `Some(s)`: the mirror holds what the engine's batches from `s` on did, but not the
    /// blocks stored before (its replay buffer no longer held them, or a gap could not be
    /// filled); cleared by batch 0 of an engine or by a mirror clear (`AllBlocksCleared`).
    pub incomplete_from: Option<u64>,
    pub last_event: Option<Instant>,
    pub load: Option<ReplicaLoad>,
    pub counters: EngineCounters,
    pub parity_warned: bool,
    /// The lookahead its events show, when it differs from the configured one (warned once).
    pub lookahead_warned: Option<usize>,
    /// Removed by discovery: no longer in the table. Its slot (and id) is reused once nothing
    /// holds `stop` any more (its thread and scraper have exited).
    pub gone: bool,
    /// Tells the engine's thread and scraper to stop (discovery removed it); each holds a
    /// clone while it runs.
    pub stop: Arc<AtomicBool>,
    /// Set when the engine thread must forget its sequence position and rebuild by replay.
    pub rebuild: Arc<AtomicBool>,
    /// Blocks its mirror may hold, from the engine's own KV-cache size (`/metrics`), when
    /// known; `zmq.max_blocks_per_engine` bounds it too.
    pub block_limit: Option<usize>,
    /// The model ids its `/v1/models` lists (base model, `--served-model-name` aliases, LoRA
    /// adapters), once read; used when the configuration names no model.
    pub served: Option<Vec<String>>,
    /// The LoRA adapters its `/v1/models` lists, with their paths (always sent: the filter
    /// hashes an adapter's blocks with its path).
    pub adapters: Vec<LoraAdapter>,
}

impl EngineState {
    /// The models it serves as the feed says: the configuration's list when it names any (an
    /// override), else what its `/v1/models` lists; empty (any model) until that is read.
    pub fn models(&self) -> &[String] {
        if !self.spec.models.is_empty() {
            return &self.spec.models;
        }
        self.served.as_deref().unwrap_or_default()
    }
}

/// An engine's mirror may hold this many times the blocks its KV cache has.
pub const BLOCK_LIMIT_FACTOR: u64 = 2;
/// The least block limit an engine's reported size sets.
pub const MIN_BLOCK_LIMIT: u64 = 4096;

/// Replica ids a filter can address (its index keys replicas by u16).
pub const MAX_ENGINES: usize = 1 << 16;

/// Everything behind the hub lock.
pub struct HubState {
    /// Indexed by engine id; removed engines stay (marked `gone`) until their slot is reused.
    pub engines: Vec<EngineState>,
    pub(super) subscribers: Vec<Weak<Subscriber>>,
    pub max_queue: usize,
    /// Bytes queued per subscriber before it is resynced (`feed.max_backlog_bytes`).
    pub max_backlog_bytes: usize,
    /// Live subscriptions at most (`feed.max_subscribers`).
    pub max_subscribers: usize,
    pub max_blocks: usize,
    pub feed: FeedCounters,
    /// `/kv_event_sources` answers refused (unparseable, another host's sockets, too many ranks),
    /// and engines not added because every id was in use; by reason.
    pub discovery_refused: crate::counters::RefusedCounts,
    /// The JetStream consumer's counters (replicas with `events = "jetstream"`).
    pub jetstream: crate::counters::JetStreamCounters,
    /// Slots of removed engines, reused once their thread and scraper have exited.
    gone_slots: Vec<usize>,
    /// Empty between calls: one batch's net changes while they are published (kept for its
    /// allocation).
    pub(super) changes: Vec<NetChange>,
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
            incomplete_from: None,
            last_event: None,
            load: None,
            counters: EngineCounters::default(),
            parity_warned: false,
            lookahead_warned: None,
            rebuild: Arc::new(AtomicBool::new(false)),
            block_limit: None,
            gone: false,
            stop: Arc::new(AtomicBool::new(false)),
            served: None,
            adapters: Vec::new(),
        }
    }
}

impl HubState {
    pub(super) fn new(specs: Vec<EngineSpec>, max_queue: usize, max_blocks: usize) -> HubState {
        HubState {
            engines: specs.into_iter().map(EngineState::new).collect(),
            subscribers: Vec::new(),
            max_queue,
            max_backlog_bytes: 64 << 20,
            max_subscribers: 1024,
            max_blocks,
            feed: FeedCounters::default(),
            discovery_refused: Default::default(),
            jetstream: Default::default(),
            gone_slots: Vec::new(),
            changes: Vec::new(),
        }
    }

    fn engine(&mut self, id: usize) -> Option<&mut EngineState> {
        self.engines.get_mut(id)
    }

    /// Engines currently configured or discovered (removed ones excluded).
    pub fn live(&self) -> impl Iterator<Item = &EngineState> {
        self.engines.iter().filter(|e| !e.gone)
    }

    /// Adds an engine (discovery). It takes the lowest slot (and id) of a removed engine whose
    /// thread and scraper have exited, else a new one; `None` when all [`MAX_ENGINES`] ids are
    /// taken (counted in `discovery_refused`). Returns its index (= its id).
    pub fn add_engine(&mut self, mut spec: EngineSpec) -> Option<usize> {
        let engines = &self.engines;
        let free =
            self.gone_slots.iter().position(|&i| engines.get(i).is_some_and(|e| Arc::strong_count(&e.stop) == 1));
        let idx = match free {
            Some(at) => self.gone_slots.swap_remove(at),
            None if self.engines.len() < MAX_ENGINES => self.engines.len(),
            None => {
                self.discovery_refused.count(crate::counters::Refused::IdsExhausted);
                return None;
            }
        };
        spec.id = u32::try_from(idx).ok()?;
        match self.engines.get_mut(idx) {
            Some(slot) => *slot = EngineState::new(spec),
            None => self.engines.push(EngineState::new(spec)),
        }
        if self.subscribers.iter().any(|w| w.strong_count() > 0) {
            let table = self.table();
            self.publish(Body::Replicas(table));
        }
        Some(idx)
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
            self.gone_slots.push(idx);
        }
        let table = self.table();
        self.publish(Body::Replicas(table));
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
                    models: e.models().to_vec(),
                    up: e.up,
                    dp_rank: e.spec.dp_rank,
                    hash: Some(HashSettings::from_spec(&e.spec.hash.spec())),
                    dp_size: e.spec.dp_size,
                    kv_groups: KvCacheGroup::from_mirror(e.mirror.groups()),
                    lora_adapters: e.adapters.clone(),
                    mirror_incomplete: e.incomplete_from.is_some(),
                })
                .collect(),
        }
    }

    /// What an engine's `/v1/models` lists now: its model ids and LoRA adapters. The table is
    /// published again when that changes what the feed says (the ids count only when the
    /// configuration names no model). False when nothing changed.
    pub fn set_served(&mut self, engine: usize, mut ids: Vec<String>, mut adapters: Vec<LoraAdapter>) -> bool {
        ids.sort_unstable();
        ids.dedup();
        adapters.sort_unstable_by(|a, b| (&a.name, &a.path).cmp(&(&b.name, &b.path)));
        let Some(e) = self.engine(engine) else { return false };
        if e.gone {
            return false;
        }
        let shown = e.spec.models.is_empty() && e.served.as_ref() != Some(&ids);
        let changed = shown || e.adapters != adapters;
        // Parity checks of the adapters' blocks need their paths too (events carry names only).
        for a in &adapters {
            e.mirror.set_lora_path(a.name.clone(), a.path.clone());
        }
        e.served = Some(ids);
        e.adapters = adapters;
        if changed {
            let table = self.table();
            self.publish(Body::Replicas(table));
        }
        changed
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
        let groups_before = e.mirror.groups_version();
        let clears_before = e.mirror.stats().clears;
        e.mirror.apply(batch, &mut changes);
        // The engine's first batch, or a clear of its whole cache: nothing before it matters.
        let completed = (seq == 0 || e.mirror.stats().clears != clears_before) && e.incomplete_from.is_some();
        if completed {
            e.incomplete_from = None;
        }
        e.counters.applied = e.counters.applied.saturating_add(1);
        let over = e.mirror.len() > e.block_limit.map_or(max_blocks, |l| l.min(max_blocks));
        // Only several groups change how the filters score (hybrid models).
        let groups_changed = e.mirror.groups_version() != groups_before && e.mirror.groups().len() > 1;
        let id = e.spec.id;
        if over {
            // Past the limit: nothing of this batch reaches a subscriber; the reset below
            // drops what the engine had.
            changes.clear();
        }
        self.changes = changes;
        // A new KV-cache group (hybrid model) is in the table before its blocks arrive.
        if groups_changed {
            let table = self.table();
            self.publish(Body::Replicas(table));
        }
        self.publish_changes(id);
        // The filters stop treating its misses as unknown.
        if completed {
            let table = self.table();
            self.publish(Body::Replicas(table));
        }
        if over {
            if let Some(e) = self.engine(engine) {
                e.counters.block_limit_hits = e.counters.block_limit_hits.saturating_add(1);
            }
            self.reset(engine, "block_limit");
            self.mark_incomplete(engine, seq.saturating_add(1));
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

    /// The mirror started from a snapshot: it is complete unless the snapshot itself holds only
    /// what batches from `incomplete_from` on stored.
    pub fn joined_snapshot(&mut self, engine: usize, incomplete_from: Option<u64>) {
        let Some(e) = self.engine(engine) else { return };
        e.counters.snapshot_joins = e.counters.snapshot_joins.saturating_add(1);
        match incomplete_from {
            Some(f) => self.mark_incomplete(engine, f),
            None => self.set_incomplete_from(engine, None),
        }
    }

    /// A snapshot was asked for and none came.
    pub fn snapshot_failed(&mut self, engine: usize, reason: &'static str) {
        if let Some(e) = self.engine(engine) {
            let c = e.counters.snapshot_failures.entry(reason).or_insert(0);
            *c = c.saturating_add(1);
        }
    }

    /// Marks an engine's mirror as holding only what its batches from `from` on did.
    pub fn mark_incomplete(&mut self, engine: usize, from: u64) {
        if let Some(e) = self.engine(engine) {
            e.counters.incomplete_starts = e.counters.incomplete_starts.saturating_add(1);
        }
        self.set_incomplete_from(engine, Some(from));
    }

    /// Sets where an engine's mirror starts; the replica table goes out again when that changes
    /// whether it is complete (the filters weigh an incomplete engine's misses as unknown).
    fn set_incomplete_from(&mut self, engine: usize, from: Option<u64>) {
        let Some(e) = self.engine(engine) else { return };
        let flipped = e.incomplete_from.is_some() != from.is_some();
        e.incomplete_from = from;
        if flipped && !e.gone {
            let table = self.table();
            self.publish(Body::Replicas(table));
        }
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

    /// The engine's KV cache holds `blocks` blocks (GPU and CPU, from its `/metrics`): its
    /// mirror may hold [`BLOCK_LIMIT_FACTOR`] times that (removals trail stores within a batch
    /// and across a publisher's lag), never fewer than [`MIN_BLOCK_LIMIT`].
    pub fn set_engine_blocks(&mut self, engine: usize, blocks: u64) {
        if let Some(e) = self.engine(engine) {
            let limit = blocks.saturating_mul(BLOCK_LIMIT_FACTOR).max(MIN_BLOCK_LIMIT);
            e.block_limit = Some(usize::try_from(limit).unwrap_or(usize::MAX));
        }
    }

    pub fn set_load(&mut self, engine: usize, load: ReplicaLoad) {
        if let Some(e) = self.engine(engine) {
            e.load = Some(load);
        }
    }

    /// Publishes one up engine's load as its scrape just read it. Each scrape's report goes out
    /// at once, not with the others' on a timer: a gateway notes its own requests on the
    /// replica as the report comes, and what the engine reported beyond them is taken for other
    /// requests' (`llmgw_core::policy::capacity`), which needs the two counts of one moment.
    pub fn publish_load(&mut self, engine: usize) {
        let load = self.engines.get(engine).filter(|e| e.up && !e.gone).and_then(|e| e.load.clone());
        if let Some(load) = load {
            self.publish(Body::Load(LoadReport { loads: vec![load] }));
        }
    }

    /// Engines whose events show lookahead hashing (EAGLE-family speculative decoding) other
    /// than configured, once per distinct value: (label, seen, configured). The filters hash
    /// as configured, so such an engine is not credited until `lookahead_tokens` is set.
    pub fn lookahead_alarms(&mut self) -> Vec<(String, usize, u32)> {
        let mut out = Vec::new();
        for e in self.engines.iter_mut().filter(|e| !e.gone) {
            let seen = e.mirror.stats().lookahead_tokens.unwrap_or(0);
            let configured = e.spec.hash.lookahead_tokens;
            if usize::try_from(configured).ok() == Some(seen) {
                e.lookahead_warned = None;
            } else if e.lookahead_warned != Some(seen) {
                e.lookahead_warned = Some(seen);
                out.push((e.spec.label(), seen, configured));
            }
        }
        out
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
}

/// Publishing to the feed subscribers.
impl HubState {
    /// (name, messages queued, snapshots sent) of every live subscriber.
    pub fn subscriber_lags(&self) -> Vec<(String, usize, u64)> {
        self.subscribers
            .iter()
            .filter_map(Weak::upgrade)
            .map(|s| {
                let (queued, snapshots) = s.backlog();
                (s.name.clone(), queued, snapshots)
            })
            .collect()
    }

    pub fn live_subscribers(&self) -> usize {
        self.subscribers.iter().filter(|w| w.strong_count() > 0).count()
    }

    /// Sends one message body to every subscriber that is in sync.
    pub fn publish(&mut self, body: Body) {
        let max = self.max_queue;
        let max_bytes = self.max_backlog_bytes;
        let cost = approx_bytes(&body);
        let feed = &mut self.feed;
        self.subscribers.retain(|w| {
            let Some(sub) = w.upgrade() else { return false };
            match sub.offer(&body, cost, max, max_bytes) {
                Offered::Sent => feed.messages = feed.messages.saturating_add(1),
                Offered::Gathered => feed.gathered = feed.gathered.saturating_add(1),
                Offered::Held => {}
                Offered::Overflowed { by_bytes } => {
                    feed.overflows = feed.overflows.saturating_add(1);
                    feed.backlog_bytes_overflows = feed.backlog_bytes_overflows.saturating_add(u64::from(by_bytes));
                }
            }
            true
        });
    }

    /// Table, snapshot chunks of every engine (the first one flagged, at most
    /// [`CHUNK_BLOCKS`] blocks each), SnapshotComplete, and the latest loads, all at once
    /// under the lock (the fallback when incremental builds keep being abandoned).
    pub fn snapshot_bodies(&self) -> Vec<Body> {
        let mut out = vec![Body::Replicas(self.table())];
        for e in self.live() {
            let keys = if e.up { e.mirror.keys() } else { Vec::new() };
            out.extend(snapshot_chunks(e.spec.id, &keys));
        }
        out.push(Body::SnapshotComplete(SnapshotComplete {}));
        let loads: Vec<ReplicaLoad> = self.live().filter_map(|e| e.load.clone()).collect();
        if !loads.is_empty() {
            out.push(Body::Load(LoadReport { loads }));
        }
        out
    }

    pub(super) fn publish_changes(&mut self, id: u32) {
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
}

#[cfg(test)]
mod tests;
