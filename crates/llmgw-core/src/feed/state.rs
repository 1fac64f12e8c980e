//! A subscriber's state: the fleet the feed announced, its blocks and loads, applied message by
//! message.

use super::messages::{BlockDelta, Body, FeedMessage};
use crate::allow::Allowlist;
use crate::fleet::{Load, Replica};
use crate::hash::BlockKey;
use crate::index::{ReplicaId, ReplicaIndex};

/// What a subscriber knows: the replica table, their blocks and loads, and whether the index
/// is complete (a snapshot was fully received since the last (re)connection).
#[derive(Debug, Clone, Default)]
pub struct FeedState {
    pub replicas: Vec<Replica>,
    /// Sorted by replica id (see [`FeedState::load`]).
    pub loads: Vec<Load>,
    /// Bumped whenever the replica table or the allowlist changes: what is derived from the
    /// table (hash plans) is recomputed when it moves.
    pub table_version: u64,
    pub index: ReplicaIndex,
    pub synced: bool,
    pub last_seq: Option<u64>,
    /// Messages that could not be applied (replica id out of range).
    pub rejected: u64,
    /// Where requests may go (`None`: anywhere, for users other than the filter); replicas
    /// elsewhere are listed in `refused`.
    pub(super) allow: Option<Allowlist>,
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
    /// The LoRA adapter `model` names, as the replicas list it (name, path): `Ok(None)` when
    /// none lists it as an adapter, `Err(())` when they disagree on its path (its blocks hash
    /// differently on each: no hash of the request is right).
    #[allow(clippy::result_unit_err)]
    pub fn lora_adapter(&self, model: Option<&str>) -> Result<Option<(String, String)>, ()> {
        let Some(model) = model else { return Ok(None) };
        let mut paths = self
            .replicas
            .iter()
            .flat_map(|r| r.lora_adapters.iter())
            .filter(|(name, _)| name == model)
            .map(|(_, path)| path);
        let Some(first) = paths.next() else { return Ok(None) };
        if paths.all(|p| p == first) {
            Ok(Some((model.to_owned(), first.clone())))
        } else {
            Err(())
        }
    }

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
        self.refused = self.replicas.iter().filter(|r| !allow.allows(&r.address)).map(|r| u32::from(r.id)).collect();
        self.table_version = self.table_version.wrapping_add(1);
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

    /// The load replica `id`'s engine last reported (a binary search: the loads are sorted by
    /// replica id).
    pub fn load(&self, id: ReplicaId) -> Option<&Load> {
        let i = self.loads.binary_search_by_key(&id, |l| l.replica).ok()?;
        self.loads.get(i)
    }

    /// The replica serving `address`, if known.
    pub fn replica(&self, id: ReplicaId) -> Option<&Replica> {
        self.replicas.iter().find(|r| r.id == id)
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

    fn apply_delta(&mut self, d: &BlockDelta) -> Result<(), FeedError> {
        let r = rid(d.replica)?;
        for &k in &d.removed {
            self.index.remove(r, BlockKey(k));
        }
        for &k in &d.added {
            self.index.insert(r, BlockKey(k));
        }
        Ok(())
    }

    fn apply_body(&mut self, body: &Body) -> Result<(), FeedError> {
        match body {
            Body::Replicas(t) => {
                let mut replicas = Vec::with_capacity(t.replicas.len());
                for r in &t.replicas {
                    replicas.push(r.resolve().ok_or(FeedError::BadReplica(r.id))?);
                }
                // Replicas that left the table lose their blocks.
                let gone: Vec<ReplicaId> =
                    self.replicas.iter().map(|r| r.id).filter(|id| !replicas.iter().any(|n| n.id == *id)).collect();
                for id in gone {
                    self.index.clear_replica(id);
                }
                self.loads.retain(|l| replicas.iter().any(|r| r.id == l.replica));
                self.replicas = replicas;
                self.table_version = self.table_version.wrapping_add(1);
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
            Body::Delta(d) => self.apply_delta(d)?,
            Body::Deltas(ds) => {
                // Each part stands alone: one naming an unknown replica is refused, the others
                // are applied, in order.
                let mut first_error = None;
                for d in &ds.deltas {
                    if let Err(e) = self.apply_delta(d) {
                        first_error.get_or_insert(e);
                    }
                }
                if let Some(e) = first_error {
                    return Err(e);
                }
            }
            Body::Load(l) => {
                for load in &l.loads {
                    let load = load.resolve().ok_or(FeedError::BadReplica(load.replica))?;
                    match self.loads.binary_search_by_key(&load.replica, |x| x.replica) {
                        Ok(i) => {
                            if let Some(x) = self.loads.get_mut(i) {
                                *x = load;
                            }
                        }
                        Err(i) => self.loads.insert(i, load),
                    }
                }
            }
            Body::Reset(r) => self.index.clear_replica(rid(r.replica)?),
            Body::Heartbeat(_) => {}
        }
        Ok(())
    }
}
