//! Routing a completions request (a text prompt) before its tokenizer answers, on the tokens of
//! an earlier prompt whose text it begins with.
//!
//! Every tokenized text prompt is kept (its first [`MAX_TOKENS`] tokens) under the tags of its
//! leading 128, 256, 512, … bytes; each tag also covers the profile, the hashing, the model and
//! the special-tokens flag. A new prompt looks up the tags of its own leading bytes. An earlier
//! prompt found under the tag of its first `b` bytes shares at least those bytes with it:
//! - where the new prompt begins with the whole earlier one (a conversation's next turn written
//!   out as text), the earlier tokens are its own too, but for the last one (which may merge
//!   with the text that follows): routed on them as a chat request on its earlier turn;
//! - otherwise (the same system prompt, then another question) the tokens of the leading text
//!   both agree on are shared: that text is read, to 64 bytes, from the prompts' marks (tags of
//!   every 64 bytes of leading text, kept with the earlier prompt), and its tokens counted at
//!   the earlier prompt's bytes per token, less an eighth (bytes per token vary along a
//!   prompt), so that the claim stays within the shared text. Routed on
//!   them only where that loses nothing, as a chat request on its siblings' common prefix: no
//!   replica, or exactly one, holds all those blocks ([`super::shared_prefix`]), or waiting for
//!   its own tokens cannot pay, or the recent waits of prompts sharing the same leading text
//!   (their family: the tag of the longest lookup boundary within the text they agree on) found
//!   nothing past it ([`super::wait_ledger`]).
//!
//! The longest claim is used; the request's own call is made after it is routed, and its answer
//! kept for the prompts after it. Each VM keeps what it learned, and hands it to the gateway
//! ([`SharedPrompt`]) for the other VMs of the Envoy, which take it up before their next lookup:
//! a conversation whose turns reach different workers goes at once on each.

use super::recent::Recent;
use super::shared_prompt::{EarlierPrompt, SharedPrompt, FIRST_BOUNDARY, MARK, MAX_MARKS, MAX_TOKENS};
use super::step::{CacheLookup, EarlyRequest, EarlyRoute, Report};
use super::wait_ledger::WaitedOn;
use super::{ExactRequest, GatewayState, Router};
use crate::request::{ParsedRequest, Prompt};
use crate::tokcache::{keyed_prefix_tags, CacheTag};
use std::sync::Arc;

/// Tags kept per VM: every tag may hold a prompt of its own, so at most
/// `MAX_TAGS × (4 × MAX_TOKENS + 8 × MAX_MARKS)` bytes (6 MiB) per VM.
pub const MAX_TAGS: usize = 512;
/// The longest leading text looked up.
const LAST_BOUNDARY: usize = MARK * MAX_MARKS;

/// Earlier text prompts' tokens, by the tags of their leading bytes.
#[derive(Debug)]
pub struct EarlierPrompts {
    slots: Recent<Arc<EarlierPrompt>>,
    /// How far the prompts other VMs shared were taken up ([`super::EarlierTurns::prompts_since`]).
    seen: u64,
}

impl Default for EarlierPrompts {
    fn default() -> Self {
        EarlierPrompts { slots: Recent::new(MAX_TAGS, |_| false), seen: 0 }
    }
}

/// What a new prompt is routed on: tokens it shares with an earlier prompt, and the tokens and
/// bytes that estimate its own length (at the earlier prompt's bytes per token).
#[derive(Debug, PartialEq)]
pub struct Claim {
    pub tokens: Vec<u32>,
    pub on: ClaimOn,
    pub per: (usize, usize),
}

/// What a claim rests on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClaimOn {
    /// The earlier prompt is the start of the new one.
    Whole,
    /// They share leading text; `family`: the tag of its longest lookup boundary (128, 256,
    /// 512, … bytes) within what they agree on, the family of the prompts that share it.
    Shared { family: u128 },
}

impl Claim {
    /// Whether the earlier prompt is the start of the new one.
    pub fn whole(&self) -> bool {
        self.on == ClaimOn::Whole
    }
}

/// The lengths of leading text marked in a prompt of `len` bytes.
fn mark_ends(len: usize) -> Vec<usize> {
    (1..=(len / MARK).min(MAX_MARKS)).map(|i| i.saturating_mul(MARK)).collect()
}

/// The tags under which a prompt with these marks is kept and looked up (a subset of its marks).
fn boundary_tags(marks: &[CacheTag]) -> impl Iterator<Item = (usize, CacheTag)> + '_ {
    boundaries(marks.len().saturating_mul(MARK))
        .into_iter()
        .filter_map(|b| Some((b, *marks.get((b / MARK).checked_sub(1)?)?)))
}

