//! The sidecar's own record of one engine's cache: every block the engine's events left in its
//! local GPU cache (per KV-cache group, with copy counts), and the sequence number it is exact
//! at. The blocks are kept in a vector of shared chunks (a hash map only indexes it), so a
//! [`Ledger::copy`] taken under the sidecar's lock costs one reference per 4,096 blocks and
//! event ingestion waits microseconds whatever the engine's size; [`LedgerCopy::encode`] turns
//! it into a snapshot outside the lock.

use super::chunked::ChunkedVec;
use super::Snapshot;
use llmgw_core::event::{EventBatch, KvEvent, Medium};
use llmgw_core::hash::MAX_KV_GROUPS;
use llmgw_core::wire::{encode_batch, Encoding, HashForm, WireBatch, WireBlockStored, WireEvent};
use std::collections::{BTreeMap, HashMap};

/// A KV-cache group as the engine's stores describe it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct GroupInfo {
    pub kind: Option<String>,
    pub block_size: u64,
    pub sliding_window: Option<i64>,
}

/// One engine's blocks, as its events left them.
#[derive(Debug)]
pub struct Ledger {
    /// Every distinct block: (group, published key, copies held), in no order.
    entries: ChunkedVec<(u32, u64, u32)>,
    /// (group, published key) → its place in `entries`.
    index: HashMap<(u32, u64), usize>,
    groups: BTreeMap<u32, GroupInfo>,
    /// The last batch applied.
    seq: Option<u64>,
    /// The ledger holds only what batches from this one on stored (the sidecar started after
    /// the engine and its replay buffer no longer reached back, or a gap could not be filled).
    incomplete_from: Option<u64>,
    /// Most distinct blocks held; past it the ledger is dropped and marked incomplete.
    max_blocks: usize,
    /// Times `max_blocks` was passed.
    pub limit_hits: u64,
    /// The publisher's connection dropped and no batch came since: the engine may have
    /// restarted, so no snapshot is served until its next batch is judged.
    suspended: bool,
}

/// What [`Ledger::copy`] takes: everything a snapshot needs, flat.
#[derive(Debug, Clone)]
pub struct LedgerCopy {
    /// Shares the ledger's chunks until the ledger changes them.
    pub entries: ChunkedVec<(u32, u64, u32)>,
    pub groups: BTreeMap<u32, GroupInfo>,
    /// `None` before the first batch, or while suspended.
    pub seq: Option<u64>,
    pub incomplete_from: Option<u64>,
}

/// The group of a block the agent's mirror keeps (local GPU cache, a known group); `None` for
/// the rest, as the mirror ignores them.
fn relevant(medium: &Medium, locality: Option<&str>, group: Option<i64>) -> Option<u32> {
    if *medium != Medium::Gpu || !matches!(locality, None | Some("LOCAL")) {
        return None;
    }
    u32::try_from(group.unwrap_or(0)).ok().filter(|g| *g < MAX_KV_GROUPS)
}

impl Ledger {
    pub fn new(max_blocks: usize) -> Ledger {
        Ledger {
            entries: ChunkedVec::default(),
            index: HashMap::new(),
            groups: BTreeMap::new(),
            seq: None,
            incomplete_from: None,
            max_blocks,
            limit_hits: 0,
            suspended: false,
        }
    }

    /// Distinct blocks held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The last batch applied.
    pub fn seq(&self) -> Option<u64> {
        self.seq
    }

    pub fn incomplete_from(&self) -> Option<u64> {
        self.incomplete_from
    }

    /// Drops every block (engine restarted, a gap that could not be filled).
    pub fn reset(&mut self) {
        self.clear_blocks();
        self.groups.clear();
        self.seq = None;
    }

    /// The publisher's connection dropped: no snapshot until the next batch.
    pub fn suspend(&mut self) {
        self.suspended = true;
    }

    /// From batch `from` on only: what was stored before it and is still cached is unknown.
    pub fn mark_incomplete(&mut self, from: u64) {
        self.incomplete_from = Some(from);
    }

    /// Applies batch `seq` (live or replayed, in sequence order).
    pub fn apply(&mut self, seq: u64, batch: &EventBatch) {
        if seq == 0 {
            // The engine's first batch: nothing before it exists.
            self.reset();
            self.incomplete_from = None;
        }
        self.seq = Some(seq);
        self.suspended = false;
        for ev in &batch.events {
            match ev {
                KvEvent::Stored(s) => {
                    let Some(g) = relevant(&s.medium, s.locality.as_deref(), s.group_idx) else { continue };
                    self.groups.insert(
                        g,
                        GroupInfo {
                            kind: s.spec_kind.clone(),
                            block_size: s.block_size,
                            sliding_window: s.sliding_window,
                        },
                    );
                    for k in &s.hashes {
                        self.store(g, k.0);
                    }
                }
                KvEvent::Removed(r) => {
                    let Some(g) = relevant(&r.medium, r.locality.as_deref(), r.group_idx) else { continue };
                    for k in &r.hashes {
                        self.remove(g, k.0);
                    }
                }
                KvEvent::AllCleared => {
                    self.clear_blocks();
                    self.incomplete_from = None;
                }
                KvEvent::Unknown(_) => {}
            }
        }
        if self.entries.len() > self.max_blocks {
            self.limit_hits = self.limit_hits.saturating_add(1);
            self.reset();
            self.seq = Some(seq);
            self.incomplete_from = Some(seq.saturating_add(1));
        }
    }

