//! BENCHMARKS ONLY (feature `bench-internals`, never in llmgw.wasm): one decision as a worker VM
//! makes it — the gateway's shared records read once ([`crate::gateway_state::Snapshot`]), then
//! the router's decision over a token-id prompt — against a fake host whose shared data is
//! empty or filled as a busy gateway's is (every replica with requests in flight from every VM,
//! replica and tokenizer health records, learned rates, a full speculative table). Used by
//! `benches/decision.rs`.

use crate::fake::FakeHost;
use crate::gateway_state::Snapshot;
use crate::host::Host;
use crate::inflight::{self, VmId};
use crate::{health, rates, returns, speculative};
use llmgw_core::config::Compiled;
use llmgw_core::feed::{Body as Msg, FeedMessage, Replica, ReplicaTable, SnapshotChunk, SnapshotComplete};
use llmgw_core::flow::{Body, Router, Speculation, Step};
use llmgw_core::policy::rates::{Basis, Features};
use llmgw_core::policy::TtftWeights;
use std::rc::Rc;

/// A router over `replicas` replicas and a host whose shared records are empty, or filled as
/// `vms` worker VMs routing to every replica leave them.
pub struct Decision {
    host: Rc<FakeHost>,
    /// The same host, as the filter's glue holds it.
    shared: Rc<dyn Host>,
    router: Router,
    body: Vec<u8>,
}

fn address(id: u32) -> String {
    format!("10.{}.{}.1:8000", id / 256, id % 256)
}

impl Decision {
    /// `held`: the block keys of the prompt, held by replica 3. Errors name what could not be
    /// set up.
    pub fn new(replicas: u32, vms: u32, filled: bool, tokens: &[u32], held: &[u64]) -> Result<Decision, String> {
        let json = br#"{"profiles":[{"name":"p","models":["m"],"kv_events":true,"seed":"0"}]}"#;
        let compiled = Compiled::from_json(json, None).map_err(|e| format!("{e:?}"))?;
        let mut router = Router::new(compiled, 7);
        let table = (0..replicas)
            .map(|id| Replica {
                id,
                name: format!("r{id}"),
                address: address(id),
                models: vec![],
                up: true,
                // The rest as a replica table leaves it (also fields the feed gains later).
                ..Default::default()
            })
            .collect();
        router.feed.begin_subscription();
        let msgs = [
            Msg::Replicas(ReplicaTable { replicas: table }),
            Msg::Snapshot(SnapshotChunk { replica: 3, first: true, blocks: held.to_vec() }),
            Msg::SnapshotComplete(SnapshotComplete {}),
        ];
        for (seq, body) in (0u64..).zip(msgs) {
            router.feed.apply(&FeedMessage { seq, body: Some(body) }).map_err(|e| format!("{e:?}"))?;
        }
        let host = Rc::new(FakeHost::new());
        if filled {
            fill(&host, replicas, vms)?;
        }
        let body = format!(r#"{{"model":"m","prompt":{tokens:?}}}"#).into_bytes();
        let shared: Rc<dyn Host> = host.clone();
        Ok(Decision { host, shared, router, body })
    }

    /// One decision: the shared records read, the router's step. `true` when it routed.
    pub fn decide(&mut self) -> bool {
        let now = self.host.now_ns.get();
        let gw = Snapshot::read(&self.shared);
        let step =
            self.router.on_body(&Body { path: "/v1/completions", bytes: &self.body, too_large: false }, &gw, now);
        matches!(step, Step::Route(_))
    }

    /// The shared records' total size in bytes.
    pub fn shared_bytes(&self) -> usize {
        [
            "llmgw.inflight.v3",
            "llmgw.inflight.vms",
            "llmgw.health",
            "llmgw.tokenizer_health",
            "llmgw.speculative",
            "llmgw.rates",
            "llmgw.returns.ends",
            "llmgw.returns.gaps",
        ]
        .iter()
        .filter_map(|k| self.host.shared_value(k))
        .map(|v| v.len())
        .sum()
    }
}

/// Every VM has a request in flight to every replica; every replica has a health and a
/// tokenizer-health record (answered after failing: the records are read, nothing is
/// avoided), learned rates (up to the rates table's bound) and a full speculative table.
fn fill(host: &FakeHost, replicas: u32, vms: u32) -> Result<(), String> {
    for vm in 0..vms {
        for id in 0..replicas {
            inflight::increment(host, VmId(vm), &address(id), 100, 0);
        }
    }
    // The shipped profile's rates as the prior, as a default configuration learns from.
    let ttft = TtftWeights::default();
    let prior = ttft.prior();
    let basis = Basis {
        features: Features { uncached: 100, queued_tokens: 0, requests: 1 },
        rates: prior,
        prior,
        learning: ttft.learning,
    };
    for id in 0..replicas {
        let a = address(id);
        health::observe(host, &a, 503).map_err(|k| k.as_str().to_string())?;
        health::observe_tokenizer(host, &a, true).map_err(|k| k.as_str().to_string())?;
        rates::observe(host, &a, &basis, 12_000).map_err(|k| k.as_str().to_string())?;
    }
    // Avoidance spans run out: every record is read, none avoids.
    host.now_ns.set(host.now_ns.get().saturating_add(health::MAX_NS));
    for vm in 0..vms {
        inflight::heartbeat(host, VmId(vm), host.now_ns.get()).ok_or("heartbeat")?;
    }
    // Requests answered on every replica (up to the records' bound), the gaps learned from
    // earlier ones that were followed: every candidate's returns are computed.
    for id in 0..u64::from(replicas) {
        let a = address(u32::try_from(id).unwrap_or(0));
        for k in 0..(llmgw_core::policy::return_ledger::PER_REPLICA as u64).saturating_add(8) {
            let key = k.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ id.wrapping_add(1).wrapping_mul(0xA24B_AED4_963E_E407);
            first_failed(returns::started(host, &a, key))?;
            if k % 2 == 0 {
                first_failed(returns::ended(host, key))?;
            }
            if k < 8 {
                first_failed(returns::followed(host, key))?;
            }
        }
    }
    let per_replica = u64::try_from(llmgw_core::flow::MAX_SPECULATIVE_ENTRIES)
        .unwrap_or(0)
        .checked_div(u64::from(replicas))
        .unwrap_or(0);
    for id in 0..u64::from(replicas) {
        let keys = (0..per_replica.max(1)).map(|k| k.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ id).collect();
        speculative::record(host, &Speculation { replica: id, keys, reset_ns: 0 })
            .map_err(|k| k.as_str().to_string())?;
    }
    Ok(())
}

/// The first shared kind an update gave up on, as an error.
fn first_failed(failed: Vec<crate::host::SharedKind>) -> Result<(), String> {
    failed.first().map_or(Ok(()), |k| Err(k.as_str().to_string()))
}
