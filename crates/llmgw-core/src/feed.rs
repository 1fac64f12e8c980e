//! The feed's messages (`proto/llmgw/feed/v1/feed.proto`) as plain prost structs, shared by the
//! agent (which serves them) and the filter (which decodes them inside Envoy), plus the logic
//! that applies them to a subscriber's state. Field numbers must match the `.proto`; the
//! agent's tests check this against code generated from it.

use crate::allow::Allowlist;
use crate::hash::{BlockKey, HashAlgo, HashSpec, MAX_LOOKAHEAD};
use crate::index::{ReplicaId, ReplicaIndex};
use crate::mirror::NetChange;

#[derive(Clone, PartialEq, prost::Message)]
pub struct SubscribeRequest {
    #[prost(string, tag = "1")]
    pub subscriber: String,
    #[prost(string, tag = "2")]
    pub token: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct FeedMessage {
    #[prost(uint64, tag = "1")]
    pub seq: u64,
    #[prost(oneof = "Body", tags = "2, 3, 4, 5, 6, 7, 8")]
    pub body: Option<Body>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum Body {
    #[prost(message, tag = "2")]
    Replicas(ReplicaTable),
    #[prost(message, tag = "3")]
    Snapshot(SnapshotChunk),
    #[prost(message, tag = "4")]
    SnapshotComplete(SnapshotComplete),
    #[prost(message, tag = "5")]
    Delta(BlockDelta),
    #[prost(message, tag = "6")]
    Load(LoadReport),
    #[prost(message, tag = "7")]
    Reset(ReplicaReset),
    #[prost(message, tag = "8")]
    Heartbeat(Heartbeat),
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Replica {
    #[prost(uint32, tag = "1")]
    pub id: u32,
    #[prost(string, tag = "2")]
    pub name: String,
    #[prost(string, tag = "3")]
    pub address: String,
    #[prost(string, repeated, tag = "4")]
    pub models: Vec<String>,
    #[prost(bool, tag = "5")]
    pub up: bool,
    #[prost(uint32, tag = "6")]
    pub dp_rank: u32,
    /// How this engine hashes (absent from older agents).
    #[prost(message, optional, tag = "7")]
    pub hash: Option<HashSettings>,
    /// Data-parallel ranks behind `address` (0 from older agents: read as 1).
    #[prost(uint32, tag = "8")]
    pub dp_size: u32,
    /// The engine's KV-cache groups (empty: one, as before hybrid support).
    #[prost(message, repeated, tag = "9")]
    pub kv_groups: Vec<KvCacheGroup>,
}

/// One KV-cache group of an engine.
#[derive(Clone, PartialEq, Eq, prost::Message)]
pub struct KvCacheGroup {
    #[prost(uint32, tag = "1")]
    pub group_idx: u32,
    #[prost(string, tag = "2")]
    pub kind: String,
    #[prost(uint32, tag = "3")]
    pub block_size: u32,
    /// Tokens; 0 without a sliding window.
    #[prost(uint32, tag = "4")]
    pub sliding_window: u32,
}

impl KvCacheGroup {
    /// The groups of a mirror, for the feed.
    pub fn from_mirror(groups: &std::collections::BTreeMap<u32, crate::mirror::GroupSpec>) -> Vec<KvCacheGroup> {
        groups
            .iter()
            .map(|(&group_idx, g)| KvCacheGroup {
                group_idx,
                kind: g.kind.clone(),
                block_size: u32::try_from(g.block_size).unwrap_or(u32::MAX),
                sliding_window: g.sliding_window.map_or(0, |w| u32::try_from(w).unwrap_or(u32::MAX)),
            })
            .collect()
    }
}

impl Replica {
    /// Whether the replica behind `address` runs several data-parallel ranks (requests then
    /// name the rank in `X-data-parallel-rank`).
    pub fn data_parallel(&self) -> bool {
        self.dp_size > 1
    }
}

/// vLLM's prefix-cache hashing of one engine, as the feed carries it.
#[derive(Clone, PartialEq, Eq, prost::Message)]
pub struct HashSettings {
    #[prost(string, tag = "1")]
    pub algo: String,
    #[prost(bool, tag = "2")]
    pub seeded: bool,
    #[prost(string, tag = "3")]
    pub seed: String,
    #[prost(uint32, tag = "4")]
    pub block_size: u32,
    #[prost(uint32, tag = "5")]
    pub lookahead_tokens: u32,
}

impl HashSettings {
    /// The settings of `spec`, for the feed.
    pub fn from_spec(spec: &HashSpec) -> HashSettings {
        HashSettings {
            algo: spec.algo.name().to_owned(),
            seeded: spec.seed.is_some(),
            seed: spec.seed.clone().unwrap_or_default(),
            block_size: u32::try_from(spec.block_size).unwrap_or(u32::MAX),
            lookahead_tokens: u32::try_from(spec.lookahead).unwrap_or(u32::MAX),
        }
    }

    /// The settings as a [`HashSpec`]; an error names what cannot be used (an unknown
    /// algorithm, a zero block size).
    pub fn spec(&self) -> Result<HashSpec, String> {
        let algo = HashAlgo::parse(&self.algo).map_err(|e| e.to_string())?;
        let block_size = usize::try_from(self.block_size).ok().filter(|&b| b > 0);
        let Some(block_size) = block_size else { return Err("block size 0".to_owned()) };
        let lookahead = usize::try_from(self.lookahead_tokens).unwrap_or(usize::MAX);
        if lookahead > MAX_LOOKAHEAD {
            return Err(format!("{lookahead} lookahead tokens (at most {MAX_LOOKAHEAD})"));
        }
        Ok(HashSpec { algo, seed: self.seeded.then(|| self.seed.clone()), block_size, lookahead })
    }
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ReplicaTable {
    #[prost(message, repeated, tag = "1")]
    pub replicas: Vec<Replica>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct SnapshotChunk {
    #[prost(uint32, tag = "1")]
    pub replica: u32,
    #[prost(bool, tag = "2")]
    pub first: bool,
    #[prost(uint64, repeated, tag = "3")]
    pub blocks: Vec<u64>,
}

#[derive(Clone, Copy, PartialEq, prost::Message)]
pub struct SnapshotComplete {}

#[derive(Clone, PartialEq, prost::Message)]
pub struct BlockDelta {
    #[prost(uint32, tag = "1")]
    pub replica: u32,
    #[prost(uint64, repeated, tag = "2")]
    pub added: Vec<u64>,
    #[prost(uint64, repeated, tag = "3")]
    pub removed: Vec<u64>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ReplicaLoad {
    #[prost(uint32, tag = "1")]
    pub replica: u32,
    #[prost(uint32, tag = "2")]
    pub running: u32,
    #[prost(uint32, tag = "3")]
    pub waiting: u32,
    #[prost(float, tag = "4")]
    pub kv_cache_usage: f32,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct LoadReport {
    #[prost(message, repeated, tag = "1")]
    pub loads: Vec<ReplicaLoad>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ReplicaReset {
    #[prost(uint32, tag = "1")]
    pub replica: u32,
    #[prost(string, tag = "2")]
    pub reason: String,
}

#[derive(Clone, Copy, PartialEq, prost::Message)]
pub struct Heartbeat {}

impl BlockDelta {
    /// Builds a delta from a mirror's net changes.
    pub fn from_changes(replica: u32, changes: &[NetChange]) -> BlockDelta {
        let mut d = BlockDelta { replica, added: Vec::new(), removed: Vec::new() };
        for c in changes {
            match *c {
                NetChange::Added(k) => d.added.push(k.0),
                NetChange::Removed(k) => d.removed.push(k.0),
            }
        }
        d
    }
}

/// What a subscriber knows: the replica table, their blocks and loads, and whether the index
/// is complete (a snapshot was fully received since the last (re)connection).
#[derive(Debug, Clone, Default)]
pub struct FeedState {
    pub replicas: Vec<Replica>,
    pub loads: Vec<ReplicaLoad>,
    pub index: ReplicaIndex,
    pub synced: bool,
    pub last_seq: Option<u64>,
    /// Messages that could not be applied (replica id out of range).
    pub rejected: u64,
    /// Where requests may go (`None`: anywhere, for users other than the filter); replicas
    /// elsewhere are listed in `refused`.
    allow: Option<Allowlist>,
    /// Ids of the replicas whose address the allowlist refuses: never routed to.
    refused: Vec<u32>,
    /// The engine-reported loads are too old to use (the agent has been away): candidates
    /// are weighed by the gateway's own in-flight counts only.
    pub loads_stale: bool,
    /// The index is too old to credit (the agent has been away): requests are routed by the
    /// fallbacks until a new snapshot.
    pub index_stale: bool,
}

/// Why a message was not applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FeedError {
    /// A replica id beyond what the index can address.
    BadReplica(u32),
    /// The message skipped sequence numbers: the subscriber must reconnect and resync.
    Gap { expected: u64, got: u64 },
}

impl std::fmt::Display for FeedError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FeedError::BadReplica(r) => write!(f, "replica id {r} out of range"),
            FeedError::Gap { expected, got } => write!(f, "feed sequence gap: expected {expected}, got {got}"),
        }
    }
}

fn rid(r: u32) -> Result<ReplicaId, FeedError> {
    ReplicaId::try_from(r).map_err(|_| FeedError::BadReplica(r))
}

impl FeedState {
    /// An empty state whose replicas are checked against `allow`.
    pub fn with_allowlist(allow: Option<Allowlist>) -> FeedState {
        FeedState { allow, ..FeedState::default() }
    }

    /// Checks the table against `allow` from now on.
    pub fn set_allowlist(&mut self, allow: &Allowlist) {
        if self.allow.as_ref() != Some(allow) {
            self.allow = Some(allow.clone());
            self.check_destinations();
        }
    }

    fn check_destinations(&mut self) {
        let Some(allow) = &self.allow else { return };
        self.refused = self.replicas.iter().filter(|r| !allow.allows(&r.address)).map(|r| r.id).collect();
    }

    /// Whether requests may go to replica `id` (its address is inside the allowlist).
    pub fn allowed(&self, id: u32) -> bool {
        !self.refused.contains(&id)
    }

    /// Replicas in the table whose address the allowlist refuses.
    pub fn refused(&self) -> &[u32] {
        &self.refused
    }

    /// Forgets everything (a new subscription starts).
    pub fn restart(&mut self) {
        self.synced = false;
        self.last_seq = None;
    }

    /// The replica serving `address`, if known.
    pub fn replica(&self, id: ReplicaId) -> Option<&Replica> {
        self.replicas.iter().find(|r| r.id == u32::from(id))
    }

    /// Applies one message. On a sequence gap the caller must resubscribe.
    pub fn apply(&mut self, msg: &FeedMessage) -> Result<(), FeedError> {
        if let Some(last) = self.last_seq {
            let expected = last.saturating_add(1);
            if msg.seq != expected {
                self.synced = false;
                return Err(FeedError::Gap { expected, got: msg.seq });
            }
        }
        self.last_seq = Some(msg.seq);
        let Some(body) = &msg.body else { return Ok(()) };
        let r = self.apply_body(body);
        if r.is_err() {
            self.rejected = self.rejected.saturating_add(1);
        }
        r
    }

    fn apply_body(&mut self, body: &Body) -> Result<(), FeedError> {
        match body {
            Body::Replicas(t) => {
                for r in &t.replicas {
                    rid(r.id)?;
                }
                // Replicas that left the table lose their blocks.
                let gone: Vec<u32> =
                    self.replicas.iter().map(|r| r.id).filter(|id| !t.replicas.iter().any(|n| n.id == *id)).collect();
                for id in gone {
                    self.index.clear_replica(rid(id)?);
                }
                self.replicas = t.replicas.clone();
                self.loads.retain(|l| t.replicas.iter().any(|r| r.id == l.replica));
                self.check_destinations();
            }
            Body::Snapshot(s) => {
                let r = rid(s.replica)?;
                if s.first {
                    self.index.clear_replica(r);
                    self.index.reserve(r, s.blocks.len());
                }
                for &k in &s.blocks {
                    self.index.insert(r, BlockKey(k));
                }
            }
            Body::SnapshotComplete(_) => self.synced = true,
            Body::Delta(d) => {
                let r = rid(d.replica)?;
                for &k in &d.removed {
                    self.index.remove(r, BlockKey(k));
                }
                for &k in &d.added {
                    self.index.insert(r, BlockKey(k));
                }
            }
            Body::Load(l) => {
                for load in &l.loads {
                    rid(load.replica)?;
                    match self.loads.iter_mut().find(|x| x.replica == load.replica) {
                        Some(x) => *x = load.clone(),
                        None => self.loads.push(load.clone()),
                    }
                }
            }
            Body::Reset(r) => self.index.clear_replica(rid(r.replica)?),
            Body::Heartbeat(_) => {}
        }
        Ok(())
    }
}

/// A subscriber's view across subscriptions: the state requests are served from, and, while a
/// new subscription receives its snapshot, the state being rebuilt. The serving state keeps
/// serving until the new one is complete, then the new one replaces it whole (memory doubles
/// meanwhile): a reconnect never leaves requests without an index.
#[derive(Debug, Clone, Default)]
pub struct FeedView {
    serving: FeedState,
    resync: Option<FeedState>,
    /// Engines (`fleet::replica_key`) reset since [`FeedView::take_cleared`] was last called.
    cleared: Vec<u64>,
}

/// At most this many reset engines are remembered between two decisions.
const MAX_CLEARED: usize = 4096;

/// What applying a message did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    /// Applied to the state it belongs to.
    Applied,
    /// Completed a resync: the rebuilt state now serves.
    Swapped,
}

impl FeedView {
    /// The state requests are served from.
    pub fn serving(&self) -> &FeedState {
        &self.serving
    }

    /// The engines reset (restarted, their caches emptied) since the last call, by
    /// `fleet::replica_key`.
    pub fn take_cleared(&mut self) -> Vec<u64> {
        std::mem::take(&mut self.cleared)
    }

    /// Whether the serving index is complete (a snapshot was fully received) and fresh.
    pub fn usable(&self) -> bool {
        self.serving.synced && !self.serving.index_stale
    }

    /// Whether the serving index is complete but too old to credit.
    pub fn stale(&self) -> bool {
        self.serving.synced && self.serving.index_stale
    }

    /// How old the serving state is, as the subscriber judges it (the feed has no clock):
    /// `index` when nothing has come from the agent for too long, `loads` when no load report
    /// has. A swap to a rebuilt state starts fresh.
    pub fn set_staleness(&mut self, index: bool, loads: bool) {
        self.serving.index_stale = index;
        self.serving.loads_stale = loads;
    }

    /// The state being rebuilt by a resync, if one is under way.
    pub fn resyncing_state(&self) -> Option<&FeedState> {
        self.resync.as_ref()
    }

    /// A resync is under way.
    pub fn resyncing(&self) -> bool {
        self.resync.is_some()
    }

    /// A new subscription delivered its first message: the agent starts over with its table and
    /// snapshot. A complete serving state keeps serving until the new one is complete; an
    /// incomplete one is simply rebuilt.
    pub fn begin_subscription(&mut self) {
        let fresh = FeedState::with_allowlist(self.serving.allow.clone());
        if self.serving.synced {
            self.resync = Some(fresh);
        } else {
            self.resync = None;
            self.serving = fresh;
        }
    }

    /// The destinations allowed from now on (the configuration changed).
    pub fn set_allowlist(&mut self, allow: &Allowlist) {
        self.serving.set_allowlist(allow);
        if let Some(r) = self.resync.as_mut() {
            r.set_allowlist(allow);
        }
    }

    /// Applies one message of the current subscription. On a gap the caller must resubscribe;
    /// a serving state that was complete stays usable meanwhile (missing a few changes, it is
    /// more useful than none), and a partial resync is dropped.
    pub fn apply(&mut self, msg: &FeedMessage) -> Result<Applied, FeedError> {
        let was_synced = self.serving.synced;
        let target = self.resync.as_mut().unwrap_or(&mut self.serving);
        if let Some(Body::Reset(r)) = &msg.body {
            let engine = target
                .replicas
                .iter()
                .find(|x| x.id == r.replica)
                .map(|x| crate::fleet::replica_key(&x.address, x.data_parallel().then_some(x.dp_rank)));
            if let Some(e) = engine.filter(|e| !self.cleared.contains(e)) {
                if self.cleared.len() < MAX_CLEARED {
                    self.cleared.push(e);
                }
            }
        }
        match target.apply(msg) {
            Ok(()) => {
                if self.resync.as_ref().is_some_and(|r| r.synced) {
                    if let Some(r) = self.resync.take() {
                        self.serving = r;
                        return Ok(Applied::Swapped);
                    }
                }
                Ok(Applied::Applied)
            }
            Err(e @ FeedError::Gap { .. }) => {
                if self.resync.take().is_none() {
                    self.serving.synced = was_synced;
                }
                Err(e)
            }
            Err(e) => Err(e),
        }
    }
}

#[cfg(test)]
#[allow(clippy::arithmetic_side_effects)]
mod tests {
    use super::*;
    use prost::Message;

    fn msg(seq: u64, body: Body) -> FeedMessage {
        FeedMessage { seq, body: Some(body) }
    }

    #[test]
    fn snapshot_then_deltas() {
        let mut st = FeedState::default();
        let table = ReplicaTable {
            replicas: vec![
                Replica {
                    id: 0,
                    name: "a".into(),
                    address: "127.0.0.1:8001".into(),
                    models: vec!["m".into()],
                    up: true,
                    dp_rank: 0,
                    hash: None,
                    dp_size: 0,
                    kv_groups: vec![],
                },
                Replica {
                    id: 1,
                    name: "b".into(),
                    address: "127.0.0.1:8002".into(),
                    models: vec!["m".into()],
                    up: true,
                    dp_rank: 0,
                    hash: None,
                    dp_size: 0,
                    kv_groups: vec![],
                },
            ],
        };
        let msgs = vec![
            msg(0, Body::Replicas(table)),
            msg(1, Body::Snapshot(SnapshotChunk { replica: 0, first: true, blocks: vec![1, 2, 3] })),
            msg(2, Body::Snapshot(SnapshotChunk { replica: 1, first: true, blocks: vec![1] })),
            msg(3, Body::SnapshotComplete(SnapshotComplete {})),
            msg(4, Body::Delta(BlockDelta { replica: 1, added: vec![2], removed: vec![] })),
            msg(5, Body::Delta(BlockDelta { replica: 0, added: vec![], removed: vec![2] })),
        ];
        for m in &msgs {
            // Through the wire, as the filter receives them.
            let decoded = FeedMessage::decode(m.encode_to_vec().as_slice()).unwrap();
            assert_eq!(&decoded, m);
            st.apply(&decoded).unwrap();
        }
        assert!(st.synced);
        let s = st.index.score(&[BlockKey(1), BlockKey(2), BlockKey(3)]);
        assert_eq!(s.leading, vec![1, 2]);
        st.apply(&msg(6, Body::Reset(ReplicaReset { replica: 1, reason: "restart".into() }))).unwrap();
        assert_eq!(st.index.score(&[BlockKey(1), BlockKey(2), BlockKey(3)]).leading, vec![1, 0]);
        assert_eq!(st.apply(&msg(8, Body::Heartbeat(Heartbeat {}))), Err(FeedError::Gap { expected: 7, got: 8 }));
        assert!(!st.synced);
        st.restart();
        let bad = msg(0, Body::Delta(BlockDelta { replica: 70_000, added: vec![1], removed: vec![] }));
        assert_eq!(st.apply(&bad), Err(FeedError::BadReplica(70_000)));
        assert_eq!(st.rejected, 1);
    }

    fn table(ids: &[u32]) -> Body {
        Body::Replicas(ReplicaTable {
            replicas: ids
                .iter()
                .map(|&id| Replica {
                    id,
                    name: format!("r{id}"),
                    address: format!("127.0.0.1:{}", 8000 + id),
                    models: vec![],
                    up: true,
                    dp_rank: 0,
                    hash: None,
                    dp_size: 0,
                    kv_groups: vec![],
                })
                .collect(),
        })
    }

    fn snapshot(view: &mut FeedView, seq0: u64, blocks: Vec<u64>) -> Vec<Applied> {
        view.begin_subscription();
        [
            table(&[0]),
            Body::Snapshot(SnapshotChunk { replica: 0, first: true, blocks }),
            Body::SnapshotComplete(SnapshotComplete {}),
        ]
        .into_iter()
        .enumerate()
        .map(|(i, b)| view.apply(&msg(seq0 + i as u64, b)).unwrap())
        .collect()
    }

    #[test]
    fn the_old_index_serves_until_the_resync_is_complete() {
        let mut view = FeedView::default();
        assert!(!view.usable());
        // A first subscription builds the serving state in place.
        assert_eq!(snapshot(&mut view, 0, vec![1, 2]), vec![Applied::Applied; 3]);
        assert!(view.usable() && !view.resyncing());
        // A resubscription: until its snapshot completes, requests see the old blocks.
        view.begin_subscription();
        assert!(view.resyncing());
        view.apply(&msg(0, table(&[0]))).unwrap();
        view.apply(&msg(1, Body::Snapshot(SnapshotChunk { replica: 0, first: true, blocks: vec![7] }))).unwrap();
        assert!(view.usable());
        assert_eq!(view.serving().index.score(&[BlockKey(1), BlockKey(2)]).leading, vec![2]);
        assert_eq!(view.serving().index.score(&[BlockKey(7)]).leading, vec![0]);
        assert_eq!(view.apply(&msg(2, Body::SnapshotComplete(SnapshotComplete {}))), Ok(Applied::Swapped));
        assert!(!view.resyncing());
        assert_eq!(view.serving().index.score(&[BlockKey(1), BlockKey(2)]).leading, vec![0]);
        assert_eq!(view.serving().index.score(&[BlockKey(7)]).leading, vec![1]);
    }

    #[test]
    fn a_gap_drops_a_partial_resync_and_keeps_a_complete_index_serving() {
        let mut view = FeedView::default();
        snapshot(&mut view, 0, vec![1]);
        // A gap on the serving subscription: still usable.
        let gap = view.apply(&msg(9, Body::Heartbeat(Heartbeat {})));
        assert_eq!(gap, Err(FeedError::Gap { expected: 3, got: 9 }));
        assert!(view.usable());
        // A gap during a resync: the partial state goes, the old one stays.
        view.begin_subscription();
        view.apply(&msg(0, table(&[0]))).unwrap();
        assert!(view.apply(&msg(5, Body::Heartbeat(Heartbeat {}))).is_err());
        assert!(!view.resyncing() && view.usable());
        assert_eq!(view.serving().index.score(&[BlockKey(1)]).leading, vec![1]);
        // An incomplete serving state is rebuilt in place by the next subscription.
        let mut fresh = FeedView::default();
        fresh.begin_subscription();
        fresh.apply(&msg(0, table(&[0]))).unwrap();
        fresh.begin_subscription();
        assert!(!fresh.resyncing() && fresh.serving().replicas.is_empty());
    }
}