    fn clear_blocks(&mut self) {
        self.entries.clear();
        self.index.clear();
    }

    /// One more copy of block `k` of group `g`.
    fn store(&mut self, g: u32, k: u64) {
        match self.index.get(&(g, k)).and_then(|&i| self.entries.get_mut(i)) {
            Some(e) => e.2 = e.2.saturating_add(1),
            None => {
                self.index.insert((g, k), self.entries.len());
                self.entries.push((g, k, 1));
            }
        }
    }

    /// One copy of block `k` of group `g` fewer; the last one leaves (the vector's last entry
    /// takes its place).
    fn remove(&mut self, g: u32, k: u64) {
        let Some(&i) = self.index.get(&(g, k)) else { return };
        match self.entries.get_mut(i) {
            Some(e) if e.2 > 1 => e.2 = e.2.saturating_sub(1),
            Some(_) => {
                self.entries.swap_remove(i);
                self.index.remove(&(g, k));
                if let Some(&(mg, mk, _)) = self.entries.get(i) {
                    self.index.insert((mg, mk), i);
                }
            }
            None => {
                self.index.remove(&(g, k));
            }
        }
    }

    /// Everything a snapshot needs (taken under the lock: one reference per chunk of entries,
    /// no copy of them, no hashing, no sorting).
    pub fn copy(&self) -> LedgerCopy {
        LedgerCopy {
            entries: self.entries.clone(),
            groups: self.groups.clone(),
            seq: self.seq.filter(|_| !self.suspended),
            incomplete_from: self.incomplete_from,
        }
    }
}

impl LedgerCopy {
    /// The snapshot: one vLLM `KVEventBatch` whose `BlockStored` events, applied to an empty
    /// cache, leave exactly these blocks (one event per group, a block repeated once per copy);
    /// `None` before the first batch.
    pub fn encode(self, dp_rank: u32) -> Option<Snapshot> {
        let seq = self.seq?;
        let mut entries: Vec<(u32, u64, u32)> = self.entries.iter().copied().collect();
        entries.sort_unstable();
        let mut events: Vec<WireEvent> = Vec::new();
        let mut current: Option<(u32, WireBlockStored)> = None;
        for (g, k, c) in entries {
            if current.as_ref().is_none_or(|(cg, _)| *cg != g) {
                if let Some((_, ev)) = current.take() {
                    events.push(WireEvent::BlockStored(ev));
                }
                let info = self.groups.get(&g).cloned().unwrap_or_default();
                current = Some((
                    g,
                    WireBlockStored {
                        block_size: info.block_size,
                        medium: Some("GPU".to_owned()),
                        group_idx: Some(i64::from(g)),
                        kv_cache_spec_kind: info.kind,
                        kv_cache_spec_sliding_window: info.sliding_window,
                        ..WireBlockStored::default()
                    },
                ));
            }
            if let Some((_, ev)) = current.as_mut() {
                ev.block_hashes.extend(std::iter::repeat_n(k, usize::try_from(c).unwrap_or(0)));
            }
        }
        if let Some((_, ev)) = current.take() {
            events.push(WireEvent::BlockStored(ev));
        }
        let batch = WireBatch { ts: 0.0, events, data_parallel_rank: Some(i64::from(dp_rank)) };
        Some(Snapshot {
            seq,
            incomplete_from: self.incomplete_from,
            payload: encode_batch(&batch, Encoding::Tagged, HashForm::Int),
        })
    }
}

#[cfg(test)]
#[allow(clippy::arithmetic_side_effects)]
mod tests {
    use super::*;
    use llmgw_core::hash::BlockKey;
    use llmgw_core::mirror::EngineMirror;
    use llmgw_core::wire::WireBlockRemoved;

    fn batch(events: Vec<WireEvent>) -> EventBatch {
        EventBatch::from(WireBatch { ts: 1.0, events, data_parallel_rank: Some(0) })
    }

    fn stored(hashes: Vec<u64>, group: Option<i64>, medium: &str) -> WireEvent {
        WireEvent::BlockStored(WireBlockStored {
            block_hashes: hashes,
            block_size: 16,
            medium: Some(medium.to_owned()),
            group_idx: group,
            kv_cache_spec_kind: group.map(|_| "sliding_window".to_owned()),
            ..WireBlockStored::default()
        })
    }

