//! The ledger behind the requests expected back ([`crate::policy::returns`]): per replica, the
//! requests answered lately and not followed yet, and what those followed or pushed out teach
//! of the gaps. The filter keeps its records in Envoy's shared data (every worker's requests in
//! one list), the endpoint picker in its memory; both keep them by these rules.
//!
//! A request is recorded from its first token (keyed by its prompt's last full block, which its
//! next request's blocks include), its end is noted, and a request whose blocks include the key
//! follows it: the record goes, and the gaps from its first token and from its end are learned.
//! The latest [`PER_REPLICA`] per replica are kept, [`MAX_RECORDS`] in all; a record pushed out
//! counts as never followed.

use crate::placement::BuildKeyHasher;
use crate::policy::returns::{Answered, Gaps, ReturnCurves, Returning, MAX_ANSWERED};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

/// Requests remembered per replica: those answered last (see [`MAX_ANSWERED`]).
pub const PER_REPLICA: usize = MAX_ANSWERED;
/// At most this many records in all (the oldest go first).
pub const MAX_RECORDS: usize = 1024;

/// One request answered on a replica and not followed yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Record {
    /// The replica's id (the keeper's own id of its address).
    pub replica: u64,
    /// What its next request's blocks include: its prompt's last full block.
    pub key: u64,
    pub first_ns: u64,
    /// 0 while it streams.
    pub end_ns: u64,
}

/// What one record teaches: the gaps to its next request, or that none followed (`None`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Observation {
    from_first: Option<u64>,
    /// Whether it had ended, and its gap from there.
    from_end: Option<Option<u64>>,
}

/// The gaps learned from the first token and from the end.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LearnedGaps {
    pub from_first: Gaps,
    pub from_end: Gaps,
}

impl LearnedGaps {
    pub fn learn(&mut self, observations: &[Observation]) {
        for o in observations {
            self.from_first.observe(o.from_first);
            if let Some(e) = o.from_end {
                self.from_end.observe(e);
            }
        }
    }
}

/// A record that goes without a next request.
fn never(a: &Record) -> Observation {
    Observation { from_first: None, from_end: (a.end_ns != 0).then_some(None) }
}

/// A request sent to `replica` produced its first token; its next one would include `key`.
/// What the records pushed out to make room teach.
pub fn start(records: &mut Vec<Record>, replica: u64, key: u64, now_ns: u64) -> Vec<Observation> {
    records.retain(|a| a.key != key);
    records.push(Record { replica, key, first_ns: now_ns, end_ns: 0 });
    let mine = records.iter().filter(|a| a.replica == replica).count();
    let mut drop_mine = mine.saturating_sub(PER_REPLICA);
    let mut drop_any = records.len().saturating_sub(drop_mine).saturating_sub(MAX_RECORDS);
    let mut gone = Vec::new();
    if drop_mine == 0 && drop_any == 0 {
        return gone;
    }
    // The oldest go first, past the per-replica bound and the overall one.
    records.sort_by_key(|a| a.first_ns);
    records.retain(|a| {
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
    gone
}

/// The request recorded under `key` ended; false when no such request streams.
pub fn end(records: &mut [Record], key: u64, now_ns: u64) -> bool {
    match records.iter_mut().find(|a| a.key == key && a.end_ns == 0) {
        Some(a) => {
            a.end_ns = now_ns.max(1);
            true
        }
        None => false,
    }
}

/// A request followed the one recorded under `key`: its record goes, and what it teaches is
/// returned (none when no such record is kept).
pub fn follow(records: &mut Vec<Record>, key: u64, now_ns: u64) -> Option<Observation> {
    let at = records.iter().position(|a| a.key == key)?;
    let a = records.remove(at);
    Some(Observation {
        from_first: Some(now_ns.saturating_sub(a.first_ns) / 1_000),
        from_end: (a.end_ns != 0).then_some(Some(now_ns.saturating_sub(a.end_ns) / 1_000)),
    })
}

/// The records and the curves learned, as one decision reads them.
#[derive(Debug, Default)]
pub struct ExpectedReturns {
    keys: HashSet<u64, BuildKeyHasher>,
    /// Per replica: its records (the first `.1`, at most [`PER_REPLICA`]).
    by_replica: HashMap<u64, ([Answered; PER_REPLICA], usize), BuildKeyHasher>,
    curves: Option<Arc<ReturnCurves>>,
}

impl ExpectedReturns {
    pub fn new(records: impl ExactSizeIterator<Item = Record>, gaps: &LearnedGaps, now_ns: u64) -> ExpectedReturns {
        let n = records.len();
        let mut r = ExpectedReturns {
            keys: HashSet::with_capacity_and_hasher(n, BuildKeyHasher::default()),
            by_replica: HashMap::with_capacity_and_hasher(n.div_ceil(PER_REPLICA), BuildKeyHasher::default()),
            curves: Some(Arc::new(ReturnCurves::new(&gaps.from_first, &gaps.from_end))),
        };
        for a in records {
            r.keys.insert(a.key);
            let since = |t: u64| now_ns.saturating_sub(t) / 1_000;
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

    /// The requests expected back on `replica`, where the gateway has `in_flight` requests of
    /// which some are still computing their prefill (`prefilling`: its prefill tokens queued
    /// there are not 0).
    pub fn of(&self, replica: u64, in_flight: u32, prefilling: bool) -> Returning {
        let (answered, count) = self.by_replica.get(&replica).copied().unwrap_or_default();
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

    const MS: u64 = 1_000_000;

    #[test]
    fn a_record_followed_teaches_its_gaps_and_goes() {
        let mut records = Vec::new();
        assert!(start(&mut records, 1, 7, 10 * MS).is_empty());
        assert!(end(&mut records, 7, 40 * MS));
        assert!(!end(&mut records, 7, 41 * MS), "ended once");
        let o = follow(&mut records, 7, 45 * MS).unwrap();
        assert_eq!(o, Observation { from_first: Some(35_000), from_end: Some(Some(5_000)) });
        assert!(records.is_empty() && follow(&mut records, 7, 50 * MS).is_none());
    }

    #[test]
    fn past_the_bounds_the_oldest_go_as_never_followed() {
        let mut records = Vec::new();
        let mut gone = Vec::new();
        for k in 0..(PER_REPLICA as u64 + 2) {
            gone.extend(start(&mut records, 1, k, k + 1));
        }
        assert_eq!(gone, vec![Observation { from_first: None, from_end: None }; 2]);
        assert_eq!(records.iter().map(|r| r.key).min(), Some(2), "the two oldest went");
        // Over every replica: at most MAX_RECORDS.
        for k in 0..(MAX_RECORDS as u64 + 5) {
            start(&mut records, 100 + k, 1_000 + k, 1_000 + k);
        }
        assert_eq!(records.len(), MAX_RECORDS);
        let r = ExpectedReturns::new(records.iter().copied(), &LearnedGaps::default(), 5_000);
        assert!(r.ended(1_000 + MAX_RECORDS as u64 + 4) && !r.ended(0));
    }
}
