//! How long a request holds its KV blocks on each replica, from its routing to its end
//! ([`llmgw_core::policy::capacity`]), shared by every worker of this Envoy through proxy-wasm
//! shared data: 24-byte records, little-endian: the address's stable hash (u64), the mean hold
//! (an `f64` bit pattern, µs), when it was last updated (u64, ns). Each end moves its replica's
//! mean ([`moved_hold_us`]). At most [`MAX_RECORDS`] replicas are kept (the one updated
//! longest ago goes first): 6 KiB at most.

use crate::host::{update_shared, Host, SharedKind};
use crate::shared_records::{address_id, decode, encode, keep_highest, FieldReader, IdMap, SharedRecord};
use llmgw_core::policy::capacity::moved_hold_us;

const KEY: &str = "llmgw.holds";
/// At most this many replicas' holds are kept.
pub const MAX_RECORDS: usize = 256;

#[derive(Debug, Clone, Copy, PartialEq)]
struct Record {
    id: u64,
    mean_us: f64,
    updated_ns: u64,
}

impl SharedRecord for Record {
    const SIZE: usize = 24;
    fn read(f: &mut FieldReader<'_>) -> Option<Self> {
        Some(Record { id: f.u64()?, mean_us: f64::from_bits(f.u64()?), updated_ns: f.u64()? })
    }
    fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.id.to_le_bytes());
        out.extend_from_slice(&self.mean_us.to_bits().to_le_bytes());
        out.extend_from_slice(&self.updated_ns.to_le_bytes());
    }
}

/// The mean holds, read once per decision, by address id.
#[derive(Default)]
pub struct HoldTimes {
    by_address: IdMap<f64>,
}

impl HoldTimes {
    pub fn read(host: &dyn Host) -> HoldTimes {
        let value = host.shared_data(KEY).and_then(|(v, _)| v).unwrap_or_default();
        HoldTimes {
            by_address: decode::<Record>(&value)
                .filter(|r| r.mean_us.is_finite() && r.mean_us >= 0.0)
                .map(|r| (r.id, r.mean_us))
                .collect(),
        }
    }

    /// The mean hold on `address` (µs; 0 when none was observed).
    pub fn of(&self, address: &str) -> f64 {
        self.by_address.get(&address_id(address)).copied().unwrap_or(0.0)
    }
}

/// The records with `id`'s moved by one hold of `us`.
fn with(v: &[u8], id: u64, now: u64, us: f64) -> Vec<u8> {
    let mut out: Vec<Record> = decode::<Record>(v).filter(|r| r.id != id).collect();
    let mean_us = moved_hold_us(decode::<Record>(v).find(|r| r.id == id).map(|r| r.mean_us), us);
    out.push(Record { id, mean_us, updated_ns: now });
    keep_highest(&mut out, MAX_RECORDS, |r| r.updated_ns);
    encode(out)
}

/// A request routed to `address` ended `us` after its routing. `Err` when the shared record
/// could not be updated.
pub fn observe(host: &dyn Host, address: &str, us: u64) -> Result<(), SharedKind> {
    let (id, now) = (address_id(address), host.now_ns());
    if update_shared(host, KEY, |v| Some(with(v, id, now, us as f64))) {
        Ok(())
    } else {
        log::debug!("llmgw: hold time of {address} not updated (shared data refused or contended)");
        Err(SharedKind::HoldTimes)
    }
}

#[cfg(test)]
#[allow(clippy::arithmetic_side_effects)]
mod tests {
    use super::*;
    use crate::fake::FakeHost;

    #[test]
    fn every_worker_moves_one_bounded_mean_per_replica() {
        let host = FakeHost::default();
        const A: &str = "10.0.0.1:8000";
        assert_eq!(HoldTimes::read(&host).of(A), 0.0);
        observe(&host, A, 800_000).unwrap();
        assert_eq!(HoldTimes::read(&host).of(A), 800_000.0);
        // Answers grow shorter: the mean follows, a sixteenth of the way each time.
        observe(&host, A, 160_000).unwrap();
        assert_eq!(HoldTimes::read(&host).of(A), 760_000.0);
        for _ in 0..100 {
            observe(&host, A, 160_000).unwrap();
        }
        assert!((HoldTimes::read(&host).of(A) - 160_000.0).abs() < 1_000.0);
        assert_eq!(host.shared_value(KEY).unwrap().len(), Record::SIZE);
        // Bounded: the replica updated longest ago goes first.
        for i in 0..MAX_RECORDS as u64 {
            host.now_ns.set(10_000 + i);
            observe(&host, &format!("10.1.{}.{}:8000", i / 256, i % 256), 1_000).unwrap();
        }
        assert_eq!(host.shared_value(KEY).unwrap().len(), MAX_RECORDS * Record::SIZE);
        assert_eq!(HoldTimes::read(&host).of(A), 0.0);
    }
}
