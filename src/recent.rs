//! Requests routed lately per replica ([`llmgw_core::policy::Candidate::recent`]), shared by
//! every worker of this Envoy through proxy-wasm shared data like the in-flight counts: a routed
//! request updates the one value with compare-and-swap, and every decision reads it once.
//!
//! The value holds 16-byte records, little-endian: the address's stable hash (u64) and its count
//! (an `f64` as its bit pattern), kept by the core's rules
//! ([`llmgw_core::policy::routed_lately`]: they fade by request, at most 256 records, 4 KiB).

use crate::host::{update_shared, Host, SharedKind};
use crate::shared_records::{address_id, decode, encode, FieldReader, IdMap, SharedRecord};
#[cfg(test)]
use llmgw_core::policy::routed_lately::MEMORY_PER_REPLICA;
use llmgw_core::policy::routed_lately::{self, sane, Count};

const KEY: &str = "llmgw.recent";

impl SharedRecord for Count {
    const SIZE: usize = 16;
    fn read(f: &mut FieldReader<'_>) -> Option<Self> {
        Some(Count { id: f.u64()?, count: f64::from_bits(f.u64()?) })
    }
    fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.id.to_le_bytes());
        out.extend_from_slice(&self.count.to_bits().to_le_bytes());
    }
}

/// The records with one request more routed to `id`.
fn with(v: &[u8], id: u64) -> Vec<u8> {
    let mut counts: Vec<Count> = decode::<Count>(v).collect();
    routed_lately::routed(&mut counts, id);
    encode(counts)
}

/// A request routed to `address`. `Err` when the shared record could not be updated.
pub fn routed(host: &dyn Host, address: &str) -> Result<(), SharedKind> {
    let id = address_id(address);
    if update_shared(host, KEY, |v| Some(with(v, id))) {
        Ok(())
    } else {
        log::debug!("llmgw: recent requests of {address} not updated (shared data refused or contended)");
        Err(SharedKind::Recent)
    }
}

/// The recent counts, read once per decision, by address id.
#[derive(Default)]
pub struct Recent {
    by_address: IdMap<f64>,
}

impl Recent {
    pub fn read(host: &dyn Host) -> Recent {
        let value = host.shared_data(KEY).and_then(|(v, _)| v).unwrap_or_default();
        Recent { by_address: decode::<Count>(&value).map(|r| (r.id, sane(r.count))).collect() }
    }

    /// Requests routed to `address` lately (0 when none).
    pub fn of(&self, address: &str) -> f64 {
        self.by_address.get(&address_id(address)).copied().unwrap_or(0.0)
    }
}

#[cfg(test)]
#[allow(clippy::arithmetic_side_effects)]
mod tests {
    use super::*;
    use crate::fake::FakeHost;

    const A: &str = "10.0.0.1:8000";
    const B: &str = "10.0.0.2:8000";

    #[test]
    fn counts_follow_the_requests_routed_and_fade_by_request() {
        let host = FakeHost::default();
        assert_eq!(Recent::read(&host).of(A), 0.0);
        for _ in 0..30 {
            routed(&host, A).unwrap();
        }
        let r = Recent::read(&host);
        assert!(r.of(A) > 15.0 && r.of(A) <= 30.0, "{}", r.of(A));
        assert_eq!(r.of(B), 0.0);
        // Traffic moves to B: A's count fades while B's grows, whatever the time.
        for _ in 0..200 {
            routed(&host, B).unwrap();
        }
        let r = Recent::read(&host);
        assert!(r.of(A) < 1.0 && r.of(B) > 40.0 && r.of(B) <= 2.0 * MEMORY_PER_REPLICA, "{} {}", r.of(A), r.of(B));
        assert_eq!(host.shared_value(KEY).unwrap().len(), 2 * Count::SIZE);
        // Long unused, A's record goes.
        for _ in 0..2000 {
            routed(&host, B).unwrap();
        }
        assert_eq!(host.shared_value(KEY).unwrap().len(), Count::SIZE);
        assert_eq!(Recent::read(&host).of(A), 0.0);
    }
}
