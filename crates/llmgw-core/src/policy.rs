//! Choosing a replica: the lowest predicted time to first token (or a blended score), and the
//! fallbacks.
//!
//! * **Exact**: the index knows the request's blocks. With the `ttft` policy (the default)
//!   each eligible replica's time to first token is predicted as
//!   `prefill_us_per_token × (uncached + queued_prefill × queued) + request_us × requests`,
//!   where `uncached` is
//!   the request's prompt tokens past the leading blocks that replica holds, `queued` the prefill
//!   tokens of requests this Envoy sent there that have not produced a first token yet, and
//!   `requests = max(in-flight, running + waiting) + waiting` (engine-reported, so other
//!   gateways' requests count too); the lowest wins, predictions within `tie_us` being equal.
//!   With the `score` policy each scores `prefix × share − load × load_term`, where `share` is
//!   the fraction of the request's blocks its leading run covers and `load_term = pressure /
//!   (pressure + load_scale) + kv_usage × kv cache usage` (pressure = in-flight + running + 2 ×
//!   waiting).
//! * **Approx**: no exact data (or nobody holds block 0). Rendezvous (highest random weight)
//!   hashing of a hash of the prompt's leading text over the replicas' addresses gives every
//!   worker and every gateway the same order for the same prefix, with no coordination; the
//!   first replica in that order whose pressure is within the bounded-load capacity wins, so a
//!   burst sharing a new prefix lands together until load says otherwise.
//! * **Load**: nothing to hash: the least-pressured replica.
//!
//! A replica that is down never wins; an overloaded one (past any `max_*` limit) wins only when
//! every replica is overloaded.

use crate::config::{PolicyMode, Weights};
use crate::index::{ReplicaId, Scores};

/// One replica as the policy sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate<'a> {
    pub id: ReplicaId,
    /// `ip:port`; also the replica's identity for rendezvous hashing.
    pub address: &'a str,
    pub up: bool,
    /// Requests this gateway has sent and not yet finished.
    pub in_flight: u32,
    /// Prefill tokens of those requests that have not produced a first token yet.
    pub pending_tokens: u64,
    /// Engine-reported running and waiting requests and KV cache usage (0..1).
    pub running: u32,
    pub waiting: u32,
    pub kv_usage: f32,
    /// The engine's data-parallel rank when the replica behind `address` runs several (its
    /// ranks share the address; the rank tells them apart).
    pub dp_rank: Option<u32>,
}

impl Candidate<'_> {
    /// The rendezvous weight of this engine for a prefix key: by address, and by rank among a
    /// data-parallel replica's ranks.
    pub fn rendezvous_weight(&self, key: u64) -> u64 {
        let w = rendezvous_weight(key, self.address);
        match self.dp_rank {
            Some(rank) => crate::stable_hash::mix64(w ^ u64::from(rank)),
            None => w,
        }
    }

    /// in-flight + running + 2 × waiting.
    pub fn pressure(&self) -> u64 {
        u64::from(self.in_flight)
            .saturating_add(u64::from(self.running))
            .saturating_add(u64::from(self.waiting).saturating_mul(2))
    }

    fn overloaded(&self, w: &Weights) -> bool {
        self.waiting > w.max_waiting || self.in_flight >= w.max_in_flight || f64::from(self.kv_usage) > w.max_kv_usage
    }

    /// The requests on the engine a new one queues behind: `max(in-flight, running + waiting) +
    /// waiting` (this gateway's in-flight requests are among the engine's; a waiting one is
    /// surely ahead).
    pub fn queued_requests(&self) -> u64 {
        let engine = u64::from(self.running).saturating_add(u64::from(self.waiting));
        u64::from(self.in_flight).max(engine).saturating_add(u64::from(self.waiting))
    }

    /// Predicted time to first token here (µs) of a request computing `uncached` prompt tokens.
    pub fn predicted_us(&self, w: &Weights, uncached: u64) -> f64 {
        let tokens = uncached as f64 + w.queued_prefill * self.pending_tokens as f64;
        w.prefill_us_per_token * tokens + w.request_us * self.queued_requests() as f64
    }

    fn load_term(&self, w: &Weights) -> f64 {
        let p = self.pressure() as f64;
        let kv = f64::from(self.kv_usage).clamp(0.0, 1.0);
        p / (p + w.load_scale) + w.kv_usage * kv
    }
}

