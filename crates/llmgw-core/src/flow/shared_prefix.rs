//! Routing a chat request on the tokens its siblings share, without waiting for the tokenizer.
//!
//! Siblings are chat requests with the same messages but the last (and the same model, tools,
//! template, template arguments and flags): most often a system prompt followed by different
//! questions. The tokens every tokenized sibling begins with (their longest common prefix, kept
//! per VM once two siblings that differ were tokenized) are what a new sibling's prompt begins
//! with too. The request is scored on them at once, and its own tokenizer call is made after it
//! is routed; its answer narrows the common prefix if the request began otherwise. While only
//! one sibling was tokenized, the second claims its tokens up to the shared messages' share of
//! its bytes, less an eighth ([`SharedPrefixes::claim`]), and is routed on those alike.
//!
//! Only when that loses nothing: the replicas' cached blocks chain from block 0, so a replica
//! can hold blocks of the request past the common prefix only if it holds the whole prefix.
//! When no replica holds the whole prefix, or exactly one does, the prefix alone decides as the
//! request's own tokens would (that one replica may hold more of it, and is credited with less).
//! When two or more hold it all, which of them holds more of the request only the request's
//! tokens tell: it waits for its call, unless waiting cannot pay. What a holder can hold past
//! the prefix is at most the request's further whole blocks. Computed at the costliest of those
//! holders' prefill rates, if that is less than the tokenizer's usual round trip
//! ([`super::tokenizer_wait`]), the request goes at once (`ttft` policy only: `score` has no
//! time to weigh). And whether waiting pays is learned per family of siblings
//! ([`super::wait_ledger`]), as it is for text prompts that begin alike.
//! Where every sibling so far happened to begin its last
//! message alike, the prefix runs past what the next one shares, until a sibling that differs
//! is tokenized.

use super::earlier_turns::estimated_tokens;
use super::exact::Scored;
use super::recent::Recent;
use super::step::{CacheLookup, EarlyRequest, EarlyRoute, Pending, Report};
use super::wait_ledger::WaitedOn;
use super::{ExactRequest, GatewayState, Router};
use crate::index::Scores;
use crate::policy::PolicyMode;

/// Common prefixes kept per VM: at most this many, each of at most [`MAX_TOKENS`] tokens (4 MiB
/// per VM at most).
pub const MAX_PREFIXES: usize = 256;
pub const MAX_TOKENS: usize = 4096;

/// The common prefixes of sibling requests' tokens, by the tag of their shared messages.
#[derive(Debug)]
pub struct SharedPrefixes {
    /// Single requests' tokens are dropped for room before common prefixes.
    entries: Recent<Prefix>,
}

#[derive(Debug)]
struct Prefix {
    tokens: Vec<u32>,
    /// Tokenized siblings that differ, that `tokens` is the common prefix of (counted up to 2).
    siblings: u8,
    /// While `tokens` are one sibling's: the bytes of its messages (0: not known, or a common
    /// prefix) and its whole token count (`tokens` keeps at most [`MAX_TOKENS`]).
    bytes: usize,
    count: usize,
}

impl Default for SharedPrefixes {
    fn default() -> Self {
        SharedPrefixes { entries: Recent::new(MAX_PREFIXES, |p| p.siblings >= 2) }
    }
}

impl SharedPrefixes {
    /// Learns the tokens of a tokenized request whose shared messages' tag is `tag`; a tag this
    /// VM has no entry for starts from the common prefix another VM kept (`kept`), if any. The
    /// common prefix when it changed (for the other VMs).
    pub fn learn(&mut self, tag: u128, tokens: &[u32], kept: impl FnOnce() -> Option<Vec<u32>>) -> Option<Vec<u32>> {
        if !self.entries.contains(tag) {
            match kept().filter(|t| !t.is_empty()) {
                Some(common) => self.insert(tag, common, 2),
                None => {
                    self.insert(tag, tokens.to_vec(), 1);
                    return None;
                }
            }
        }
        let p = self.entries.get(tag)?;
        let before = (p.tokens.len(), p.siblings);
        let common = p.tokens.iter().zip(tokens).take_while(|(a, b)| a == b).count();
        // The same prompt tokenized again is no second sibling.
        if common < p.tokens.len() || p.siblings >= 2 {
            p.tokens.truncate(common);
            p.siblings = p.siblings.saturating_add(1).min(2);
        }
        (p.siblings >= 2 && (p.tokens.len(), p.siblings) != before).then(|| p.tokens.clone())
    }

