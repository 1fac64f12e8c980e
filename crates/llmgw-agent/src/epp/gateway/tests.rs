//! The picker's own traffic as decisions read it.

use super::*;
use crate::epp::learned::basis;
use llmgw_core::flow::MAX_SPECULATIVE_ENTRIES;

const A: &str = "10.0.0.1:8000";

fn charge(address: &str) -> Charge {
    Charge::new(address.to_owned(), 0, None, None)
}

#[test]
fn counts_avoidance_and_the_subset_are_what_decisions_read() {
    let g = Gateway::new(Duration::from_secs(60));
    g.started(&charge(A));
    let second = charge(A);
    g.started(&second);
    g.finished(charge(A));
    g.avoid("10.0.0.2:8000");
    let subset = vec![A.to_owned(), "10.0.0.2:8000".to_owned()];
    let s = g.snapshot(Some(&subset));
    assert_eq!(s.in_flight(A), 1);
    assert!(!s.avoided(A));
    assert!(s.avoided("10.0.0.2:8000"), "avoided after the data plane could not use it");
    assert!(s.avoided("10.0.0.3:8000"), "outside the subset hint");
    let all = g.snapshot(None);
    assert!(!all.avoided("10.0.0.3:8000"));
    // Routed lately: the two started on A, none elsewhere.
    assert!(all.recent_requests(A) > 1.9 && all.recent_requests("10.0.0.2:8000") == 0.0);
    g.finished(second);
    g.finished(charge(A));
    assert_eq!(g.snapshot(None).in_flight(A), 0);
}

#[test]
fn a_request_queues_its_prefill_until_its_first_token_holds_its_blocks_until_its_end_and_teaches_once() {
    let g = Gateway::new(Duration::from_secs(60));
    // Two questions under one 40-block system prompt, the second taught nothing.
    let h = |own| Some(Holding { run: 7, run_blocks: 40, own_blocks: own });
    let mut first = Charge::new(A.to_owned(), 300, h(3), Some(basis(100)));
    let second = Charge::new(A.to_owned(), 200, h(2), None);
    g.started(&first);
    g.started(&second);
    let s = g.snapshot(None);
    assert_eq!((s.in_flight(A), s.pending_tokens(A), s.held_blocks(A)), (2, 500, 45));
    // What a load report arriving now is noted with (what the engine reports beyond it is
    // other requests').
    assert_eq!(g.shares().get(A), Some(&GatewayShare { requests: 2, blocks: 45 }));
    assert_eq!(s.hold_us(A), 0.0);
    assert_eq!(s.learned_rates(A), None);
    g.first_token(&mut first, true);
    g.first_token(&mut first, true);
    let s = g.snapshot(None);
    assert_eq!(s.pending_tokens(A), 200, "the first's prefill is done, once");
    assert_eq!(s.learned_rates(A).map(|r| r.observations), Some(1), "taught once");
    g.finished(first);
    g.finished(second);
    let s = g.snapshot(None);
    assert_eq!((s.in_flight(A), s.pending_tokens(A), s.held_blocks(A)), (0, 0, 0));
    assert!(s.hold_us(A) > 0.0, "the ends timed the hold");
    assert_eq!(s.learned_rates(A).map(|r| r.observations), Some(1), "an end teaches nothing");
    assert!(g.learned_text().contains(&format!("llmgw_rates_observations{{replica=\"{A}\"}} 1")));
}

#[test]
fn a_request_routed_on_an_estimate_teaches_with_its_counted_tokens_and_not_before_they_come() {
    // Counted before its first token: its uncached tokens moved by what the count says.
    let mut c = Charge::new(A.to_owned(), 0, None, Some(basis(100)));
    c.counted_later().set(150, 120);
    assert_eq!(c.lesson().map(|b| b.features.uncached), Some(130));
    let mut c = Charge::new(A.to_owned(), 0, None, Some(basis(100)));
    c.counted_later().set(90, 120);
    assert_eq!(c.lesson().map(|b| b.features.uncached), Some(70));
    // Not counted yet when its first token comes: nothing is taught.
    let g = Gateway::new(Duration::from_secs(60));
    let mut c = Charge::new(A.to_owned(), 0, None, Some(basis(100)));
    let counted = c.counted_later();
    g.started(&c);
    g.first_token(&mut c, true);
    counted.set(100, 100);
    g.finished(c);
    assert_eq!(g.snapshot(None).learned_rates(A), None);
    // Routed on its own tokens: taught as predicted.
    let mut c = Charge::new(A.to_owned(), 0, None, Some(basis(100)));
    assert_eq!(c.lesson().map(|b| b.features.uncached), Some(100));
}

