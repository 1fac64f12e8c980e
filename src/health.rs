//! Passive health: a replica whose connects fail or that answers 5xx is avoided from the next
//! request on, by every worker of this Envoy (proxy-wasm shared data, like the in-flight
//! counts), then tried again. Only what the replica caused counts: its own answer, or a connect
//! that failed or a connection it reset or closed before answering. Envoy's own replies (a
//! circuit breaker's overflow, the route's timeout, no healthy upstream, a local reset) leave
//! the record alone: they say nothing about the replica, and a client could otherwise get a
//! healthy replica avoided by filling Envoy's limits. Each failure in a row doubles the time it is avoided (1 s up to
//! 30 s); the first answer below 500 clears it. The agent's health view (a replica down when its
//! `/metrics` or its publisher is gone) takes seconds; this takes one request.
//!
//! Tokenizer calls have a breaker of their own, kept the same way under another key: a call
//! that timed out, was reset, or answered 5xx or garbage leaves that address alone for
//! tokenizer calls (1 s doubling to 30 s, cleared by a good answer) while requests may still be
//! routed there; when every tokenizer is left alone, requests fall back without a call.
//!
//! The shared value holds 20-byte records: the address's stable hash (u64), the end of its
//! avoidance (u64, nanoseconds), its failures in a row (u32), little-endian.

use crate::host::{update_shared, Host, SharedKind};
use crate::shared_records::{address_id, decode, encode, keep_highest, FieldReader, IdSet, SharedRecord};

const KEY: &str = "llmgw.health";
const TOKENIZER_KEY: &str = "llmgw.tokenizer_health";
/// How long a first failure keeps a replica avoided; each failure in a row doubles it.
pub const FIRST_NS: u64 = 1_000_000_000;
/// The longest a replica is avoided at a time.
pub const MAX_NS: u64 = 30_000_000_000;
/// At most this many replicas are remembered (the oldest avoidance goes first).
const MAX_RECORDS: usize = 4096;

/// One address avoided: its id, until when, after how many failures in a row.
struct Avoidance {
    id: u64,
    until: u64,
    strikes: u32,
}

impl SharedRecord for Avoidance {
    const SIZE: usize = 20;
    fn read(f: &mut FieldReader<'_>) -> Option<Self> {
        Some(Avoidance { id: f.u64()?, until: f.u64()?, strikes: f.u32()? })
    }
    fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.id.to_le_bytes());
        out.extend_from_slice(&self.until.to_le_bytes());
        out.extend_from_slice(&self.strikes.to_le_bytes());
    }
}

fn records(v: &[u8]) -> impl Iterator<Item = Avoidance> + '_ {
    decode(v)
}

/// The shared health records, read once per decision: the addresses avoided now, by id (a
/// lookup costs the same whatever the number of records).
#[derive(Default)]
pub struct Health {
    avoided: IdSet,
}

impl Health {
    /// The replicas' health, as requests are routed.
    pub fn read(host: &dyn Host) -> Health {
        Health::read_key(host, KEY)
    }

    /// The tokenizer calls' breaker.
    pub fn read_tokenizers(host: &dyn Host) -> Health {
        Health::read_key(host, TOKENIZER_KEY)
    }

    fn read_key(host: &dyn Host, key: &str) -> Health {
        let value = host.shared_data(key).and_then(|(v, _)| v).unwrap_or_default();
        let now = host.now_ns();
        Health { avoided: records(&value).filter(|a| now < a.until).map(|a| a.id).collect() }
    }

    /// Whether `address` is avoided right now.
    pub fn avoided(&self, address: &str) -> bool {
        self.avoided.contains(&address_id(address))
    }
}

/// The records with `id`'s updated: one more failure in a row, or removed when it answered.
fn with(v: &[u8], id: u64, now: u64, failed: bool) -> Vec<u8> {
    let mut out: Vec<Avoidance> = records(v).filter(|a| a.id != id).collect();
    if failed {
        let strikes = records(v).find(|a| a.id == id).map_or(0, |a| a.strikes).saturating_add(1);
        let span = FIRST_NS.saturating_mul(1u64 << strikes.saturating_sub(1).min(5)).min(MAX_NS);
        out.push(Avoidance { id, until: now.saturating_add(span), strikes });
        keep_highest(&mut out, MAX_RECORDS, |a| a.until);
    }
    encode(out)
}

