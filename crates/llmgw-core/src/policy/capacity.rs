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
//! ([`Pool::hold_us`](super::Pool::hold_us)). Other requests' blocks come from the engine: what
//! its last load report put in use (`kv_cache_usage × num_gpu_blocks`) beyond the blocks this
//! gateway's requests held there as the report came ([`Pool::others`](super::Pool::others)):
//! other gateways' requests, and what running requests added while decoding, counted where the
//! engine ran requests beyond this gateway's (with none, the excess is what this gateway's own
//! answers added, which may have ended since: left out, towards room). Subtracting the
//! gateway's blocks of that moment, not of this one, keeps the report's age out of the count:
//! requests this gateway sent or ended since are counted by `held` as they are now. What other
//! gateways' requests did since the report is not seen. Where the prompt's blocks and these
//! exceed the cache ([`Pool::blocks`](super::Pool::blocks), from the engine's
//! `vllm:cache_config_info`), the request is predicted to wait for the first of the `k`
//! requests running there to end (this gateway's in flight, and the others' the report counted
//! the same way): with their ends spread evenly over a hold, `hold / (k + 1)`. Where the prompt
//! fits nowhere or nothing is known (no cache size, no hold observed yet, no request running),
//! nothing is added.
//!
//! Counted more than once, towards no room: a prefix requests of several workers share (once per
//! worker), and the prompt's blocks its replica's running requests already hold (the prompt's
//! need is all its blocks). A prefix this gateway's requests share with other requests is
//! counted once in the engine's report and in full in `held`, so the others' share comes out
//! smaller, towards room.

use super::candidate::Candidate;

/// The wait predicted on `c` for a prompt of `need` blocks before the engine starts it (µs):
/// 0 where it fits.
pub fn wait_us(c: &Candidate<'_>, need: u64) -> f64 {
    let p = &c.pool;
    let running = c.in_flight.saturating_add(p.others_running);
    let known = p.blocks > 0 && p.hold_us.is_finite() && p.hold_us > 0.0 && running > 0;
    if !known || need > p.blocks || p.held.saturating_add(p.others).saturating_add(need) <= p.blocks {
        return 0.0;
    }
    p.hold_us / (f64::from(running) + 1.0)
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
