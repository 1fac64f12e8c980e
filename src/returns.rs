//! Requests answered lately per replica and how soon next requests followed them
//! ([`llmgw_core::policy::returns`]), shared by every worker of this Envoy through proxy-wasm
//! shared data: a conversation's turns may come over different connections, so different VMs.
//!
//! A request is recorded from its first token, not only from its end: a conversation's next
//! turn often arrives a few milliseconds after the answer ends, and a request decided while that
//! answer's last tokens stream would not see it coming otherwise.
//!
//! Two values, updated with compare-and-swap:
//! * `llmgw.returns.ends`: 32-byte records, little-endian: the replica's address id, the key
//!   the request is recorded under (its prompt's last full block), its first token's time and
//!   its end's (ns; 0 while it streams). The latest
//!   [`PER_REPLICA`](llmgw_core::policy::return_ledger::PER_REPLICA) per replica are kept,
//!   [`MAX_RECORDS`](llmgw_core::policy::return_ledger::MAX_RECORDS) in all (32 KiB). A request whose blocks include a record's key is its next
//!   one: the record goes, and the gaps are learned. A record pushed out first counts as never
//!   followed.
//! * `llmgw.returns.gaps`: the gaps learned ([`Gaps`]) from the first token, then from the end:
//!   each one `f64` bit pattern per bucket, then the count of requests never followed.
//!
//! The rules (what goes, what is learned) are the core's ledger, which the endpoint picker
//! keeps in its memory by the same rules; this module stores it.

use crate::host::{update_shared, Host, SharedKind};
use crate::shared_records::{address_id, decode, encode, FieldReader, SharedRecord};
use llmgw_core::policy::return_ledger::{
    end, follow, start, ExpectedReturns, LearnedGaps as ReturnGaps, Observation, Record as ReturnRecord,
};
use llmgw_core::policy::returns::{Gaps, Returning};

const ENDS: &str = "llmgw.returns.ends";
const GAPS: &str = "llmgw.returns.gaps";

impl SharedRecord for ReturnRecord {
    const SIZE: usize = 32;
    fn read(f: &mut FieldReader<'_>) -> Option<Self> {
        Some(ReturnRecord { replica: f.u64()?, key: f.u64()?, first_ns: f.u64()?, end_ns: f.u64()? })
    }
    fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.replica.to_le_bytes());
        out.extend_from_slice(&self.key.to_le_bytes());
        out.extend_from_slice(&self.first_ns.to_le_bytes());
        out.extend_from_slice(&self.end_ns.to_le_bytes());
    }
}

#[derive(Debug, Clone, Copy)]
struct Weight(f64);

impl SharedRecord for Weight {
    const SIZE: usize = 8;
    fn read(f: &mut FieldReader<'_>) -> Option<Self> {
        Some(Weight(f64::from_bits(f.u64()?)))
    }
    fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.0.to_bits().to_le_bytes());
    }
}

fn read_learned(v: &[u8]) -> ReturnGaps {
    let mut weights = decode::<Weight>(v);
    let mut next = || weights.next().map_or(0.0, |w| w.0);
    let mut l = ReturnGaps::default();
    for g in [&mut l.from_first, &mut l.from_end] {
        for b in g.buckets.iter_mut() {
            *b = next();
        }
        g.never = next();
    }
    l
}

fn write_learned(l: &ReturnGaps) -> Vec<u8> {
    let one = |g: &Gaps| g.buckets.iter().copied().chain(std::iter::once(g.never)).collect::<Vec<f64>>();
    encode(one(&l.from_first).into_iter().chain(one(&l.from_end)).map(Weight))
}

fn learn(host: &dyn Host, observations: &[Observation]) -> Result<(), SharedKind> {
    if observations.is_empty() {
        return Ok(());
    }
    let ok = update_shared(host, GAPS, |v| {
        let mut l = read_learned(v);
        l.learn(observations);
        Some(write_learned(&l))
    });
    if ok {
        Ok(())
    } else {
        Err(SharedKind::Returns)
    }
}

/// A request sent to `address` produced its first token; its next one would include `key`.
pub fn started(host: &dyn Host, address: &str, key: u64) -> Vec<SharedKind> {
    let now = host.now_ns();
    let replica = address_id(address);
    let mut gone = Vec::new();
    let ok = update_shared(host, ENDS, |v| {
        let mut all: Vec<ReturnRecord> = decode::<ReturnRecord>(v).collect();
        gone = start(&mut all, replica, key, now);
        Some(encode(all))
    });
    let mut failed = Vec::new();
    if !ok {
        failed.push(SharedKind::Returns);
    }
    failed.extend(learn(host, &gone).err());
    failed
}

/// The request recorded under `key` ended.
pub fn ended(host: &dyn Host, key: u64) -> Vec<SharedKind> {
    let now = host.now_ns();
    let ok = update_shared(host, ENDS, |v| {
        let mut all: Vec<ReturnRecord> = decode::<ReturnRecord>(v).collect();
        end(&mut all, key, now).then(|| encode(all))
    });
    if ok {
        Vec::new()
    } else {
        vec![SharedKind::Returns]
    }
}

/// A request followed the one recorded under `key`: the gaps are learned.
pub fn followed(host: &dyn Host, key: u64) -> Vec<SharedKind> {
    let now = host.now_ns();
    let mut seen = None;
    let ok = update_shared(host, ENDS, |v| {
        let mut all: Vec<ReturnRecord> = decode::<ReturnRecord>(v).collect();
        seen = follow(&mut all, key, now);
        seen.map(|_| encode(all))
    });
    let mut failed = Vec::new();
    if !ok {
        failed.push(SharedKind::Returns);
    }
    if let Some(o) = seen {
        failed.extend(learn(host, &[o]).err());
    }
    failed
}

