//! Requests in flight per replica, shared by the worker VMs of one Envoy through proxy-wasm
//! shared data (process-wide, namespaced by vm_id, so every worker running this filter sees the
//! same counts).
//!
//! Each VM counts its own requests: one key holds 24-byte records (the VM's id, u32; the
//! address's stable hash, u64; its count, u32; the prefill tokens of those requests that have
//! not produced a first token yet, u32; the KV blocks their prompts hold there, u32
//! ([`llmgw_core::flow::HeldBlocks`]); little-endian), a second key each VM's last heartbeat
//! (its id, u32; the time, u64 nanoseconds). A decision reads both once whatever the fleet's
//! size and sums the counts of live VMs; a request updates its VM's record at its start, at its
//! first token (when it had prefill tokens counted) and at its end, each time with
//! compare-and-swap. A VM that stops heartbeating for `STALE_NS` (it
//! crashed and was replaced, or its configuration went away) no longer counts, and its records
//! are dropped by the next write: counts return to zero instead of drifting.

use crate::host::{update_shared, Host, SharedKind};
use crate::shared_records::{address_id, decode, encode, FieldReader, IdMap, SharedRecord};

/// (Versioned: the records grew a token count, then a block count; a VM of an older build keeps
/// its own key.)
const KEY: &str = "llmgw.inflight.v3";
const LIVE_KEY: &str = "llmgw.inflight.vms";
/// A VM silent this long is gone: its requests no longer count.
pub const STALE_NS: u64 = 10_000_000_000;
/// How often a VM renews its heartbeat.
pub const HEARTBEAT_NS: u64 = 1_000_000_000;

/// A VM's id in the shared records (random per VM).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VmId(pub u32);

/// One VM's requests to one address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Record {
    vm: u32,
    id: u64,
    requests: u32,
    tokens: u32,
    blocks: u32,
}

impl SharedRecord for Record {
    const SIZE: usize = 24;
    fn read(f: &mut FieldReader<'_>) -> Option<Self> {
        Some(Record { vm: f.u32()?, id: f.u64()?, requests: f.u32()?, tokens: f.u32()?, blocks: f.u32()? })
    }
    fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.vm.to_le_bytes());
        out.extend_from_slice(&self.id.to_le_bytes());
        out.extend_from_slice(&self.requests.to_le_bytes());
        out.extend_from_slice(&self.tokens.to_le_bytes());
        out.extend_from_slice(&self.blocks.to_le_bytes());
    }
}

fn records(v: &[u8]) -> impl Iterator<Item = Record> + '_ {
    decode(v)
}

/// One VM's last heartbeat.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Heartbeat {
    vm: u32,
    at: u64,
}

impl SharedRecord for Heartbeat {
    const SIZE: usize = 12;
    fn read(f: &mut FieldReader<'_>) -> Option<Self> {
        Some(Heartbeat { vm: f.u32()?, at: f.u64()? })
    }
    fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.vm.to_le_bytes());
        out.extend_from_slice(&self.at.to_le_bytes());
    }
}

/// A change to one VM's record of one address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Change {
    /// +1 at a request's start, −1 at its end, 0 in between.
    pub requests: i32,
    /// Prefill tokens added (at the start) or removed (at the first token, or the end).
    pub tokens: i64,
    /// KV blocks the VM's requests hold there, added or removed ([`llmgw_core::flow::HeldBlocks`]).
    pub blocks: i64,
}

fn apply(n: u32, d: i64) -> u32 {
    let v = i64::from(n).saturating_add(d).clamp(0, i64::from(u32::MAX));
    u32::try_from(v).unwrap_or(0)
}

fn heartbeats(v: &[u8]) -> impl Iterator<Item = Heartbeat> + '_ {
    decode(v)
}

