//! The warning when an engine's block claims are rejected (their recomputed hashes differ from
//! the published ones, see `llmgw_core::mirror`): at most once per interval and engine, with how
//! many were rejected since the last warning, so a replica publishing forged or mis-seeded
//! stores cannot flood the log.

use llmgw_core::hash::BlockKey;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// One engine's claims as the mirror counts them.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineClaims {
    pub label: String,
    /// Rejected block claims so far.
    pub rejected: u64,
    /// The last mismatch: (published key, recomputed key).
    pub last_mismatch: Option<(BlockKey, BlockKey)>,
}

/// A warning due now.
#[derive(Debug, Clone, PartialEq)]
pub struct ClaimWarning {
    pub label: String,
    /// Rejected since the last warning about this engine.
    pub new: u64,
    pub total: u64,
    pub last_mismatch: Option<(BlockKey, BlockKey)>,
}

pub struct ClaimLog {
    every: Duration,
    /// label → (total at the last warning, when).
    warned: HashMap<String, (u64, Instant)>,
}

impl ClaimLog {
    pub fn new(every: Duration) -> ClaimLog {
        ClaimLog { every, warned: HashMap::new() }
    }

    /// The warnings due at `now` for these engines.
    pub fn due(&mut self, now: Instant, engines: impl IntoIterator<Item = EngineClaims>) -> Vec<ClaimWarning> {
        let mut out = Vec::new();
        for e in engines {
            let (logged, at) = match self.warned.get(&e.label) {
                // A smaller total: the engine's mirror was replaced; count from zero.
                Some(&(logged, at)) if e.rejected >= logged => (logged, Some(at)),
                _ => (0, None),
            };
            let quiet = at.is_some_and(|t| now.saturating_duration_since(t) < self.every);
            if e.rejected > logged && !quiet {
                out.push(ClaimWarning {
                    label: e.label.clone(),
                    new: e.rejected.saturating_sub(logged),
                    total: e.rejected,
                    last_mismatch: e.last_mismatch,
                });
                self.warned.insert(e.label, (e.rejected, now));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn engine(rejected: u64) -> EngineClaims {
        EngineClaims { label: "r0/0".to_owned(), rejected, last_mismatch: Some((BlockKey(1), BlockKey(2))) }
    }

    #[test]
    fn one_warning_per_interval_with_the_count_since_the_last() {
        let mut log = ClaimLog::new(Duration::from_secs(60));
        let t0 = Instant::now();
        assert!(log.due(t0, [engine(0)]).is_empty(), "nothing rejected");
        let w = log.due(t0, [engine(3)]);
        assert_eq!(w.len(), 1);
        assert_eq!((w[0].new, w[0].total), (3, 3));
        // A flood within the interval: silent.
        for n in 4..1000 {
            assert!(log.due(t0 + Duration::from_secs(1), [engine(n)]).is_empty());
        }
        let w = log.due(t0 + Duration::from_secs(61), [engine(1000)]);
        assert_eq!((w[0].new, w[0].total), (997, 1000));
        // No new rejection: silent even after the interval.
        assert!(log.due(t0 + Duration::from_secs(200), [engine(1000)]).is_empty());
        // The mirror was replaced (its counters restart): counted from zero.
        let w = log.due(t0 + Duration::from_secs(300), [engine(5)]);
        assert_eq!((w[0].new, w[0].total), (5, 5));
    }
}