    fn removed(hashes: Vec<u64>) -> WireEvent {
        WireEvent::BlockRemoved(WireBlockRemoved { block_hashes: hashes, ..WireBlockRemoved::default() })
    }

    fn counts(m: &EngineMirror) -> Vec<(BlockKey, u32)> {
        m.keys().into_iter().map(|k| (k, m.count(k))).collect()
    }

    #[test]
    fn a_snapshot_applied_to_an_empty_mirror_holds_what_the_batches_left() {
        let batches = [
            batch(vec![stored(vec![1, 2, 3], None, "GPU"), stored(vec![2, 1], None, "GPU")]),
            batch(vec![stored(vec![9, 8], Some(1), "GPU"), stored(vec![50], None, "CPU")]),
            batch(vec![removed(vec![3, 2, 77])]),
        ];
        let (mut ledger, mut mirror, mut out) = (Ledger::new(100), EngineMirror::new(None), Vec::new());
        for (seq, b) in batches.iter().enumerate() {
            ledger.apply(seq as u64 + 4, b);
            mirror.apply(b, &mut out);
        }
        let snap = ledger.copy().encode(0).expect("a snapshot after a batch");
        assert_eq!((snap.seq, snap.incomplete_from), (6, None));
        let mut from_snapshot = EngineMirror::new(None);
        from_snapshot.apply(&EventBatch::decode(&snap.payload).expect("decodes"), &mut out);
        assert_eq!(counts(&from_snapshot), counts(&mirror));
        assert_eq!(from_snapshot.groups(), mirror.groups());
        assert_eq!(from_snapshot.len(), 4, "1, 2 (one copy left), 9 and 8 in group 1");
        assert_eq!(from_snapshot.count(BlockKey(1)), 2, "both copies of block 1");
    }

    #[test]
    fn stores_and_removals_in_any_order_leave_what_a_map_of_counts_would() {
        // Removals move the vector's last entry into the freed place: its index must follow.
        let (mut ledger, mut model) = (Ledger::new(1 << 20), HashMap::<u64, u32>::new());
        let mut x: u64 = 7;
        for seq in 0..2000u64 {
            x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            let k = (x >> 33) % 64;
            if x & 1 == 0 || !model.contains_key(&k) {
                ledger.apply(seq, &batch(vec![stored(vec![k], None, "GPU")]));
                *model.entry(k).or_default() += 1;
            } else {
                ledger.apply(seq, &batch(vec![removed(vec![k])]));
                let c = model.get_mut(&k).expect("held");
                *c -= 1;
                if *c == 0 {
                    model.remove(&k);
                }
            }
        }
        let mut got: Vec<(u64, u32)> = ledger.copy().entries.iter().map(|&(_, k, c)| (k, c)).collect();
        let mut want: Vec<(u64, u32)> = model.into_iter().collect();
        got.sort_unstable();
        want.sort_unstable();
        assert_eq!(got, want);
        assert_eq!(ledger.index.len(), ledger.entries.len());
        assert!(ledger.index.iter().all(|(&(g, k), &i)| ledger.entries.get(i).is_some_and(|e| (e.0, e.1) == (g, k))));
    }

    #[test]
    fn a_restart_a_clear_and_the_block_limit() {
        let mut ledger = Ledger::new(3);
        assert!(ledger.copy().encode(0).is_none(), "nothing seen: no snapshot");
        ledger.apply(5, &batch(vec![stored(vec![1, 2], None, "GPU")]));
        ledger.mark_incomplete(5);
        // The engine restarted: its first batch makes the ledger exact again.
        ledger.apply(0, &batch(vec![stored(vec![7], None, "GPU")]));
        assert_eq!((ledger.len(), ledger.incomplete_from()), (1, None));
        ledger.mark_incomplete(1);
        ledger.apply(1, &batch(vec![WireEvent::AllBlocksCleared, stored(vec![3], None, "GPU")]));
        assert_eq!((ledger.len(), ledger.incomplete_from()), (1, None));
        ledger.apply(2, &batch(vec![stored(vec![10, 11, 12], None, "GPU")]));
        assert_eq!((ledger.len(), ledger.limit_hits, ledger.incomplete_from()), (0, 1, Some(3)));
        let snap = ledger.copy().encode(0).expect("seq known");
        assert_eq!((snap.seq, snap.incomplete_from), (2, Some(3)));
        // A lost connection: nothing is served until the next batch says whose engine it is.
        ledger.suspend();
        assert!(ledger.copy().encode(0).is_none());
        ledger.apply(3, &batch(vec![stored(vec![1], None, "GPU")]));
        assert_eq!(ledger.copy().encode(0).map(|s| s.seq), Some(3));
    }
}