/// The VMs whose last heartbeat is within `STALE_NS` of `now`.
fn live_vms(v: &[u8], now: u64) -> Vec<u32> {
    heartbeats(v).filter(|h| now.saturating_sub(h.at) <= STALE_NS).map(|h| h.vm).collect()
}

/// Applies `change` to `vm`'s record of `id`; records falling to 0 requests and records of VMs
/// not in `live` are removed, so the value holds only live VMs' requests in flight (`None`: the
/// heartbeats could not be read, every VM's records are kept).
pub fn bump(v: &[u8], live: Option<&[u32]>, vm: u32, id: u64, change: Change) -> Vec<u8> {
    let mut found = false;
    let mut out: Vec<Record> = Vec::new();
    for mut r in records(v) {
        if r.vm == vm && r.id == id {
            found = true;
            r.requests = apply(r.requests, i64::from(change.requests));
            r.tokens = apply(r.tokens, change.tokens);
            r.blocks = apply(r.blocks, change.blocks);
        }
        if r.requests > 0 && (r.vm == vm || live.is_none_or(|l| l.contains(&r.vm))) {
            out.push(r);
        }
    }
    if !found && change.requests > 0 {
        let requests = apply(0, i64::from(change.requests));
        out.push(Record { vm, id, requests, tokens: apply(0, change.tokens), blocks: apply(0, change.blocks) });
    }
    encode(out)
}

/// The heartbeat list with `vm` seen at `now` and stale VMs left out.
fn beat(v: &[u8], vm: u32, now: u64) -> Vec<u8> {
    let others = heartbeats(v).filter(|h| h.vm != vm && now.saturating_sub(h.at) <= STALE_NS);
    encode(others.chain([Heartbeat { vm, at: now }]))
}

/// Renews `vm`'s heartbeat when it is older than `HEARTBEAT_NS` (or absent); returns the live
/// VMs as the heartbeats stand afterwards (`None` when they could not be read or written).
pub fn heartbeat(host: &dyn Host, vm: VmId, now: u64) -> Option<Vec<u32>> {
    let mut live = Vec::new();
    let ok = update_shared(host, LIVE_KEY, |v| {
        let fresh = heartbeats(v).any(|h| h.vm == vm.0 && now.saturating_sub(h.at) < HEARTBEAT_NS);
        let next = (!fresh).then(|| beat(v, vm.0, now));
        live = live_vms(next.as_deref().unwrap_or(v), now);
        next
    });
    ok.then_some(live)
}

/// The in-flight records summed per address over the live VMs, read once per decision: a
/// lookup costs the same whatever the number of records and VMs.
pub struct Counts {
    by_address: IdMap<Summed>,
}

/// One address's records summed over the live VMs.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Summed {
    requests: u32,
    tokens: u64,
    blocks: u64,
}

impl Counts {
    pub fn read(host: &dyn Host) -> Counts {
        let now = host.now_ns();
        let live = host.shared_data(LIVE_KEY).and_then(|(v, _)| v).unwrap_or_default();
        let records = host.shared_data(KEY).and_then(|(v, _)| v).unwrap_or_default();
        Counts::summed(&records, &live_vms(&live, now))
    }

    fn summed(records: &[u8], live: &[u32]) -> Counts {
        // The live VMs are few (a VM per worker thread): a sorted list searched by halves.
        let mut live = live.to_vec();
        live.sort_unstable();
        let mut by_address: IdMap<Summed> = IdMap::default();
        for r in decode::<Record>(records).filter(|r| live.binary_search(&r.vm).is_ok()) {
            let s = by_address.entry(r.id).or_default();
            s.requests = s.requests.saturating_add(r.requests);
            s.tokens = s.tokens.saturating_add(u64::from(r.tokens));
            s.blocks = s.blocks.saturating_add(u64::from(r.blocks));
        }
        Counts { by_address }
    }

    /// The requests to `address` over the live VMs, and their prefill tokens awaiting a first
    /// token.
    pub fn of(&self, address: &str) -> (u32, u64) {
        let s = self.by_address.get(&address_id(address)).copied().unwrap_or_default();
        (s.requests, s.tokens)
    }