#[test]
fn a_kept_turn_is_what_later_decisions_find() {
    let g = Gateway::new(Duration::from_secs(60));
    let before = g.snapshot(None);
    assert_eq!(before.earlier_tokens(5), None);
    g.keep(&Keep { tokens: vec![(5, vec![1, 2, 3])], prompt: None });
    assert_eq!(before.earlier_tokens(5), Some((vec![1, 2, 3], 3)), "read when decided, not copied");
}

#[test]
fn blocks_just_sent_to_an_engine_are_credited_to_it_by_the_next_decisions() {
    let g = Gateway::new(Duration::from_secs(60));
    let before = g.snapshot(None);
    assert_eq!(g.speculate(&Speculation { replica: 7, keys: vec![10, 11], reset_ns: 0 }), 0);
    let mut hits = Vec::new();
    before.speculative(&[11, 99, 10], &mut hits);
    let mut got: Vec<(usize, u64)> = hits.iter().map(|h| (h.key, h.engine)).collect();
    got.sort_unstable();
    assert_eq!(got, vec![(0, 7), (2, 7)], "read when decided, not copied");
    // Bounded: past the bound the entries expiring first go, and the drop is told.
    let many = Speculation { replica: 8, keys: (100..100 + MAX_SPECULATIVE_ENTRIES as u64).collect(), reset_ns: 0 };
    assert_eq!(g.speculate(&many), 2);
    assert_eq!(g.speculative.lock().unwrap().len(), MAX_SPECULATIVE_ENTRIES);
}

#[test]
fn an_answered_request_is_expected_back_where_it_was_answered_until_its_next_one_comes() {
    let g = Gateway::new(Duration::from_secs(60));
    let routed = |key| Charge::new(A.to_owned(), 0, None, None).recorded_as(Some(key));
    // Recorded from its first token, not before.
    let mut c = routed(7);
    g.started(&c);
    assert!(!g.snapshot(None).ended_request(7));
    g.first_token(&mut c, false);
    let s = g.snapshot(None);
    assert!(s.ended_request(7));
    assert_eq!((s.returning(A).count, s.returning("10.0.0.2:8000").count), (1, 0));
    g.finished(c);
    assert!(g.snapshot(None).returning(A).answered[0].ended, "its end noted");
    // Its next request came: no longer expected.
    g.followed(7);
    assert!(!g.snapshot(None).ended_request(7));
    // An error, and a request that ended without an answer, are nobody's turn before.
    let mut failed = routed(8);
    g.started(&failed);
    failed.failed();
    g.first_token(&mut failed, false);
    let cut = routed(9);
    g.started(&cut);
    g.finished(cut);
    g.finished(failed);
    let s = g.snapshot(None);
    assert!(!s.ended_request(8) && !s.ended_request(9));
    assert_eq!(s.returning(A).count, 0);
}

#[test]
fn the_tokenizer_calls_usual_round_trip_is_known_once_enough_were_made() {
    use llmgw_core::flow::tokenizer_wait::MIN_CALLS;
    let g = Gateway::new(Duration::from_secs(60));
    for ms in 1..MIN_CALLS as u64 {
        g.tokenizer_round_trip(Duration::from_millis(ms));
    }
    assert_eq!(g.snapshot(None).tokenizer_round_trip_us(), None, "too few calls: every such request waits");
    g.tokenizer_round_trip(Duration::from_secs(5));
    assert_eq!(g.snapshot(None).tokenizer_round_trip_us(), Some(5_000), "the median, not the slow one");
}
