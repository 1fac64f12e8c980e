//! The KV blocks a gateway's requests in flight hold on each replica
//! ([`crate::policy::capacity`]): a request's own blocks, and the runs it shares with what the
//! replica held when it was routed, each run counted once however many of the requests in
//! flight share it (their system prompt, for instance). The filter keeps one per VM (what a
//! change moves the VM's total by goes into its in-flight record, which every worker sums, so a
//! run two workers' requests share counts once per worker); the endpoint picker keeps one.

use super::step::Holding;
use crate::stable_hash::stable_hash;
use std::collections::HashMap;

fn address_id(address: &str) -> u64 {
    stable_hash(address.as_bytes())
}

/// One replica's blocks held by this VM's requests.
#[derive(Debug, Default)]
struct Held {
    own: u64,
    /// Per shared run (its last block's key): its blocks and the requests sharing it.
    runs: HashMap<u64, (u64, u32)>,
}

impl Held {
    fn total(&self) -> u64 {
        self.runs.values().fold(self.own, |sum, &(blocks, _)| sum.saturating_add(blocks))
    }
}

/// The held blocks per replica (by address). Its size follows the requests in flight: a
/// request adds one run at most, and its end takes it out.
#[derive(Debug, Default)]
pub struct HeldBlocks {
    by_address: HashMap<u64, Held>,
}

impl HeldBlocks {
    /// A request routed to `address` holding `h`: what the total there grew by.
    pub fn add(&mut self, address: &str, h: &Holding) -> i64 {
        let held = self.by_address.entry(address_id(address)).or_default();
        let before = held.total();
        held.own = held.own.saturating_add(h.own_blocks);
        if h.run != 0 {
            let run = held.runs.entry(h.run).or_insert((h.run_blocks, 0));
            run.1 = run.1.saturating_add(1);
        }
        delta(before, held.total())
    }

    /// The end of a request `add` counted: what the total on `address` fell by (negative).
    pub fn remove(&mut self, address: &str, h: &Holding) -> i64 {
        let id = address_id(address);
        let Some(held) = self.by_address.get_mut(&id) else { return 0 };
        let before = held.total();
        held.own = held.own.saturating_sub(h.own_blocks);
        if let Some(run) = held.runs.get_mut(&h.run) {
            run.1 = run.1.saturating_sub(1);
            if run.1 == 0 {
                held.runs.remove(&h.run);
            }
        }
        let after = held.total();
        if held.runs.is_empty() && held.own == 0 {
            self.by_address.remove(&id);
        }
        delta(before, after)
    }

    /// The blocks held on `address`.
    pub fn total(&self, address: &str) -> u64 {
        self.by_address.get(&address_id(address)).map_or(0, Held::total)
    }
}

fn delta(before: u64, after: u64) -> i64 {
    let d = i128::from(after).saturating_sub(i128::from(before));
    i64::try_from(d).unwrap_or(if d < 0 { i64::MIN } else { i64::MAX })
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "10.0.0.1:8000";
    const B: &str = "10.0.0.2:8000";

    fn holding(run: u64, run_blocks: u64, own_blocks: u64) -> Holding {
        Holding { run, run_blocks, own_blocks }
    }

    #[test]
    fn a_shared_run_counts_once_and_leaves_with_its_last_request() {
        let mut h = HeldBlocks::default();
        // Two questions under one 40-block system prompt: 40 + 3 + 2, not 2 × 40 + 5.
        assert_eq!(h.add(A, &holding(7, 40, 3)), 43);
        assert_eq!(h.add(A, &holding(7, 40, 2)), 2);
        // Two conversations of their own: each holds its whole history.
        assert_eq!(h.add(B, &holding(0, 0, 80)), 80);
        assert_eq!(h.add(B, &holding(9, 1, 70)), 71);
        assert_eq!((h.total(A), h.total(B)), (45, 151));
        // The run stays while a request shares it.
        assert_eq!(h.remove(A, &holding(7, 40, 3)), -3);
        assert_eq!(h.remove(A, &holding(7, 40, 2)), -42);
        assert!(!h.by_address.contains_key(&address_id(A)));
        assert_eq!(h.remove(B, &holding(0, 0, 80)), -80);
        assert_eq!(h.remove(B, &holding(9, 1, 70)), -71);
        assert!(h.by_address.is_empty());
        // An end nobody counted moves nothing.
        assert_eq!(h.remove(A, &holding(7, 40, 3)), 0);
    }
}
