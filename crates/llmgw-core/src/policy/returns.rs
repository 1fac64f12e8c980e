//! Work about to come back: requests that ended on a replica lately, whose conversation's next
//! request (an agent's next step, a user's next turn) may arrive while a new request's prefill
//! runs there, and wait behind it.
//!
//! The gateway learns how soon next requests follow: [`Gaps`] holds the times between a
//! request's end and the arrival of the next request extending its prompt, and the share of
//! requests no such request followed, fading by observation (so it follows the traffic, whatever
//! the fleet's speed). From it, each candidate carries what the returns to expect on it are
//! computed from ([`Returning`]): for each request answered there that has not come back, the
//! chance that it comes back within a window given that it has not yet.
//!
//! The `ttft` policy counts what a request's prefill would cost them: the returns expected
//! within the prefill's predicted time, each delayed by about that time. Traffic with human
//! think times (seconds) expects none within a prefill; a loop that sends its next request
//! milliseconds after the last answer expects one on the replica it just left.

use std::sync::Arc;

/// The requests answered lately on a replica that are kept: those answered last there. What is
/// learned is how soon a next request follows before this many more are answered there, and
/// that is what is predicted.
pub const MAX_ANSWERED: usize = 4;
/// Gap buckets: `[0, 1)` ms, then `[2^(b−1), 2^b)` ms; the last holds everything longer
/// (about 2.3 hours and up).
pub const GAP_BUCKETS: usize = 24;
/// Observations the gaps remember (one counts half after about 0.69 × this many).
pub const MEMORY: f64 = 256.0;
/// Below this many observations nothing is expected: too few to tell a loop from people.
pub const MIN_OBSERVATIONS: f64 = 16.0;

/// A request answered on a replica and not yet followed: the time since its end, or since its
/// first token while it streams (µs).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Answered {
    pub since_us: u64,
    pub ended: bool,
}

/// The gaps learned from the first token and from the end, summed for lookups; shared by every
/// candidate of a decision.
#[derive(Debug, Clone, PartialEq)]
pub struct ReturnCurves {
    from_first: Option<Cumulative>,
    from_end: Option<Cumulative>,
}

impl ReturnCurves {
    pub fn new(from_first: &Gaps, from_end: &Gaps) -> ReturnCurves {
        ReturnCurves { from_first: Cumulative::of(from_first), from_end: Cumulative::of(from_end) }
    }
}

/// The requests expected back on one replica: computed only for the windows a decision asks.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Returning {
    /// The requests answered there lately and not yet followed (the first `count`).
    pub answered: [Answered; MAX_ANSWERED],
    pub count: usize,
    /// Requests there still computing their prefill. A new request's prefill starts after
    /// theirs; each comes back within the new one's prefill as a request comes back within
    /// that time of its first token.
    pub prefilling: u32,
    /// What was learned (none: nothing is expected).
    pub curves: Option<Arc<ReturnCurves>>,
}

impl Returning {
    /// The returns expected within a new request's prefill of `window_us`: for each request,
    /// the chance that it comes back within the window given that it has not yet.
    pub fn expected_within(&self, window_us: f64) -> f64 {
        let Some(c) = &self.curves else { return 0.0 };
        if window_us.is_nan() || window_us <= 0.0 {
            return 0.0;
        }
        let w = window_us as u64;
        let chance = |curve: &Option<Cumulative>, since: u64| curve.as_ref().map_or(0.0, |k| k.chance(since, w));
        let answered: f64 = self
            .answered
            .iter()
            .take(self.count)
            .map(|a| chance(if a.ended { &c.from_end } else { &c.from_first }, a.since_us))
            .sum();
        answered + f64::from(self.prefilling) * chance(&c.from_first, 0)
    }
}

/// How soon next requests followed the requests that ended, learned from observations.
#[derive(Debug, Clone, PartialEq)]
pub struct Gaps {
    /// Fading counts of gaps per bucket.
    pub buckets: [f64; GAP_BUCKETS],
    /// Fading count of requests no next request followed.
    pub never: f64,
}

impl Default for Gaps {
    fn default() -> Self {
        Gaps { buckets: [0.0; GAP_BUCKETS], never: 0.0 }
    }
}

