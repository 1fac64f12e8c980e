//! Block key → the replicas holding it, with leading-prefix scoring.
//!
//! Layout: replicas are grouped in pages of 16; each page is an open-addressing table of 8-byte
//! slots, `fingerprint (48 bits) | replica bitmask (16 bits)`, with linear probing and
//! backward-shift deletion (no tombstones). Placement is keyed: the fingerprint is the top 48
//! bits of `mix64(key ^ secret)` (a bijection on u64; the secret is drawn once per process,
//! `placement::placement_secret`), and the slot a key belongs to is the top bits of its
//! fingerprint. Publishers choose block keys: with an unkeyed placement they could send keys
//! that all probe one slot, stalling every lookup.
//! Two block keys share a slot only when their products agree in 48 bits (probability about
//! n²/2⁴⁹ for an index of n blocks: one merged pair in a thousand indexes of 800,000 blocks),
//! which at worst credits a replica with one block it does not hold.
//!
//! A fleet of up to 16 replicas costs 8 bytes per distinct block, shared by every replica
//! holding it; small slots keep large indexes within the CPU's TLB reach.
//!
//! No clocks; the only random state is the placement secret, which changes where keys sit, never
//! what the index answers.

use crate::hash::BlockKey;
use crate::mirror::NetChange;

/// A replica's slot in the index: dense from 0, chosen by whoever owns the replica table (the
/// agent numbers the replicas of its feed). Distinct from the feed's wire `u32` so an id that
/// does not fit is refused where it enters ([`ReplicaId::try_from`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct ReplicaId(pub u16);

impl From<ReplicaId> for usize {
    fn from(r: ReplicaId) -> usize {
        usize::from(r.0)
    }
}

impl From<ReplicaId> for u32 {
    fn from(r: ReplicaId) -> u32 {
        u32::from(r.0)
    }
}

impl TryFrom<u32> for ReplicaId {
    type Error = std::num::TryFromIntError;
    fn try_from(v: u32) -> Result<Self, Self::Error> {
        u16::try_from(v).map(ReplicaId)
    }
}

impl TryFrom<usize> for ReplicaId {
    type Error = std::num::TryFromIntError;
    fn try_from(v: usize) -> Result<Self, Self::Error> {
        u16::try_from(v).map(ReplicaId)
    }
}

impl std::fmt::Display for ReplicaId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

const PAGE_BITS: usize = 16;
const MASK_BITS: u32 = 16;
const FP_BITS: u32 = 48;
const MIN_CAPACITY: usize = 16;
/// Table size cap; `1 << 40` does not fit a 32-bit usize (wasm32).
const MAX_CAPACITY: usize = if usize::BITS > 32 { 1 << (usize::BITS - 24) } else { 1 << 30 };

/// The 48-bit fingerprint of a key (never all of a slot: the mask of an occupied slot is set).
#[inline]
fn fingerprint(key: BlockKey) -> u64 {
    crate::placement::place(key.0) >> MASK_BITS
}

#[inline]
fn slot_fp(s: u64) -> u64 {
    s >> MASK_BITS
}

#[inline]
fn slot_mask(s: u64) -> u64 {
    s & 0xffff
}

/// One page: up to 16 replicas.
#[derive(Clone, Default, Debug)]
struct Table {
    slots: Vec<u64>,
    len: usize,
    /// 48 - log2(capacity).
    shift: u32,
}

impl Table {
    #[inline]
    fn cap_mask(&self) -> usize {
        self.slots.len().wrapping_sub(1)
    }

    /// The slot a fingerprint belongs to (`shift` keeps the result below the capacity).
    #[inline]
    fn home(&self, fp: u64) -> usize {
        (fp >> self.shift) as usize
    }

    #[inline]
    fn get(&self, key: BlockKey) -> u64 {
        match self.find(fingerprint(key)) {
            (i, true) => self.slots.get(i).map_or(0, |&s| slot_mask(s)),
            _ => 0,
        }
    }

    /// Loads the home slots of `keys` so that their cache misses overlap (the result only
    /// exists to keep the loads from being optimised away).
    #[inline]
    fn touch(&self, keys: impl Iterator<Item = BlockKey>) -> u64 {
        let mut acc = 0u64;
        for k in keys {
            if let Some(s) = self.slots.get(self.home(fingerprint(k))) {
                acc ^= s;
            }
        }
        acc
    }