/// `Err` when the shared record could not be updated.
fn update(host: &dyn Host, key: &str, what: SharedKind, address: &str, failed: bool) -> Result<(), SharedKind> {
    let id = address_id(address);
    let now = host.now_ns();
    let ok = update_shared(host, key, |v| {
        // Nothing to clear: no write (the common case, every healthy answer).
        (failed || records(v).any(|a| a.id == id)).then(|| with(v, id, now, failed))
    });
    if ok {
        Ok(())
    } else {
        log::debug!("llmgw: {} of {address} not updated (shared data refused or contended)", what.as_str());
        Err(what)
    }
}

/// `response.code_details` of an answer the replica sent itself.
const VIA_UPSTREAM: &[u8] = b"via_upstream";
/// Envoy's response flags (`response.flags`, bit `1 << flag` of `StreamInfo::CoreResponseFlag`)
/// that blame the replica for a reply Envoy made itself: UR (remote reset, 4), UF (connection
/// failure, 5), UC (connection termination, 6), UPE (upstream protocol error, 23). Every other
/// local reply (UO overflow, UT route timeout, UH no healthy upstream, LR local reset, ...) is
/// Envoy's own.
const REPLICA_FAULT_FLAGS: u64 = (1 << 4) | (1 << 5) | (1 << 6) | (1 << 23);

/// Who a response to a routed request came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// The replica answered with this status.
    Replica(u32),
    /// Envoy answered because the replica failed (connect failure, reset, closed, protocol error).
    ReplicaFailed,
    /// Envoy answered on its own (overflow, timeout, no healthy upstream, ...): not the replica's.
    Envoy,
}

/// Where the response with `status` came from, by Envoy's stream info; a host that does not
/// expose `response.code_details` gets the status counted as the replica's.
pub fn origin(host: &dyn Host, status: u32) -> Origin {
    let Some(details) = host.property(&["response", "code_details"]) else { return Origin::Replica(status) };
    if details == VIA_UPSTREAM {
        return Origin::Replica(status);
    }
    let flags = host
        .property(&["response", "flags"])
        .and_then(|v| <[u8; 8]>::try_from(v.as_slice()).ok())
        .map_or(0, u64::from_le_bytes);
    if flags & REPLICA_FAULT_FLAGS != 0 {
        Origin::ReplicaFailed
    } else {
        Origin::Envoy
    }
}

/// The response to a request routed to `address` (its headers, `status`): counted by where it
/// came from ([`origin`]); Envoy's own replies change nothing. `Err` when the record could not
/// be updated.
pub fn observe_response(host: &dyn Host, address: &str, status: u32) -> Result<(), SharedKind> {
    // An answer below 500 is no failure, whoever sent it (Envoy answers a replica's failures
    // with 502 or 503): it can only clear the replica's record, and only the replica's own
    // answer may. Nearly every answer finds no record to clear, so Envoy's stream info (host
    // calls on the first token's way) is read only where there is one.
    if status < 500 && nothing_recorded(host, KEY, address) {
        return Ok(());
    }
    match origin(host, status) {
        Origin::Replica(code) => observe(host, address, code),
        Origin::ReplicaFailed => update(host, KEY, SharedKind::Health, address, true),
        Origin::Envoy => Ok(()),
    }
}

/// Whether the record under `key` could be read and holds nothing of `address`.
fn nothing_recorded(host: &dyn Host, key: &str, address: &str) -> bool {
    let id = address_id(address);
    host.shared_data(key).is_some_and(|(v, _)| !records(v.as_deref().unwrap_or_default()).any(|a| a.id == id))
}

/// The replica's answer: 5xx avoids it for a while, anything else clears it. `Err` when the
/// record could not be updated.
pub fn observe(host: &dyn Host, address: &str, status: u32) -> Result<(), SharedKind> {
    update(host, KEY, SharedKind::Health, address, status >= 500)
}