/// The bucket of a gap, and where it begins and ends (µs).
fn bucket_of(gap_us: u64) -> usize {
    let ms = gap_us / 1_000;
    if ms == 0 {
        return 0;
    }
    // ms in [2^(b−1), 2^b): b = bits of ms.
    let b = u64::BITS.saturating_sub(ms.leading_zeros()) as usize;
    b.min(GAP_BUCKETS.saturating_sub(1))
}

fn bucket_bounds_us(b: usize) -> (f64, f64) {
    if b == 0 {
        return (0.0, 1_000.0);
    }
    let lo = 2f64.powi(b.saturating_sub(1) as i32) * 1_000.0;
    (lo, lo * 2.0)
}

impl Gaps {
    /// One observation: a next request `Some(gap)` after its predecessor ended, or `None`: no
    /// next request followed.
    pub fn observe(&mut self, gap_us: Option<u64>) {
        let keep = 1.0 - 1.0 / MEMORY;
        for b in self.buckets.iter_mut() {
            *b = sane(*b) * keep;
        }
        self.never = sane(self.never) * keep;
        match gap_us {
            Some(g) => {
                if let Some(b) = self.buckets.get_mut(bucket_of(g)) {
                    *b += 1.0;
                }
            }
            None => self.never += 1.0,
        }
    }

    /// Every observation's weight.
    pub fn total(&self) -> f64 {
        self.buckets.iter().map(|&b| sane(b)).sum::<f64>() + sane(self.never)
    }

    /// The chance that a request that ended `elapsed_us` ago and has not come back comes back
    /// within the next `window_us` (0 below [`MIN_OBSERVATIONS`]).
    pub fn chance(&self, elapsed_us: u64, window_us: u64) -> f64 {
        Cumulative::of(self).map_or(0.0, |c| c.chance(elapsed_us, window_us))
    }
}

/// The gaps' weights summed up to each bucket, so that a chance costs two lookups.
#[derive(Debug, Clone, PartialEq)]
struct Cumulative {
    /// `below[b]`: the weight of the buckets before `b`.
    below: [f64; GAP_BUCKETS],
    weights: [f64; GAP_BUCKETS],
    total: f64,
}

impl Cumulative {
    /// `None` below [`MIN_OBSERVATIONS`].
    fn of(g: &Gaps) -> Option<Cumulative> {
        let mut c = Cumulative { below: [0.0; GAP_BUCKETS], weights: [0.0; GAP_BUCKETS], total: 0.0 };
        let mut sum = 0.0;
        for ((below, weight), &w) in c.below.iter_mut().zip(c.weights.iter_mut()).zip(g.buckets.iter()) {
            *below = sum;
            *weight = sane(w);
            sum += *weight;
        }
        c.total = sum + sane(g.never);
        (c.total >= MIN_OBSERVATIONS).then_some(c)
    }

    /// The weight of gaps up to `us`, the bucket holding it counted in proportion (the last
    /// bucket, unbounded, counts whole only past its start).
    fn upto(&self, us: f64) -> f64 {
        let b = bucket_of(us as u64);
        let (lo, hi) = bucket_bounds_us(b);
        let below = self.below.get(b).copied().unwrap_or(0.0);
        let w = self.weights.get(b).copied().unwrap_or(0.0);
        let share = if b.saturating_add(1) < GAP_BUCKETS { ((us - lo) / (hi - lo)).clamp(0.0, 1.0) } else { 0.0 };
        below + w * share
    }

    fn chance(&self, elapsed_us: u64, window_us: u64) -> f64 {
        let e = elapsed_us as f64;
        let before = self.upto(e);
        let left = self.total - before;
        if left <= 0.0 {
            return 0.0;
        }
        ((self.upto(e + window_us as f64) - before) / left).clamp(0.0, 1.0)
    }
}

/// A count read from shared data: finite and non-negative, or 0.
fn sane(v: f64) -> f64 {
    if v.is_finite() && v > 0.0 {
        v
    } else {
        0.0
    }
}

#[cfg(test)]
#[allow(clippy::arithmetic_side_effects)]
mod tests {
    use super::*;

