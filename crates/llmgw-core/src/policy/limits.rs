//! Overload limits: a replica past any of them is chosen only when every replica is.

use super::candidate::Candidate;
use super::validation::{non_negative, InvalidWeight};

/// The most a replica may carry before it counts as overloaded.
#[derive(Debug, Clone, PartialEq)]
pub struct Limits {
    /// Engine-reported waiting requests.
    pub max_waiting: u32,
    /// Requests this gateway has in flight there.
    pub max_in_flight: u32,
    /// Engine-reported KV cache usage (0..1).
    pub max_kv_usage: f64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { max_waiting: 64, max_in_flight: 256, max_kv_usage: 0.99 }
    }
}

impl Limits {
    pub fn validate(&self) -> Result<(), InvalidWeight> {
        non_negative(&[("max_kv_usage", self.max_kv_usage)])?;
        if self.max_in_flight == 0 {
            return Err(InvalidWeight { field: "max_in_flight", message: "must be at least 1" });
        }
        Ok(())
    }

    pub fn overloaded(&self, c: &Candidate<'_>) -> bool {
        c.waiting > self.max_waiting || c.in_flight >= self.max_in_flight || f64::from(c.kv_usage) > self.max_kv_usage
    }

    /// Indices of the replicas a policy may pick: up and not overloaded, or, when every up
    /// replica is overloaded, every up replica.
    pub fn eligible(&self, cands: &[Candidate<'_>]) -> Vec<usize> {
        let up: Vec<usize> = cands.iter().enumerate().filter(|(_, c)| c.up).map(|(i, _)| i).collect();
        let ok: Vec<usize> =
            up.iter().copied().filter(|&i| cands.get(i).is_some_and(|c| !self.overloaded(c))).collect();
        if ok.is_empty() {
            up
        } else {
            ok
        }
    }
}
