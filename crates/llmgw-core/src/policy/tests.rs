use super::*;
use crate::index::ReplicaId;

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
            rates: None,
            incomplete: false,
            recent: 0.0,
            returning: Default::default(),
            pool: Default::default(),
        })
        .collect()
}

/// The blended-score policy's weights.
fn score() -> Weights {
    Weights::score()
}

/// A decision without its predicted figures.
fn bare(d: Decision) -> Decision {
    Decision { predicted_us: None, runner_up: None, basis: None, ..d }
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
    c[1].waiting = w.limits.max_waiting + 1;
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
    assert_eq!(least_loaded(&c, &w.limits, 0), Some(1));
}

#[test]
fn no_healthy_replica() {
    let w = Weights::default();
    let mut c = fleet(2);
    c[0].up = false;
    c[1].up = false;
    assert_eq!(decide(&c, None, Some(1), &w).outcome, Outcome::NoReplica);
    assert_eq!(decide(&[], None, None, &w).winner, None);
    assert_eq!(least_loaded(&c, &w.limits, 0), None);
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
    // A prefix the index shows nobody holds, with two choices (the default is every replica):
    // the faster predicted of the first two in its order (one request more is within the tie
    // margin); equal ones keep the first. Without exact data (a fallback) the first choice
    // stays, load bound permitting.
    assert_eq!(Weights::default().fallback.approx_choices, 0);
    let mut w2 = Weights::default();
    w2.fallback.approx_choices = 2;
    let none = scores(&[0, 0, 0], 7);
    assert_eq!(decide(&fleet(3), Some(&none), Some(key), &w2).winner, Some(home));
    let mut c4 = fleet(3);
    c4[home].in_flight = 1;
    assert_eq!(decide(&c4, Some(&none), Some(key), &w2).winner, Some(home));
    c4[home].in_flight = 2;
    assert_eq!(decide(&c4, Some(&none), Some(key), &w2).winner, Some(spill));
    assert_eq!(decide(&c4, None, Some(key), &w2).winner, Some(home));
    c4[spill].in_flight = 2;
    assert_eq!(decide(&c4, Some(&none), Some(key), &w2).winner, Some(home));
    // Every replica a choice: the third, idle, wins.
    let third = (0..3).find(|&i| i != home && i != spill).unwrap();
    assert_eq!(decide(&c4, Some(&none), Some(key), &Weights::default()).winner, Some(third));
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
    let mut strict = score();
    strict.score.tie_margin = 0.0;
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
    let mut unbounded = score();
    unbounded.fallback.holder_spill_factor = 0.0;
    assert_eq!(decide(&c, Some(&held), Some(key), &unbounded).outcome, Outcome::Exact);
}

/// The `ttft` policy at 200 µs per prompt token and 40 ms per request.
fn rated() -> Weights {
    let mut w = Weights::default();
    w.ttft.prefill_us_per_token = 200.0;
    w.ttft.request_us = 40_000.0;
    w
}