/// The lengths of leading text looked up for a prompt of `len` bytes (multiples of [`MARK`]).
fn boundaries(len: usize) -> Vec<usize> {
    std::iter::successors(Some(FIRST_BOUNDARY), |b| b.checked_mul(2))
        .take_while(|&b| b <= len.min(LAST_BOUNDARY))
        .collect()
}

impl EarlierPrompts {
    /// Keeps the tokens of `text` (tagged with `key` and `context`): what was kept, for the
    /// other VMs.
    pub fn learn(&mut self, key: u64, context: &[&[u8]], text: &[u8], tokens: &[u32]) -> Option<SharedPrompt> {
        let mut ends = mark_ends(text.len());
        if boundaries(text.len()).is_empty() || tokens.is_empty() {
            return None;
        }
        ends.push(text.len());
        let tags = keyed_prefix_tags(key, context, text, &ends);
        let (whole, marks) = tags.split_last()?;
        let prompt = Arc::new(EarlierPrompt {
            bytes: text.len(),
            whole: whole.0,
            tokens: tokens.iter().copied().take(MAX_TOKENS).collect(),
            count: tokens.len(),
            marks: marks.iter().map(|t| t.0 as u64).collect(),
        });
        let shared = SharedPrompt { tags: boundary_tags(marks).map(|(_, t)| t.0).collect(), prompt };
        self.keep(&shared);
        Some(shared)
    }

    fn keep(&mut self, shared: &SharedPrompt) {
        for &tag in &shared.tags {
            self.slots.insert(tag, Arc::clone(&shared.prompt));
        }
    }

    /// Keeps a prompt another VM learned, unless this VM keeps it already (it learned it
    /// itself, or took it up before).
    pub fn adopt(&mut self, shared: SharedPrompt) {
        let Some(&first) = shared.tags.first().filter(|_| shared.is_bounded()) else { return };
        let (whole, bytes) = (shared.prompt.whole, shared.prompt.bytes);
        if self.slots.peek(first).is_none_or(|p| (p.whole, p.bytes) != (whole, bytes)) {
            self.keep(&shared);
        }
    }

    /// Takes up the prompts the other VMs learned since the last call.
    pub(super) fn take_up(&mut self, gw: &dyn GatewayState) {
        let mut shared = Vec::new();
        self.seen = gw.prompts_since(self.seen, &mut shared);
        for p in shared {
            self.adopt(p);
        }
    }

    /// The longest claim `text` can make on an earlier prompt: on one it begins with whole
    /// (`whole_ok`), or on the leading text they share (`part_ok`).
    pub fn claim(&mut self, key: u64, context: &[&[u8]], text: &[u8], whole_ok: bool, part_ok: bool) -> Option<Claim> {
        let marks = keyed_prefix_tags(key, context, text, &mark_ends(text.len()));
        let mut found: Vec<Arc<EarlierPrompt>> =
            boundary_tags(&marks).filter_map(|(_, t)| self.slots.get(t.0).map(|p| Arc::clone(p))).collect();
        // A prompt kept under several of these tags is weighed once.
        found.dedup_by(|a, b| Arc::ptr_eq(a, b));
        if found.is_empty() {
            return None;
        }
        // The earlier prompts' whole texts, as tags of the new prompt's leading bytes.
        let mut lens: Vec<usize> = found.iter().map(|e| e.bytes).filter(|&l| l <= text.len()).collect();
        lens.sort_unstable();
        lens.dedup();
        let whole_tags = if whole_ok { keyed_prefix_tags(key, context, text, &lens) } else { Vec::new() };
        let begins_with = |e: &EarlierPrompt| {
            lens.binary_search(&e.bytes).ok().and_then(|i| whole_tags.get(i)).is_some_and(|t| t.0 == e.whole)
        };
        let mut best: Option<Claim> = None;
        for e in &found {
            let claim = if begins_with(e) {
                let n = e.tokens.len().min(e.count.saturating_sub(1));
                let tokens = e.tokens.iter().copied().take(n).collect();
                Claim { tokens, on: ClaimOn::Whole, per: (e.count, e.bytes) }
            } else if part_ok {
                // The tokens of the leading text both agree on (to a mark), at the earlier
                // prompt's bytes per token, less an eighth.
                let agreed = marks.iter().zip(&e.marks).take_while(|(a, b)| a.0 as u64 == **b).count();
                let n = e.count.saturating_mul(agreed.saturating_mul(MARK)).checked_div(e.bytes).unwrap_or(0);
                let n = n.saturating_sub(n / 8);
                // The family: the tag at the longest lookup boundary within what they agree on
                // (questions that happen to begin alike past it stay in their system prompt's).
                // (An earlier prompt is found under a boundary's tag: they agree on one at least.)
                let agreed_bytes = agreed.saturating_mul(MARK);
                let family = boundary_tags(&marks).take_while(|&(b, _)| b <= agreed_bytes).last();
                let Some((_, family)) = family else { continue };
                let tokens = e.tokens.iter().copied().take(n).collect();
                Claim { tokens, on: ClaimOn::Shared { family: family.0 }, per: (e.count, e.bytes) }
            } else {
                continue;
            };
            if !claim.tokens.is_empty() && best.as_ref().is_none_or(|c| claim.tokens.len() > c.tokens.len()) {
                best = Some(claim);
            }
        }
        best
    }

