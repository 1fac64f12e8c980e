//! The tokens of chat requests this Envoy tokenized, kept in proxy-wasm shared data for the
//! next turn of their conversations (`llmgw_core::flow::EarlierTurns`), so the next turn is
//! routed at once whichever worker it reaches; and, under their own tags, the tokens sibling
//! requests (the same messages but the last) share.
//!
//! A fixed set of [`SLOTS`] values, `llmgw.turn.N`, each holding one token list: its tag
//! (u128), its prompt's token count (u32) and at most [`MAX_TOKENS`] of its leading tokens (u32
//! each), little-endian. A request's slot is its tag modulo [`SLOTS`]; a later request with the
//! same slot replaces it (the lookup checks the tag). At most `SLOTS × (20 + 4 × MAX_TOKENS)`
//! bytes, 16 MiB, however many conversations there are; the leading tokens are what routing
//! reads (the replica holding them holds the conversation).
//!
//! Turn tags are keyed by a secret this Envoy's VMs share ([`shared_key`]): the first VM to
//! configure writes one, the others read it.

use crate::host::{update_shared, Host};
use crate::shared_records::FieldReader;

/// Slots kept.
pub const SLOTS: u64 = llmgw_core::flow::KEPT_TURNS;
/// Leading tokens kept per request.
pub const MAX_TOKENS: usize = llmgw_core::flow::KEPT_TURN_TOKENS;
const KEY_KEY: &str = "llmgw.turn_key";

fn slot(tag: u128) -> String {
    format!("llmgw.turn.{}", (tag as u64) % SLOTS)
}

/// Keeps `tokens` for the request whose turn tag is `tag`. `false`: the host refused.
pub fn keep(host: &dyn Host, tag: u128, tokens: &[u32]) -> bool {
    let kept = tokens.get(..MAX_TOKENS).unwrap_or(tokens);
    let mut v = Vec::with_capacity(20usize.saturating_add(kept.len().saturating_mul(4)));
    v.extend_from_slice(&tag.to_le_bytes());
    v.extend_from_slice(&u32::try_from(tokens.len()).unwrap_or(u32::MAX).to_le_bytes());
    for t in kept {
        v.extend_from_slice(&t.to_le_bytes());
    }
    host.set_shared_data(&slot(tag), &v, None).is_ok()
}

/// The leading tokens kept for `tag`, and its prompt's token count.
pub fn lookup(host: &dyn Host, tag: u128) -> Option<(Vec<u32>, usize)> {
    let (value, _) = host.shared_data(&slot(tag))?;
    let value = value?;
    let mut f = FieldReader::new(&value);
    if f.u128()? != tag {
        return None;
    }
    let count = f.u32()?;
    let tokens = f.rest_u32s();
    let count = usize::try_from(count).unwrap_or(usize::MAX).max(tokens.len());
    (!tokens.is_empty()).then_some((tokens, count))
}

/// The secret of turn tags every VM of this Envoy uses: written by the first (`candidate`, a
/// random value of its own), read by the others. `None` when shared data is refused.
pub fn shared_key(host: &dyn Host, candidate: u64) -> Option<u64> {
    let written = update_shared(host, KEY_KEY, |v| (v.len() != 8).then(|| candidate.to_le_bytes().to_vec()));
    if !written {
        return None;
    }
    let (value, _) = host.shared_data(KEY_KEY)?;
    value?.as_slice().first_chunk::<8>().map(|b| u64::from_le_bytes(*b))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fake::FakeHost;

    #[test]
    fn a_kept_request_is_found_by_its_tag_only_and_long_prompts_keep_their_head() {
        let host = FakeHost::default();
        let tokens: Vec<u32> = (0..100).collect();
        assert!(keep(&host, 7, &tokens));
        assert_eq!(lookup(&host, 7), Some((tokens.clone(), 100)));
        // Another tag in the same slot replaces it; the old tag finds nothing.
        let other = 7 + u128::from(SLOTS);
        assert_eq!(lookup(&host, other), None);
        assert!(keep(&host, other, &[1, 2, 3]));
        assert_eq!(lookup(&host, 7), None);
        assert_eq!(lookup(&host, other), Some((vec![1, 2, 3], 3)));
        // A prompt past the bound keeps its leading tokens and its whole count.
        let long: Vec<u32> = (0..(MAX_TOKENS as u32 + 10)).collect();
        assert!(keep(&host, 9, &long));
        let (head, count) = lookup(&host, 9).unwrap();
        assert_eq!((head.len(), count), (MAX_TOKENS, MAX_TOKENS + 10));
        assert_eq!(head[..], long[..MAX_TOKENS]);
    }

    #[test]
    fn every_vm_takes_the_first_vms_key() {
        let host = FakeHost::default();
        assert_eq!(shared_key(&host, 11), Some(11));
        assert_eq!(shared_key(&host, 22), Some(11));
    }
}
