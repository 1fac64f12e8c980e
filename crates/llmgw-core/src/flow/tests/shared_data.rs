//! A stand-in for the gateway's shared data in tests of several VMs: the tokens VMs kept, by
//! tag (the latest wins), the text prompts they shared, in order, and nothing else.

use crate::flow::{
    EarlierTurns, InFlightCounts, Keep, LearnedRates, ReplicaAvoidance, SharedPrompt, SpeculativeEntries,
};
use std::cell::RefCell;

#[derive(Default)]
pub(super) struct Kept(pub(super) RefCell<Vec<(u128, Vec<u32>)>>, pub(super) RefCell<Vec<SharedPrompt>>);

impl Kept {
    /// Keeps what a VM handed to the gateway.
    pub(super) fn keep(&self, keep: Keep) {
        self.0.borrow_mut().extend(keep.tokens);
        self.1.borrow_mut().extend(keep.prompt);
    }
}

impl InFlightCounts for Kept {
    fn in_flight(&self, _address: &str) -> u32 {
        0
    }
}
impl ReplicaAvoidance for Kept {}
impl SpeculativeEntries for Kept {}
impl LearnedRates for Kept {}
impl crate::flow::TokenizerCalls for Kept {}
impl EarlierTurns for Kept {
    fn earlier_tokens(&self, tag: u128) -> Option<(Vec<u32>, usize)> {
        self.0.borrow().iter().rev().find(|(t, _)| *t == tag).map(|(_, v)| (v.clone(), v.len()))
    }

    fn prompts_since(&self, seen: u64, out: &mut Vec<SharedPrompt>) -> u64 {
        let prompts = self.1.borrow();
        out.extend(prompts.iter().skip(usize::try_from(seen).unwrap_or(usize::MAX)).cloned());
        u64::try_from(prompts.len()).unwrap_or(u64::MAX)
    }
}

/// A gateway whose tokenizer calls take the given median round trip (µs; `None`: too few were
/// timed) and that knows nothing else.
pub(super) struct CallsTaking(pub(super) Option<u64>);

impl InFlightCounts for CallsTaking {
    fn in_flight(&self, _address: &str) -> u32 {
        0
    }
}
impl ReplicaAvoidance for CallsTaking {}
impl SpeculativeEntries for CallsTaking {}
impl LearnedRates for CallsTaking {}
impl crate::flow::TokenizerCalls for CallsTaking {
    fn tokenizer_round_trip_us(&self) -> Option<u64> {
        self.0
    }
}
impl EarlierTurns for CallsTaking {}
