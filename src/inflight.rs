//! Requests in flight per replica, shared by the worker VMs of one Envoy through proxy-wasm
//! shared data (process-wide, namespaced by vm_id, so every worker running this filter sees the
//! same counts).
//!
//! Each VM counts its own requests: one key holds 16-byte records (the VM's id, u32; the
//! address's stable hash, u64; its count, u32; little-endian), a second key each VM's last
//! heartbeat (its id, u32; the time, u64 nanoseconds). A decision reads both once whatever the
//! fleet's size and sums the counts of live VMs; a request updates its VM's record twice (start
//! and end), each time with compare-and-swap. A VM that stops heartbeating for `STALE_NS` (it
//! crashed and was replaced, or its configuration went away) no longer counts, and its records
//! are dropped by the next write: counts return to zero instead of drifting.

use crate::host::{update_shared, Host};
use llmgw_core::flow::InFlight;
use llmgw_core::policy::stable_hash;

const KEY: &str = "llmgw.inflight";
const LIVE_KEY: &str = "llmgw.inflight.vms";
const RECORD: usize = 16;
const LIVE_RECORD: usize = 12;
/// A VM silent this long is gone: its requests no longer count.
pub const STALE_NS: u64 = 10_000_000_000;
/// How often a VM renews its heartbeat.
pub const HEARTBEAT_NS: u64 = 1_000_000_000;

/// A VM's id in the shared records (random per VM).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VmId(pub u32);

/// The id an address is recorded under.
pub fn address_id(address: &str) -> u64 {
    stable_hash(address.as_bytes())
}

fn records(v: &[u8]) -> impl Iterator<Item = (u32, u64, u32)> + '_ {
    v.chunks_exact(RECORD).filter_map(|r| {
        let vm = u32::from_le_bytes(r.get(..4)?.try_into().ok()?);
        let id = u64::from_le_bytes(r.get(4..12)?.try_into().ok()?);
        let n = u32::from_le_bytes(r.get(12..16)?.try_into().ok()?);
        Some((vm, id, n))
    })
}

fn heartbeats(v: &[u8]) -> impl Iterator<Item = (u32, u64)> + '_ {
    v.chunks_exact(LIVE_RECORD).filter_map(|r| {
        let vm = u32::from_le_bytes(r.get(..4)?.try_into().ok()?);
        let at = u64::from_le_bytes(r.get(4..12)?.try_into().ok()?);
        Some((vm, at))
    })
}

/// The VMs whose last heartbeat is within `STALE_NS` of `now`.
fn live_vms(v: &[u8], now: u64) -> Vec<u32> {
    heartbeats(v).filter(|&(_, at)| now.saturating_sub(at) <= STALE_NS).map(|(vm, _)| vm).collect()
}

/// The count of `id` over the live VMs (0 when absent).
pub fn count(v: &[u8], live: &[u32], id: u64) -> u32 {
    records(v).filter(|&(vm, x, _)| x == id && live.contains(&vm)).fold(0u32, |a, (_, _, n)| a.saturating_add(n))
}

/// Adds ±1 to `vm`'s count of `id`; records falling to 0 and records of VMs not in `live` are
/// removed, so the value holds only live VMs' requests in flight (`None`: the heartbeats could
/// not be read, every VM's records are kept).
pub fn bump(v: &[u8], live: Option<&[u32]>, vm: u32, id: u64, up: bool) -> Vec<u8> {
    let mut out = Vec::with_capacity(v.len().saturating_add(RECORD));
    let mut found = false;
    for (x_vm, x, n) in records(v) {
        let n = if x_vm == vm && x == id {
            found = true;
            if up {
                n.saturating_add(1)
            } else {
                n.saturating_sub(1)
            }
        } else {
            n
        };
        if n > 0 && (x_vm == vm || live.is_none_or(|l| l.contains(&x_vm))) {
            out.extend_from_slice(&x_vm.to_le_bytes());
            out.extend_from_slice(&x.to_le_bytes());
            out.extend_from_slice(&n.to_le_bytes());
        }
    }
    if !found && up {
        out.extend_from_slice(&vm.to_le_bytes());
        out.extend_from_slice(&id.to_le_bytes());
        out.extend_from_slice(&1u32.to_le_bytes());
    }
    out
}

/// The heartbeat list with `vm` seen at `now` and stale VMs left out.
fn beat(v: &[u8], vm: u32, now: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(v.len().saturating_add(LIVE_RECORD));
    for (x, at) in heartbeats(v) {
        if x != vm && now.saturating_sub(at) <= STALE_NS {
            out.extend_from_slice(&x.to_le_bytes());
            out.extend_from_slice(&at.to_le_bytes());
        }
    }
    out.extend_from_slice(&vm.to_le_bytes());
    out.extend_from_slice(&now.to_le_bytes());
    out
}

/// Renews `vm`'s heartbeat when it is older than `HEARTBEAT_NS` (or absent); returns the live
/// VMs as the heartbeats stand afterwards (`None` when they could not be read or written).
pub fn heartbeat(host: &dyn Host, vm: VmId, now: u64) -> Option<Vec<u32>> {
    let mut live = Vec::new();
    let ok = update_shared(host, LIVE_KEY, |v| {
        let fresh = heartbeats(v).any(|(x, at)| x == vm.0 && now.saturating_sub(at) < HEARTBEAT_NS);
        let next = (!fresh).then(|| beat(v, vm.0, now));
        live = live_vms(next.as_deref().unwrap_or(v), now);
        next
    });
    ok.then_some(live)
}

