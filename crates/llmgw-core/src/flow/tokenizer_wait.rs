//! How long a request waits for its tokenizer call, learned from the calls' round trips: this
//! VM's, where the gateway keeps none of every worker's (`LearnedRates::tokenizer_round_trip_us`).
//!
//! A request that could be routed on what it shares with earlier ones, but whose own tokens
//! might tell better, either waits for its call or goes at once. Going at once loses at most
//! what the tokens would have shown; waiting costs the call's round trip. This keeps the round
//! trips of the last [`WINDOW`] calls (answered or failed, to a replica or the dedicated
//! tokenizer) and gives their median: a slow call now and then (a replica's API server busy for
//! a moment) does not move it, a tokenizer that slows down for good moves it within
//! [`WINDOW`] / 2 calls. Nothing is known before [`MIN_CALLS`] calls: until then every such
//! request waits, as it did before any was measured.

/// The calls remembered.
pub const WINDOW: usize = 32;
/// Calls needed before the median is used.
pub const MIN_CALLS: usize = 8;

/// The last [`WINDOW`] round trips (µs), oldest overwritten first.
#[derive(Debug, Default)]
pub struct TokenizerWait {
    round_trips_us: Vec<u64>,
    next: usize,
}

impl TokenizerWait {
    /// A call answered (or failed) after `us` µs.
    pub fn observe(&mut self, us: u64) {
        if self.round_trips_us.len() < WINDOW {
            self.round_trips_us.push(us);
        } else if let Some(slot) = self.round_trips_us.get_mut(self.next) {
            *slot = us;
        }
        self.next = self.next.saturating_add(1).checked_rem(WINDOW).unwrap_or(0);
    }

    /// The median round trip of the calls remembered (µs), once [`MIN_CALLS`] were made.
    pub fn median_us(&self) -> Option<u64> {
        median_round_trip_us(self.round_trips_us.clone())
    }
}

/// The median of `round_trips_us` (the last [`WINDOW`] calls' round trips, of this VM or of
/// every worker of the gateway), once there are [`MIN_CALLS`].
pub fn median_round_trip_us(mut round_trips_us: Vec<u64>) -> Option<u64> {
    if round_trips_us.len() < MIN_CALLS {
        return None;
    }
    round_trips_us.sort_unstable();
    round_trips_us.get(round_trips_us.len() / 2).copied()
}

impl super::Router {
    /// A tokenizer call answered or failed `round_trip_us` after it was sent.
    pub fn tokenizer_answered(&mut self, round_trip_us: u64) {
        self.tokenizer_wait.observe(round_trip_us);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_median_needs_enough_calls_ignores_a_slow_one_and_follows_a_lasting_change() {
        let mut w = TokenizerWait::default();
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
        assert_eq!(w.round_trips_us.len(), WINDOW);
    }
}