    /// Finds the slot holding `fp` (`true`), or the free slot where it would go (`false`).
    #[inline]
    fn find(&self, fp: u64) -> (usize, bool) {
        if self.slots.is_empty() {
            return (0, false);
        }
        let m = self.cap_mask();
        let mut i = self.home(fp);
        loop {
            match self.slots.get(i) {
                Some(&0) | None => return (i, false),
                Some(&s) if slot_fp(s) == fp => return (i, true),
                Some(_) => i = i.wrapping_add(1) & m,
            }
        }
    }

    fn with_capacity(cap: usize) -> Table {
        // At most 2^40 slots (2^30 where usize is 32 bits, as in wasm32): the fingerprint must cover the home index.
        let cap = cap.clamp(MIN_CAPACITY, MAX_CAPACITY).next_power_of_two();
        Table { slots: vec![0; cap], len: 0, shift: FP_BITS.saturating_sub(cap.trailing_zeros()) }
    }

    fn grow_if_needed(&mut self) {
        // Keep the load at or below 7/8.
        let cap = self.slots.len();
        if self.len.saturating_add(1).saturating_mul(8) > cap.saturating_mul(7) {
            self.rehash(cap.saturating_mul(2).max(MIN_CAPACITY));
        }
    }

    fn rehash(&mut self, cap: usize) {
        let old = std::mem::take(&mut self.slots);
        *self = Table::with_capacity(cap);
        for s in old.into_iter().filter(|&s| slot_mask(s) != 0) {
            let (i, _) = self.find(slot_fp(s));
            if let Some(dst) = self.slots.get_mut(i) {
                *dst = s;
                self.len = self.len.saturating_add(1);
            }
        }
    }

    /// Sets `bit` for `key`; true if it was not set.
    fn set(&mut self, key: BlockKey, bit: u64) -> bool {
        self.grow_if_needed();
        let fp = fingerprint(key);
        let (i, found) = self.find(fp);
        let Some(s) = self.slots.get_mut(i) else { return false };
        if found {
            let was = *s & bit != 0;
            *s |= bit;
            !was
        } else {
            *s = (fp << MASK_BITS) | bit;
            self.len = self.len.saturating_add(1);
            true
        }
    }

    /// Clears `bit` for `key`; true if it was set.
    fn unset(&mut self, key: BlockKey, bit: u64) -> bool {
        let (i, found) = self.find(fingerprint(key));
        if !found {
            return false;
        }
        let Some(s) = self.slots.get_mut(i) else { return false };
        let was = *s & bit != 0;
        *s &= !bit;
        if slot_mask(*s) == 0 {
            self.delete_at(i);
        }
        was
    }

    /// Backward-shift deletion: pulls later members of the probe run into the hole.
    fn delete_at(&mut self, mut hole: usize) {
        let m = self.cap_mask();
        let mut j = hole;
        loop {
            j = j.wrapping_add(1) & m;
            let Some(&s) = self.slots.get(j) else { break };
            if s == 0 {
                break;
            }
            let home = self.home(slot_fp(s));
            // Move s into the hole unless its home lies cyclically within (hole, j].
            let dist_home = j.wrapping_sub(home) & m;
            let dist_hole = j.wrapping_sub(hole) & m;
            if dist_home >= dist_hole {
                if let Some(dst) = self.slots.get_mut(hole) {
                    *dst = s;
                }
                hole = j;
            }
        }
        if let Some(dst) = self.slots.get_mut(hole) {
            *dst = 0;
        }
        self.len = self.len.saturating_sub(1);
    }

    /// Clears `bit` everywhere; returns how many slots had it.
    fn unset_all(&mut self, bit: u64) -> u64 {
        let mut n = 0u64;
        for s in self.slots.iter_mut() {
            if *s & bit != 0 {
                *s &= !bit;
                n = n.saturating_add(1);
                if slot_mask(*s) == 0 {
                    *s = 0;
                }
            }
        }
        if n > 0 {
            // Rebuild without the emptied slots (same capacity, or smaller when mostly empty).
            let live = self.slots.iter().filter(|&&s| s != 0).count();
            let cap = self.slots.len();
            let target = if live.saturating_mul(8) < cap { live.saturating_mul(2) } else { cap };
            self.rehash(target);
        }
        n
    }
}

/// Per replica, how many leading blocks of a request it holds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Scores {
    /// `leading[r]`: number of consecutive blocks from block 0 that replica `r` holds.
    pub leading: Vec<u32>,
    /// Number of blocks in the request.
    pub total: u32,
}