/// How a decision was made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// From the index: the winner holds leading blocks of the request.
    Exact,
    /// Rendezvous hashing of the prompt's leading text, bounded by load.
    Approx,
    /// Least load (nothing to hash, or exact data said the prefix lives on a replica that load
    /// ruled out and nobody else holds any of it).
    Load,
    /// Replicas held the request's leading blocks, but every one of them was past the holders'
    /// load bound (`Weights::holder_spill_factor`): the request went where a new prefix would
    /// (its rendezvous order, bounded by load), and that replica then holds the prefix too. A
    /// hot prefix is replicated this way; a cold one stays where it is.
    Spill,
    /// No healthy replica.
    NoReplica,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Exact => "exact",
            Outcome::Approx => "approx",
            Outcome::Load => "load",
            Outcome::Spill => "spill",
            Outcome::NoReplica => "no_replica",
        }
    }

    pub const ALL: [Outcome; 5] = [Outcome::Exact, Outcome::Approx, Outcome::Load, Outcome::Spill, Outcome::NoReplica];
}

/// The choice: `winner` indexes the candidate slice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    pub winner: Option<usize>,
    pub outcome: Outcome,
    /// Leading blocks the winner holds, of `total` in the request (0/0 without exact data).
    pub matched: u32,
    pub total: u32,
    /// `ttft` policy with exact data: the winner's predicted time to first token (µs), and the
    /// runner-up's (its index and prediction), for the explain header.
    pub predicted_us: Option<u64>,
    pub runner_up: Option<(usize, u64)>,
}

impl Decision {
    fn new(winner: Option<usize>, outcome: Outcome, matched: u32, total: u32) -> Decision {
        Decision { winner, outcome, matched, total, predicted_us: None, runner_up: None }
    }
}

/// The prompt a decision is about: its token count and the block size the index counts in
/// (the `ttft` policy's uncached tokens).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Work {
    pub tokens: u64,
    pub block_size: u64,
}

/// Defined with the other stable hashing helpers; routing keys are made with it from here.
pub use crate::stable_hash::stable_hash;

/// The rendezvous weight of `address` for a prefix key.
pub fn rendezvous_weight(key: u64, address: &str) -> u64 {
    crate::stable_hash::mix64(key ^ stable_hash(address.as_bytes()))
}

