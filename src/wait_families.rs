//! What the workers' waits for a request's own tokens found, per family of requests that share
//! a prefix (`llmgw_core::flow::wait_ledger`), shared by every worker of this Envoy through
//! proxy-wasm shared data, so that a family is learned once per Envoy, not once per worker.
//! Read where a worker meets a family it has not seen or would make a member wait (not at
//! every decision); written with compare-and-swap after each wait.
//!
//! Two values: the families' counts, 20-byte records (the family's tag, u128; its waits in a
//! row that found nothing past the prefix, u32; little-endian), the most recently written last,
//! at most [`MAX_FAMILIES`] (the ledger's own bound: the oldest go first); and every family's
//! count, one u32.

use crate::host::{update_shared, Host, SharedKind};
use crate::shared_records::{decode, encode, FieldReader, SharedRecord};
use llmgw_core::flow::wait_ledger::MAX_FAMILIES;

const KEY: &str = "llmgw.wait_families";
const EVERY_KEY: &str = "llmgw.wait_families.every";

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

/// `family`'s count as the worker that waited last recorded it.
pub fn of(host: &dyn Host, family: u128) -> Option<u8> {
    let value = host.shared_data(KEY).and_then(|(v, _)| v)?;
    let unpaid = decode::<Family>(&value).filter(|f| f.tag == family).last()?.unpaid;
    Some(u8::try_from(unpaid).unwrap_or(u8::MAX))
}

/// Every family's count.
pub fn every(host: &dyn Host) -> Option<u8> {
    let value = host.shared_data(EVERY_KEY).and_then(|(v, _)| v)?;
    let unpaid = FieldReader::new(&value).u32()?;
    Some(u8::try_from(unpaid).unwrap_or(u8::MAX))
}

/// Records a wait's counts: `family`'s (moved to the end) and every family's. The kinds not
/// updated (refused, or every compare-and-swap lost its race).
pub fn record(host: &dyn Host, family: u128, unpaid: u8, every_family: u8) -> Vec<SharedKind> {
    let mut failed = Vec::new();
    let families = update_shared(host, KEY, |v| {
        let mut out: Vec<Family> = decode::<Family>(v).filter(|f| f.tag != family).collect();
        out.push(Family { tag: family, unpaid: u32::from(unpaid) });
        let extra = out.len().saturating_sub(MAX_FAMILIES);
        out.drain(..extra);
        Some(encode(out))
    });
    let every = update_shared(host, EVERY_KEY, |_| Some(u32::from(every_family).to_le_bytes().to_vec()));
    if !families || !every {
        log::debug!("llmgw: the waits' counts of a family were not shared (shared data refused or contended)");
        failed.push(SharedKind::WaitFamilies);
    }
    failed
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fake::FakeHost;

    #[test]
    fn every_worker_reads_the_latest_count_of_each_family_and_the_oldest_go_first() {
        let host = FakeHost::default();
        assert_eq!((of(&host, 1), every(&host)), (None, None));
        assert!(record(&host, 1, 2, 2).is_empty());
        assert!(record(&host, 7, 0, 0).is_empty());
        assert_eq!((of(&host, 1), of(&host, 7), every(&host)), (Some(2), Some(0), Some(0)));
        record(&host, 1, 3, 1);
        assert_eq!((of(&host, 1), every(&host)), (Some(3), Some(1)));
        // Bounded: the families written longest ago go first.
        for f in 100..(100 + MAX_FAMILIES as u128) {
            record(&host, f, 1, 1);
        }
        assert_eq!((of(&host, 1), of(&host, 100)), (None, Some(1)));
        assert_eq!(host.shared_value(KEY).unwrap().len(), 20 * MAX_FAMILIES);
    }
}