    /// Tags dropped for room since the last call.
    pub fn take_evicted(&mut self) -> u64 {
        self.slots.take_evicted()
    }

    pub fn clear(&mut self) {
        self.slots.clear();
    }
}

/// What enters the tags of a text prompt besides its text (the tokens it gets depend on these),
/// and the prompt: borrowed from the request, nothing allocated.
struct PromptContext<'a> {
    key: u64,
    profile: [u8; 8],
    spec: [u8; 8],
    model: &'a [u8],
    special: [u8; 1],
    text: &'a [u8],
}

impl PromptContext<'_> {
    fn parts(&self) -> [&[u8]; 4] {
        [&self.profile, &self.spec, self.model, &self.special]
    }
}

impl Router {
    /// Earlier text prompts' tags dropped for room since the last call.
    pub fn take_earlier_prompts_evicted(&mut self) -> u64 {
        self.earlier_prompts.take_evicted()
    }

    /// The context of `parsed`'s text prompt; `None` where earlier prompts are not kept or it
    /// has no text prompt.
    fn prompt_context<'a>(&self, profile: usize, spec: u64, parsed: &'a ParsedRequest) -> Option<PromptContext<'a>> {
        let key = self.background_calls?;
        let on = self.config.route_on_earlier_turns || self.config.route_on_shared_prefixes;
        let Prompt::Text(text) = &parsed.prompt else { return None };
        if !on || !self.tokcache.enabled() {
            return None;
        }
        Some(PromptContext {
            key,
            profile: u64::try_from(profile).unwrap_or(u64::MAX).to_le_bytes(),
            spec: spec.to_le_bytes(),
            model: parsed.model.as_deref().unwrap_or_default().as_bytes(),
            special: [parsed.add_special_tokens.map_or(2u8, u8::from)],
            text: text.as_bytes(),
        })
    }

    /// Keeps a text prompt's tokens for the prompts after it: what to share with the other VMs.
    pub(super) fn learn_prompt(
        &mut self,
        profile: usize,
        spec: u64,
        parsed: &ParsedRequest,
        tokens: &[u32],
    ) -> Option<SharedPrompt> {
        let c = self.prompt_context(profile, spec, parsed)?;
        self.earlier_prompts.learn(c.key, &c.parts(), c.text, tokens)
    }

    /// Routes a text prompt on the tokens it shares with an earlier one, where that decides as
    /// its own tokens would: the route, and the estimate of its prompt tokens.
    pub(super) fn route_on_earlier_prompt(&mut self, req: &EarlyRequest<'_>, report: Report) -> EarlyRoute {
        let EarlyRequest { profile, spec, parsed, gw, .. } = *req;
        let c = self.prompt_context(profile, spec, parsed).ok_or(None)?;
        let (whole_ok, part_ok) = (self.config.route_on_earlier_turns, self.config.route_on_shared_prefixes);
        self.earlier_prompts.take_up(gw);
        let claim = self.earlier_prompts.claim(c.key, &c.parts(), c.text, whole_ok, part_ok).ok_or(None)?;
        let lookup = if claim.whole() { CacheLookup::EarlierTurn } else { CacheLookup::SharedPrefix };
        let mut report = Report { tokenizer_cache: Some(lookup), ..report };
        let model = parsed.model.as_deref();
        let exact = ExactRequest {
            profile,
            model,
            cache_salt: parsed.cache_salt.as_deref(),
            tokens: &claim.tokens,
            known: &[],
            mm: Vec::new(),
        };
        let mut scored = self.exact(exact, gw, &mut report).map_err(|_| None)?;
        let (count, bytes) = claim.per;
        scored.tokens = super::earlier_turns::estimated_tokens(count, bytes, c.text.len()).ok_or(None)?;
        match claim.on {
            // Its own tokens but the last: held or not, nothing more to learn by waiting.
            ClaimOn::Whole if self.scratch.scores.total == 0 => return Err(None),
            ClaimOn::Whole => {}
            ClaimOn::Shared { family } => {
                self.the_prefix_decides(profile, &scored, WaitedOn { family, prefix: claim.tokens.len() }, gw)?
            }
        }
        self.route_early(req, &scored, report).ok_or(None)
    }
}

