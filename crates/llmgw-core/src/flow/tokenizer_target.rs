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

/// A tokenizer call's key among equally loaded replicas: a hash of its body's last bytes
/// (where prompts sharing a system prompt differ).
pub(super) fn call_key(body: &[u8]) -> u64 {
    stable_hash(body.get(body.len().saturating_sub(CALL_KEY_BYTES)..).unwrap_or(body))
}

impl Router {
    /// Where profile `pi`'s tokenizer call (its [`call_key`] `key`) goes: its dedicated
    /// tokenizer unless that is failing, else the least-loaded healthy replica serving `model`
    /// whose tokenizer is not failing.
    pub(super) fn tokenizer_target(
        &self,
        pi: usize,
        model: Option<&str>,
        key: u64,
        gw: &dyn GatewayState,
    ) -> TokenizerTarget {
        let p = self.config.profile(pi);
        if let Some(a) = p.and_then(|p| p.tokenizer_address.as_deref()) {
            if !gw.tokenizer_avoided(a) {
                return TokenizerTarget::At(a.to_owned());
            }
        }
        self.replica_tokenizer(pi, model, key, gw, None)
    }

    /// The least-loaded healthy replica serving `model` whose tokenizer is not failing, leaving
    /// `except` out too (a call after routing avoids the replica computing its request); among
    /// equally loaded ones, the first in the rendezvous order of the call's `key`.
    pub(super) fn replica_tokenizer(
        &self,
        pi: usize,
        model: Option<&str>,
        key: u64,
        gw: &dyn GatewayState,
        except: Option<&str>,
    ) -> TokenizerTarget {
        let mut cands = candidates::candidates(self.feed.serving(), model, gw);
        if !cands.iter().any(|c| c.up) {
            return TokenizerTarget::Nobody;
        }
        let w = self.config.profile(pi).map_or(&self.default_weights, |p| &p.weights);
        cands.retain(|c| c.up && Some(c.address) != except && !gw.tokenizer_avoided(c.address));
        match policy::least_loaded(&cands, &w.limits, key).and_then(|i| cands.get(i)) {
            Some(c) => TokenizerTarget::At(c.address.to_owned()),
            None => TokenizerTarget::CircuitOpen,
        }
    }
}