impl Scores {
    /// Share of the request's blocks that replica `r`'s leading run covers (0 when empty).
    pub fn share(&self, r: ReplicaId) -> f64 {
        match (self.leading.get(usize::from(r)), self.total) {
            (Some(&l), t) if t > 0 => f64::from(l) / f64::from(t),
            _ => 0.0,
        }
    }

    /// The replica with the longest leading run (lowest id on ties), if any holds block 0.
    pub fn best(&self) -> Option<(ReplicaId, u32)> {
        let mut best: Option<(ReplicaId, u32)> = None;
        for (r, &l) in self.leading.iter().enumerate() {
            if l > 0 && best.is_none_or(|(_, b)| l > b) {
                best = ReplicaId::try_from(r).ok().map(|r| (r, l));
            }
        }
        best
    }
}

/// Block key → replicas holding it.
#[derive(Clone, Default, Debug)]
pub struct ReplicaIndex {
    pages: Vec<Table>,
    /// Distinct blocks held, per replica.
    blocks: Vec<u64>,
}

impl ReplicaIndex {
    pub fn new() -> Self {
        Self::default()
    }

    /// Pre-sizes the table of the page holding `replica` for `blocks` distinct keys.
    pub fn reserve(&mut self, replica: ReplicaId, blocks: usize) {
        let (p, _) = Self::page_bit(replica);
        self.ensure(replica);
        if let Some(t) = self.pages.get_mut(p) {
            let want = blocks.saturating_add(t.len).saturating_mul(8) / 7;
            if want > t.slots.len() {
                t.rehash(want.saturating_add(1));
            }
        }
    }

    #[inline]
    fn page_bit(replica: ReplicaId) -> (usize, u64) {
        let r = usize::from(replica);
        (r / PAGE_BITS, 1u64 << (r % PAGE_BITS))
    }

    fn ensure(&mut self, replica: ReplicaId) {
        let (p, _) = Self::page_bit(replica);
        if self.pages.len() <= p {
            self.pages.resize_with(p.saturating_add(1), Table::default);
        }
        let r = usize::from(replica);
        if self.blocks.len() <= r {
            self.blocks.resize(r.saturating_add(1), 0);
        }
    }

    fn bump(&mut self, replica: ReplicaId, up: bool) {
        if let Some(c) = self.blocks.get_mut(usize::from(replica)) {
            *c = if up { c.saturating_add(1) } else { c.saturating_sub(1) };
        }
    }

    /// Records that `replica` holds `key`. Idempotent.
    pub fn insert(&mut self, replica: ReplicaId, key: BlockKey) {
        self.ensure(replica);
        let (p, bit) = Self::page_bit(replica);
        if self.pages.get_mut(p).is_some_and(|t| t.set(key, bit)) {
            self.bump(replica, true);
        }
    }

    /// Records that `replica` no longer holds `key`. Idempotent.
    pub fn remove(&mut self, replica: ReplicaId, key: BlockKey) {
        let (p, bit) = Self::page_bit(replica);
        if self.pages.get_mut(p).is_some_and(|t| t.unset(key, bit)) {
            self.bump(replica, false);
        }
    }

    /// Applies a replica's net changes.
    pub fn apply(&mut self, replica: ReplicaId, changes: &[NetChange]) {
        self.ensure(replica);
        let (p, bit) = Self::page_bit(replica);
        let Some(t) = self.pages.get_mut(p) else { return };
        let mut added = 0u64;
        let mut removed = 0u64;
        // Random keys into a large table: issue a chunk's loads together so that their cache
        // and TLB misses overlap, then apply the chunk against warm lines.
        const AHEAD: usize = 16;
        for chunk in changes.chunks(AHEAD) {
            if t.slots.len() > 4096 {
                std::hint::black_box(t.touch(chunk.iter().map(|c| c.key())));
            }
            for c in chunk {
                match *c {
                    NetChange::Added(k) => {
                        if t.set(k, bit) {
                            added = added.saturating_add(1);
                        }
                    }
                    NetChange::Removed(k) => {
                        if t.unset(k, bit) {
                            removed = removed.saturating_add(1);
                        }
                    }
                }
            }
        }
        if let Some(c) = self.blocks.get_mut(usize::from(replica)) {
            *c = c.saturating_add(added).saturating_sub(removed);
        }
    }

    /// Drops every block of `replica` (it went down or restarted).
    pub fn clear_replica(&mut self, replica: ReplicaId) {
        let (p, bit) = Self::page_bit(replica);
        if let Some(t) = self.pages.get_mut(p) {
            t.unset_all(bit);
        }
        if let Some(c) = self.blocks.get_mut(usize::from(replica)) {
            *c = 0;
        }
    }

