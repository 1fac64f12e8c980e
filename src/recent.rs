//! Requests routed lately per replica ([`llmgw_core::policy::Candidate::recent`]), shared by
//! every worker of this Envoy through proxy-wasm shared data like the in-flight counts: a routed
//! request updates the one value with compare-and-swap, and every decision reads it once.
//!
//! The value holds 16-byte records, little-endian: the address's stable hash (u64) and its count
//! (an `f64` as its bit pattern). Each routed request multiplies every count by
//! `1 − 1 / (MEMORY_PER_REPLICA × replicas)` and adds 1 to its replica's: the counts fade by
//! request, not by time, so they mean the same on a fleet of any speed, and together they hold
//! about the last `MEMORY_PER_REPLICA` requests per replica. A count that has faded below
//! [`FORGOTTEN`] goes (a replica no longer routed to), and at most [`MAX_RECORDS`] are kept (the
//! smallest go first): 4 KiB at most.

use crate::host::{update_shared, Host, SharedKind};
use crate::shared_records::{address_id, decode, encode, FieldReader, IdMap, SharedRecord};

const KEY: &str = "llmgw.recent";
/// At most this many replicas' counts are kept.
pub const MAX_RECORDS: usize = 256;
/// Requests per replica the counts remember (a request counts half after about 0.69 × this
/// many per replica). Counted in requests, so no figure of any fleet's speed: long enough that a
/// difference of a fifth in the replicas' shares is several requests (well past the rounding
/// the policy compares them with), short enough to follow a change in traffic within a few
/// hundred requests.
pub const MEMORY_PER_REPLICA: f64 = 32.0;
/// A count below this is dropped.
pub const FORGOTTEN: f64 = 0.01;

#[derive(Debug, Clone, Copy, PartialEq)]
struct Record {
    id: u64,
    count: f64,
}

impl SharedRecord for Record {
    const SIZE: usize = 16;
    fn read(f: &mut FieldReader<'_>) -> Option<Self> {
        Some(Record { id: f.u64()?, count: f64::from_bits(f.u64()?) })
    }
    fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.id.to_le_bytes());
        out.extend_from_slice(&self.count.to_bits().to_le_bytes());
    }
}

/// A count read from shared data: finite and non-negative, or 0.
fn sane(v: f64) -> f64 {
    if v.is_finite() && v > 0.0 {
        v
    } else {
        0.0
    }
}

/// The records with one request more routed to `id`.
fn with(v: &[u8], id: u64) -> Vec<u8> {
    let mut out: Vec<Record> = decode::<Record>(v).map(|r| Record { count: sane(r.count), ..r }).collect();
    if !out.iter().any(|r| r.id == id) {
        out.push(Record { id, count: 0.0 });
    }
    let replicas = out.len().max(1) as f64;
    let keep = 1.0 - 1.0 / (MEMORY_PER_REPLICA * replicas);
    for r in out.iter_mut() {
        r.count = r.count * keep + if r.id == id { 1.0 } else { 0.0 };
    }
    out.retain(|r| r.count >= FORGOTTEN);
    if out.len() > MAX_RECORDS {
        out.sort_by(|a, b| b.count.total_cmp(&a.count));
        out.truncate(MAX_RECORDS);
    }
    encode(out)
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
        Recent { by_address: decode::<Record>(&value).map(|r| (r.id, sane(r.count))).collect() }
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
        assert_eq!(host.shared_value(KEY).unwrap().len(), 2 * Record::SIZE);
        // Long unused, A's record goes.
        for _ in 0..2000 {
            routed(&host, B).unwrap();
        }
        assert_eq!(host.shared_value(KEY).unwrap().len(), Record::SIZE);
        assert_eq!(Recent::read(&host).of(A), 0.0);
    }

    #[test]
    fn records_are_bounded_and_bad_values_count_as_zero() {
        let mut v = Vec::new();
        for i in 0..(MAX_RECORDS as u64 + 10) {
            v = with(&v, i);
        }
        assert_eq!(v.len(), MAX_RECORDS * Record::SIZE);
        // The most recent survive.
        assert!(decode::<Record>(&v).any(|r| r.id == MAX_RECORDS as u64 + 9));
        let bad = encode([Record { id: 1, count: f64::NAN }, Record { id: 2, count: -5.0 }]);
        let next = with(&bad, 3);
        assert!(decode::<Record>(&next).all(|r| r.count.is_finite() && r.count >= 0.0));
        assert_eq!(decode::<Record>(&next).map(|r| r.id).collect::<Vec<_>>(), vec![3]);
    }
}