/// Indices of the replicas the policy may pick: up and not overloaded, or, when every up
/// replica is overloaded, every up replica.
fn eligible(cands: &[Candidate<'_>], w: &Weights) -> Vec<usize> {
    let up: Vec<usize> = cands.iter().enumerate().filter(|(_, c)| c.up).map(|(i, _)| i).collect();
    let ok: Vec<usize> = up.iter().copied().filter(|&i| cands.get(i).is_some_and(|c| !c.overloaded(w))).collect();
    if ok.is_empty() {
        up
    } else {
        ok
    }
}

/// The least-pressured replica among `idx` (ties: lower KV usage, then address order).
fn least_of(cands: &[Candidate<'_>], idx: &[usize]) -> Option<usize> {
    idx.iter()
        .copied()
        .filter_map(|i| cands.get(i).map(|c| (i, c)))
        .min_by(|(_, a), (_, b)| {
            a.pressure().cmp(&b.pressure()).then(a.kv_usage.total_cmp(&b.kv_usage)).then(a.address.cmp(b.address))
        })
        .map(|(i, _)| i)
}

/// The least-loaded healthy replica (used for tokenizer callouts and the load fallback).
pub fn least_loaded(cands: &[Candidate<'_>], w: &Weights) -> Option<usize> {
    least_of(cands, &eligible(cands, w))
}

/// The load bound: `ceil(factor × (total pressure + 1) / n) + slack`, the most pressure a
/// replica may have after taking the request.
fn load_cap(cands: &[Candidate<'_>], idx: &[usize], factor: f64, slack: u32) -> u64 {
    let n = idx.len().max(1);
    let total: u64 = idx.iter().filter_map(|&i| cands.get(i)).map(|c| c.pressure()).fold(0u64, u64::saturating_add);
    let mean = (total.saturating_add(1)) as f64 / n as f64;
    let cap = (factor * mean).ceil() as u64;
    cap.saturating_add(u64::from(slack))
}

/// Rendezvous order with bounded-load spillover: among the replicas within the load bound, the
/// least pressured of the first `choices` in the key's rendezvous order (ties: the earlier
/// one), so equal loads keep a prefix on its first replica everywhere.
fn approx_pick(cands: &[Candidate<'_>], idx: &[usize], key: u64, w: &Weights, choices: u32) -> Option<usize> {
    let n = idx.len();
    if n == 0 {
        return None;
    }
    let cap = load_cap(cands, idx, w.spill_factor, w.spill_slack);
    let mut order: Vec<(u64, usize)> =
        idx.iter().filter_map(|&i| cands.get(i).map(|c| (c.rendezvous_weight(key), i))).collect();
    order.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    let choices = usize::try_from(choices.max(1)).unwrap_or(1);
    order
        .iter()
        .filter_map(|&(_, i)| cands.get(i).map(|c| (i, c)))
        .filter(|(_, c)| c.pressure().saturating_add(1) <= cap)
        .take(choices)
        // `min_by_key` keeps the first of equal minima: the earlier rendezvous choice.
        .min_by_key(|(_, c)| c.pressure())
        .map(|(i, _)| i)
        .or_else(|| least_of(cands, idx))
}

/// Decides where a request goes.
///
/// `exact`: the index's scores for the request's blocks (indexed by replica id), when the
/// tokens were hashed and the index is synced. `approx_key`: [`stable_hash`] of the prompt's
/// leading text, when there is any.
pub fn decide(cands: &[Candidate<'_>], exact: Option<&Scores>, approx_key: Option<u64>, w: &Weights) -> Decision {
    decide_lazy(cands, exact, None, || approx_key, w)
}

/// As [`decide`], with the approximate key computed only if the decision needs it (a tie
/// between equally good replicas, or no exact match): reading a long prompt's leading text is
/// skipped whenever the index alone decides. `work`: the prompt's size (without it, the
/// `ttft` policy counts the request's full blocks at 16 tokens).
pub fn decide_lazy(
    cands: &[Candidate<'_>],
    exact: Option<&Scores>,
    work: Option<Work>,
    approx_key: impl Fn() -> Option<u64>,
    w: &Weights,
) -> Decision {
    let key_cell = std::cell::OnceCell::new();
    let approx_key = || *key_cell.get_or_init(&approx_key);
    let idx = eligible(cands, w);
    let none = Decision::new(None, Outcome::NoReplica, 0, 0);
    if idx.is_empty() {
        return none;
    }
    let leading = |s: &Scores, i: usize| -> u32 {
        cands.get(i).and_then(|c| s.leading.get(usize::from(c.id))).copied().unwrap_or(0)
    };
    // Holders past their load bound give up their claim to the prefix.
    let mut spilled = false;
    if let Some(s) = exact {
        let any_match = idx.iter().any(|&i| leading(s, i) > 0);
        let cap = load_cap(cands, &idx, w.holder_spill_factor, w.spill_slack.saturating_mul(2));
        let bounded = w.holder_spill_factor > 0.0;
        let within = |i: usize| !bounded || cands.get(i).is_some_and(|c| c.pressure().saturating_add(1) <= cap);
        let holders_within = idx.iter().any(|&i| leading(s, i) > 0 && within(i));
        spilled = any_match && !holders_within;
        if holders_within && s.total > 0 {
            let tiebreak = |i: usize| approx_key().and_then(|k| cands.get(i).map(|c| c.rendezvous_weight(k)));
            // Holders past the bound are out of this contest; replicas holding nothing stay in.
            let contest = || idx.iter().copied().filter(|&i| within(i) || leading(s, i) == 0);
            let best = match w.policy {
                PolicyMode::Ttft => {
                    let work = work.unwrap_or(Work { tokens: u64::from(s.total).saturating_mul(16), block_size: 16 });
                    let predicted = |i: usize| -> f64 {
                        let Some(c) = cands.get(i) else { return f64::INFINITY };
                        let cached = u64::from(leading(s, i)).saturating_mul(work.block_size);
                        c.predicted_us(w, work.tokens.saturating_sub(cached))
                    };
                    // Lower is better; predictions within `tie_us` are equal.
                    let order = |a: usize, b: usize| {
                        let (pa, pb) = (predicted(a), predicted(b));
                        let by =
                            if (pa - pb).abs() <= w.tie_us { std::cmp::Ordering::Equal } else { pb.total_cmp(&pa) };
                        by.then(leading(s, a).cmp(&leading(s, b)))
                            .then_with(|| tiebreak(a).cmp(&tiebreak(b)))
                            .then(b.cmp(&a))
                    };
                    let best = contest().max_by(|&a, &b| order(a, b));
                    best.map(|b| {
                        let second = contest().filter(|&i| i != b).max_by(|&x, &y| order(x, y));
                        (b, Some(predicted(b) as u64), second.map(|r| (r, predicted(r) as u64)))
                    })
                }
                PolicyMode::Score => {
                    let score = |i: usize| -> f64 {
                        let Some(c) = cands.get(i) else { return f64::NEG_INFINITY };
                        let share = f64::from(leading(s, i)) / f64::from(s.total);
                        w.prefix * share - w.load * c.load_term(w)
                    };
                    // Scores within the tie margin are equal (see `Weights::tie_margin`).
                    let by_score = |a: usize, b: usize| {
                        let (sa, sb) = (score(a), score(b));
                        if (sa - sb).abs() <= w.tie_margin {
                            std::cmp::Ordering::Equal
                        } else {
                            sa.total_cmp(&sb)
                        }
                    };
                    let best = contest().max_by(|&a, &b| {
                        by_score(a, b)
                            .then(leading(s, a).cmp(&leading(s, b)))
                            // Lazily: the key is only computed for a tie.
                            .then_with(|| tiebreak(a).cmp(&tiebreak(b)))
                            .then(b.cmp(&a))
                    });
                    best.map(|b| (b, None, None))
                }
            };
            if let Some((b, predicted_us, runner_up)) = best {
                let matched = leading(s, b);
                let outcome = if matched > 0 { Outcome::Exact } else { Outcome::Load };
                return Decision { predicted_us, runner_up, ..Decision::new(Some(b), outcome, matched, s.total) };
            }
        }
    }
    let total = exact.map_or(0, |s| s.total);
    // With exact data the prefix is known to be new: it may go to the less loaded of its first
    // rendezvous choices. Without (a fallback), its first choice is the best guess of where
    // earlier requests sharing it went, so only the load bound moves it.
    // A spilled hot prefix is replicated to the least loaded replica within the bound.
    let choices = if spilled {
        u32::try_from(idx.len()).unwrap_or(u32::MAX)
    } else if exact.is_some() {
        w.approx_choices
    } else {
        1
    };
    let (approx, load) = if spilled { (Outcome::Spill, Outcome::Spill) } else { (Outcome::Approx, Outcome::Load) };
    match approx_key() {
        Some(k) => Decision::new(approx_pick(cands, &idx, k, w, choices), approx, 0, total),
        None => Decision::new(least_of(cands, &idx), load, 0, total),
    }
}

#[cfg(test)]
#[allow(clippy::arithmetic_side_effects)]
mod tests {
    use super::*;

    const ADDRS: [&str; 4] = ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.4:8000"];

    fn fleet(n: usize) -> Vec<Candidate<'static>> {
        (0..n)
            .map(|i| Candidate {
                id: ReplicaId(i as u16),
                address: ADDRS[i],
                dp_rank: None,
                up: true,
                in_flight: 0,
                pending_tokens: 0,
                running: 0,
                waiting: 0,
                kv_usage: 0.0,
            })
            .collect()
    }

    /// The blended-score policy's weights.
    fn score() -> Weights {
        Weights { policy: PolicyMode::Score, ..Weights::default() }
    }

    /// A decision without its predicted figures.
    fn bare(d: Decision) -> Decision {
        Decision { predicted_us: None, runner_up: None, ..d }
    }

    fn scores(leading: &[u32], total: u32) -> Scores {
        Scores { leading: leading.to_vec(), total }
    }

    #[test]
    fn exact_longest_prefix_wins() {
        let w = score();
        let c = fleet(3);
        let d = decide(&c, Some(&scores(&[2, 8, 0], 10)), Some(1), &w);
        assert_eq!(bare(d), Decision::new(Some(1), Outcome::Exact, 8, 10));
        // Mild load does not move a long prefix.
        let mut c = fleet(3);
        c[1].in_flight = 2;
        c[1].running = 3;
        assert_eq!(decide(&c, Some(&scores(&[2, 8, 0], 10)), None, &w).winner, Some(1));
    }

    #[test]
    fn load_blend_prefers_idle_replica_for_a_short_prefix() {
        let w = Weights::default();
        let mut c = fleet(3);
        c[0].running = 30;
        c[0].waiting = 10;
        // Replica 0 holds 1 of 10 blocks but is far past the holders' load bound: the request
        // goes where a new prefix would.
        let d = decide(&c, Some(&scores(&[1, 0, 0], 10)), None, &w);
        assert_eq!(d.outcome, Outcome::Spill);
        assert_ne!(d.winner, Some(0));
        // Within the bound, load still outweighs a short prefix.
        let mut c = fleet(3);
        c[0].running = 6;
        let d = decide(&c, Some(&scores(&[1, 0, 0], 10)), None, &w);
        assert_eq!(d.outcome, Outcome::Load);
        assert_ne!(d.winner, Some(0));
    }

    #[test]
    fn overloaded_or_down_replica_loses_despite_longest_prefix() {
        let w = Weights::default();
        let mut c = fleet(3);
        c[1].waiting = w.max_waiting + 1;
        let d = decide(&c, Some(&scores(&[3, 10, 0], 10)), None, &w);
        assert_eq!(bare(d), Decision::new(Some(0), Outcome::Exact, 3, 10));
        let mut c = fleet(3);
        c[1].kv_usage = 1.0;
        assert_eq!(decide(&c, Some(&scores(&[3, 10, 0], 10)), None, &w).winner, Some(0));
        let mut c = fleet(3);
        c[1].up = false;
        assert_eq!(decide(&c, Some(&scores(&[0, 10, 0], 10)), Some(5), &w).outcome, Outcome::Approx);
        assert_ne!(decide(&c, Some(&scores(&[0, 10, 0], 10)), Some(5), &w).winner, Some(1));
        // All overloaded: still routed, to the least loaded.
        let mut c = fleet(2);
        c[0].waiting = 100;
        c[1].waiting = 90;
        assert_eq!(decide(&c, None, None, &w).winner, Some(1));
        assert_eq!(least_loaded(&c, &w), Some(1));
    }

    #[test]
    fn no_healthy_replica() {
        let w = Weights::default();
        let mut c = fleet(2);
        c[0].up = false;
        c[1].up = false;
        assert_eq!(decide(&c, None, Some(1), &w).outcome, Outcome::NoReplica);
        assert_eq!(decide(&[], None, None, &w).winner, None);
        assert_eq!(least_loaded(&c, &w), None);
    }

    #[test]
    fn fallback_is_consistent_across_independent_instances() {
        let w = Weights::default();
        // Two gateways build their candidate lists in different orders (different replica ids);
        // the same prefix still lands on the same address.
        let a = fleet(4);
        let mut b: Vec<Candidate<'static>> = fleet(4).into_iter().rev().collect();
        for (i, c) in b.iter_mut().enumerate() {
            c.id = ReplicaId(i as u16);
        }
        let mut hits = [0u32; 4];
        for p in 0..200u32 {
            let key = stable_hash(format!("system prompt {p}").as_bytes());
            let da = decide(&a, None, Some(key), &w);
            let db = decide(&b, None, Some(key), &w);
            assert_eq!(da.outcome, Outcome::Approx);
            let (wa, wb) = (da.winner.unwrap(), db.winner.unwrap());
            assert_eq!(a[wa].address, b[wb].address);
            // With exact data that matches nowhere, the same approximate choice is made.
            let dz = decide(&a, Some(&scores(&[0, 0, 0, 0], 7)), Some(key), &w);
            assert_eq!(dz.winner, Some(wa));
            hits[wa] += 1;
        }
        // Different prefixes spread over the fleet.
        assert!(hits.iter().all(|&h| h > 20), "{hits:?}");
        assert_eq!(stable_hash(b"abc"), stable_hash(b"abc"));
        assert_ne!(stable_hash(b"abc"), stable_hash(b"abd"));
    }

    #[test]
    fn approx_spills_under_load_then_returns() {
        let w = Weights::default();
        let key = stable_hash(b"shared prefix");
        let c = fleet(3);
        let home = decide(&c, None, Some(key), &w).winner.unwrap();
        // A burst stays together while within the bound.
        let mut c2 = fleet(3);
        c2[home].in_flight = 2;
        assert_eq!(decide(&c2, None, Some(key), &w).winner, Some(home));
        // Far past the bound: spills elsewhere.
        c2[home].in_flight = 40;
        let spill = decide(&c2, None, Some(key), &w).winner.unwrap();
        assert_ne!(spill, home);
        // Spillover is consistent too: the second replica in the prefix's order.
        let mut c3 = fleet(3);
        c3[home].running = 40;
        assert_eq!(decide(&c3, None, Some(key), &w).winner, Some(spill));
        // A prefix the index shows nobody holds, with two choices (the default): the less
        // loaded of the first two in its order; equal loads keep the first. Without exact data
        // (a fallback) the first choice stays, load bound permitting.
        let w2 = Weights::default();
        assert_eq!(w2.approx_choices, 2);
        let none = scores(&[0, 0, 0], 7);
        assert_eq!(decide(&fleet(3), Some(&none), Some(key), &w2).winner, Some(home));
        let mut c4 = fleet(3);
        c4[home].in_flight = 1;
        assert_eq!(decide(&c4, Some(&none), Some(key), &w2).winner, Some(spill));
        assert_eq!(decide(&c4, None, Some(key), &w2).winner, Some(home));
        c4[spill].in_flight = 1;
        assert_eq!(decide(&c4, Some(&none), Some(key), &w2).winner, Some(home));
    }

    #[test]
    fn holders_within_the_tie_margin_are_chosen_by_the_prompt_not_by_load_noise() {
        let w = score();
        let both = scores(&[10, 10, 0], 10);
        let mut first = [0u32; 2];
        for p in 0..200u32 {
            let key = stable_hash(format!("prompt {p}").as_bytes());
            let idle = decide(&fleet(3), Some(&both), Some(key), &w).winner.unwrap();
            // One gateway's agent scraped a running request on one holder, another's on the
            // other: both still choose the same holder.
            for busy in 0..2 {
                let mut c = fleet(3);
                c[busy].running = 1;
                assert_eq!(decide(&c, Some(&both), Some(key), &w).winner, Some(idle), "prompt {p}");
            }
            first[idle] += 1;
            // A real difference in load still moves it.
            let mut c = fleet(3);
            c[idle].running = 4;
            assert_eq!(decide(&c, Some(&both), Some(key), &w).winner, Some(1 - idle));
        }
        // Equal holders share the prompts between them.
        assert!(first.iter().all(|&n| n > 60), "{first:?}");
        // Without the margin, one running request decides.
        let strict = Weights { tie_margin: 0.0, ..score() };
        let key = stable_hash(b"prompt 0");
        let idle = decide(&fleet(3), Some(&both), Some(key), &strict).winner.unwrap();
        let mut c = fleet(3);
        c[idle].running = 1;
        assert_eq!(decide(&c, Some(&both), Some(key), &strict).winner, Some(1 - idle));
    }

    #[test]
    fn a_hot_prefix_spills_past_the_holders_bound_and_a_cold_one_stays() {
        let w = score();
        let key = stable_hash(b"hot prefix");
        let held = scores(&[10, 0, 0, 0], 10);
        // A burst on one gateway: each request is counted in flight where it went.
        let mut c = fleet(4);
        let mut spills = 0;
        for _ in 0..64 {
            let d = decide(&c, Some(&held), Some(key), &w);
            let i = d.winner.unwrap();
            spills += usize::from(d.outcome == Outcome::Spill);
            c[i].in_flight += 1;
        }
        let max = c.iter().map(|x| x.in_flight).max().unwrap();
        assert!(spills > 0 && max <= 40, "holder kept {max} of 64 ({spills} spilled)");
        // (Here the index keeps showing one holder; in a fleet the replicas it spilled to hold
        // the prefix too after their first prefill.)
        assert!(
            c.iter().filter(|x| x.in_flight > 0).count() >= 3,
            "{:?}",
            c.iter().map(|x| x.in_flight).collect::<Vec<_>>()
        );
        // A cold prefix (a few requests) stays on its holder.
        let mut c = fleet(4);
        for _ in 0..4 {
            let d = decide(&c, Some(&held), Some(key), &w);
            assert_eq!((d.winner, d.outcome), (Some(0), Outcome::Exact));
            c[0].in_flight += 1;
        }
        // Engine-reported load (other gateways' requests) counts too.
        let mut c = fleet(4);
        c[0].waiting = 20;
        assert_eq!(decide(&c, Some(&held), Some(key), &w).outcome, Outcome::Spill);
        // Without the bound the holder keeps everything short of overload.
        let unbounded = Weights { holder_spill_factor: 0.0, ..score() };
        assert_eq!(decide(&c, Some(&held), Some(key), &unbounded).outcome, Outcome::Exact);
    }

    fn ttft(c: &[Candidate<'_>], s: &Scores, tokens: u64, key: u64, w: &Weights) -> Decision {
        decide_lazy(c, Some(s), Some(Work { tokens, block_size: 16 }), || Some(key), w)
    }

    #[test]
    fn the_lowest_predicted_time_to_first_token_wins() {
        let w = Weights::default();
        assert_eq!(w.policy, PolicyMode::Ttft);
        // 1,600 prompt tokens (100 blocks of 16); replica 1 holds 80 leading blocks, replica 0 20.
        let held = scores(&[20, 80, 0], 100);
        let d = ttft(&fleet(3), &held, 1600, 7, &w);
        assert_eq!((d.winner, d.outcome, d.matched), (Some(1), Outcome::Exact, 80));
        // 320 uncached tokens at 200 µs; the runner-up computes 1,280.
        assert_eq!(d.predicted_us, Some(64_000));
        assert_eq!(d.runner_up, Some((0, 256_000)));
        // Prefill queued on replica 1 (this gateway's requests without a first token yet): 3,000
        // more tokens there, half of which count (`queued_prefill` 0.5), and the request itself
        // make replica 0 the fastest (404 ms against 256 ms; replica 2, computing everything,
        // 320 ms). By default (1, as vLLM computes a step's tokens together) all of it counts
        // (704 ms); at 0 only the request does (104 ms).
        assert_eq!(w.queued_prefill, 1.0);
        let half = Weights { queued_prefill: 0.5, ..Weights::default() };
        let none = Weights { queued_prefill: 0.0, ..Weights::default() };
        let mut c = fleet(3);
        c[1].in_flight = 1;
        c[1].pending_tokens = 3000;
        let d = ttft(&c, &held, 1600, 7, &half);
        assert_eq!((d.winner, d.predicted_us), (Some(0), Some(256_000)));
        assert_eq!(d.runner_up, Some((2, 320_000)));
        let d = ttft(&c, &held, 1600, 7, &w);
        assert_eq!((d.winner, d.predicted_us), (Some(0), Some(256_000)));
        assert_eq!(ttft(&c, &held, 1600, 7, &none).predicted_us, Some(104_000));
        // The same request that already produced its first token costs only its slot.
        c[1].pending_tokens = 0;
        assert_eq!(ttft(&c, &held, 1600, 7, &half).winner, Some(1));
        // Engine-reported queues (other gateways' requests) count: 3 waiting = 6 requests ahead.
        let mut c = fleet(3);
        c[1].waiting = 3;
        let d = ttft(&c, &held, 1600, 7, &w);
        assert_eq!((d.winner, d.predicted_us), (Some(0), Some(256_000)));
        // This gateway's in-flight requests are among the engine's running ones: not added twice.
        let mut c = fleet(3);
        c[1].in_flight = 2;
        c[1].running = 3;
        assert_eq!(ttft(&c, &held, 1600, 7, &w).predicted_us, Some(64_000 + 3 * 40_000));
        // Without exact data the prediction is not made.
        assert_eq!(decide(&fleet(3), None, Some(7), &w).predicted_us, None);
    }

    #[test]
    fn predictions_within_tie_us_are_decided_by_the_prompt_and_a_hot_prefix_spreads_by_prediction() {
        let w = Weights::default();
        let both = scores(&[50, 50, 0, 0], 50);
        let mut first = [0u32; 2];
        for p in 0..100u32 {
            let key = stable_hash(format!("prompt {p}").as_bytes());
            let idle = ttft(&fleet(4), &both, 800, key, &w).winner.unwrap();
            // One running request more on either holder (gateways seeing loads at different
            // instants) is within the tie: the same holder everywhere.
            for busy in 0..2 {
                let mut c = fleet(4);
                c[busy].running = 1;
                assert_eq!(ttft(&c, &both, 800, key, &w).winner, Some(idle), "prompt {p}");
            }
            first[idle] += 1;
        }
        assert!(first.iter().all(|&n| n > 25), "{first:?}");
        // A burst of one hot prefix (800 tokens, held by replica 0 only): it stays while the
        // holder's queue costs less than the prefill it saves, then spreads by prediction (the
        // replicas it goes to hold it after their first prefill; here the index keeps showing one).
        let held = scores(&[50, 0, 0, 0], 50);
        let key = stable_hash(b"hot prefix");
        let mut c = fleet(4);
        for _ in 0..64 {
            let i = ttft(&c, &held, 800, key, &w).winner.unwrap();
            c[i].in_flight += 1;
        }
        let counts: Vec<u32> = c.iter().map(|x| x.in_flight).collect();
        assert!(counts[0] <= 24 && counts.iter().all(|&n| n >= 12), "{counts:?}");
        // A cold prefix (a few requests) stays on its holder.
        let mut c = fleet(4);
        for _ in 0..4 {
            let d = ttft(&c, &held, 800, key, &w);
            assert_eq!((d.winner, d.outcome), (Some(0), Outcome::Exact));
            c[0].in_flight += 1;
        }
    }

    #[test]
    fn load_fallback_without_prompt() {
        let w = Weights::default();
        let mut c = fleet(3);
        c[0].in_flight = 3;
        c[1].in_flight = 1;
        c[2].in_flight = 2;
        assert_eq!(decide(&c, None, None, &w), Decision::new(Some(1), Outcome::Load, 0, 0));
        assert_eq!(least_loaded(&c, &w), Some(1));
    }
}