    /// The KV blocks the requests to `address` hold there, over the live VMs.
    pub fn blocks(&self, address: &str) -> u64 {
        self.by_address.get(&address_id(address)).map_or(0, |s| s.blocks)
    }
}

/// Returns the shared records it could not update (none, usually).
fn update(host: &dyn Host, vm: VmId, address: &str, change: Change) -> Vec<SharedKind> {
    let mut gave_up = Vec::new();
    // One read of the heartbeats: renewed on the way when this VM's is due (its first request
    // may come before its first tick).
    let live = heartbeat(host, vm, host.now_ns());
    if live.is_none() {
        gave_up.push(SharedKind::Heartbeat);
    }
    let id = address_id(address);
    if !update_shared(host, KEY, |v| Some(bump(v, live.as_deref(), vm.0, id, change))) {
        log::debug!("llmgw: in-flight count of {address} not updated (shared data refused or contended)");
        gave_up.push(SharedKind::InFlight);
    }
    gave_up
}

/// A request routed to `address`, with `tokens` of prefill to compute there, growing the KV
/// blocks this VM's requests hold there by `blocks`. Returns the shared records it could not
/// update.
pub fn increment(host: &dyn Host, vm: VmId, address: &str, tokens: u32, blocks: i64) -> Vec<SharedKind> {
    update(host, vm, address, Change { requests: 1, tokens: i64::from(tokens), blocks })
}

/// A request's first token: its `tokens` of prefill are done. Returns the shared records it
/// could not update.
pub fn first_token(host: &dyn Host, vm: VmId, address: &str, tokens: u32) -> Vec<SharedKind> {
    if tokens == 0 {
        return Vec::new();
    }
    update(host, vm, address, Change { requests: 0, tokens: 0i64.saturating_sub(i64::from(tokens)), blocks: 0 })
}

