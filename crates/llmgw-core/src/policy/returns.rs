//! Work about to come back: requests that ended on a replica lately, whose conversation's next
//! request (an agent's next step, a user's next turn) may arrive while a new request's prefill
//! runs there, and wait behind it.
//!
//! The gateway learns how soon next requests follow: [`Gaps`] holds the times between a
//! request's end and the arrival of the next request extending its prompt, and the share of
//! requests no such request followed, fading by observation (so it follows the traffic, whatever
//! the fleet's speed). From it, each candidate carries the returns to expect within windows of
//! 1, 2, 4, … ms from now ([`Returning`]): for each request that ended there and has not come
//! back, the chance that it comes back within the window given that it has not yet.
//!
//! The `ttft` policy counts what a request's prefill would cost them: the returns expected
//! within the prefill's predicted time, each delayed by about that time. Traffic with human
//! think times (seconds) expects none within a prefill; a loop that sends its next request
//! milliseconds after the last answer expects one on the replica it just left.

/// Windows of `2^k` ms, `k` in `0..WINDOWS`: 1 ms to about 4 s.
pub const WINDOWS: usize = 13;
/// Gap buckets: `[0, 1)` ms, then `[2^(b−1), 2^b)` ms; the last holds everything longer
/// (about 2.3 hours and up).
pub const GAP_BUCKETS: usize = 24;
/// Observations the gaps remember (one counts half after about 0.69 × this many).
pub const MEMORY: f64 = 256.0;
/// Below this many observations nothing is expected: too few to tell a loop from people.
pub const MIN_OBSERVATIONS: f64 = 16.0;

/// The returns expected on one replica within each window (`within[k]`: within `2^k` ms).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Returning {
    /// From the requests answered there lately, not yet followed.
    pub within: [f32; WINDOWS],
    /// Requests there still computing their prefill. A new request's prefill starts after
    /// theirs; each comes back within the new one's prefill as a request comes back within
    /// that time of its first token (`after_first`).
    pub prefilling: u32,
    /// The chance that a request comes back within each window of its first token (learned
    /// over the fleet).
    pub after_first: [f32; WINDOWS],
}

/// A curve over the windows at `window_us`, interpolated on a log scale (a window under 1 ms
/// takes a share of the first).
fn at_window(curve: &[f32; WINDOWS], window_us: f64) -> f64 {
    if window_us.is_nan() || window_us <= 0.0 {
        return 0.0;
    }
    let ms = window_us / 1_000.0;
    let at = |k: usize| curve.get(k).map_or(0.0, |&v| if v.is_finite() && v > 0.0 { f64::from(v) } else { 0.0 });
    if ms <= 1.0 {
        return at(0) * ms;
    }
    let x = ms.log2();
    let last = WINDOWS.saturating_sub(1);
    if x >= last as f64 {
        return at(last);
    }
    let k = x.floor() as usize;
    let f = x - x.floor();
    at(k) * (1.0 - f) + at(k.saturating_add(1)) * f
}

impl Returning {
    /// The returns expected within a new request's prefill of `window_us`.
    pub fn expected_within(&self, window_us: f64) -> f64 {
        at_window(&self.within, window_us) + f64::from(self.prefilling) * at_window(&self.after_first, window_us)
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

    /// The weight of gaps up to `us`, the bucket holding it counted in proportion (the last
    /// bucket, unbounded, counts whole only past its start).
    fn mass_upto(&self, us: f64) -> f64 {
        let mut m = 0.0;
        for (b, &w) in self.buckets.iter().enumerate() {
            let (lo, hi) = bucket_bounds_us(b);
            let w = sane(w);
            if us >= hi && b.saturating_add(1) < GAP_BUCKETS {
                m += w;
            } else if us > lo {
                let share = if b.saturating_add(1) < GAP_BUCKETS { (us - lo) / (hi - lo) } else { 0.0 };
                m += w * share.clamp(0.0, 1.0);
                break;
            } else {
                break;
            }
        }
        m
    }

    /// The chance that a request that ended `elapsed_us` ago and has not come back comes back
    /// within the next `window_us`.
    pub fn chance(&self, elapsed_us: u64, window_us: u64) -> f64 {
        let total = self.total();
        if total < MIN_OBSERVATIONS {
            return 0.0;
        }
        let e = elapsed_us as f64;
        let before = self.mass_upto(e);
        let left = total - before;
        if left <= 0.0 {
            return 0.0;
        }
        ((self.mass_upto(e + window_us as f64) - before) / left).clamp(0.0, 1.0)
    }

    /// The chance, per window, that a request comes back within it (of its end or first token).
    pub fn from_start(&self) -> [f32; WINDOWS] {
        self.outlook(std::iter::once(0)).within
    }

    /// The returns expected within each window from requests that ended `elapsed_us` ago (one
    /// item per request).
    pub fn outlook(&self, elapsed_us: impl Iterator<Item = u64>) -> Returning {
        let mut r = Returning::default();
        if self.total() < MIN_OBSERVATIONS {
            return r;
        }
        for e in elapsed_us {
            for (k, w) in r.within.iter_mut().enumerate() {
                let window_us = 1_000u64.checked_shl(k as u32).unwrap_or(u64::MAX);
                *w += self.chance(e, window_us) as f32;
            }
        }
        r
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

    #[test]
    fn a_loop_returning_within_milliseconds_is_expected_soon_after_it_ended_and_not_later() {
        // Three in four requests followed 4-12 ms after the answer.
        let g = learned(&[4, 5, 5, 6, 8, 12], 2);
        let just_ended = g.chance(1_000, 400_000);
        assert!(just_ended > 0.7, "{just_ended}");
        // 50 ms on, whatever was coming has come: only the requests nobody followed are left.
        assert!(g.chance(50_000, 400_000) < 0.01);
        let r = g.outlook([1_000u64, 50_000].into_iter());
        let in_prefill = r.expected_within(400_000.0);
        assert!((0.7..1.01).contains(&in_prefill), "{in_prefill}");
        assert!(r.expected_within(1_000.0) < 0.1, "{}", r.expected_within(1_000.0));
    }

    #[test]
    fn people_thinking_for_seconds_are_not_expected_within_a_prefill() {
        let g = learned(&[3_000, 5_000, 9_000, 20_000, 60_000], 1);
        let r = g.outlook([2_000u64].into_iter());
        assert!(r.expected_within(400_000.0) < 0.02, "{}", r.expected_within(400_000.0));
        assert!(r.expected_within(4_000_000.0) > 0.1, "{}", r.expected_within(4_000_000.0));
    }

    #[test]
    fn nothing_is_expected_before_enough_is_known() {
        let mut g = Gaps::default();
        for _ in 0..10 {
            g.observe(Some(5_000));
        }
        assert_eq!(g.outlook([1_000u64].into_iter()), Returning::default());
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
        let r = Returning { within: [f32::NAN; WINDOWS], prefilling: 3, after_first: [f32::INFINITY; WINDOWS] };
        assert_eq!(r.expected_within(f64::NAN), 0.0);
        assert_eq!(r.expected_within(5e5), 0.0);
    }
}
