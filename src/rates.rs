//! Rates learned per replica from observed times to first token
//! ([`llmgw_core::policy::rates`]), shared by every worker of this Envoy through proxy-wasm
//! shared data like the in-flight counts: a streamed request's first chunk (once its prompt's
//! tokens are known) updates its replica's record with compare-and-swap, and every decision
//! reads the records once.
//!
//! The shared value holds 180-byte records, little-endian: the address's stable hash (u64), its
//! observations (u32), when it was last updated (u64, nanoseconds), then 20 `f64` (as their bit
//! patterns): the observations' weight and the running mean absolute residual, `Σ λᵏ x xᵀ` (10,
//! upper triangle), `Σ λᵏ x y` (4), and the rates solved at the last update (base, prefill and
//! queued per token, per request). At most [`MAX_RECORDS`] replicas are kept (the one updated
//! longest ago goes first): 46 KiB at most.

use crate::host::{update_shared, Host, SharedKind};
use crate::shared_records::{address_id, decode, encode, keep_highest, FieldReader, IdMap, SharedRecord};
use llmgw_core::policy::rates::{Basis, Estimator, Rates, N, TRI};

const KEY: &str = "llmgw.rates";
/// At most this many replicas' rates are kept.
pub const MAX_RECORDS: usize = 256;
/// Floats per record.
const FLOATS: usize = 2 + TRI + N + 4;

/// One replica's learned rates and the observations behind them.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Record {
    id: u64,
    updated_ns: u64,
    estimator: Estimator,
    rates: Rates,
}

impl SharedRecord for Record {
    const SIZE: usize = 8 + 4 + 8 + 8 * FLOATS;
    fn read(f: &mut FieldReader<'_>) -> Option<Self> {
        let id = f.u64()?;
        let count = f.u32()?;
        let updated_ns = f.u64()?;
        let mut floats = [0.0f64; FLOATS];
        for v in floats.iter_mut() {
            *v = f64::from_bits(f.u64()?);
        }
        let mut it = floats.into_iter();
        let mut next = || it.next().unwrap_or(0.0);
        let weight = next();
        let scale = next();
        let xx: [f64; TRI] = std::array::from_fn(|_| next());
        let xy: [f64; N] = std::array::from_fn(|_| next());
        let rates = Rates {
            base_us: next(),
            prefill_us_per_token: next(),
            queued_us_per_token: next(),
            request_us: next(),
            observations: count,
            residual_us: scale,
            quiet_ns: 0,
        };
        let estimator = Estimator { xx, xy, weight, scale, count };
        Some(Record { id, updated_ns, estimator, rates })
    }
    fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.id.to_le_bytes());
        out.extend_from_slice(&self.estimator.count.to_le_bytes());
        out.extend_from_slice(&self.updated_ns.to_le_bytes());
        let e = &self.estimator;
        let r = &self.rates;
        let floats = [e.weight, e.scale].into_iter().chain(e.xx).chain(e.xy).chain([
            r.base_us,
            r.prefill_us_per_token,
            r.queued_us_per_token,
            r.request_us,
        ]);
        for v in floats {
            out.extend_from_slice(&v.to_bits().to_le_bytes());
        }
    }
}

/// The learned rates, read once per decision, by address id.
#[derive(Default)]
pub struct Learned {
    by_address: IdMap<Rates>,
}

impl Learned {
    pub fn read(host: &dyn Host) -> Learned {
        let value = host.shared_data(KEY).and_then(|(v, _)| v).unwrap_or_default();
        let now = host.now_ns();
        let quiet = |r: Record| Rates { quiet_ns: now.saturating_sub(r.updated_ns), ..r.rates };
        Learned { by_address: decode::<Record>(&value).map(|r| (r.id, quiet(r))).collect() }
    }

    /// The rates learned for `address`, when any.
    pub fn of(&self, address: &str) -> Option<Rates> {
        self.by_address.get(&address_id(address)).copied()
    }
}

