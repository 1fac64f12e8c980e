//! Triage of a body: the first reason it cannot be routed exactly, and the key the approximate
//! fallback hashes (the prompt's leading text).

use super::reasons::Fallback;
use super::step::Body;
use crate::config::CompiledProfile;
use crate::policy;
use crate::request::{ParsedRequest, Prompt};

/// The approximate fallback's key: a stable hash of the prompt's leading text, or of the raw
/// body's leading bytes when there is no prompt.
pub fn approx_key(parsed: Option<&ParsedRequest>, body: &[u8], nbytes: usize) -> Option<u64> {
    let mut lead = Vec::new();
    match parsed {
        Some(p) if !matches!(p.prompt, Prompt::None) => p.leading_text(nbytes, &mut lead),
        _ => lead.extend(body.iter().take(nbytes)),
    }
    (!lead.is_empty()).then(|| policy::stable_hash(&lead))
}

/// The first reason a parsed body cannot be routed exactly, if any.
pub fn fallback_reason(
    body: &Body<'_>,
    parsed: Option<&ParsedRequest>,
    profile: Option<&CompiledProfile>,
    unusable: Option<Fallback>,
    max_salt: usize,
) -> Option<Fallback> {
    match (parsed, profile) {
        _ if body.too_large => Some(Fallback::BodyTooLarge),
        (None, _) if body.bytes.is_empty() => Some(Fallback::NoPrompt),
        (None, _) => Some(Fallback::Unparseable),
        (Some(p), _) if matches!(p.prompt, Prompt::None) => Some(Fallback::NoPrompt),
        (Some(p), _) if p.cache_salt.as_ref().is_some_and(|s| s.len() > max_salt) => Some(Fallback::SaltTooLong),
        (Some(_), None) => Some(Fallback::NoProfile),
        (Some(_), Some(p)) if !p.kv_events => Some(Fallback::NoKvEvents),
        _ => unusable,
    }
}
