//! Where new and shared prefixes go: spread evenly under equal load or equal holding, by
//! prediction past its typical error, and away from the requests expected back within a new
//! prefix's prefill.

use super::*;

#[test]
fn new_prefixes_spread_evenly_under_equal_load() {
    // New prefixes arrive one after another on an idle fleet; each one's requests are counted
    // where it went (fading as the filter's recent counts do). Rendezvous order alone spreads
    // them as a hash does; the recent counts even them out.
    // The same when every replica holds the prompts' first block (a system prompt the whole
    // fleet has cached): past it, each prompt is new.
    for (n, common) in [(3usize, 0), (4, 0), (3, 1), (4, 1)] {
        for policy in [Weights::default(), score()] {
            let mut c = fleet(n);
            let none = scores(&vec![common; n], 50);
            let mut placed = vec![0u32; n];
            for p in 0..(12 * n as u32) {
                let key = stable_hash(format!("conversation {p}").as_bytes());
                let d = ttft(&c, &none, 800, key, &policy);
                let expect = if common == 0 { Outcome::Approx } else { Outcome::Exact };
                assert_eq!((d.outcome, d.matched), (expect, common));
                let i = d.winner.unwrap();
                placed[i] += 1;
                // Every prefix brings four requests, each fading the others' counts.
                for _ in 0..4 {
                    for x in c.iter_mut() {
                        x.recent *= 1.0 - 1.0 / (32.0 * n as f64);
                    }
                    c[i].recent += 1.0;
                }
            }
            let (max, min) = (*placed.iter().max().unwrap(), *placed.iter().min().unwrap());
            assert!(
                f64::from(max) <= 1.25 * f64::from(min),
                "{n} replicas, {common} common, {}: {placed:?}",
                policy.holder_policy().name()
            );
        }
    }
    // A replica that has carried more lately gets the next new prefix, its first choice or not.
    let key = stable_hash(b"a new system prompt");
    let home = decide(&fleet(3), None, Some(key), &Weights::default()).winner.unwrap();
    let mut c = fleet(3);
    c[home].recent = 5.0;
    let d = ttft(&c, &scores(&[0, 0, 0], 50), 800, key, &Weights::default());
    assert_ne!(d.winner, Some(home));
    // Less than one request apart is even: the prompt's order decides, as on every gateway.
    c[home].recent = 0.4;
    assert_eq!(ttft(&c, &scores(&[0, 0, 0], 50), 800, key, &Weights::default()).winner, Some(home));
}

#[test]
fn replicas_holding_a_prefix_equally_share_its_requests() {
    // Replicas 0 and 2 hold a long shared prompt, replica 1 nothing; every request has the same
    // leading text (one rendezvous key for the fallbacks) and its own question past the shared
    // part. Equal holders with equal predictions take the requests by each prompt's own key,
    // instead of the shared text's first choice taking them all; each prompt's choice is the
    // same whatever this gateway routed lately (every gateway makes it).
    let shared = stable_hash(b"a shared system prompt");
    for policy in [Weights::default(), score()] {
        let held = scores(&[40, 0, 40], 50);
        let mut placed = [0u32; 3];
        for q in 0..60 {
            let own = stable_hash(format!("question {q}").as_bytes());
            let work = Some(Work { tokens: 800, block_size: 16, prompt_key: own });
            let mut c = fleet(3);
            let d = decide_lazy(&c, Some(&held), work, || Some(shared), &policy);
            assert_eq!((d.outcome, d.matched), (Outcome::Exact, 40));
            let i = d.winner.unwrap();
            placed[i] += 1;
            c[i].recent = 20.0;
            assert_eq!(decide_lazy(&c, Some(&held), work, || Some(shared), &policy).winner, Some(i));
        }
        assert_eq!(placed[1], 0, "{}: {placed:?}", policy.holder_policy().name());
        assert!(placed[0].min(placed[2]) >= 20, "{}: {placed:?}", policy.holder_policy().name());
    }
}

