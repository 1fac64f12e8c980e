//! Where a request's tokenizer call goes: the profile's dedicated tokenizer unless its calls
//! are failing, else the least-loaded healthy replica of the model (among equally loaded ones,
//! by the rendezvous order of the call's prompt, so that calls made at once spread).

use super::candidates;
use super::step::TokenizerTarget;
use super::{GatewayState, Router};
use crate::policy;
use crate::stable_hash::stable_hash;

/// The bytes of a call's body (its end) that key its place among equally loaded replicas.
const CALL_KEY_BYTES: usize = 256;

impl Router {
    /// Where profile `pi`'s tokenizer call (`body`) goes: its dedicated tokenizer unless that
    /// is failing, else the least-loaded healthy replica serving `model` whose tokenizer is not
    /// failing.
    pub(super) fn tokenizer_target(
        &self,
        pi: usize,
        model: Option<&str>,
        body: &[u8],
        gw: &dyn GatewayState,
    ) -> TokenizerTarget {
        let p = self.config.profile(pi);
        if let Some(a) = p.and_then(|p| p.tokenizer_address.as_deref()) {
            if !gw.tokenizer_avoided(a) {
                return TokenizerTarget::At(a.to_owned());
            }
        }
        self.replica_tokenizer(pi, model, body, gw)
    }

    /// The least-loaded healthy replica serving `model` whose tokenizer is not failing; among
    /// equally loaded ones, the first in the rendezvous order of the call `body`'s last bytes
    /// (where prompts sharing a system prompt differ).
    pub(super) fn replica_tokenizer(
        &self,
        pi: usize,
        model: Option<&str>,
        body: &[u8],
        gw: &dyn GatewayState,
    ) -> TokenizerTarget {
        let p = self.config.profile(pi);
        let w = p.map_or(&self.default_weights, |p| &p.weights);
        let mut cands = candidates::candidates(self.feed.serving(), model, gw);
        if !cands.iter().any(|c| c.up) {
            return TokenizerTarget::Nobody;
        }
        cands.retain(|c| c.up && !gw.tokenizer_avoided(c.address));
        let tail = body.get(body.len().saturating_sub(CALL_KEY_BYTES)..).unwrap_or(body);
        match policy::least_loaded_for(&cands, &w.limits, stable_hash(tail)).and_then(|i| cands.get(i)) {
            Some(c) => TokenizerTarget::At(c.address.to_owned()),
            None => TokenizerTarget::CircuitOpen,
        }
    }
}
