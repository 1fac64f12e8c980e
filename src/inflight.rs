//! Requests in flight per replica, shared by the worker VMs of one Envoy through proxy-wasm
//! shared data (one small key per replica address: a u64 little-endian counter, updated
//! with compare-and-swap). Shared data is process-wide and namespaced by vm_id, so every
//! worker running this filter sees the same counts.

use proxy_wasm::hostcalls;
use proxy_wasm::types::Status;

const PREFIX: &str = "llmgw.inflight.";
const CAS_RETRIES: u32 = 16;

fn key(address: &str) -> String {
    let mut k = String::with_capacity(PREFIX.len().saturating_add(address.len()));
    k.push_str(PREFIX);
    k.push_str(address);
    k
}

fn decode(v: Option<&[u8]>) -> u64 {
    match v.and_then(|b| <[u8; 8]>::try_from(b).ok()) {
        Some(a) => u64::from_le_bytes(a),
        None => 0,
    }
}

/// The current count for `address` (0 when unknown or unreadable).
pub fn get(address: &str) -> u32 {
    match hostcalls::get_shared_data(&key(address)) {
        Ok((v, _)) => u32::try_from(decode(v.as_deref())).unwrap_or(u32::MAX),
        Err(_) => 0,
    }
}

fn update(address: &str, f: impl Fn(u64) -> u64) {
    let k = key(address);
    for _ in 0..CAS_RETRIES {
        let Ok((v, cas)) = hostcalls::get_shared_data(&k) else { return };
        let next = f(decode(v.as_deref())).to_le_bytes();
        match hostcalls::set_shared_data(&k, Some(&next), cas) {
            Err(Status::CasMismatch) => continue,
            _ => return,
        }
    }
}

pub fn increment(address: &str) {
    update(address, |n| n.saturating_add(1));
}

pub fn decrement(address: &str) {
    update(address, |n| n.saturating_sub(1));
}