#[test]
fn a_new_prefix_goes_by_prediction_only_past_the_predictions_typical_error() {
    use super::rates::Rates;
    let learned = |prefill: f64, residual: f64| Rates {
        base_us: 0.0,
        prefill_us_per_token: prefill,
        queued_us_per_token: 0.0,
        request_us: 2_000.0,
        observations: 60,
        residual_us: residual,
        quiet_ns: 0,
    };
    let none = scores(&[0, 0, 0], 50);
    // The first two in each prompt's order are its choices (the third would be one too by
    // default, and win as the least recently sent to).
    let mut w = Weights::default();
    w.fallback.approx_choices = 2;
    for p in 0..30u32 {
        let key = stable_hash(format!("conversation {p}").as_bytes());
        let order: Vec<usize> = {
            let c = fleet(3);
            let mut o: Vec<usize> = (0..3).collect();
            o.sort_by_key(|&i| std::cmp::Reverse(c[i].rendezvous_weight(key)));
            o
        };
        let (first, second) = (order[0], order[1]);
        // The first choice is learned 10 % slower (8 ms on 800 tokens) and has carried more
        // lately. Its rates typically miss by 10 ms: the difference is noise, the recent
        // counts decide.
        let mut c = fleet(3);
        for x in c.iter_mut() {
            x.rates = Some(learned(100.0, 10_000.0));
        }
        c[first].rates = Some(learned(110.0, 10_000.0));
        c[first].recent = 3.0;
        c[second].recent = 6.0;
        assert_eq!(ttft(&c, &none, 800, key, &w).winner, Some(first), "prompt {p}");
        // Predictions that rarely miss: the faster one wins.
        for x in c.iter_mut() {
            x.rates = Some(learned(100.0, 1_000.0));
        }
        c[first].rates = Some(learned(110.0, 1_000.0));
        assert_eq!(ttft(&c, &none, 800, key, &w).winner, Some(second), "prompt {p}");
        // A replica really slower (twice: 80 ms) loses whatever it carried.
        c[first].rates = Some(learned(200.0, 10_000.0));
        c[first].recent = 0.0;
        assert_eq!(ttft(&c, &none, 800, key, &w).winner, Some(second), "prompt {p}");
    }
}

#[test]
fn new_prefixes_sent_a_moment_apart_do_not_share_a_replica_while_the_rates_still_miss_by_much() {
    use super::rates::Rates;
    // Early learning at dear prefill: every replica's rates miss by 400 ms. Each replica
    // holds the prompts' common first block, so past it every prompt is new.
    let learned = |prefill: f64| Rates {
        base_us: 0.0,
        prefill_us_per_token: prefill,
        queued_us_per_token: prefill,
        request_us: 20_000.0,
        observations: 3,
        residual_us: 400_000.0,
        quiet_ns: 0,
    };
    let common = scores(&[1, 1, 1], 40);
    for p in 0..30u32 {
        let key = stable_hash(format!("conversation {p}").as_bytes());
        let mut c = fleet(3);
        for (x, prefill) in c.iter_mut().zip([800.0, 850.0, 900.0]) {
            x.rates = Some(learned(prefill));
            x.recent = 4.0;
        }
        // The replica sent to least lately is computing a new conversation of 300 tokens
        // (about 260 ms of known work, within what the rates miss by); the others are idle.
        let busy = p as usize % 3;
        c[busy].recent = 1.0;
        c[busy].in_flight = 1;
        c[busy].pending_tokens = 300;
        let d = ttft(&c, &common, 640, key, &Weights::default());
        assert_eq!((d.outcome, d.matched), (Outcome::Exact, 1));
        assert_ne!(d.winner, Some(busy), "prompt {p}: {d:?}");
        // Idle everywhere, the rates' scatter (50 µs a token: 30 ms) decides nothing: fewer
        // recent requests do.
        c[busy].in_flight = 0;
        c[busy].pending_tokens = 0;
        assert_eq!(ttft(&c, &common, 640, key, &Weights::default()).winner, Some(busy), "prompt {p}");
    }
}