#[cfg(test)]
#[allow(clippy::arithmetic_side_effects)]
mod tests {
    use super::*;

    const KEY: u64 = 7;

    fn text(n: usize, seed: u8) -> Vec<u8> {
        (0..n).map(|i| b'a' + ((i as u8).wrapping_mul(31) ^ seed) % 26).collect()
    }

    #[test]
    fn a_prompt_that_begins_with_an_earlier_one_claims_its_tokens_but_the_last() {
        let mut p = EarlierPrompts::default();
        let first = text(300, 1);
        p.learn(KEY, &[b"ctx"], &first, &(0..60).collect::<Vec<_>>());
        let mut next = first.clone();
        next.extend_from_slice(b" and then some more text");
        let c = p.claim(KEY, &[b"ctx"], &next, true, true).unwrap();
        assert_eq!((c.tokens.len(), c.whole(), c.per), (59, true, (60, 300)));
        // Not with whole claims off: then only the leading 256 bytes' worth (60 × 256 / 300 = 51,
        // less an eighth).
        let c = p.claim(KEY, &[b"ctx"], &next, false, true).unwrap();
        assert_eq!((c.tokens.len(), c.whole()), (45, false));
        // Another context, or text that differs in its first 128 bytes: nothing.
        assert_eq!(p.claim(KEY, &[b"other"], &next, true, true), None);
        assert_eq!(p.claim(KEY, &[b"ctx"], &text(300, 2), true, true), None);
        // Shorter than the first boundary: nothing kept, nothing claimed.
        p.learn(KEY, &[b"ctx"], &first[..100], &[1, 2]);
        assert_eq!(p.claim(KEY, &[b"ctx"], &first[..100], true, true), None);
    }

    #[test]
    fn a_prompt_sharing_leading_text_claims_that_texts_tokens() {
        let mut p = EarlierPrompts::default();
        // 600 bytes shared, then each its own.
        let mut a = text(600, 3);
        a.extend_from_slice(&text(200, 4));
        let mut b = text(600, 3);
        b.extend_from_slice(&text(200, 5));
        p.learn(KEY, &[], &a, &(0..200).collect::<Vec<_>>());
        let c = p.claim(KEY, &[], &b, true, true).unwrap();
        // The first 576 bytes (nine marks): 200 × 576 / 800 = 144 tokens, less an eighth.
        assert_eq!((c.tokens.len(), c.whole()), (126, false));
        assert_eq!(p.claim(KEY, &[], &b, true, false), None);
    }

    #[test]
    fn a_prompt_another_vm_learned_is_taken_up_within_the_bounds() {
        let mut learner = EarlierPrompts::default();
        let first = text(300, 1);
        let shared = learner.learn(KEY, &[b"ctx"], &first, &(0..60).collect::<Vec<_>>()).unwrap();
        assert_eq!(shared.tags.len(), 2, "kept under its leading 128 and 256 bytes");
        let mut next = first.clone();
        next.extend_from_slice(b" and then some more text");
        // Past the bounds: not taken up.
        let mut other = EarlierPrompts::default();
        let long = EarlierPrompt { tokens: vec![0; MAX_TOKENS + 1], count: MAX_TOKENS + 1, ..(*shared.prompt).clone() };
        other.adopt(SharedPrompt { tags: shared.tags.clone(), prompt: Arc::new(long) });
        assert_eq!(other.claim(KEY, &[b"ctx"], &next, true, true), None);
        other.adopt(shared);
        assert_eq!(other.claim(KEY, &[b"ctx"], &next, true, true).map(|c| c.tokens.len()), Some(59));
    }

    #[test]
    fn tags_are_bounded_and_the_least_recently_used_go_first() {
        let mut p = EarlierPrompts::default();
        let keep = text(200, 9);
        p.learn(KEY, &[b"keep"], &keep, &[1, 2, 3]);
        for i in 0..MAX_TAGS + 10 {
            let ctx = i.to_le_bytes();
            p.learn(KEY, &[&ctx], &text(200, 0), &[1, 2, 3]);
            // Looked up now and then, the first prompt stays.
            if i % 100 == 0 {
                assert!(p.claim(KEY, &[b"keep"], &keep, true, true).is_some(), "{i}");
            }
        }
        assert_eq!(p.slots.len(), MAX_TAGS);
        assert!(p.claim(KEY, &[b"keep"], &keep, true, true).is_some());
        assert_eq!((p.take_evicted(), p.take_evicted()), (11, 0));
    }
}