    fn insert(&mut self, tag: u128, mut tokens: Vec<u32>, siblings: u8) {
        let count = tokens.len();
        tokens.truncate(MAX_TOKENS);
        self.entries.insert(tag, Prefix { tokens, siblings, bytes: 0, count });
    }

    /// The tokenized sibling of `tag`, while it is the only one, spans `bytes` of messages (its
    /// first record stays: a later one whose tokens begin with all those kept is not a second
    /// sibling, and its bytes are not those tokens').
    pub fn note_bytes(&mut self, tag: u128, bytes: usize) {
        if let Some(p) = self.entries.get(tag).filter(|p| p.siblings == 1 && p.bytes == 0) {
            p.bytes = bytes;
        }
    }

    /// What a sibling may be routed on while only one sibling of `tag` was tokenized: that
    /// sibling's tokens up to the share of its messages' bytes that the shared messages span
    /// (`shared`), less an eighth (tokens per byte vary along a prompt, and the template's
    /// tokens for the last message come after the shared ones), so that the claim stays within
    /// what the two share. With it, the request's own length estimated at that sibling's
    /// tokens per byte over its `all` bytes of messages.
    pub fn claim(&mut self, tag: u128, shared: usize, all: usize) -> Option<(Vec<u32>, u64)> {
        let p = self.entries.get(tag).filter(|p| p.siblings == 1 && p.bytes > 0)?;
        let (count, bytes) = (p.count as u64, p.bytes as u64);
        let n = count.checked_mul(shared as u64)?.checked_div(bytes)?.checked_mul(7)?.checked_div(8)?;
        let n = usize::try_from(n).unwrap_or(usize::MAX).min(p.tokens.len());
        let claimed = p.tokens.get(..n).filter(|t| !t.is_empty())?.to_vec();
        Some((claimed, count.checked_mul(all as u64)?.checked_div(bytes)?))
    }

    /// The tokens at least two differing siblings of `tag` begin with.
    pub fn common(&mut self, tag: u128) -> Option<&[u32]> {
        let p = self.entries.get(tag).filter(|p| p.siblings >= 2 && !p.tokens.is_empty())?;
        Some(&p.tokens)
    }

    /// Prefixes dropped for room since the last call.
    pub fn take_evicted(&mut self) -> u64 {
        self.entries.take_evicted()
    }

    pub fn clear(&mut self) {
        self.entries.clear();
    }
}

/// No replica can hold blocks of the request past its common prefix unless it holds the whole
/// prefix: scored on the prefix, the request is scored as its own tokens would score it when at
/// most one replica holds it all (and some replica holds part of it).
fn the_prefix_alone_decides(scores: &Scores) -> bool {
    let deepest = scores.leading.iter().copied().max().unwrap_or(0);
    deepest > 0 && (deepest < scores.total || whole_holders(scores).count() == 1)
}

/// The replicas (by id) holding every block of the prefix.
fn whole_holders(scores: &Scores) -> impl Iterator<Item = usize> + '_ {
    scores.leading.iter().enumerate().filter(move |&(_, &l)| scores.total > 0 && l >= scores.total).map(|(r, _)| r)
}

impl Router {
    /// Siblings' common prefixes dropped for room since the last call.
    pub fn take_shared_prefixes_evicted(&mut self) -> u64 {
        self.shared_prefixes.take_evicted()
    }

    /// Families whose waits were counted ([`super::wait_ledger`]) dropped for room since the
    /// last call.
    pub fn take_wait_families_evicted(&mut self) -> u64 {
        self.waits.take_evicted()
    }

