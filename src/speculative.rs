//! Speculative index entries (`llmgw_core::flow::speculative`) in proxy-wasm shared data, so
//! every worker of this Envoy sees the blocks any of them just sent: 24-byte records (the
//! block key, u64; the engine's `replica_key`, u64; the expiry, u64 nanoseconds;
//! little-endian), kept and looked up as the core keeps them ([`add_speculative`],
//! [`speculative_hits`]): a record expires the TTL after it was first written, unless it
//! predates its engine's reset. At most `MAX_SPECULATIVE_ENTRIES` are kept (48 KiB, read once
//! per decision): past that the ones expiring first go, counted in
//! `llmgw_speculative_dropped_total`.

use crate::host::{update_shared, Host, SharedKind};
use crate::shared_records::{decode, encode, FieldReader, SharedRecord};
use llmgw_core::flow::{add_speculative, speculative_hits, Speculation, SpeculativeEntry, SpeculativeHit};

const KEY: &str = "llmgw.speculative";

impl SharedRecord for SpeculativeEntry {
    const SIZE: usize = 24;
    fn read(f: &mut FieldReader<'_>) -> Option<Self> {
        Some(SpeculativeEntry { key: f.u64()?, engine: f.u64()?, expires: f.u64()? })
    }
    fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.key.to_le_bytes());
        out.extend_from_slice(&self.engine.to_le_bytes());
        out.extend_from_slice(&self.expires.to_le_bytes());
    }
}

fn records(v: &[u8]) -> impl Iterator<Item = SpeculativeEntry> + '_ {
    decode(v)
}

/// The live records, as a decision reads them.
#[derive(Debug, Default)]
pub struct Entries {
    records: Vec<u8>,
    now: u64,
}

impl Entries {
    pub fn read(host: &dyn Host) -> Entries {
        Entries { records: host.shared_data(KEY).and_then(|(v, _)| v).unwrap_or_default(), now: host.now_ns() }
    }

    /// For each of `keys` an unexpired record holds, a hit.
    pub fn lookup(&self, keys: &[u64], out: &mut Vec<SpeculativeHit>) {
        speculative_hits(records(&self.records), keys, self.now, out);
    }
}

/// The records with `spec`'s added (see [`add_speculative`]), and how many unexpired records
/// the bound dropped.
fn with(v: &[u8], spec: &Speculation, now: u64) -> (Vec<u8>, usize) {
    let mut out: Vec<SpeculativeEntry> = records(v).collect();
    let dropped = add_speculative(&mut out, spec, now);
    (encode(out), dropped)
}

/// Records `spec` (a routed request's blocks); returns how many unexpired entries the bound
/// dropped, or `Err` when the entries could not be updated.
pub fn record(host: &dyn Host, spec: &Speculation) -> Result<usize, SharedKind> {
    let now = host.now_ns();
    let mut dropped = 0;
    let ok = update_shared(host, KEY, |v| {
        let (next, d) = with(v, spec, now);
        dropped = d;
        (next.as_slice() != v).then_some(next)
    });
    if !ok {
        log::debug!("llmgw: speculative entries not recorded (shared data refused or contended)");
        return Err(SharedKind::Speculative);
    }
    Ok(dropped)
}

#[cfg(test)]
mod tests {
    use super::*;
    use llmgw_core::flow::{MAX_SPECULATIVE_ENTRIES as MAX_RECORDS, SPECULATIVE_TTL_NS as TTL_NS};

    /// The documented record size.
    const RECORD: usize = 24;
    use crate::fake::FakeHost;

    #[test]
    fn entries_expire_after_the_ttl_keep_their_first_expiry_and_are_bounded() {
        let host = FakeHost::default();
        host.now_ns.set(1_000);
        let spec = Speculation { replica: 7, keys: vec![10, 11], reset_ns: 0 };
        assert_eq!(record(&host, &spec), Ok(0));
        let mut hits = Vec::new();
        Entries::read(&host).lookup(&[11, 99, 10], &mut hits);
        let mut got: Vec<(usize, u64, u64)> = hits.iter().map(|h| (h.key, h.engine, h.written_ns)).collect();
        got.sort_unstable();
        assert_eq!(got, vec![(0, 7, 1_000), (2, 7, 1_000)]);
        // Routed again later: still expires TTL after the first write.
        host.now_ns.set(1_000 + TTL_NS / 2);
        record(&host, &spec).unwrap();
        host.now_ns.set(1_000 + TTL_NS);
        let mut hits = Vec::new();
        Entries::read(&host).lookup(&[10, 11], &mut hits);
        assert!(hits.is_empty(), "{hits:?}");
        // Past the bound the entries expiring first go, and the drop is reported.
        let many = Speculation { replica: 8, keys: (0..MAX_RECORDS as u64 + 5).collect(), reset_ns: 0 };
        assert_eq!(record(&host, &many), Ok(5));
        let v = host.shared_value(KEY).unwrap();
        assert_eq!(v.len(), MAX_RECORDS * RECORD);
        let mut hits = Vec::new();
        Entries::read(&host).lookup(&[4, 5], &mut hits);
        assert_eq!(hits.iter().map(|h| (h.key, h.engine)).collect::<Vec<_>>(), vec![(1, 8)]);
    }
}