/// The records with `id`'s updated by one observation.
fn with(v: &[u8], id: u64, now: u64, basis: &Basis, ttft_us: f64) -> Vec<u8> {
    let mut out: Vec<Record> = decode::<Record>(v).filter(|r| r.id != id).collect();
    let (mut estimator, quiet_ns) = decode::<Record>(v)
        .find(|r| r.id == id)
        .map_or((Estimator::default(), 0), |r| (r.estimator, now.saturating_sub(r.updated_ns)));
    let rates = estimator.teach(basis, ttft_us, quiet_ns);
    out.push(Record { id, updated_ns: now, estimator, rates });
    keep_highest(&mut out, MAX_RECORDS, |r| r.updated_ns);
    encode(out)
}

/// A streamed request routed to `address` by a prediction resting on `basis` produced its first
/// chunk `ttft_us` after the decision. `Err` when the shared record could not be updated.
pub fn observe(host: &dyn Host, address: &str, basis: &Basis, ttft_us: u64) -> Result<(), SharedKind> {
    let id = address_id(address);
    let now = host.now_ns();
    if update_shared(host, KEY, |v| Some(with(v, id, now, basis, ttft_us as f64))) {
        Ok(())
    } else {
        log::debug!("llmgw: learned rates of {address} not updated (shared data refused or contended)");
        Err(SharedKind::Rates)
    }
}

#[cfg(test)]
#[allow(clippy::arithmetic_side_effects, clippy::indexing_slicing)]
mod tests {
    use super::*;
    use crate::fake::FakeHost;
    use llmgw_core::policy::rates::{Features, Learning};

    fn basis(uncached: u64, requests: u64) -> Basis {
        let prior = Rates {
            base_us: 0.0,
            prefill_us_per_token: 100.0,
            queued_us_per_token: 100.0,
            request_us: 20_000.0,
            observations: 0,
            residual_us: 0.0,
            quiet_ns: 0,
        };
        Basis {
            features: Features { uncached, queued_tokens: 0, requests },
            rates: prior,
            prior,
            learning: Learning::default(),
        }
    }

    #[test]
    fn every_worker_learns_into_one_bounded_record_per_replica() {
        let host = FakeHost::default();
        const A: &str = "10.0.0.1:8000";
        const B: &str = "10.0.0.2:8000";
        assert_eq!(Learned::read(&host).of(A), None);
        // A computes a token in 400 µs and a request in 5 ms: its observations, from whichever
        // worker, end up in one record that every decision reads.
        for i in 0..120u64 {
            host.now_ns.set(1_000 + i);
            let (u, r) = ((i * 97) % 1000, i % 4);
            observe(&host, A, &basis(u, r), 2_000 + 400 * u + 5_000 * r).unwrap();
        }
        let a = Learned::read(&host).of(A).unwrap();
        assert_eq!(a.observations, 120);
        assert!((a.prefill_us_per_token - 400.0).abs() < 20.0, "{a:?}");
        assert!((a.request_us - 5_000.0).abs() < 1_000.0, "{a:?}");
        assert_eq!(Learned::read(&host).of(B), None);
        assert_eq!(host.shared_value(KEY).unwrap().len(), Record::SIZE);
        // Read later, they say how long they have been quiet; an observation after a quiet past
        // `forget_ns` starts them afresh.
        let forget = basis(0, 0).learning.forget_ns;
        host.now_ns.set(1_119 + forget + 1);
        assert_eq!(Learned::read(&host).of(A).unwrap().quiet_ns, forget + 1);
        observe(&host, A, &basis(100, 0), 2_000 + 400 * 100).unwrap();
        let a = Learned::read(&host).of(A).unwrap();
        assert_eq!((a.observations, a.quiet_ns), (1, 0));
        // Bounded: the replica updated longest ago goes first.
        for i in 0..MAX_RECORDS as u64 {
            host.now_ns.set(1_200 + forget + i);
            observe(&host, &format!("10.1.{}.{}:8000", i / 256, i % 256), &basis(10, 0), 3_000).unwrap();
        }
        assert_eq!(host.shared_value(KEY).unwrap().len(), MAX_RECORDS * Record::SIZE);
        assert_eq!(Learned::read(&host).of(A), None);
    }
}