/// A request's end, with the prefill tokens still counted for it (it never produced a first
/// token), and what it moved the blocks this VM's requests hold there by (`blocks`, 0 or
/// negative). Returns the shared records it could not update.
pub fn decrement(host: &dyn Host, vm: VmId, address: &str, tokens: u32, blocks: i64) -> Vec<SharedKind> {
    update(host, vm, address, Change { requests: -1, tokens: 0i64.saturating_sub(i64::from(tokens)), blocks })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fake::FakeHost;

    /// The documented record sizes.
    const RECORD: usize = 24;
    const LIVE_RECORD: usize = 12;
    const UP: Change = Change { requests: 1, tokens: 0, blocks: 0 };
    const DOWN: Change = Change { requests: -1, tokens: 0, blocks: 0 };

    fn n(v: &[u8], live: &[u32], id: u64) -> u32 {
        count(v, live, id).0
    }

    fn count(v: &[u8], live: &[u32], id: u64) -> (u32, u64) {
        let s = Counts::summed(v, live).by_address.get(&id).copied().unwrap_or_default();
        (s.requests, s.tokens)
    }

    #[test]
    fn records_count_up_and_down_and_vanish_at_zero() {
        let (a, b) = (address_id("10.0.0.1:8000"), address_id("10.0.0.2:8000"));
        assert_ne!(a, b);
        let live = [1, 2];
        let mut v = Vec::new();
        for _ in 0..3 {
            v = bump(&v, Some(&live), 1, a, UP);
        }
        v = bump(&v, Some(&live), 2, a, UP);
        v = bump(&v, Some(&live), 1, b, UP);
        assert_eq!((n(&v, &live, a), n(&v, &live, b)), (4, 1));
        assert_eq!(v.len(), 3 * RECORD);
        v = bump(&v, Some(&live), 1, b, DOWN);
        assert_eq!((n(&v, &live, a), n(&v, &live, b)), (4, 0));
        assert_eq!(v.len(), 2 * RECORD);
        // A decrement of an absent address (its start was counted by an older VM) stays at 0.
        v = bump(&v, Some(&live), 1, b, DOWN);
        assert_eq!(n(&v, &live, b), 0);
        // A value of another shape (trailing bytes) is read as far as it goes.
        let mut odd = v.clone();
        odd.push(7);
        assert_eq!(n(&odd, &live, a), 4);
        assert_eq!(bump(&odd, Some(&live), 1, a, DOWN), bump(&v, Some(&live), 1, a, DOWN));
        // Records of a VM no longer live neither count nor survive the next write.
        assert_eq!(n(&v, &[1], a), 3);
        v = bump(&v, Some(&[1]), 1, a, DOWN);
        assert_eq!(v.len(), RECORD);
        assert_eq!(n(&v, &[1, 2], a), 2);
    }

    #[test]
    fn prefill_tokens_count_from_the_start_to_the_first_token_on_every_vm() {
        let host = FakeHost::default();
        host.now_ns.set(1_000_000_000);
        const A: &str = "10.0.0.1:8000";
        // Two workers route to A: 700 and 300 tokens to compute there.
        increment(&host, VmId(1), A, 700, 0);
        increment(&host, VmId(2), A, 300, 0);
        let s = Counts::read(&host);
        assert_eq!(s.of(A), (2, 1000));
        // The first one's first token: its prefill is done, the request still in flight.
        first_token(&host, VmId(1), A, 700);
        let s = Counts::read(&host);
        assert_eq!(s.of(A), (2, 300));
        // The second ends without a first token (an error, a reset): its tokens go with it.
        decrement(&host, VmId(2), A, 300, 0);
        decrement(&host, VmId(1), A, 0, 0);
        let s = Counts::read(&host);
        assert_eq!(s.of(A), (0, 0));
        assert_eq!(host.shared_value(KEY).unwrap(), Vec::<u8>::new());
        // Sums saturate instead of wrapping.
        let v = bump(&[], None, 1, 9, Change { requests: 1, tokens: i64::MAX, blocks: 0 });
        let v = bump(&v, None, 1, 9, Change { requests: 1, tokens: i64::MAX, blocks: 0 });
        assert_eq!(count(&v, &[1], 9), (2, u64::from(u32::MAX)));
    }

    #[test]
    fn a_crashed_vms_requests_stop_counting_and_the_counts_return_to_zero() {
        let host = FakeHost::default();
        host.now_ns.set(1_000_000_000);
        let (old, new) = (VmId(7), VmId(8));
        const A: &str = "10.0.0.1:8000";
        // The old VM routes three requests, then traps (no on_log ever runs for them).
        for _ in 0..3 {
            increment(&host, old, A, 10, 0);
        }
        assert_eq!(Counts::read(&host).of(A).0, 3);
        // Its replacement starts, heartbeats and routes one of its own.
        host.now_ns.set(2_000_000_000);
        increment(&host, new, A, 5, 0);
        assert_eq!(Counts::read(&host).of(A).0, 4);
        assert_eq!(Counts::read(&host).of(A).1, 35);
        // Past STALE_NS without the old VM's heartbeat: only the new VM's request counts.
        for s in 3..=12u64 {
            host.now_ns.set(s * 1_000_000_000);
            heartbeat(&host, new, host.now_ns.get());
        }
        assert_eq!(Counts::read(&host).of(A).0, 1);
        assert_eq!(Counts::read(&host).of(A).1, 5);
        decrement(&host, new, A, 5, 0);
        assert_eq!(Counts::read(&host).of(A).0, 0);
        // The dead VM's records are gone from the value too.
        assert_eq!(host.shared_value(KEY).unwrap(), Vec::<u8>::new());
        assert_eq!(host.shared_value(LIVE_KEY).unwrap().len(), LIVE_RECORD);
    }
}