/// A tokenizer call to `address` came back: `failed` when it says the tokenizer is unwell
/// ([`llmgw_core::flow::TokenizerFailure::strikes`]). `Err` when the record could not be updated.
pub fn observe_tokenizer(host: &dyn Host, address: &str, failed: bool) -> Result<(), SharedKind> {
    update(host, TOKENIZER_KEY, SharedKind::TokenizerHealth, address, failed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fake::FakeHost;

    #[test]
    fn a_failing_replica_is_avoided_longer_each_time_and_cleared_by_an_answer() {
        let host = FakeHost::default();
        const A: &str = "10.0.0.1:8000";
        const B: &str = "10.0.0.2:8000";
        host.now_ns.set(100);
        assert!(!Health::read(&host).avoided(A));
        observe(&host, A, 503).unwrap();
        assert!(Health::read(&host).avoided(A) && !Health::read(&host).avoided(B));
        // Tried again after a second; failing again doubles the wait.
        host.now_ns.set(100 + FIRST_NS);
        assert!(!Health::read(&host).avoided(A));
        observe(&host, A, 502).unwrap();
        host.now_ns.set(100 + FIRST_NS + FIRST_NS);
        assert!(Health::read(&host).avoided(A));
        host.now_ns.set(100 + FIRST_NS + 2 * FIRST_NS);
        assert!(!Health::read(&host).avoided(A));
        // An answer below 500 clears it.
        observe(&host, A, 200).unwrap();
        observe(&host, A, 500).unwrap();
        host.now_ns.set(100 + 4 * FIRST_NS + 1);
        assert!(!Health::read(&host).avoided(A), "a first failure again waits one second");
        observe(&host, A, 200).unwrap();
        assert_eq!(host.shared_value(KEY).unwrap(), Vec::<u8>::new());
        // The wait is capped.
        for _ in 0..20 {
            observe(&host, B, 503).unwrap();
        }
        let until = records(&host.shared_value(KEY).unwrap()).next().unwrap().until;
        assert_eq!(until - host.now_ns.get(), MAX_NS);
    }

    /// Envoy's response flags, as bits.
    const UO: u64 = 1 << 7;
    const UT: u64 = 1 << 2;
    const UH: u64 = 1 << 1;
    const UF: u64 = 1 << 5;
    const UR: u64 = 1 << 4;

    #[test]
    fn only_the_replicas_own_failures_count_not_envoys_local_replies() {
        const A: &str = "10.0.0.1:8000";
        let host = FakeHost::default();
        host.now_ns.set(100);
        // Envoy's own 503 (overflow, no healthy upstream) and 504 (route timeout): not counted.
        for (details, flags, status) in [
            ("upstream_reset_before_response_started{overflow}", UO, 503),
            ("no_healthy_upstream", UH, 503),
            ("upstream_response_timeout", UT, 504),
        ] {
            host.set_response_info(details, flags);
            assert_eq!(origin(&host, status), Origin::Envoy, "{details}");
            observe_response(&host, A, status).unwrap();
            assert!(!Health::read(&host).avoided(A), "{details} charged to the replica");
        }
        // A connect that failed, or a reset before the answer: the replica's fault.
        host.set_response_info("upstream_reset_before_response_started{remote_connection_failure}", UF);
        observe_response(&host, A, 503).unwrap();
        assert!(Health::read(&host).avoided(A));
        // Envoy's own reply does not clear it either (it says nothing of the replica).
        host.set_response_info("upstream_reset_before_response_started{overflow}", UO);
        observe_response(&host, A, 503).unwrap();
        assert!(Health::read(&host).avoided(A));
        host.set_response_info("upstream_reset_before_response_started{remote_reset}", UR);
        assert_eq!(origin(&host, 503), Origin::ReplicaFailed);
        // The replica's own answers: 5xx counts, anything else clears.
        host.set_response_info("via_upstream", 0);
        assert_eq!(origin(&host, 500), Origin::Replica(500));
        observe_response(&host, A, 200).unwrap();
        assert!(!Health::read(&host).avoided(A));
        observe_response(&host, A, 502).unwrap();
        assert!(Health::read(&host).avoided(A));
        // An answer below 500 with nothing to clear reads none of Envoy's stream info.
        let reads = host.property_reads.get();
        observe_response(&host, "10.0.0.2:8000", 200).unwrap();
        assert_eq!(host.property_reads.get(), reads);
        // Where there is something to clear, only the replica's own answer clears it.
        host.set_response_info("direct_response", 0);
        observe_response(&host, A, 200).unwrap();
        assert!(host.property_reads.get() > reads);
        assert!(Health::read(&host).avoided(A), "Envoy's own answer cleared the replica's record");
        host.set_response_info("via_upstream", 0);
        observe_response(&host, A, 200).unwrap();
        assert!(!Health::read(&host).avoided(A));
        // A host without the attributes: the status is the replica's, as before.
        let bare = FakeHost::default();
        assert_eq!(origin(&bare, 503), Origin::Replica(503));
    }
}