    /// Routes on the common prefix of `parsed`'s siblings, when it decides as the request's own
    /// tokens would: the route, and the estimate of the request's prompt tokens.
    pub(super) fn route_on_shared_prefix(&mut self, req: &EarlyRequest<'_>, report: Report) -> EarlyRoute {
        let EarlyRequest { parsed, gw, .. } = *req;
        let tags = req.tags.ok_or(None)?;
        let (tag, bytes) = tags.siblings.ok_or(None)?;
        // This VM's, else the one another VM of this Envoy kept, else what the one sibling
        // tokenized here shares with this one (the request's length at that sibling's bytes
        // per token).
        let kept = match self.shared_prefixes.common(tag.0) {
            Some(t) => Some(t.to_vec()),
            None => gw.earlier_tokens(tag.0).map(|(t, _)| t).filter(|t| !t.is_empty()),
        };
        let (tokens, estimate) = match kept {
            Some(t) => {
                let estimate = estimated_tokens(t.len(), bytes, tags.bytes).ok_or(None)?;
                (t, estimate)
            }
            None => self.shared_prefixes.claim(tag.0, bytes, tags.bytes).ok_or(None)?,
        };
        let mut report = Report { tokenizer_cache: Some(CacheLookup::SharedPrefix), ..report };
        let model = parsed.model.as_deref();
        let exact = ExactRequest {
            profile: tags.profile,
            model,
            cache_salt: parsed.cache_salt.as_deref(),
            tokens: &tokens,
            known: &[],
            mm: Vec::new(),
        };
        let mut scored = self.exact(exact, gw, &mut report).map_err(|_| None)?;
        scored.tokens = estimate;
        let on = WaitedOn { family: tag.0, prefix: tokens.len() };
        self.the_prefix_decides(tags.profile, &scored, on, gw)?;
        self.route_early(req, &scored, report).ok_or(None)
    }

    /// A request that waited for its tokens was scored on them (`scored`, its scores in the
    /// scratch space): whether that paid, for its family's next members. It paid where the
    /// replicas holding the whole prefix it could have been routed on (among which routing on
    /// it would have chosen by load alone) held different amounts of the request: its tokens
    /// told one of them apart. Past a claim, which stops short of the shared text by design,
    /// they all hold the rest of that text alike, and that is no gain.
    pub(super) fn note_whether_waiting_paid(&mut self, pending: &Pending, scored: Option<&Scored>) {
        let (Some(on), Some(scored)) = (pending.waited_on, scored) else { return };
        let prefix_blocks = u32::try_from(on.prefix.checked_div(scored.block_size).unwrap_or(0)).unwrap_or(u32::MAX);
        let holders = self.scratch.scores.leading.iter().copied().filter(|&l| l > 0 && l >= prefix_blocks);
        let (least, most) = holders.fold((u32::MAX, 0), |(lo, hi), l| (lo.min(l), hi.max(l)));
        self.waits.waited(on.family, most > least);
    }

    /// Whether a request scored on a prefix it shares with earlier ones (`scored`, its scores
    /// in the scratch space; the prefix and its family `on`) may be routed on it, without its
    /// own tokens: the prefix decides as they would, or waiting for them cannot pay, or the
    /// family's recent waits found nothing past the prefix. Else it waits: `Err(Some(on))`
    /// where its tokens will tell whether waiting paid (two or more replicas hold the prefix
    /// whole).
    pub(super) fn the_prefix_decides(
        &mut self,
        profile: usize,
        scored: &Scored,
        on: WaitedOn,
        gw: &dyn GatewayState,
    ) -> Result<(), Option<WaitedOn>> {
        let scores = &self.scratch.scores;
        if the_prefix_alone_decides(scores) {
            return Ok(());
        }
        if whole_holders(scores).nth(1).is_none() {
            return Err(None);
        }
        if self.waiting_cannot_pay(profile, scores, scored, gw) || self.waits.skips_waiting(on.family) {
            return Ok(());
        }
        Err(Some(on))
    }

