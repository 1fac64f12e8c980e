//! Rates learned from the fleet: per replica, how the observed time to first token (the
//! decision to the replica's first streamed chunk) depends on the `ttft` policy's components.
//!
//! The model is `ttft = base + prefill × uncached + queued × queued_tokens + request × requests`
//! ([`Features`], [`Rates`]). Each replica keeps exponentially weighted sufficient statistics
//! of its observations ([`Estimator`]: `Σ λᵏ x xᵀ`, `Σ λᵏ x y`, `Σ λᵏ`, 16 numbers), with
//! `λ = 1 − 1/memory`, so an observation counts half after `0.69 × memory` requests. The rates
//! are the ridge solution pulled toward the profile's rates (the prior) with the weight of
//! `prior_weight` observations per component, every rate kept ≥ 0 (a component solved negative
//! is fixed at 0 and the rest solved again). Outliers are clipped: past `CLIP` × the running
//! mean absolute residual, an observation counts as if it lay at that bound (a Huber-like
//! influence). The mean absolute residual follows the residuals within the bound, and each
//! clipped one widens the bound by half: one outlier moves the rates little, while a replica
//! that really slows down widens it within a few requests and is followed.

/// Components a prediction multiplies: `[1, uncached, queued_tokens, requests]`.
pub const N: usize = 4;
/// Upper-triangle entries of an `N × N` symmetric matrix.
pub const TRI: usize = 10;
/// Residuals past this many mean absolute residuals are clipped.
pub const CLIP: f64 = 3.0;
/// How much the clipping bound widens at each clipped observation.
const GROWTH: f64 = 1.5;
/// Observations before clipping starts (the scale of residuals is known by then).
const WARMUP: u32 = 8;
/// The `(row, column)` of each upper-triangle entry, row by row.
const TRI_AT: [(usize, usize); TRI] = [(0, 0), (0, 1), (0, 2), (0, 3), (1, 1), (1, 2), (1, 3), (2, 2), (2, 3), (3, 3)];

type Mat = [[f64; N]; N];

/// What a prediction is made of, for one replica and one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Features {
    /// The request's prompt tokens past the leading blocks the replica holds.
    pub uncached: u64,
    /// Prefill tokens of this gateway's requests there still without a first token.
    pub queued_tokens: u64,
    /// Requests a new one queues behind there ([`super::Candidate::queued_requests`]).
    pub requests: u64,
}

impl Features {
    fn x(&self) -> [f64; N] {
        [1.0, self.uncached as f64, self.queued_tokens as f64, self.requests as f64]
    }
}

/// Rates a prediction multiplies the components by (µs).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rates {
    /// What every request waits whatever the load (an engine step, the network).
    pub base_us: f64,
    pub prefill_us_per_token: f64,
    /// Per prefill token queued there by this gateway.
    pub queued_us_per_token: f64,
    /// Per request a new one queues behind.
    pub request_us: f64,
    /// The observations behind these rates (0: the profile's rates).
    pub observations: u32,
    /// How far off a prediction from these rates typically is: the running mean absolute
    /// residual of the observations behind them (µs; 0 for the profile's rates).
    pub residual_us: f64,
    /// How long before they were read their last observation came (ns; 0 for the profile's
    /// rates and as they are learned): rates quiet past [`Learning::forget_ns`] are forgotten.
    pub quiet_ns: u64,
}

impl Rates {
    fn theta(&self) -> [f64; N] {
        [self.base_us, self.prefill_us_per_token, self.queued_us_per_token, self.request_us]
    }

    fn from_theta(t: [f64; N], observations: u32, residual_us: f64) -> Rates {
        let [base_us, prefill_us_per_token, queued_us_per_token, request_us] = t;
        let residual_us = if residual_us.is_finite() { residual_us.max(0.0) } else { 0.0 };
        Rates { base_us, prefill_us_per_token, queued_us_per_token, request_us, observations, residual_us, quiet_ns: 0 }
    }

    /// The explain header's part: `rates=profile`, or the learned rates and how many
    /// observations they rest on.
    pub fn explain(&self) -> String {
        if self.observations == 0 {
            return "rates=profile".to_owned();
        }
        format!(
            "rates=learned/{} base_ms={:.1} prefill_us={:.1} queued_us={:.1} request_ms={:.1}",
            self.observations,
            self.base_us / 1000.0,
            self.prefill_us_per_token,
            self.queued_us_per_token,
            self.request_us / 1000.0
        )
    }

