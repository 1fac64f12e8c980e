//! Room in a replica's KV cache: a prompt that does not fit in the blocks left free waits.
//!
//! vLLM starts a waiting request only once every block of its prompt fits in its GPU KV cache
//! besides the blocks its running requests hold: the blocks of a prompt cached earlier but held
//! by no running request count too, since they leave the free list again. A request sent where
//! it does not fit waits until running requests end and give their blocks back, however few
//! requests the replica runs; the prediction from the rates, which count requests, not blocks,
//! does not see that wait. A conversation's later turns, each holding its whole history, fill a
//! small cache with a few requests.
//!
//! The gateway counts the blocks its own requests in flight hold on each replica (their
//! prompts', those of one prefix counted once per worker: [`Pool::held`](super::Pool::held)),
//! and how long a request held them there lately, from its routing to its end
//! ([`Pool::hold_us`](super::Pool::hold_us)). Where the prompt's blocks and the held ones
//! exceed the cache ([`Pool::blocks`](super::Pool::blocks), from the engine's
//! `vllm:cache_config_info`), the request is predicted to wait for the first of the `k`
//! requests in flight there to end: with their ends spread evenly over a hold, `hold / (k + 1)`.
//! Where the prompt fits nowhere or nothing is known (no cache size, no hold observed yet, no
//! request in flight), nothing is added.
//!
//! Left out, so that the count errs towards room (the prediction then stays what it was without
//! it): the blocks running requests add while they decode, and other gateways' requests. Counted
//! more than once, towards no room: a prefix requests of several workers share (once per
//! worker), and the prompt's blocks its replica's running requests already hold (the prompt's
//! need is all its blocks).

use super::candidate::Candidate;

/// The wait predicted on `c` for a prompt of `need` blocks before the engine starts it (µs):
/// 0 where it fits.
pub fn wait_us(c: &Candidate<'_>, need: u64) -> f64 {
    let p = &c.pool;
    let known = p.blocks > 0 && p.hold_us.is_finite() && p.hold_us > 0.0 && c.in_flight > 0;
    if !known || need > p.blocks || p.held.saturating_add(need) <= p.blocks {
        return 0.0;
    }
    p.hold_us / (f64::from(c.in_flight) + 1.0)
}

/// The requests whose holds a replica's mean hold remembers, about.
const HOLD_MEMORY: f64 = 16.0;

/// A replica's mean hold (µs) moved by one request that held its blocks `us`: by `1 /`
/// [`HOLD_MEMORY`] of the difference, so that it follows the answers' lengths as the traffic
/// changes them; the first hold observed (`mean` none, or not a hold) sets it.
pub fn moved_hold_us(mean: Option<f64>, us: f64) -> f64 {
    match mean {
        Some(m) if m.is_finite() && m >= 0.0 => m + (us - m) / HOLD_MEMORY,
        _ => us,
    }
}

/// The blocks a prompt of `tokens` takes at `block_size` tokens a block (its last one partly
/// filled counts whole).
pub fn blocks_of(tokens: u64, block_size: u64) -> u64 {
    match block_size {
        0 => 0,
        bs => tokens.div_ceil(bs),
    }
}
