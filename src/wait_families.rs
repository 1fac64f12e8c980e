//! What the workers' waits for a request's own tokens found, per family of requests that share
//! a prefix (`llmgw_core::flow::wait_ledger`), shared by every worker of this Envoy through
//! proxy-wasm shared data, so that a family is learned once per Envoy, not once per worker.
//! Each wait updates the counts with compare-and-swap, counting on from what the value holds
//! then (so concurrent workers' waits all count, and a wait that paid is never overwritten by a
//! stale count); the family's count is read where a worker meets a family it has not seen,
//! would make a member wait, or sees that a wait paid since (up to 20 KiB each), and every
//! family's (8 bytes) at each member that might go at once.
//!
//! Two values: the families' counts, 20-byte records (the family's tag, u128; its waits in a
//! row that found nothing past the prefix, u32; little-endian), the most recently written last,
//! at most [`MAX_WAIT_FAMILIES`] (the ledger's own bound: the oldest go first); and every
//! family's, two u32: its waits in a row that found nothing past the prefix, and the waits that
//! paid so far. Family tags carry the hashing plan they were computed under, so a
//! configuration that changes it starts new records; one that changes other settings keeps
//! what was learned of the traffic (whether its questions repeat).

use crate::host::{update_shared, Host, SharedKind};
use crate::shared_records::{decode, encode, FieldReader, SharedRecord};
use llmgw_core::flow::{unpaid_after, AllWaits, MAX_WAIT_FAMILIES};

const KEY: &str = "llmgw.wait_families";
const ALL_KEY: &str = "llmgw.wait_families.all";

/// One family's count.
struct Family {
    tag: u128,
    unpaid: u32,
}

impl SharedRecord for Family {
    const SIZE: usize = 20;
    fn read(f: &mut FieldReader<'_>) -> Option<Self> {
        Some(Family { tag: f.u128()?, unpaid: f.u32()? })
    }
    fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.tag.to_le_bytes());
        out.extend_from_slice(&self.unpaid.to_le_bytes());
    }
}

fn count(unpaid: u32) -> u8 {
    u8::try_from(unpaid).unwrap_or(u8::MAX)
}

/// `family`'s count in the value `v` (its latest record).
fn family_in(v: &[u8], family: u128) -> Option<u8> {
    let records: Vec<Family> = decode::<Family>(v).collect();
    records.iter().rev().find(|f| f.tag == family).map(|f| count(f.unpaid))
}

/// Every family's counts in the value `v`.
fn all_in(v: &[u8]) -> Option<AllWaits> {
    let mut f = FieldReader::new(v);
    Some(AllWaits { unpaid: count(f.u32()?), paid: f.u32()? })
}

/// `family`'s count as every worker's waits left it.
pub fn of(host: &dyn Host, family: u128) -> Option<u8> {
    family_in(&host.shared_data(KEY).and_then(|(v, _)| v)?, family)
}

/// Every family's counts.
pub fn all(host: &dyn Host) -> Option<AllWaits> {
    all_in(&host.shared_data(ALL_KEY).and_then(|(v, _)| v)?)
}

/// Applies what one wait found (`paid`) to `family`'s count (moved to the end) and every
/// family's, each from what the value holds as it is updated (`local`: this worker's counts,
/// where it holds none). The counts after it (`None` unless both were updated), and the kinds
/// not updated (refused, or every compare-and-swap lost its race).
pub fn record(host: &dyn Host, family: u128, paid: bool, local: (u8, u8)) -> (Option<(u8, u8)>, Vec<SharedKind>) {
    let mut unpaid = local.0;
    let families = update_shared(host, KEY, |v| {
        unpaid = unpaid_after(family_in(v, family).unwrap_or(local.0), paid);
        let mut out: Vec<Family> = decode::<Family>(v).filter(|f| f.tag != family).collect();
        out.push(Family { tag: family, unpaid: u32::from(unpaid) });
        let extra = out.len().saturating_sub(MAX_WAIT_FAMILIES);
        out.drain(..extra);
        Some(encode(out))
    });
    let mut every = local.1;
    let everyone = update_shared(host, ALL_KEY, |v| {
        let was = all_in(v);
        every = unpaid_after(was.map_or(local.1, |a| a.unpaid), paid);
        let paid_so_far = was.map_or(0, |a| a.paid).wrapping_add(u32::from(paid));
        let mut out = u32::from(every).to_le_bytes().to_vec();
        out.extend_from_slice(&paid_so_far.to_le_bytes());
        Some(out)
    });
    if families && everyone {
        return (Some((unpaid, every)), Vec::new());
    }
    log::debug!("llmgw: a wait's finding was not shared with the other workers (shared data refused or contended)");
    (None, vec![SharedKind::WaitFamilies])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fake::FakeHost;

    #[test]
    fn each_wait_counts_on_from_what_the_workers_left_and_the_oldest_families_go_first() {
        let host = FakeHost::default();
        assert_eq!((of(&host, 1), all(&host)), (None, None));
        // From the worker's own counts where nothing is held.
        assert_eq!(record(&host, 1, false, (1, 2)), (Some((2, 3)), vec![]));
        assert_eq!(record(&host, 7, false, (0, 0)), (Some((1, 4)), vec![]));
        assert_eq!((of(&host, 1), of(&host, 7)), (Some(2), Some(1)));
        // Then from what is held, whatever the worker knew (a stale count does not win).
        assert_eq!(record(&host, 1, false, (0, 0)), (Some((3, 5)), vec![]));
        // A wait that paid: both counts back to nothing, and one more wait that paid.
        assert_eq!(record(&host, 1, true, (5, 5)).0, Some((0, 0)));
        assert_eq!(all(&host), Some(AllWaits { unpaid: 0, paid: 1 }));
        // A lost race is tried again from the value as it then is.
        host.cas_failures.set(1);
        assert_eq!(record(&host, 1, false, (0, 0)).0, Some((1, 1)));
        // Bounded: the families written longest ago go first.
        for f in 100..(100 + MAX_WAIT_FAMILIES as u128) {
            record(&host, f, false, (0, 0));
        }
        assert_eq!((of(&host, 1), of(&host, 100)), (None, Some(1)));
        assert_eq!(host.shared_value(KEY).unwrap().len(), 20 * MAX_WAIT_FAMILIES);
    }
}
