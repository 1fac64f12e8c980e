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
//!   its end's (ns; 0 while it streams). The latest [`PER_REPLICA`] per replica are kept,
//!   [`MAX_RECORDS`] in all (32 KiB). A request whose blocks include a record's key is its next
//!   one: the record goes, and the gaps are learned. A record pushed out first counts as never
//!   followed.
//! * `llmgw.returns.gaps`: the gaps learned ([`Gaps`]) from the first token, then from the end:
//!   each one `f64` bit pattern per bucket, then the count of requests never followed.

use crate::host::{update_shared, Host, SharedKind};
use crate::shared_records::{address_id, decode, encode, FieldReader, IdMap, IdSet, SharedRecord};
use llmgw_core::policy::returns::{Answered, Gaps, ReturnCurves, Returning, MAX_ANSWERED};
use std::sync::Arc;

const ENDS: &str = "llmgw.returns.ends";
const GAPS: &str = "llmgw.returns.gaps";
/// Requests remembered per replica: those answered last (see [`MAX_ANSWERED`]).
pub const PER_REPLICA: usize = MAX_ANSWERED;
/// At most this many records in all (the oldest go first).
pub const MAX_RECORDS: usize = 1024;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Record {
    replica: u64,
    key: u64,
    first_ns: u64,
    /// 0 while it streams.
    end_ns: u64,
}