    /// Two or more replicas hold the whole prefix: whether the most any of them can hold past it
    /// (the request's further whole blocks, of its `scored.tokens`) costs less to compute, at
    /// the costliest of those holders' prefill rates, than the tokenizer's median round trip.
    fn waiting_cannot_pay(&self, profile: usize, scores: &Scores, scored: &Scored, gw: &dyn GatewayState) -> bool {
        let Some(wait_us) = gw.tokenizer_round_trip_us() else {
            return false;
        };
        let Some(w) = self.config.profile(profile).map(|p| &p.weights) else { return false };
        if w.policy != PolicyMode::Ttft {
            return false;
        }
        let block = u64::try_from(scored.block_size).unwrap_or(u64::MAX).max(1);
        // vLLM reuses whole blocks short of a prompt's last token.
        let further =
            scored.tokens.saturating_sub(1).checked_div(block).unwrap_or(0).saturating_sub(u64::from(scores.total));
        let replicas = &self.feed.serving().replicas;
        let rate = whole_holders(scores)
            .filter_map(|id| replicas.iter().find(|r| usize::from(r.id) == id))
            .map(|r| w.ttft.rates_from(gw.learned_rates(&r.address)).prefill_us_per_token)
            .filter(|r| r.is_finite())
            .fold(0.0_f64, f64::max);
        (further.saturating_mul(block) as f64) * rate < wait_us as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_common_prefix_needs_two_siblings_that_differ() {
        let mut s = SharedPrefixes::default();
        s.learn(1, &[1, 2, 3, 4], || None);
        assert_eq!(s.common(1), None);
        // The same prompt again is not a second sibling.
        s.learn(1, &[1, 2, 3, 4], || None);
        assert_eq!(s.common(1), None);
        s.learn(1, &[1, 2, 9, 9, 9], || None);
        assert_eq!(s.common(1), Some(&[1, 2][..]));
        // A third sibling narrows it; one that shares it all leaves it.
        s.learn(1, &[1, 2, 3], || None);
        assert_eq!(s.common(1), Some(&[1, 2][..]));
        s.learn(1, &[1, 7], || None);
        assert_eq!(s.common(1), Some(&[1][..]));
        assert_eq!(s.common(2), None);
    }

    #[test]
    fn a_vm_starts_from_the_prefix_another_kept_and_hands_on_what_changed() {
        let mut s = SharedPrefixes::default();
        // Nothing kept elsewhere: a single request, nothing to hand on.
        assert_eq!(s.learn(1, &[1, 2, 3], || None), None);
        // Known elsewhere: this VM's first sibling narrows it, and the narrower prefix is handed on.
        assert_eq!(s.learn(2, &[1, 2, 7], || Some(vec![1, 2, 3])), Some(vec![1, 2]));
        assert_eq!(s.common(2), Some(&[1, 2][..]));
        // A sibling sharing it all changes nothing: nothing to hand on.
        assert_eq!(s.learn(2, &[1, 2, 8], || None), None);
        // The second sibling of a tag known here only hands its prefix on.
        assert_eq!(s.learn(1, &[1, 2, 4], || None), Some(vec![1, 2]));
    }

    #[test]
    fn single_requests_are_evicted_before_common_prefixes() {
        let mut s = SharedPrefixes::default();
        s.learn(0, &[1, 2], || None);
        s.learn(0, &[1, 3], || None);
        for t in 1..=MAX_PREFIXES as u128 + 5 {
            s.learn(t, &[5], || None);
        }
        assert_eq!(s.entries.len(), MAX_PREFIXES);
        assert_eq!(s.common(0), Some(&[1][..]));
        assert_eq!((s.take_evicted(), s.take_evicted()), (6, 0));
    }

    #[test]
    fn a_claim_stays_within_the_shared_messages_share_and_estimates_the_request_at_the_first_ones_rate() {
        let mut s = SharedPrefixes::default();
        let first: Vec<u32> = (0..5000).collect();
        s.learn(1, &first, || None);
        s.note_bytes(1, 10_000);
        // A later record of the same family does not replace the first's bytes.
        s.note_bytes(1, 99);
        // 5,000 tokens over 10,000 bytes (4,096 of them kept): the shared 5,000 bytes claim
        // 2,500 less an eighth; a shorter request of 6,000 bytes is estimated at 3,000 tokens.
        let (claimed, estimate) = s.claim(1, 5_000, 6_000).unwrap();
        assert_eq!((claimed.len(), estimate), (2_187, 3_000));
        assert_eq!(claimed.last(), Some(&2_186));
        // Never past the tokens kept; nothing once two siblings give the common prefix.
        assert_eq!(s.claim(1, 10_000, 10_000).unwrap().0.len(), MAX_TOKENS);
        s.learn(1, &[0, 1, 9], || None);
        assert_eq!(s.claim(1, 5_000, 6_000), None);
        // Unknown bytes: no claim.
        s.learn(2, &first, || None);
        assert_eq!(s.claim(2, 5_000, 6_000), None);
    }

    #[test]
    fn the_prefix_decides_unless_several_replicas_hold_it_whole() {
        let scores = |leading: &[u32]| Scores { leading: leading.to_vec(), total: 4 };
        assert!(the_prefix_alone_decides(&scores(&[4, 1, 0])));
        assert!(the_prefix_alone_decides(&scores(&[2, 2, 0])));
        assert!(!the_prefix_alone_decides(&scores(&[4, 4, 0])));
        assert!(!the_prefix_alone_decides(&scores(&[0, 0, 0])));
    }
}
