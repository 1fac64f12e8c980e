//! The tokens of chat requests the picker tokenized, kept for the next turn of their
//! conversations ([`llmgw_core::flow::EarlierTurns`]): the next turn is routed on them at once,
//! and its own tokenizer call goes out after it is routed. The filter keeps the same in Envoy's
//! shared data; here, in the agent's memory, with the filter's bounds: [`KEPT_TURNS`] slots, a
//! turn's slot its tag modulo that, a later turn in the same slot replacing it, and at most
//! [`KEPT_TURN_TOKENS`] leading tokens each (16 MiB at most, however many conversations).

use llmgw_core::flow::{Keep, KEPT_TURNS, KEPT_TURN_TOKENS};
use std::collections::HashMap;

#[derive(Debug)]
struct Turn {
    tag: u128,
    /// The prompt's token count.
    count: usize,
    /// Its leading tokens.
    tokens: Vec<u32>,
}

#[derive(Debug, Default)]
pub struct Turns {
    slots: HashMap<u64, Turn>,
}

impl Turns {
    /// Keeps what a routing step or a call after routing said to keep.
    pub fn keep(&mut self, keep: &Keep) {
        for (tag, tokens) in &keep.tokens {
            let kept = tokens.get(..KEPT_TURN_TOKENS).unwrap_or(tokens);
            let turn = Turn { tag: *tag, count: tokens.len(), tokens: kept.to_vec() };
            self.slots.insert(slot(*tag), turn);
        }
    }

    /// The leading tokens kept for `tag`, and its prompt's token count.
    pub fn lookup(&self, tag: u128) -> Option<(Vec<u32>, usize)> {
        let t = self.slots.get(&slot(tag)).filter(|t| t.tag == tag && !t.tokens.is_empty())?;
        Some((t.tokens.clone(), t.count.max(t.tokens.len())))
    }
}

fn slot(tag: u128) -> u64 {
    (tag as u64) % KEPT_TURNS
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keep(tag: u128, tokens: Vec<u32>) -> Keep {
        Keep { tokens: vec![(tag, tokens)], prompt: None }
    }

    #[test]
    fn a_kept_turn_is_found_by_its_tag_only_and_bounded_by_its_slots_and_head() {
        let mut t = Turns::default();
        t.keep(&keep(7, (0..100).collect()));
        assert_eq!(t.lookup(7), Some(((0..100).collect(), 100)));
        // Another tag in the same slot replaces it; the old tag finds nothing.
        let other = 7 + u128::from(KEPT_TURNS);
        assert_eq!(t.lookup(other), None);
        t.keep(&keep(other, vec![1, 2, 3]));
        assert_eq!(t.lookup(7), None);
        assert_eq!(t.lookup(other), Some((vec![1, 2, 3], 3)));
        // A long prompt keeps its head and its count.
        let long: Vec<u32> = (0..(KEPT_TURN_TOKENS as u32 + 10)).collect();
        t.keep(&keep(9, long));
        let (head, count) = t.lookup(9).unwrap();
        assert_eq!((head.len(), count), (KEPT_TURN_TOKENS, KEPT_TURN_TOKENS + 10));
        for i in 0..(2 * KEPT_TURNS) {
            t.keep(&keep(u128::from(i) + 1_000_000, vec![1]));
        }
        assert_eq!(t.slots.len() as u64, KEPT_TURNS);
    }
}