/// The records and the curves learned, read once per decision.
#[derive(Default)]
pub struct Returns(ExpectedReturns);

impl Returns {
    pub fn read(host: &dyn Host) -> Returns {
        let ends = host.shared_data(ENDS).and_then(|(v, _)| v).unwrap_or_default();
        let gaps = host.shared_data(GAPS).and_then(|(v, _)| v).unwrap_or_default();
        let records: Vec<ReturnRecord> = decode::<ReturnRecord>(&ends).collect();
        Returns(ExpectedReturns::new(records.into_iter(), &read_learned(&gaps), host.now_ns()))
    }

    /// Whether a request recorded under `key` has not been followed yet.
    pub fn ended(&self, key: u64) -> bool {
        self.0.ended(key)
    }

    /// The requests expected back on `address`, where this Envoy has `in_flight` requests of
    /// which some are still computing their prefill (`prefilling`: its prefill tokens queued
    /// there are not 0).
    pub fn of(&self, address: &str, in_flight: u32, prefilling: bool) -> Returning {
        self.0.of(address_id(address), in_flight, prefilling)
    }
}

#[cfg(test)]
#[allow(clippy::arithmetic_side_effects)]
mod tests {
    use super::*;
    use crate::fake::FakeHost;
    use llmgw_core::policy::return_ledger::PER_REPLICA;
    use llmgw_core::policy::returns::GAP_BUCKETS;

    const A: &str = "10.0.0.1:8000";
    const B: &str = "10.0.0.2:8000";
    const MS: u64 = 1_000_000;

    fn learned(host: &FakeHost) -> ReturnGaps {
        read_learned(&host.shared_data(GAPS).and_then(|(v, _)| v).unwrap_or_default())
    }

    #[test]
    fn a_loop_that_follows_each_answer_within_milliseconds_is_expected_back_where_it_was_answered() {
        let host = FakeHost::default();
        // 40 requests on A, each streaming for 30 ms and followed 5 ms after its end.
        for i in 0..40u64 {
            host.now_ns.set(1_000 * MS * (i + 1));
            assert!(started(&host, A, i).is_empty());
            host.now_ns.set(1_000 * MS * (i + 1) + 30 * MS);
            assert!(ended(&host, i).is_empty());
            host.now_ns.set(1_000 * MS * (i + 1) + 35 * MS);
            assert!(followed(&host, i).is_empty());
        }
        host.now_ns.set(100_000 * MS);
        assert!(started(&host, A, 999).is_empty());
        // Streaming 20 ms in: expected back within a prefill of 300 ms.
        host.now_ns.set(100_020 * MS);
        let r = Returns::read(&host);
        assert!(r.ended(999) && !r.ended(3));
        let streaming = r.of(A, 0, false).expected_within(300_000.0);
        assert!(streaming > 0.9, "{streaming}");
        assert_eq!(r.of(B, 0, false).expected_within(1e9), 0.0);
        // Two requests computing their prefill on B come back within 300 ms of their first
        // token, so within a new request's 300 ms prefill queued behind them.
        let behind = r.of(B, 2, true).expected_within(300_000.0);
        assert!((1.8..2.01).contains(&behind), "{behind}");
        // Two in flight on A: one streams (recorded), the other is computing its prefill.
        assert!(r.of(A, 2, true).expected_within(300_000.0) > streaming + 0.9);
        // Ended 1 ms ago: expected back within 10 ms.
        assert!(ended(&host, 999).is_empty());
        host.now_ns.set(100_021 * MS);
        let just_ended = Returns::read(&host).of(A, 0, false).expected_within(10_000.0);
        assert!(just_ended > 0.9, "{just_ended}");
        // A second later it is not expected any more.
        host.now_ns.set(101_000 * MS);
        assert!(Returns::read(&host).of(A, 0, false).expected_within(300_000.0) < 0.05);
    }

    #[test]
    fn requests_nobody_followed_are_pushed_out_and_learned_as_never_followed() {
        let host = FakeHost::default();
        for i in 0..(PER_REPLICA as u64 + 3) {
            host.now_ns.set(1_000 + i);
            assert!(started(&host, A, i).is_empty());
            if i < 2 {
                assert!(ended(&host, i).is_empty());
            }
        }
        let ends = host.shared_data(ENDS).and_then(|(v, _)| v).unwrap_or_default();
        assert_eq!(ends.len(), PER_REPLICA * ReturnRecord::SIZE);
        let l = learned(&host);
        // Three went: all three from the first token, the two that had ended from the end.
        assert!((l.from_first.never - 3.0).abs() < 0.1, "{}", l.from_first.never);
        assert!((l.from_end.never - 2.0).abs() < 0.1, "{}", l.from_end.never);
        let r = Returns::read(&host);
        assert!(!r.ended(0) && r.ended(PER_REPLICA as u64 + 2));
    }

    #[test]
    fn a_garbled_shared_value_counts_nothing() {
        let host = FakeHost::default();
        host.set_shared_data(GAPS, &[0xff; 7 + 16 * (GAP_BUCKETS + 1)], None).ok();
        host.set_shared_data(ENDS, &[0xff; 40], None).ok();
        let r = Returns::read(&host);
        assert_eq!(r.of(A, 0, false).expected_within(1e9), 0.0);
        assert!(started(&host, A, 1).is_empty());
        assert!(followed(&host, 1).is_empty());
    }
}