    /// Replaces `replica`'s blocks with a snapshot.
    pub fn replace_replica(&mut self, replica: ReplicaId, keys: impl IntoIterator<Item = BlockKey>) {
        self.clear_replica(replica);
        let keys = keys.into_iter();
        self.reserve(replica, keys.size_hint().0);
        for k in keys {
            self.insert(replica, k);
        }
    }

    /// Empties the index.
    pub fn clear(&mut self) {
        self.pages.clear();
        self.blocks.clear();
    }

    /// Whether `replica` holds `key`.
    pub fn holds(&self, replica: ReplicaId, key: BlockKey) -> bool {
        let (p, bit) = Self::page_bit(replica);
        self.pages.get(p).is_some_and(|t| t.get(key) & bit != 0)
    }

    /// Distinct blocks `replica` holds.
    pub fn replica_blocks(&self, replica: ReplicaId) -> u64 {
        self.blocks.get(usize::from(replica)).copied().unwrap_or(0)
    }

    /// One past the highest replica id seen.
    pub fn replica_slots(&self) -> usize {
        self.blocks.len()
    }

    /// Number of (block, replica) pairs.
    pub fn entries(&self) -> u64 {
        self.blocks.iter().fold(0u64, |a, &b| a.saturating_add(b))
    }

    /// Bytes held by the tables.
    pub fn memory_bytes(&self) -> usize {
        self.pages
            .iter()
            .map(|t| t.slots.len().saturating_mul(std::mem::size_of::<u64>()))
            .fold(0, usize::saturating_add)
    }

    /// Scores a request's block keys: for each replica, the number of leading blocks it holds.
    pub fn score(&self, keys: &[BlockKey]) -> Scores {
        let mut s = Scores::default();
        self.score_into(keys, &mut s);
        s
    }

    /// As [`Self::score`], reusing `out`'s allocation.
    pub fn score_into(&self, keys: &[BlockKey], out: &mut Scores) {
        out.leading.clear();
        out.leading.resize(self.blocks.len(), 0);
        out.total = u32::try_from(keys.len()).unwrap_or(u32::MAX);
        let Some(&first) = keys.first() else { return };
        // Most pages hold nothing of a request. Probe the first key in a group of pages at once
        // (independent loads, so their cache misses overlap) and walk only the pages where some
        // replica holds it: one miss per idle page instead of a chunk of them.
        const GROUP: usize = 8;
        for (g, group) in self.pages.chunks(GROUP).enumerate() {
            let mut heads = [0u64; GROUP];
            for (h, t) in heads.iter_mut().zip(group) {
                *h = if t.len == 0 { 0 } else { t.get(first) };
            }
            for (i, (t, &h)) in group.iter().zip(&heads).enumerate() {
                if h != 0 {
                    Self::walk_page(t, g.saturating_mul(GROUP).saturating_add(i), keys, out);
                }
            }
        }
    }

    /// Leading runs of one page's replicas over `keys`, written into `out.leading`.
    #[inline]
    fn walk_page(t: &Table, p: usize, keys: &[BlockKey], out: &mut Scores) {
        let base = p.saturating_mul(PAGE_BITS);
        let mut alive = 0xffff_u64;
        let mut run = 0u32;
        // Look up a few keys at a time: the loads are independent, so the CPU overlaps
        // their cache misses; the fold below then stops at the first block nobody holds.
        const CHUNK: usize = 8;
        'outer: for chunk in keys.chunks(CHUNK) {
            let mut masks = [0u64; CHUNK];
            for (m, &k) in masks.iter_mut().zip(chunk) {
                *m = t.get(k);
            }
            for &m in masks.iter().take(chunk.len()) {
                let next = alive & m;
                let dropped = alive & !next;
                if dropped != 0 {
                    record(&mut out.leading, base, dropped, run);
                }
                alive = next;
                if alive == 0 {
                    break 'outer;
                }
                run = run.saturating_add(1);
            }
        }
        if alive != 0 {
            record(&mut out.leading, base, alive, run);
        }
    }
}

#[inline]
fn record(leading: &mut [u32], base: usize, mut bits: u64, run: u32) {
    while bits != 0 {
        let b = bits.trailing_zeros() as usize;
        bits &= bits.wrapping_sub(1);
        if let Some(l) = leading.get_mut(base.saturating_add(b)) {
            *l = run;
        }
    }
}

#[cfg(test)]
#[allow(clippy::arithmetic_side_effects)]
mod tests;
