//! Where a request's tokenizer call goes: the profile's dedicated tokenizer unless its calls
//! are failing, else the least-loaded healthy replica of the model.

use super::candidates;
use super::step::TokenizerTarget;
use super::{GatewayState, Router};
use crate::policy;

impl Router {
    /// Where profile `pi`'s tokenizer call goes: its dedicated tokenizer unless that is failing,
    /// else the least-loaded healthy replica serving `model` whose tokenizer is not failing.
    pub(super) fn tokenizer_target(&self, pi: usize, model: Option<&str>, gw: &dyn GatewayState) -> TokenizerTarget {
        let p = self.config.profile(pi);
        if let Some(a) = p.and_then(|p| p.tokenizer_address.as_deref()) {
            if !gw.tokenizer_avoided(a) {
                return TokenizerTarget::At(a.to_owned());
            }
        }
        self.replica_tokenizer(pi, model, gw)
    }

    /// The least-loaded healthy replica serving `model` whose tokenizer is not failing.
    pub(super) fn replica_tokenizer(&self, pi: usize, model: Option<&str>, gw: &dyn GatewayState) -> TokenizerTarget {
        let p = self.config.profile(pi);
        let w = p.map_or(&self.default_weights, |p| &p.weights);
        let mut cands = candidates::candidates(self.feed.serving(), model, gw);
        if !cands.iter().any(|c| c.up) {
            return TokenizerTarget::Nobody;
        }
        cands.retain(|c| c.up && !gw.tokenizer_avoided(c.address));
        match policy::least_loaded(&cands, &w.limits).and_then(|i| cands.get(i)) {
            Some(c) => TokenizerTarget::At(c.address.to_owned()),
            None => TokenizerTarget::CircuitOpen,
        }
    }
}
