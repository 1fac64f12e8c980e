//! Text to token ids through the model's tokenizer, piece by piece with the [`PieceCache`]:
//! the text is cut where an added token matched before normalization begins, cached pieces
//! are taken from the cache, each run of uncached pieces is encoded in one call and its ids
//! shared out to its pieces by their offsets, and the post-processor (BOS/EOS) is applied to
//! the whole once. The result equals one `encode` of the whole text.

use crate::piece_cache::PieceCache;
use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tokenizers::{Encoding, NormalizerWrapper, OffsetReferential, OffsetType, Token, Tokenizer};

/// Bytes of text encoded at most per request (about 4 MiB: a million-token prompt).
pub const MAX_TEXT_BYTES: usize = 16 << 20;

pub struct Encoder {
    pub tokenizer: Tokenizer,
    /// Ids of added tokens matched on the raw text (not normalized): the cut points.
    cut_ids: HashSet<u32>,
    pub cache: PieceCache,
}

impl Encoder {
    pub fn new(tokenizer: Tokenizer, cache_bytes: usize) -> Encoder {
        let cut_ids =
            tokenizer.get_added_tokens_decoder().into_iter().filter(|(_, t)| !t.normalized).map(|(id, _)| id).collect();
        Encoder { tokenizer, cut_ids, cache: PieceCache::new(cache_bytes) }
    }

    /// The ids of one plain `encode(text, add_special_tokens)`.
    pub fn encode_uncached(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, String> {
        self.tokenizer.encode(text, add_special_tokens).map(|e| e.get_ids().to_vec()).map_err(|e| e.to_string())
    }

    /// The same ids as [`Encoder::encode_uncached`], from cached pieces where it can.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, String> {
        if text.len() > MAX_TEXT_BYTES {
            return Err(format!(
                "the prompt is {} bytes, more than the {MAX_TEXT_BYTES} this tokenizer takes",
                text.len()
            ));
        }
        let cuts = self.cut_points(text);
        let mut ids: Vec<u32> = Vec::new();
        // Pieces [start, end) in order, each from the cache or awaiting one encode of its run.
        let mut run: Vec<(usize, usize, u128)> = Vec::new();
        let mut bounds = cuts.into_iter().chain(std::iter::once(text.len())).peekable();
        let mut start = 0;
        while let Some(end) = bounds.next() {
            if end <= start && bounds.peek().is_some() {
                continue;
            }
            let piece = text.get(start..end).unwrap_or_default();
            let key = self.cache.key(piece, start == 0);
            match self.cache.get(key) {
                Some(hit) => {
                    self.encode_run(text, &run, &mut ids)?;
                    run.clear();
                    self.cache.counters.hits.fetch_add(1, Ordering::Relaxed);
                    self.cache.counters.hit_tokens.fetch_add(hit.len() as u64, Ordering::Relaxed);
                    ids.extend_from_slice(&hit);
                }
                None => run.push((start, end, key)),
            }
            start = end;
        }
        self.encode_run(text, &run, &mut ids)?;
        if !add_special_tokens {
            return Ok(ids);
        }
        let tokens = ids.iter().map(|&id| Token::new(id, String::new(), (0, 0))).collect();
        let processed =
            self.tokenizer.post_process(Encoding::from_tokens(tokens, 0), None, true).map_err(|e| e.to_string())?;
        Ok(processed.get_ids().to_vec())
    }

    /// Where pieces begin (after 0): the start of each added token matched on the raw text.
    fn cut_points(&self, text: &str) -> Vec<usize> {
        let pre = self.tokenizer.get_added_vocabulary().extract_and_normalize(None::<&NormalizerWrapper>, text);
        pre.get_splits(OffsetReferential::Original, OffsetType::Byte)
            .into_iter()
            .filter_map(|(_, (s, _), tokens)| {
                let first = tokens.as_ref()?.first()?;
                (s > 0 && self.cut_ids.contains(&first.id)).then_some(s)
            })
            .collect()
    }

    /// Encodes the consecutive pieces of `run` as one text, appends their ids and caches each
    /// piece's share.
    fn encode_run(&self, text: &str, run: &[(usize, usize, u128)], ids: &mut Vec<u32>) -> Result<(), String> {
        let (Some(first), Some(last)) = (run.first(), run.last()) else { return Ok(()) };
        let base = first.0;
        let slice = text.get(base..last.1).ok_or("a cut point is not on a character boundary")?;
        if run.len() == 1 {
            // One piece: its ids need no sharing out, so no offsets either.
            let enc = self.tokenizer.encode_fast(slice, false).map_err(|e| e.to_string())?;
            let got = enc.get_ids();
            self.cache.counters.misses.fetch_add(1, Ordering::Relaxed);
            self.cache.counters.miss_tokens.fetch_add(got.len() as u64, Ordering::Relaxed);
            ids.extend_from_slice(got);
            self.cache.insert(first.2, got);
            return Ok(());
        }
        let enc = self.tokenizer.encode(slice, false).map_err(|e| e.to_string())?;
        let got = enc.get_ids();
        self.cache.counters.misses.fetch_add(run.len() as u64, Ordering::Relaxed);
        self.cache.counters.miss_tokens.fetch_add(got.len() as u64, Ordering::Relaxed);
        ids.extend_from_slice(got);
        // Each token to the piece its text starts in (a token trimmed to nothing at a cut
        // belongs to the piece before it).
        let mut piece = 0usize;
        let mut from = 0usize;
        let offsets = enc.get_offsets();
        for (i, &(s, e)) in offsets.iter().enumerate() {
            let at = if e > s { s } else { s.saturating_sub(1) };
            while run.get(piece).is_some_and(|p| at.saturating_add(base) >= p.1) && piece.saturating_add(1) < run.len()
            {
                if let (Some(p), Some(share)) = (run.get(piece), got.get(from..i)) {
                    self.cache.insert(p.2, share);
                }
                piece = piece.saturating_add(1);
                from = i;
            }
        }
        if let (Some(p), Some(share)) = (run.get(piece), got.get(from..)) {
            self.cache.insert(p.2, share);
        }
        // Pieces after the last token's piece hold no tokens (cannot happen for non-empty text).
        for p in run.iter().skip(piece.saturating_add(1)) {
            self.cache.insert(p.2, &[]);
        }
        Ok(())
    }
}

/// Shares an encoder between threads.
pub type SharedEncoder = Arc<Encoder>;
