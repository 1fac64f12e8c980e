//! Requests in flight per replica, shared by the worker VMs of one Envoy through proxy-wasm
//! shared data (process-wide, namespaced by vm_id, so every worker running this filter sees the
//! same counts). One key holds every replica with requests in flight, as 12-byte records (the
//! address's stable hash, u64 little-endian, then its count, u32 little-endian): a decision
//! reads it once whatever the fleet's size, and a request updates it twice (start and end), each
//! time with compare-and-swap.

use crate::host::{Host, SharedWrite};
use llmgw_core::flow::InFlight;
use llmgw_core::policy::stable_hash;

const KEY: &str = "llmgw.inflight";
const RECORD: usize = 12;
const CAS_RETRIES: u32 = 16;

/// The id an address is recorded under.
pub fn address_id(address: &str) -> u64 {
    stable_hash(address.as_bytes())
}

fn records(v: &[u8]) -> impl Iterator<Item = (u64, u32)> + '_ {
    v.chunks_exact(RECORD).filter_map(|r| {
        let id = u64::from_le_bytes(r.get(..8)?.try_into().ok()?);
        let n = u32::from_le_bytes(r.get(8..12)?.try_into().ok()?);
        Some((id, n))
    })
}

/// The count recorded for `id` (0 when absent).
pub fn count(v: &[u8], id: u64) -> u32 {
    records(v).find(|&(x, _)| x == id).map_or(0, |(_, n)| n)
}

/// Adds `delta` (±1) to `id`'s count; a record falling to 0 is removed, so the value holds only
/// replicas with requests in flight.
pub fn bump(v: &[u8], id: u64, up: bool) -> Vec<u8> {
    let mut out = Vec::with_capacity(v.len().saturating_add(RECORD));
    let mut found = false;
    for (x, n) in records(v) {
        let n = if x == id {
            found = true;
            if up {
                n.saturating_add(1)
            } else {
                n.saturating_sub(1)
            }
        } else {
            n
        };
        if n > 0 {
            out.extend_from_slice(&x.to_le_bytes());
            out.extend_from_slice(&n.to_le_bytes());
        }
    }
    if !found && up {
        out.extend_from_slice(&id.to_le_bytes());
        out.extend_from_slice(&1u32.to_le_bytes());
    }
    out
}

/// Every replica's in-flight count, read once.
pub struct Snapshot(Vec<u8>);

impl Snapshot {
    pub fn read(host: &dyn Host) -> Snapshot {
        Snapshot(host.shared_data(KEY).and_then(|(v, _)| v).unwrap_or_default())
    }
}

impl InFlight for Snapshot {
    fn in_flight(&self, address: &str) -> u32 {
        count(&self.0, address_id(address))
    }
}

fn update(host: &dyn Host, address: &str, up: bool) {
    let id = address_id(address);
    for _ in 0..CAS_RETRIES {
        // A refused read leaves the record alone (a blind write would drop other replicas' counts).
        let Some((v, cas)) = host.shared_data(KEY) else { return };
        let next = bump(v.as_deref().unwrap_or_default(), id, up);
        match host.set_shared_data(KEY, &next, cas) {
            Err(SharedWrite::CasMismatch) => continue,
            _ => return,
        }
    }
}

pub fn increment(host: &dyn Host, address: &str) {
    update(host, address, true);
}

pub fn decrement(host: &dyn Host, address: &str) {
    update(host, address, false);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_count_up_and_down_and_vanish_at_zero() {
        let (a, b) = (address_id("10.0.0.1:8000"), address_id("10.0.0.2:8000"));
        assert_ne!(a, b);
        let mut v = Vec::new();
        for _ in 0..3 {
            v = bump(&v, a, true);
        }
        v = bump(&v, b, true);
        assert_eq!((count(&v, a), count(&v, b)), (3, 1));
        assert_eq!(v.len(), 2 * RECORD);
        v = bump(&v, b, false);
        assert_eq!((count(&v, a), count(&v, b)), (3, 0));
        assert_eq!(v.len(), RECORD);
        // A decrement of an absent address (its start was counted by an older VM) stays at 0.
        v = bump(&v, b, false);
        assert_eq!(count(&v, b), 0);
        assert_eq!(v.len(), RECORD);
        // A value of another shape (trailing bytes) is read as far as it goes.
        let mut odd = v.clone();
        odd.push(7);
        assert_eq!(count(&odd, a), 3);
        assert_eq!(bump(&odd, a, false), bump(&v, a, false));
    }
}
