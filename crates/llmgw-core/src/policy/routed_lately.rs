//! Requests routed lately per replica ([`crate::policy::Candidate::recent`]): the counts a tie
//! between equally fast replicas is broken by. The filter keeps them in Envoy's shared data
//! (every worker's requests in one value), the endpoint picker in its memory; both by these rules.
//!
//! Each routed request multiplies every count by `1 − 1 / (MEMORY_PER_REPLICA × replicas)` and
//! adds 1 to its replica's: the counts fade by request, not by time, so they mean the same on a
//! fleet of any speed, and together they hold about the last [`MEMORY_PER_REPLICA`] requests per
//! replica. A count that has faded below [`FORGOTTEN`] goes (a replica no longer routed to), and
//! at most [`MAX_RECORDS`] are kept (the smallest go first).

/// At most this many replicas' counts are kept.
pub const MAX_RECORDS: usize = 256;
/// Requests per replica the counts remember (a request counts half after about 0.69 × this
/// many per replica). Counted in requests, so no figure of any fleet's speed: long enough that a
/// difference of a fifth in the replicas' shares is several requests (well past the rounding
/// the policy compares them with), short enough to follow a change in traffic within a few
/// hundred requests.
pub const MEMORY_PER_REPLICA: f64 = 32.0;
/// A count below this is dropped.
pub const FORGOTTEN: f64 = 0.01;

/// One replica's count (its id: the keeper's own id of its address).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Count {
    pub id: u64,
    pub count: f64,
}

/// A count as read back: finite and non-negative, or 0.
pub fn sane(v: f64) -> f64 {
    if v.is_finite() && v > 0.0 {
        v
    } else {
        0.0
    }
}

/// One request more routed to `id`.
pub fn routed(counts: &mut Vec<Count>, id: u64) {
    for c in counts.iter_mut() {
        c.count = sane(c.count);
    }
    if !counts.iter().any(|c| c.id == id) {
        counts.push(Count { id, count: 0.0 });
    }
    let replicas = counts.len().max(1) as f64;
    let keep = 1.0 - 1.0 / (MEMORY_PER_REPLICA * replicas);
    for c in counts.iter_mut() {
        c.count = c.count * keep + if c.id == id { 1.0 } else { 0.0 };
    }
    counts.retain(|c| c.count >= FORGOTTEN);
    if counts.len() > MAX_RECORDS {
        counts.sort_by(|a, b| b.count.total_cmp(&a.count));
        counts.truncate(MAX_RECORDS);
    }
}

#[cfg(test)]
#[allow(clippy::arithmetic_side_effects)]
mod tests {
    use super::*;

    fn of(counts: &[Count], id: u64) -> f64 {
        counts.iter().find(|c| c.id == id).map_or(0.0, |c| c.count)
    }

    #[test]
    fn counts_follow_the_requests_routed_and_fade_by_request() {
        let mut counts = Vec::new();
        for _ in 0..30 {
            routed(&mut counts, 1);
        }
        assert!(of(&counts, 1) > 15.0 && of(&counts, 1) <= 30.0, "{}", of(&counts, 1));
        // Traffic moves to 2: 1's count fades while 2's grows, whatever the time.
        for _ in 0..200 {
            routed(&mut counts, 2);
        }
        assert!(of(&counts, 1) < 1.0 && of(&counts, 2) > 40.0 && of(&counts, 2) <= 2.0 * MEMORY_PER_REPLICA);
        // Long unused, 1's record goes.
        for _ in 0..2000 {
            routed(&mut counts, 2);
        }
        assert_eq!(counts.len(), 1);
    }

    #[test]
    fn records_are_bounded_and_bad_values_count_as_zero() {
        let mut counts = Vec::new();
        for i in 0..(MAX_RECORDS as u64 + 10) {
            routed(&mut counts, i);
        }
        assert_eq!(counts.len(), MAX_RECORDS);
        assert!(counts.iter().any(|c| c.id == MAX_RECORDS as u64 + 9), "the most recent survive");
        let mut bad = vec![Count { id: 1, count: f64::NAN }, Count { id: 2, count: -5.0 }];
        routed(&mut bad, 3);
        assert_eq!(bad.iter().map(|c| c.id).collect::<Vec<_>>(), vec![3]);
    }
}