    /// Whether `residual_us` says how far off these rates' predictions typically are: they rest
    /// on `WARMUP` (8) observations or more. Before, it rests on too few residuals, each measured
    /// against rates that moved with every observation (the profile's rates have none).
    pub fn residual_known(&self) -> bool {
        self.observations >= WARMUP
    }

    /// Predicted time to first token (µs).
    pub fn predict(&self, f: &Features) -> f64 {
        dot(&self.theta(), &f.x())
    }
}

/// What a decision's prediction for its winner rested on: what the observed time to first
/// token is learned against.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Basis {
    pub features: Features,
    /// The rates the prediction used (learned, or the profile's).
    pub rates: Rates,
    /// The profile's rates (the prior) and how it learns.
    pub prior: Rates,
    pub learning: Learning,
}

impl Basis {
    /// This basis for a request routed on an estimate of `estimated` prompt tokens whose
    /// tokens, counted since, are `tokens`: its uncached tokens moved by the difference.
    pub fn corrected(mut self, tokens: u64, estimated: u64) -> Basis {
        let u = self.features.uncached;
        self.features.uncached = match tokens.checked_sub(estimated) {
            Some(more) => u.saturating_add(more),
            None => u.saturating_sub(estimated.saturating_sub(tokens)),
        };
        self
    }
}

/// How rates are learned (`profiles[].weights`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Learning {
    /// Learn at all (otherwise the profile's rates are used as they are).
    pub enabled: bool,
    /// The prior's weight, in observations per component.
    pub prior_weight: f64,
    /// Requests over which observations fade (`λ = 1 − 1/memory`).
    pub memory: f64,
    /// How long a replica's rates are kept without an observation (ns; 0: for good). A replica
    /// whose rates predict it slower than its peers gets no request to correct them: after a
    /// slow spell it would be left out for good. Past this, its rates are forgotten: it is
    /// predicted at the profile's rates (a new prefix's places then go by their loads until it
    /// has [`WARMUP`] observations again), and its next observation starts them afresh.
    pub forget_ns: u64,
}

/// The shipped [`Learning::forget_ns`]: 30 s. A replica that takes a steady share of a fleet's
/// streamed traffic is observed far more often than that, so its rates are kept while it
/// serves. A replica left out is tried again within half a minute. If it is still slow, that
/// costs a request or a few, twice a minute at most.
pub const FORGET_NS: u64 = 30_000_000_000;

impl Default for Learning {
    fn default() -> Self {
        Learning { enabled: true, prior_weight: 1.0, memory: 50.0, forget_ns: FORGET_NS }
    }
}

impl Learning {
    /// Whether rates last observed `quiet_ns` ago are forgotten.
    pub fn forgets(&self, quiet_ns: u64) -> bool {
        self.forget_ns > 0 && quiet_ns > self.forget_ns
    }
}

/// One replica's observations, exponentially weighted.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Estimator {
    /// `Σ λᵏ x xᵀ`, upper triangle row by row.
    pub xx: [f64; TRI],
    /// `Σ λᵏ x y`.
    pub xy: [f64; N],
    /// `Σ λᵏ`: the observations' weight.
    pub weight: f64,
    /// The running mean absolute residual (µs).
    pub scale: f64,
    /// Observations so far (saturating).
    pub count: u32,
}