    fn learned(gaps_ms: &[u64], never: usize) -> Gaps {
        let mut g = Gaps::default();
        for _ in 0..8 {
            for &ms in gaps_ms {
                g.observe(Some(ms * 1_000));
            }
            for _ in 0..never {
                g.observe(None);
            }
        }
        g
    }

    /// Requests that ended `since_us` ago, the gaps from their end `g`.
    fn ended(g: &Gaps, since_us: &[u64]) -> Returning {
        let mut r = Returning { curves: Some(Arc::new(ReturnCurves::new(&Gaps::default(), g))), ..Default::default() };
        for (a, &us) in r.answered.iter_mut().zip(since_us) {
            *a = Answered { since_us: us, ended: true };
        }
        r.count = since_us.len().min(MAX_ANSWERED);
        r
    }

    #[test]
    fn a_loop_returning_within_milliseconds_is_expected_soon_after_it_ended_and_not_later() {
        // Three in four requests followed 4-12 ms after the answer.
        let g = learned(&[4, 5, 5, 6, 8, 12], 2);
        let just_ended = g.chance(1_000, 400_000);
        assert!(just_ended > 0.7, "{just_ended}");
        // 50 ms on, whatever was coming has come: only the requests nobody followed are left.
        assert!(g.chance(50_000, 400_000) < 0.01);
        let r = ended(&g, &[1_000, 50_000]);
        let in_prefill = r.expected_within(400_000.0);
        assert!((0.7..1.01).contains(&in_prefill), "{in_prefill}");
        assert!(r.expected_within(1_000.0) < 0.1, "{}", r.expected_within(1_000.0));
    }

    #[test]
    fn requests_still_computing_their_prefill_come_back_as_from_a_first_token() {
        // Each request followed 40 ms after its first token.
        let first = learned(&[40, 40, 40], 0);
        let curves = Some(Arc::new(ReturnCurves::new(&first, &Gaps::default())));
        let r = Returning { prefilling: 2, curves, ..Default::default() };
        let within = r.expected_within(300_000.0);
        assert!((1.9..2.01).contains(&within), "{within}");
        assert!(r.expected_within(10_000.0) < 0.01);
    }

    #[test]
    fn people_thinking_for_seconds_are_not_expected_within_a_prefill() {
        let g = learned(&[3_000, 5_000, 9_000, 20_000, 60_000], 1);
        let r = ended(&g, &[2_000]);
        assert!(r.expected_within(400_000.0) < 0.02, "{}", r.expected_within(400_000.0));
        assert!(r.expected_within(4_000_000.0) > 0.1, "{}", r.expected_within(4_000_000.0));
    }

    #[test]
    fn nothing_is_expected_before_enough_is_known() {
        let mut g = Gaps::default();
        for _ in 0..10 {
            g.observe(Some(5_000));
        }
        assert_eq!(ended(&g, &[1_000]).expected_within(400_000.0), 0.0);
        assert_eq!(Returning::default().expected_within(1e6), 0.0);
    }

    #[test]
    fn the_memory_fades_so_a_change_of_traffic_is_followed() {
        let mut g = learned(&[5], 0);
        for _ in 0..(4.0 * MEMORY) as usize {
            g.observe(None);
        }
        assert!(g.chance(1_000, 400_000) < 0.05, "{}", g.chance(1_000, 400_000));
    }

    #[test]
    fn hostile_values_read_from_shared_data_count_nothing() {
        let mut g = Gaps { buckets: [f64::NAN; GAP_BUCKETS], never: f64::INFINITY };
        assert_eq!(g.total(), 0.0);
        g.observe(Some(u64::MAX));
        assert!(g.total() > 0.99 && g.total() < 1.01);
        assert_eq!(bucket_of(u64::MAX), GAP_BUCKETS - 1);
        let r = ended(&learned(&[5, 5, 5], 0), &[u64::MAX, 0]);
        assert!(r.expected_within(5e5) > 0.9);
        assert_eq!(r.expected_within(f64::NAN), 0.0);
        assert!(r.expected_within(f64::INFINITY) <= 2.0);
        let r = Returning { count: usize::MAX, ..r };
        assert!(r.expected_within(5e5) <= MAX_ANSWERED as f64);
    }
}