impl SharedRecord for Record {
    const SIZE: usize = 32;
    fn read(f: &mut FieldReader<'_>) -> Option<Self> {
        Some(Record { replica: f.u64()?, key: f.u64()?, first_ns: f.u64()?, end_ns: f.u64()? })
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

/// The gaps from the first token and from the end.
#[derive(Debug, Clone, Default, PartialEq)]
struct Learned {
    from_first: Gaps,
    from_end: Gaps,
}

/// What one record teaches: the gaps to its next request, or that none followed (`None`).
#[derive(Debug, Clone, Copy)]
struct Observation {
    from_first: Option<u64>,
    /// Whether it had ended, and its gap from there.
    from_end: Option<Option<u64>>,
}

fn read_learned(v: &[u8]) -> Learned {
    let mut weights = decode::<Weight>(v);
    let mut next = || weights.next().map_or(0.0, |w| w.0);
    let mut l = Learned::default();
    for g in [&mut l.from_first, &mut l.from_end] {
        for b in g.buckets.iter_mut() {
            *b = next();
        }
        g.never = next();
    }
    l
}

fn write_learned(l: &Learned) -> Vec<u8> {
    let one = |g: &Gaps| g.buckets.iter().copied().chain(std::iter::once(g.never)).collect::<Vec<f64>>();
    encode(one(&l.from_first).into_iter().chain(one(&l.from_end)).map(Weight))
}

fn learn(host: &dyn Host, observations: &[Observation]) -> Result<(), SharedKind> {
    if observations.is_empty() {
        return Ok(());
    }
    let ok = update_shared(host, GAPS, |v| {
        let mut l = read_learned(v);
        for o in observations {
            l.from_first.observe(o.from_first);
            if let Some(e) = o.from_end {
                l.from_end.observe(e);
            }
        }
        Some(write_learned(&l))
    });
    if ok {
        Ok(())
    } else {
        Err(SharedKind::Returns)
    }
}

/// A record that goes without a next request.
fn never(a: &Record) -> Observation {
    Observation { from_first: None, from_end: (a.end_ns != 0).then_some(None) }
}

/// A request sent to `address` produced its first token; its next one would include `key`.
pub fn started(host: &dyn Host, address: &str, key: u64) -> Vec<SharedKind> {
    let now = host.now_ns();
    let replica = address_id(address);
    let mut gone = Vec::new();
    let ok = update_shared(host, ENDS, |v| {
        gone.clear();
        let mut all: Vec<Record> = decode::<Record>(v).filter(|a| a.key != key).collect();
        all.push(Record { replica, key, first_ns: now, end_ns: 0 });
        let mine = all.iter().filter(|a| a.replica == replica).count();
        let mut drop_mine = mine.saturating_sub(PER_REPLICA);
        let mut drop_any = all.len().saturating_sub(drop_mine).saturating_sub(MAX_RECORDS);
        // The oldest go first, past the per-replica bound and the overall one.
        all.sort_by_key(|a| a.first_ns);
        all.retain(|a| {
            let goes = if a.replica == replica && drop_mine > 0 {
                drop_mine = drop_mine.saturating_sub(1);
                true
            } else if drop_any > 0 {
                drop_any = drop_any.saturating_sub(1);
                true
            } else {
                false
            };
            if goes {
                gone.push(never(a));
            }
            !goes
        });
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
        let mut all: Vec<Record> = decode::<Record>(v).collect();
        let a = all.iter_mut().find(|a| a.key == key && a.end_ns == 0)?;
        a.end_ns = now.max(1);
        Some(encode(all))
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
        let all: Vec<Record> = decode::<Record>(v).collect();
        let a = all.iter().find(|a| a.key == key)?;
        seen = Some(Observation {
            from_first: Some(now.saturating_sub(a.first_ns) / 1_000),
            from_end: (a.end_ns != 0).then_some(Some(now.saturating_sub(a.end_ns) / 1_000)),
        });
        Some(encode(all.into_iter().filter(|a| a.key != key)))
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
pub struct Returns {
    keys: IdSet,
    /// Per replica: its records (the first `.1`, at most [`PER_REPLICA`]).
    by_replica: IdMap<([Answered; PER_REPLICA], usize)>,
    curves: Option<Arc<ReturnCurves>>,
}

impl Returns {
    pub fn read(host: &dyn Host) -> Returns {
        let ends = host.shared_data(ENDS).and_then(|(v, _)| v).unwrap_or_default();
        let gaps = host.shared_data(GAPS).and_then(|(v, _)| v).unwrap_or_default();
        let now = host.now_ns();
        let learned = read_learned(&gaps);
        let curves = Some(Arc::new(ReturnCurves::new(&learned.from_first, &learned.from_end)));
        let n = ends.len() / Record::SIZE;
        let mut r = Returns {
            keys: IdSet::with_capacity_and_hasher(n, Default::default()),
            by_replica: IdMap::with_capacity_and_hasher(n.div_ceil(PER_REPLICA), Default::default()),
            curves,
        };
        for a in decode::<Record>(&ends) {
            r.keys.insert(a.key);
            let since = |t: u64| now.saturating_sub(t) / 1_000;
            let seen = if a.end_ns != 0 {
                Answered { since_us: since(a.end_ns), ended: true }
            } else {
                Answered { since_us: since(a.first_ns), ended: false }
            };
            let (list, n) = r.by_replica.entry(a.replica).or_default();
            if let Some(slot) = list.get_mut(*n) {
                *slot = seen;
                *n = n.saturating_add(1);
            }
        }
        r
    }

    /// Whether a request recorded under `key` has not been followed yet.
    pub fn ended(&self, key: u64) -> bool {
        self.keys.contains(&key)
    }

    /// The requests expected back on `address`, where this Envoy has `in_flight` requests of
    /// which some are still computing their prefill (`prefilling`: its prefill tokens queued
    /// there are not 0).
    pub fn of(&self, address: &str, in_flight: u32, prefilling: bool) -> Returning {
        let (answered, count) = self.by_replica.get(&address_id(address)).copied().unwrap_or_default();
        // In flight and not streaming (as far as the records tell): computing its prefill.
        let streams = answered.iter().take(count).filter(|a| !a.ended).count();
        let prefilling =
            if prefilling { in_flight.saturating_sub(u32::try_from(streams).unwrap_or(u32::MAX)).max(1) } else { 0 };
        Returning { answered, count, prefilling, curves: self.curves.clone() }
    }
}

#[cfg(test)]
#[allow(clippy::arithmetic_side_effects)]
mod tests {
    use super::*;
    use crate::fake::FakeHost;
    use llmgw_core::policy::returns::GAP_BUCKETS;

    const A: &str = "10.0.0.1:8000";
    const B: &str = "10.0.0.2:8000";
    const MS: u64 = 1_000_000;

    fn learned(host: &FakeHost) -> Learned {
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
        assert_eq!(ends.len(), PER_REPLICA * Record::SIZE);
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
