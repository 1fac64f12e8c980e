//! The prefixes requests reused lately per replica, shared by every worker of this Envoy through
//! proxy-wasm shared data: a family's requests (a system prompt's questions, an agent's tasks
//! under one set of instructions) come over any connection, so to any VM.
//!
//! A request routed to a replica because that replica held more of its prompt than another
//! ([`llmgw_core::flow::Routed::reuses`]) reuses the prefix ending at its last matched block
//! there. A prefix reused there twice is a family the replica serves: each decision expects,
//! per replica, its families' next requests within a new prefix's prefill, from each family's
//! pace ([`Reused`]).
//!
//! `llmgw.reuse.prefixes`: 40-byte records, little-endian: the replica's address id, the
//! prefix's last block key, its first and last reuses' times (ns) and its reuses. At most
//! [`PER_REPLICA`] per replica and [`MAX_RECORDS`] in all (10 KiB); past them, prefixes reused
//! once go first, then the families reused longest ago.

use crate::host::{update_shared, Host, SharedKind};
use crate::shared_records::{address_id, decode, encode, FieldReader, IdMap, SharedRecord};
use llmgw_core::policy::returns::{Returning, Reused, MAX_REUSED};

const PREFIXES: &str = "llmgw.reuse.prefixes";
/// Prefixes remembered per replica: its families and the prefixes that may become one.
pub const PER_REPLICA: usize = 2 * MAX_REUSED;
/// At most this many records in all.
pub const MAX_RECORDS: usize = 256;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Record {
    replica: u64,
    key: u64,
    first_ns: u64,
    last_ns: u64,
    uses: u64,
}

impl Record {
    /// Reused at least twice: a family whose next reuse is expected.
    fn family(&self) -> bool {
        self.uses >= 2
    }

    /// As a decision at `now_ns` sees it.
    fn reused(&self, now_ns: u64) -> Reused {
        let gaps = self.uses.saturating_sub(1).max(1);
        Reused {
            since_us: now_ns.saturating_sub(self.last_ns) / 1_000,
            gap_us: self.last_ns.saturating_sub(self.first_ns).checked_div(gaps).unwrap_or(0) / 1_000,
        }
    }
}

impl SharedRecord for Record {
    const SIZE: usize = 40;
    fn read(f: &mut FieldReader<'_>) -> Option<Self> {
        Some(Record { replica: f.u64()?, key: f.u64()?, first_ns: f.u64()?, last_ns: f.u64()?, uses: f.u64()? })
    }
    fn write(&self, out: &mut Vec<u8>) {
        for v in [self.replica, self.key, self.first_ns, self.last_ns, self.uses] {
            out.extend_from_slice(&v.to_le_bytes());
        }
    }
}

/// A request routed to `address` reused the prefix ending at block `key` there.
pub fn reused(host: &dyn Host, address: &str, key: u64) -> Vec<SharedKind> {
    let now = host.now_ns();
    let replica = address_id(address);
    let ok = update_shared(host, PREFIXES, |v| {
        let mut all: Vec<Record> = decode::<Record>(v).collect();
        match all.iter_mut().find(|r| r.replica == replica && r.key == key) {
            Some(r) => {
                r.last_ns = now.max(r.last_ns);
                r.uses = r.uses.saturating_add(1);
            }
            None => all.push(Record { replica, key, first_ns: now, last_ns: now, uses: 1 }),
        }
        let mine = all.iter().filter(|r| r.replica == replica).count();
        let mut drop_mine = mine.saturating_sub(PER_REPLICA);
        let mut drop_any = all.len().saturating_sub(drop_mine).saturating_sub(MAX_RECORDS);
        // Prefixes reused once go first, then the families reused longest ago.
        all.sort_by_key(|r| (r.family(), r.last_ns));
        all.retain(|r| {
            let goes = if r.replica == replica && drop_mine > 0 {
                drop_mine = drop_mine.saturating_sub(1);
                true
            } else if drop_any > 0 {
                drop_any = drop_any.saturating_sub(1);
                true
            } else {
                false
            };
            !goes
        });
        Some(encode(all))
    });
    if ok {
        Vec::new()
    } else {
        vec![SharedKind::Returns]
    }
}

/// Per replica, its families as a decision sees them, read once per decision.
#[derive(Default)]
pub struct Reuse {
    by_replica: IdMap<([Reused; MAX_REUSED], usize)>,
}