#[test]
fn a_new_prefix_is_not_computed_where_a_request_is_expected_back_within_its_prefill() {
    use super::returns::{Answered, Gaps, ReturnCurves, Returning};
    let none = scores(&[0, 0, 0], 50);
    // The first two in each prompt's order are its choices.
    let mut w = Weights::default();
    w.fallback.approx_choices = 2;
    // A request answered 1 ms ago, where every request so far came back 5 ms after its answer
    // (a loop's next step).
    let mut gaps = Gaps::default();
    for _ in 0..32 {
        gaps.observe(Some(5_000));
    }
    let mut soon = Returning {
        curves: Some(std::sync::Arc::new(ReturnCurves::new(&Gaps::default(), &gaps))),
        count: 1,
        ..Default::default()
    };
    soon.answered[0] = Answered { since_us: 1_000, ended: true };
    assert!(soon.expected_within(80_000.0) > 0.99);
    for p in 0..30u32 {
        let key = stable_hash(format!("conversation {p}").as_bytes());
        let mut c = fleet(3);
        let mut o: Vec<usize> = (0..3).collect();
        o.sort_by_key(|&i| std::cmp::Reverse(c[i].rendezvous_weight(key)));
        let (first, second) = (o[0], o[1]);
        c[second].recent = 5.0;
        assert_eq!(ttft(&c, &none, 800, key, &w).winner, Some(first), "prompt {p}");
        // 800 tokens at 100 µs: the request coming back would wait about 80 ms.
        c[first].returning = soon.clone();
        assert_eq!(ttft(&c, &none, 800, key, &w).winner, Some(second), "prompt {p}");
        // A prompt it holds 10 of 50 blocks of stays there: 64 ms of prefill against 80 ms
        // elsewhere (with the request expected back counted, it would be 128 ms).
        let mut holds = vec![0u32; 3];
        holds[first] = 10;
        assert_eq!(ttft(&c, &scores(&holds, 50), 800, key, &w).winner, Some(first), "prompt {p}");
        let mut ignoring = w.clone();
        ignoring.ttft.returning = 0.0;
        assert_eq!(ttft(&c, &none, 800, key, &ignoring).winner, Some(first), "prompt {p}");
        // A prompt short enough to be done before it comes back is not moved.
        assert_eq!(ttft(&c, &none, 16, key, &w).winner, Some(first), "prompt {p}");
        // Waiting behind 2,000 tokens of queued prefill (200 ms) costs more than delaying it.
        c[second].in_flight = 1;
        c[second].pending_tokens = 2_000;
        assert_eq!(ttft(&c, &none, 800, key, &w).winner, Some(first), "prompt {p}");
    }
}

#[test]
fn a_replica_that_looked_slow_in_its_first_requests_still_takes_new_prefixes_while_idle() {
    use super::rates::Rates;
    let rates = |prefill: f64, observations: u32, residual: f64| Rates {
        base_us: 5_000.0,
        prefill_us_per_token: prefill,
        queued_us_per_token: prefill,
        request_us: 10_000.0,
        observations,
        residual_us: residual,
        quiet_ns: 0,
    };
    // Replicas 0 and 1 are known (60 observations, 200 µs a token, predictions off by 20 ms
    // typically) and each computing a new conversation of 500 tokens. Replica 2's first two
    // requests came while it was slow: its rates, fitted to them, say 900 µs a token, and
    // their residual rests on those two. It is idle. Every replica holds the prompts' common
    // first block.
    let common = scores(&[1, 1, 1], 40);
    let fleet_with = |slow: Rates| {
        let mut c = fleet(3);
        for x in c.iter_mut().take(2) {
            x.rates = Some(rates(200.0, 60, 20_000.0));
            x.in_flight = 1;
            x.pending_tokens = 500;
        }
        c[2].rates = Some(slow);
        c
    };
    for p in 0..30u32 {
        let key = stable_hash(format!("conversation {p}").as_bytes());
        // Two observations are too few to judge it by: the loads decide, and being idle it
        // takes the new conversation (whose first token teaches its rates).
        let d = ttft(&fleet_with(rates(900.0, 2, 220_000.0)), &common, 640, key, &Weights::default());
        assert_eq!(d.winner, Some(2), "prompt {p}");
        // The same rates resting on as many observations as the others', as sure of themselves:
        // it is that slow, and the new conversation waits for a busy replica instead.
        let c = fleet_with(rates(900.0, 60, 20_000.0));
        assert_ne!(ttft(&c, &common, 640, key, &Weights::default()).winner, Some(2), "prompt {p}");
    }
}
