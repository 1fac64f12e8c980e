//! How long a request waits for its tokenizer call: the round trips of the last calls and their
//! median, which the gateway keeps for every worker of an Envoy and reports to the router
//! (`TokenizerCalls::tokenizer_round_trip_us`).
//!
//! A request that could be routed on what it shares with earlier ones, but whose own tokens
//! might tell better, either waits for its call or goes at once. Going at once loses at most
//! what the tokens would have shown; waiting costs the call's round trip. The gateway keeps the
//! round trips of the last [`WINDOW`] calls (answered or failed, to a replica or the dedicated
//! tokenizer) in a [`RoundTrips`] and gives their median: a slow call now and then (a replica's
//! API server busy for a moment) does not move it, a tokenizer that slows down for good moves
//! it within [`WINDOW`] / 2 calls. Nothing is known before [`MIN_CALLS`] calls: until then
//! every such request waits, as it did before any was measured.

/// The calls remembered.
pub const WINDOW: usize = 32;
/// Calls needed before the median is used.
pub const MIN_CALLS: usize = 8;

/// The last [`WINDOW`] round trips (µs), oldest first.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct RoundTrips(Vec<u32>);

impl RoundTrips {
    /// The round trips `us`, oldest first; only the last [`WINDOW`] are kept.
    pub fn new(mut us: Vec<u32>) -> Self {
        let drop = us.len().saturating_sub(WINDOW);
        us.drain(..drop);
        RoundTrips(us)
    }

    /// A call answered (or failed) after `us` µs: the oldest beyond [`WINDOW`] is dropped.
    pub fn observe(&mut self, us: u64) {
        self.0.push(u32::try_from(us).unwrap_or(u32::MAX));
        let drop = self.0.len().saturating_sub(WINDOW);
        self.0.drain(..drop);
    }

    /// The round trips kept (µs), oldest first.
    pub fn as_us(&self) -> &[u32] {
        &self.0
    }

    /// The median round trip of the calls kept (µs), once [`MIN_CALLS`] were made.
    pub fn median_us(&self) -> Option<u64> {
        if self.0.len() < MIN_CALLS {
            return None;
        }
        let mut sorted = self.0.clone();
        sorted.sort_unstable();
        sorted.get(sorted.len() / 2).copied().map(u64::from)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_median_needs_enough_calls_ignores_a_slow_one_and_follows_a_lasting_change() {
        let mut w = RoundTrips::default();
        for _ in 0..MIN_CALLS - 1 {
            w.observe(4_000);
        }
        assert_eq!(w.median_us(), None);
        w.observe(4_000);
        assert_eq!(w.median_us(), Some(4_000));
        // One call stuck behind a busy API server.
        w.observe(900_000);
        assert_eq!(w.median_us(), Some(4_000));
        // The tokenizer slows down for good: the window turns over.
        for _ in 0..WINDOW {
            w.observe(12_000);
        }
        assert_eq!(w.median_us(), Some(12_000));
        assert_eq!(w.as_us().len(), WINDOW);
        // A round trip past u32's µs (over an hour) counts as the longest.
        w.observe(u64::MAX);
        assert_eq!(w.as_us().last(), Some(&u32::MAX));
        // Given more than a window, it keeps the newest.
        let many = RoundTrips::new((0..40).collect());
        assert_eq!(many.as_us().first(), Some(&8));
        assert_eq!(many.as_us().len(), WINDOW);
    }
}