/// Every replica's in-flight count over the live VMs, and which replicas are avoided
/// (`crate::health`), read once.
pub struct Snapshot {
    records: Vec<u8>,
    live: Vec<u32>,
    health: crate::health::Health,
    tokenizers: crate::health::Health,
}

impl Snapshot {
    pub fn read(host: &dyn Host) -> Snapshot {
        let now = host.now_ns();
        let live = host.shared_data(LIVE_KEY).and_then(|(v, _)| v).unwrap_or_default();
        Snapshot {
            records: host.shared_data(KEY).and_then(|(v, _)| v).unwrap_or_default(),
            live: live_vms(&live, now),
            health: crate::health::Health::read(host),
            tokenizers: crate::health::Health::read_tokenizers(host),
        }
    }
}

impl InFlight for Snapshot {
    fn in_flight(&self, address: &str) -> u32 {
        count(&self.records, &self.live, address_id(address))
    }

    fn avoided(&self, address: &str) -> bool {
        self.health.avoided(address)
    }

    fn tokenizer_avoided(&self, address: &str) -> bool {
        self.tokenizers.avoided(address)
    }
}

fn update(host: &dyn Host, vm: VmId, address: &str, up: bool) {
    // One read of the heartbeats: renewed on the way when this VM's is due (its first request
    // may come before its first tick).
    let live = heartbeat(host, vm, host.now_ns());
    let id = address_id(address);
    if !update_shared(host, KEY, |v| Some(bump(v, live.as_deref(), vm.0, id, up))) {
        log::debug!("llmgw: in-flight count of {address} not updated (shared data refused or contended)");
    }
}

pub fn increment(host: &dyn Host, vm: VmId, address: &str) {
    update(host, vm, address, true);
}

pub fn decrement(host: &dyn Host, vm: VmId, address: &str) {
    update(host, vm, address, false);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fake::FakeHost;

    #[test]
    fn records_count_up_and_down_and_vanish_at_zero() {
        let (a, b) = (address_id("10.0.0.1:8000"), address_id("10.0.0.2:8000"));
        assert_ne!(a, b);
        let live = [1, 2];
        let mut v = Vec::new();
        for _ in 0..3 {
            v = bump(&v, Some(&live), 1, a, true);
        }
        v = bump(&v, Some(&live), 2, a, true);
        v = bump(&v, Some(&live), 1, b, true);
        assert_eq!((count(&v, &live, a), count(&v, &live, b)), (4, 1));
        assert_eq!(v.len(), 3 * RECORD);
        v = bump(&v, Some(&live), 1, b, false);
        assert_eq!((count(&v, &live, a), count(&v, &live, b)), (4, 0));
        assert_eq!(v.len(), 2 * RECORD);
        // A decrement of an absent address (its start was counted by an older VM) stays at 0.
        v = bump(&v, Some(&live), 1, b, false);
        assert_eq!(count(&v, &live, b), 0);
        // A value of another shape (trailing bytes) is read as far as it goes.
        let mut odd = v.clone();
        odd.push(7);
        assert_eq!(count(&odd, &live, a), 4);
        assert_eq!(bump(&odd, Some(&live), 1, a, false), bump(&v, Some(&live), 1, a, false));
        // Records of a VM no longer live neither count nor survive the next write.
        assert_eq!(count(&v, &[1], a), 3);
        v = bump(&v, Some(&[1]), 1, a, false);
        assert_eq!(v.len(), RECORD);
        assert_eq!(count(&v, &[1, 2], a), 2);
    }

    #[test]
    fn a_crashed_vms_requests_stop_counting_and_the_counts_return_to_zero() {
        let host = FakeHost::default();
        host.now_ns.set(1_000_000_000);
        let (old, new) = (VmId(7), VmId(8));
        const A: &str = "10.0.0.1:8000";
        // The old VM routes three requests, then traps (no on_log ever runs for them).
        for _ in 0..3 {
            increment(&host, old, A);
        }
        assert_eq!(Snapshot::read(&host).in_flight(A), 3);
        // Its replacement starts, heartbeats and routes one of its own.
        host.now_ns.set(2_000_000_000);
        increment(&host, new, A);
        assert_eq!(Snapshot::read(&host).in_flight(A), 4);
        // Past STALE_NS without the old VM's heartbeat: only the new VM's request counts.
        for s in 3..=12u64 {
            host.now_ns.set(s * 1_000_000_000);
            heartbeat(&host, new, host.now_ns.get());
        }
        assert_eq!(Snapshot::read(&host).in_flight(A), 1);
        decrement(&host, new, A);
        assert_eq!(Snapshot::read(&host).in_flight(A), 0);
        // The dead VM's records are gone from the value too.
        assert_eq!(host.shared_value(KEY).unwrap(), Vec::<u8>::new());
        assert_eq!(host.shared_value(LIVE_KEY).unwrap().len(), LIVE_RECORD);
    }
}