fn ttft(c: &[Candidate<'_>], s: &Scores, tokens: u64, key: u64, w: &Weights) -> Decision {
    decide_lazy(c, Some(s), Some(Work { tokens, block_size: 16, prompt_key: key }), || Some(key), w)
}

#[test]
fn the_lowest_predicted_time_to_first_token_wins() {
    let w = rated();
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
    assert_eq!(w.ttft.queued_prefill, 1.0);
    let mut half = rated();
    half.ttft.queued_prefill = 0.5;
    let mut none = rated();
    none.ttft.queued_prefill = 0.0;
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
    assert_eq!(least_loaded(&c, &w.limits, 0), Some(1));
}

#[test]
fn a_replica_learned_to_be_slow_loses_to_one_computing_more() {
    use super::rates::Rates;
    // Replica 1 holds 80 of 100 blocks; replica 0 holds 20. At the profile's rates 1 wins.
    let held = scores(&[20, 80, 0], 100);
    let w = rated();
    assert_eq!(ttft(&fleet(3), &held, 1600, 7, &w).winner, Some(1));
    // Learned: replica 1 computes a token ten times slower than the profile says.
    let slow = Rates {
        base_us: 0.0,
        prefill_us_per_token: 2_000.0,
        queued_us_per_token: 2_000.0,
        request_us: 40_000.0,
        observations: 60,
        residual_us: 0.0,
        quiet_ns: 0,
    };
    let mut c = fleet(3);
    c[1].rates = Some(slow);
    let d = ttft(&c, &held, 1600, 7, &w);
    assert_eq!(d.winner, Some(0));
    // The decision carries what its prediction was made of.
    let b = d.basis.unwrap();
    assert_eq!((b.features.uncached, b.features.requests, b.rates.observations), (1280, 0, 0));
    assert_eq!(b.prior.prefill_us_per_token, 200.0);
    // With learning off, the profile's rates decide.
    let mut off = rated();
    off.ttft.learning.enabled = false;
    assert_eq!(ttft(&c, &held, 1600, 7, &off).winner, Some(1));
    // Observed no more, its rates are kept up to `forget_ns` (30 s), then forgotten: the
    // profile's rates decide again, and it is tried again.
    let forget = w.ttft.learning.forget_ns;
    c[1].rates = Some(Rates { quiet_ns: forget, ..slow });
    assert_eq!(ttft(&c, &held, 1600, 7, &w).winner, Some(0));
    c[1].rates = Some(Rates { quiet_ns: forget + 1, ..slow });
    let d = ttft(&c, &held, 1600, 7, &w);
    assert_eq!(d.winner, Some(1));
    assert_eq!(d.basis.unwrap().rates.observations, 0, "predicted at the profile's rates");
    // `rates_forget_ms: 0` keeps them for good.
    let mut keep = rated();
    keep.ttft.learning.forget_ns = 0;
    assert_eq!(ttft(&c, &held, 1600, 7, &keep).winner, Some(0));
}

#[test]
fn the_tie_margin_is_in_requests_at_the_learned_rate() {
    use super::rates::Rates;
    // Two holders of the whole prompt, on a fleet learned to cost 2 ms a request.
    let fast = Rates {
        base_us: 0.0,
        prefill_us_per_token: 30.0,
        queued_us_per_token: 0.0,
        request_us: 2_000.0,
        observations: 80,
        residual_us: 0.0,
        quiet_ns: 0,
    };
    let both = scores(&[50, 50, 0, 0], 50);
    let w = Weights::default();
    for p in 0..50u32 {
        let key = stable_hash(format!("prompt {p}").as_bytes());
        let mut c = fleet(4);
        for x in c.iter_mut() {
            x.rates = Some(fast);
        }
        let idle = ttft(&c, &both, 800, key, &w).winner.unwrap();
        let other = 1 - idle;
        // One request more on the chosen holder is within the tie: the same holder.
        c[idle].running = 1;
        assert_eq!(ttft(&c, &both, 800, key, &w).winner, Some(idle), "prompt {p}");
        // Two more cost 4 ms, past 1.1 requests' worth (2.2 ms): the other holder.
        c[idle].running = 2;
        assert_eq!(ttft(&c, &both, 800, key, &w).winner, Some(other), "prompt {p}");
        // A fixed margin of 45 ms (the old default) would have kept it.
        let mut fixed = Weights::default();
        fixed.ttft.tie_us = 45_000.0;
        assert_eq!(ttft(&c, &both, 800, key, &fixed).winner, Some(idle), "prompt {p}");
    }
}

#[test]
fn an_incomplete_engines_misses_are_not_proof_that_a_prefix_is_new() {
    let w = Weights::default();
    let key = stable_hash(b"a system prompt cached before the agent started");
    let home = decide(&fleet(3), None, Some(key), &w).winner.unwrap();
    let none = scores(&[0, 0, 0], 7);
    // Complete mirrors showing nobody holding it: a new prefix, free to take the less loaded
    // of its first two choices.
    let mut c = fleet(3);
    c[home].in_flight = 2;
    let second = decide(&c, Some(&none), Some(key), &w).winner.unwrap();
    assert_ne!(second, home);
    // An engine whose mirror is incomplete may hold it unseen: the prefix stays on its first
    // choice, where earlier requests sharing it went, as without exact data.
    for incomplete in 0..3 {
        let mut c = c.clone();
        c[incomplete].incomplete = true;
        let d = decide(&c, Some(&none), Some(key), &w);
        assert_eq!((d.winner, d.outcome), (Some(home), Outcome::Approx), "incomplete {incomplete}");
    }
    // The load bound still moves it.
    let mut far = c.clone();
    far[home].in_flight = 40;
    far[second].incomplete = true;
    assert_ne!(decide(&far, Some(&none), Some(key), &w).winner, Some(home));
    // A down incomplete engine says nothing about where the prefix is.
    let mut down = c.clone();
    let other = (0..3).find(|&i| i != home && i != second).unwrap();
    down[other].incomplete = true;
    down[other].up = false;
    assert_eq!(decide(&down, Some(&none), Some(key), &w).winner, Some(second));
    // Its hits are real: an incomplete holder wins as a complete one does, and a complete
    // holder is not given up for an incomplete engine the index shows holding nothing.
    for policy in [Weights::default(), score()] {
        let mut c = fleet(3);
        c[1].incomplete = true;
        let d = decide(&c, Some(&scores(&[0, 5, 0], 7)), Some(key), &policy);
        assert_eq!((d.winner, d.outcome, d.matched), (Some(1), Outcome::Exact, 5));
        let d = decide(&c, Some(&scores(&[5, 0, 0], 7)), Some(key), &policy);
        assert_eq!((d.winner, d.outcome, d.matched), (Some(0), Outcome::Exact, 5));
    }
}

/// Where new and shared prefixes go.
mod new_prefix;

/// Room in the replicas' KV caches.
mod capacity;