impl Reuse {
    pub fn read(host: &dyn Host) -> Reuse {
        let v = host.shared_data(PREFIXES).and_then(|(v, _)| v).unwrap_or_default();
        let now = host.now_ns();
        let mut families: Vec<Record> = decode::<Record>(&v).filter(Record::family).collect();
        // The families reused last first: those are the ones counted where there are more.
        families.sort_by_key(|r| std::cmp::Reverse(r.last_ns));
        let mut by_replica: IdMap<([Reused; MAX_REUSED], usize)> = IdMap::default();
        for r in families {
            let (list, n) = by_replica.entry(r.replica).or_default();
            if let Some(slot) = list.get_mut(*n) {
                *slot = r.reused(now);
                *n = n.saturating_add(1);
            }
        }
        Reuse { by_replica }
    }

    /// Adds `address`'s families to what is expected back there.
    pub fn fill(&self, address: &str, r: &mut Returning) {
        let (families, n) = self.by_replica.get(&address_id(address)).copied().unwrap_or_default();
        r.reused = families;
        r.reused_count = n;
    }
}

#[cfg(test)]
#[allow(clippy::arithmetic_side_effects)]
mod tests {
    use super::*;
    use crate::fake::FakeHost;
    use crate::returns::Returns;

    const A: &str = "10.0.0.1:8000";
    const B: &str = "10.0.0.2:8000";
    const MS: u64 = 1_000_000;

    fn expected(host: &FakeHost, address: &str, window_us: f64) -> f64 {
        let mut r = Returns::read(host).of(address, 0, false);
        Reuse::read(host).fill(address, &mut r);
        r.expected_within(window_us)
    }

    #[test]
    fn families_reused_every_few_tens_of_milliseconds_are_expected_back_where_they_are_held() {
        let host = FakeHost::default();
        // Three families on A, one on B, each reused every 30 ms, 3 times.
        let mut t = 1_000 * MS;
        for i in 0..3u64 {
            t += 30 * MS;
            host.now_ns.set(t);
            for key in [1, 2, 3] {
                assert!(reused(&host, A, key).is_empty());
            }
            assert!(reused(&host, B, 4).is_empty());
            // Next turns of conversations: each prefix reused once, never a family.
            assert!(reused(&host, B, 1_000 + i).is_empty());
        }
        host.now_ns.set(t + 3 * MS);
        let (a, b) = (expected(&host, A, 100_000.0), expected(&host, B, 100_000.0));
        assert!((2.6..3.0).contains(&a), "{a}");
        assert!((0.85..1.0).contains(&b), "{b}");
        // Silent for a second: none is expected any more.
        host.now_ns.set(t + 1_000 * MS);
        assert!(expected(&host, A, 100_000.0) < 0.001);
    }

    #[test]
    fn the_records_are_bounded_and_families_outlast_prefixes_reused_once() {
        let host = FakeHost::default();
        for round in 0..3u64 {
            host.now_ns.set((round + 1) * MS);
            assert!(reused(&host, A, 7).is_empty());
        }
        for key in 100..(100 + 3 * PER_REPLICA as u64) {
            host.now_ns.set((key + 10) * MS);
            assert!(reused(&host, A, key).is_empty());
        }
        let v = host.shared_data(PREFIXES).and_then(|(v, _)| v).unwrap_or_default();
        let all: Vec<Record> = decode::<Record>(&v).collect();
        assert_eq!(all.len(), PER_REPLICA);
        assert!(all.iter().any(|r| r.key == 7 && r.uses == 3), "{all:?}");
        // Other replicas' prefixes fill the rest up to the overall bound.
        for key in 0..(2 * MAX_RECORDS as u64) {
            let address = format!("10.1.{}.{}:8000", key / 200, key % 200);
            assert!(reused(&host, &address, key).is_empty());
        }
        let v = host.shared_data(PREFIXES).and_then(|(v, _)| v).unwrap_or_default();
        assert_eq!(v.len(), MAX_RECORDS * Record::SIZE);
    }

    #[test]
    fn a_garbled_shared_value_counts_nothing() {
        let host = FakeHost::default();
        host.set_shared_data(PREFIXES, &[0xff; 40], None).ok();
        let mut r = Returning::default();
        Reuse::read(&host).fill(A, &mut r);
        assert!(r.reused_count <= MAX_REUSED);
        assert!(reused(&host, A, 1).is_empty());
    }
}