fn dot(a: &[f64; N], b: &[f64; N]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

fn at(m: &Mat, i: usize, j: usize) -> f64 {
    m.get(i).and_then(|r| r.get(j)).copied().unwrap_or(0.0)
}

fn put(m: &mut Mat, i: usize, j: usize, v: f64) {
    if let Some(x) = m.get_mut(i).and_then(|r| r.get_mut(j)) {
        *x = v;
    }
}

fn item(v: &[f64; N], i: usize) -> f64 {
    v.get(i).copied().unwrap_or(0.0)
}

fn put_item(v: &mut [f64; N], i: usize, x: f64) {
    if let Some(e) = v.get_mut(i) {
        *e = x;
    }
}

/// `a x = b` for a symmetric positive definite `a` (Cholesky); `None` when it is not.
fn solve_spd(a: &Mat, b: &[f64; N]) -> Option<[f64; N]> {
    let mut l: Mat = [[0.0; N]; N];
    for i in 0..N {
        for j in 0..=i {
            let s = at(a, i, j) - (0..j).map(|k| at(&l, i, k) * at(&l, j, k)).sum::<f64>();
            if i == j {
                if !(s > 0.0 && s.is_finite()) {
                    return None;
                }
                put(&mut l, i, i, s.sqrt());
            } else {
                let v = s / at(&l, j, j);
                put(&mut l, i, j, v);
            }
        }
    }
    let mut y = [0.0; N];
    for i in 0..N {
        let s = item(b, i) - (0..i).map(|k| at(&l, i, k) * item(&y, k)).sum::<f64>();
        put_item(&mut y, i, s / at(&l, i, i));
    }
    let mut x = [0.0; N];
    for i in (0..N).rev() {
        let s = item(&y, i) - (i..N).skip(1).map(|k| at(&l, k, i) * item(&x, k)).sum::<f64>();
        put_item(&mut x, i, s / at(&l, i, i));
    }
    x.iter().all(|v| v.is_finite()).then_some(x)
}

impl Estimator {
    fn matrix(&self) -> Mat {
        let mut m: Mat = [[0.0; N]; N];
        for (&(i, j), &v) in TRI_AT.iter().zip(&self.xx) {
            put(&mut m, i, j, v);
            put(&mut m, j, i, v);
        }
        m
    }

    /// The rates these observations give with `prior`; the prior itself before any.
    pub fn rates(&self, prior: &Rates, learning: &Learning) -> Rates {
        if self.count == 0 || self.weight <= 0.0 {
            return *prior;
        }
        let xx = self.matrix();
        let theta0 = prior.theta();
        // The prior weighs as much as `prior_weight` observations tell about each rate: its
        // component's variance over the observations (the base's: 1). A component that never
        // varied keeps the prior's rate.
        let lambda0: [f64; N] = std::array::from_fn(|j| {
            let mean = at(&xx, 0, j) / self.weight;
            let spread = if j == 0 { 1.0 } else { at(&xx, j, j) / self.weight - mean * mean };
            learning.prior_weight.max(1e-9) * spread.max(1.0)
        });
        let mut free = [true; N];
        for _ in 0..N {
            let mut a: Mat = [[0.0; N]; N];
            let mut b = [0.0; N];
            for i in 0..N {
                if !free.get(i).copied().unwrap_or(false) {
                    put(&mut a, i, i, 1.0);
                    continue;
                }
                for j in 0..N {
                    if free.get(j).copied().unwrap_or(false) {
                        put(&mut a, i, j, at(&xx, i, j));
                    }
                }
                let l0 = item(&lambda0, i);
                let v = at(&a, i, i) + l0;
                put(&mut a, i, i, v);
                put_item(&mut b, i, item(&self.xy, i) + l0 * item(&theta0, i));
            }
            let Some(theta) = solve_spd(&a, &b) else { return *prior };
            // Every rate ≥ 0: the most negative is fixed at 0 and the rest solved again.
            let worst = theta.iter().enumerate().filter(|(_, v)| **v < 0.0).min_by(|a, b| a.1.total_cmp(b.1));
            match worst {
                Some((j, _)) => {
                    if let Some(f) = free.get_mut(j) {
                        *f = false;
                    }
                }
                None => return Rates::from_theta(theta, self.count, self.scale),
            }
        }
        Rates::from_theta([0.0; N], self.count, self.scale)
    }

    /// One observed time to first token `ttft_us` of a request predicted from `f`; `current`:
    /// the rates before it (what its residual is measured against).
    pub fn observe(&mut self, f: &Features, ttft_us: f64, current: &Rates, learning: &Learning) {
        if !ttft_us.is_finite() || ttft_us < 0.0 {
            return;
        }
        let x = f.x();
        let predicted = current.predict(f);
        let residual = ttft_us - predicted;
        let bound = CLIP * self.scale;
        let outlier = self.count >= WARMUP && residual.abs() > bound;
        let clipped = if outlier { bound.copysign(residual) } else { residual };
        let y = predicted + clipped;
        if outlier {
            // One outlier widens the bound a little; a run of them (the replica really slowed
            // down) widens it geometrically, and it is followed within a few requests.
            self.scale *= GROWTH;
        } else {
            // The scale follows the residuals: quickly at first, then over `memory / 5`.
            let alpha = (1.0 / f64::from(self.count.saturating_add(1))).max(5.0 / learning.memory.max(5.0));
            self.scale += alpha * (residual.abs() - self.scale);
        }
        let decay = 1.0 - 1.0 / learning.memory.max(1.0);
        for (v, &(i, j)) in self.xx.iter_mut().zip(&TRI_AT) {
            *v = *v * decay + item(&x, i) * item(&x, j);
        }
        for (v, xi) in self.xy.iter_mut().zip(x) {
            *v = *v * decay + xi * y;
        }
        self.weight = self.weight * decay + 1.0;
        self.count = self.count.saturating_add(1);
    }

    /// One observed time to first token `ttft_us` of a request predicted on `basis`, measured
    /// against the rates these observations gave before it; the rates they give now. `quiet_ns`:
    /// how long ago the observation before it came; past [`Learning::forget_ns`] the earlier
    /// ones are forgotten and this one starts afresh from the prior.
    pub fn teach(&mut self, basis: &Basis, ttft_us: f64, quiet_ns: u64) -> Rates {
        if basis.learning.forgets(quiet_ns) {
            *self = Estimator::default();
        }
        let current = self.rates(&basis.prior, &basis.learning);
        self.observe(&basis.features, ttft_us, &current, &basis.learning);
        self.rates(&basis.prior, &basis.learning)
    }
}

#[cfg(test)]
#[allow(clippy::arithmetic_side_effects, clippy::indexing_slicing)]
mod tests {
    use super::*;

    const TRUE: Rates = Rates {
        base_us: 6_000.0,
        prefill_us_per_token: 120.0,
        queued_us_per_token: 0.0,
        request_us: 9_000.0,
        observations: 0,
        residual_us: 0.0,
        quiet_ns: 0,
    };
    /// Four times off in every rate.
    const WRONG: Rates = Rates {
        base_us: 24_000.0,
        prefill_us_per_token: 30.0,
        queued_us_per_token: 480.0,
        request_us: 36_000.0,
        observations: 0,
        residual_us: 0.0,
        quiet_ns: 0,
    };

    /// A small deterministic generator (no clock, no randomness between runs).
    struct Lcg(u64);
    impl Lcg {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            self.0 >> 33
        }
        fn features(&mut self) -> Features {
            Features { uncached: self.next() % 1200, queued_tokens: self.next() % 600, requests: self.next() % 6 }
        }
        /// ±5 % noise.
        fn noisy(&mut self, v: f64) -> f64 {
            v * (0.95 + (self.next() % 1000) as f64 / 10_000.0)
        }
    }

    fn feed(e: &mut Estimator, rng: &mut Lcg, truth: &Rates, prior: &Rates, n: usize) {
        let l = Learning::default();
        for _ in 0..n {
            let f = rng.features();
            let y = rng.noisy(truth.predict(&f));
            let current = e.rates(prior, &l);
            e.observe(&f, y, &current, &l);
        }
    }

    fn close(got: f64, want: f64, tol: f64) -> bool {
        (got - want).abs() <= tol * want.abs().max(1.0)
    }

    fn assert_near(r: &Rates, truth: &Rates, tol: f64) {
        assert!(close(r.prefill_us_per_token, truth.prefill_us_per_token, tol), "{r:?} vs {truth:?}");
        assert!(close(r.request_us, truth.request_us, tol), "{r:?} vs {truth:?}");
        // A rate that is 0 in truth: within a share of what one token would cost.
        assert!((r.queued_us_per_token - truth.queued_us_per_token).abs() <= tol * truth.prefill_us_per_token, "{r:?}");
        // Predictions over the range seen match the truth's.
        let f = Features { uncached: 800, queued_tokens: 300, requests: 3 };
        assert!(close(r.predict(&f), truth.predict(&f), tol), "{r:?} vs {truth:?}");
    }

    #[test]
    fn an_observation_after_a_quiet_past_forget_ns_starts_the_rates_afresh() {
        // Sixty observations of a replica four times slower than the profile says.
        let learning = Learning::default();
        let slow = |f: &Features| 4.0 * TRUE.predict(f);
        let basis = |features| Basis { features, rates: TRUE, prior: TRUE, learning };
        let (mut e, mut rng) = (Estimator::default(), Lcg(7));
        for _ in 0..60 {
            let f = rng.features();
            e.teach(&basis(f), slow(&f), 1_000_000);
        }
        let f = Features { uncached: 800, queued_tokens: 0, requests: 0 };
        // It recovered; the first observation since says so. Within `forget_ns` of the one
        // before it, it is one of 61 and moves the rates little.
        let mut kept = e;
        let r = kept.teach(&basis(f), TRUE.predict(&f), learning.forget_ns);
        assert_eq!(r.observations, 61);
        assert!(r.predict(&f) > 2.5 * TRUE.predict(&f), "{r:?}");
        // Past it, the earlier ones are forgotten: it starts again from the prior.
        let r = e.teach(&basis(f), TRUE.predict(&f), learning.forget_ns + 1);
        assert_eq!(r.observations, 1);
        assert!(close(r.predict(&f), TRUE.predict(&f), 0.05), "{r:?}");
        // Rates quiet that long are forgotten where they are read too.
        assert!(!learning.forgets(learning.forget_ns) && learning.forgets(learning.forget_ns + 1));
        assert!(!Learning { forget_ns: 0, ..learning }.forgets(u64::MAX), "0: kept for good");
    }

    #[test]
    fn before_any_observation_the_prior_is_used() {
        let e = Estimator::default();
        assert_eq!(e.rates(&WRONG, &Learning::default()), WRONG);
    }

    #[test]
    fn the_rates_converge_from_a_prior_four_times_off_within_a_hundred_requests() {
        for prior in [
            WRONG,
            Rates {
                base_us: 1_500.0,
                prefill_us_per_token: 480.0,
                queued_us_per_token: 0.0,
                request_us: 2_250.0,
                observations: 0,
                residual_us: 0.0,
                quiet_ns: 0,
            },
        ] {
            let mut e = Estimator::default();
            let mut rng = Lcg(7);
            feed(&mut e, &mut rng, &TRUE, &prior, 100);
            assert_near(&e.rates(&prior, &Learning::default()), &TRUE, 0.15);
        }
    }

    #[test]
    fn a_replica_that_slows_down_is_followed() {
        let mut e = Estimator::default();
        let mut rng = Lcg(11);
        feed(&mut e, &mut rng, &TRUE, &TRUE, 200);
        let slow = Rates {
            base_us: TRUE.base_us * 3.0,
            prefill_us_per_token: TRUE.prefill_us_per_token * 3.0,
            request_us: TRUE.request_us * 3.0,
            ..TRUE
        };
        // Within a memory's worth of requests the estimate is most of the way there...
        feed(&mut e, &mut rng, &slow, &TRUE, 50);
        let r = e.rates(&TRUE, &Learning::default());
        assert!(r.prefill_us_per_token > 2.0 * TRUE.prefill_us_per_token, "{r:?}");
        // ...and close within two.
        feed(&mut e, &mut rng, &slow, &TRUE, 50);
        assert_near(&e.rates(&TRUE, &Learning::default()), &slow, 0.2);
    }

    #[test]
    fn an_outlier_moves_the_rates_little() {
        let mut e = Estimator::default();
        let mut rng = Lcg(3);
        feed(&mut e, &mut rng, &TRUE, &TRUE, 150);
        let l = Learning::default();
        let before = e.rates(&TRUE, &l);
        let f = Features { uncached: 500, queued_tokens: 0, requests: 1 };
        // A request stuck for 30 s (a stalled connection, a preempted sequence).
        e.observe(&f, 30_000_000.0, &before, &l);
        let after = e.rates(&TRUE, &l);
        assert!(close(after.predict(&f), before.predict(&f), 0.1), "{before:?} → {after:?}");
        assert_near(&after, &TRUE, 0.15);
        // Unclipped, the same observation would have swamped them.
        let mut raw = e;
        raw.count = 1;
        raw.observe(&f, 30_000_000.0, &before, &l);
        let swamped = raw.rates(&TRUE, &l).predict(&f);
        assert!(swamped > 3.0 * before.predict(&f), "{swamped}");
    }

    #[test]
    fn a_component_never_seen_keeps_the_priors_rate_and_none_goes_negative() {
        let mut e = Estimator::default();
        let l = Learning::default();
        // Queued tokens always 0; the truth has a negative slope in requests (a fluke).
        for i in 0..100u64 {
            let f = Features { uncached: (i * 37) % 1000, queued_tokens: 0, requests: i % 4 };
            let y = 5_000.0 + 100.0 * f.uncached as f64 - 500.0 * f.requests as f64;
            let cur = e.rates(&WRONG, &l);
            e.observe(&f, y, &cur, &l);
        }
        let r = e.rates(&WRONG, &l);
        assert!(close(r.queued_us_per_token, WRONG.queued_us_per_token, 0.01), "{r:?}");
        assert!(r.request_us >= 0.0 && r.base_us >= 0.0 && r.prefill_us_per_token > 80.0, "{r:?}");
    }

    #[test]
    fn bad_inputs_change_nothing() {
        let mut e = Estimator::default();
        let l = Learning::default();
        e.observe(&Features::default(), f64::NAN, &TRUE, &l);
        e.observe(&Features::default(), -1.0, &TRUE, &l);
        assert_eq!(e, Estimator::default());
    }
}
