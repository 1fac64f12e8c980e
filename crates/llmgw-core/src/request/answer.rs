//! The tokenizer's answer: token ids from a `/tokenize` answer (`tokens`) or a render answer
//! (`token_ids`), and a render answer's multimodal features (`features.mm_hashes` and
//! `features.mm_placeholders`, per modality). A fast path reads the common `/tokenize` form
//! without a full parse; it agrees with the full parse on every body it accepts and defers to
//! it on anything unusual.

use super::parsed::RequestError;
use crate::hash::MmFeature;
use serde::Deserialize;
use std::collections::BTreeMap;

/// Media items one answer may name (a request with more is not routed exactly).
pub const MAX_MM_ITEMS: usize = 1024;
/// Longest media item identifier accepted (vLLM's are 64 hex digits, or a client's uuid).
pub const MAX_MM_IDENTIFIER: usize = 512;

#[derive(Deserialize)]
struct TokenizeResponse {
    #[serde(default)]
    tokens: Option<Vec<u32>>,
    #[serde(default)]
    token_ids: Option<Vec<u32>>,
    #[serde(default)]
    features: Option<Features>,
}

#[derive(Deserialize)]
struct Features {
    #[serde(default)]
    mm_hashes: BTreeMap<String, Vec<String>>,
    #[serde(default)]
    mm_placeholders: BTreeMap<String, Vec<Placeholder>>,
}

#[derive(Deserialize)]
struct Placeholder {
    offset: u64,
    length: u64,
}

/// What a tokenizer answered: the prompt's token ids and, from a render answer, its media
/// items (sorted by offset, as vLLM hashes them).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TokenizerAnswer {
    pub tokens: Vec<u32>,
    pub mm: Vec<MmFeature>,
}

/// Token ids from a `/tokenize` answer (`tokens`) or a render answer (`token_ids`, possibly one
/// object per prompt in an array: the first is used, as for routing).
pub fn parse_tokenizer_response(body: &[u8]) -> Result<Vec<u32>, RequestError> {
    parse_tokenizer_answer(body).map(|a| a.tokens)
}

/// Token ids and media items of a tokenizer answer. A render answer's features must pair
/// every item hash with a placeholder range (per modality, in order), and name at most
/// [`MAX_MM_ITEMS`] items with identifiers of at most [`MAX_MM_IDENTIFIER`] bytes.
pub fn parse_tokenizer_answer(body: &[u8]) -> Result<TokenizerAnswer, RequestError> {
    if let Some(tokens) = fast_tokens(body) {
        return Ok(TokenizerAnswer { tokens, mm: Vec::new() });
    }
    let bad = |m: String| RequestError::BadTokenizerResponse(m);
    let first = body.iter().find(|b| !b.is_ascii_whitespace());
    let r: TokenizeResponse = if first == Some(&b'[') {
        let mut items: Vec<TokenizeResponse> = serde_json::from_slice(body).map_err(|e| bad(e.to_string()))?;
        if items.is_empty() {
            return Err(bad("empty array".into()));
        }
        items.swap_remove(0)
    } else {
        // Straight into the struct: no intermediate `Value` for thousands of token ids.
        serde_json::from_slice(body).map_err(|e| bad(e.to_string()))?
    };
    let mm = match r.features {
        Some(f) => media_items(f).map_err(bad)?,
        None => Vec::new(),
    };
    let tokens = r.tokens.or(r.token_ids).ok_or_else(|| bad("no `tokens` or `token_ids`".into()))?;
    if let Some(last) = mm.last() {
        let end = last.offset.saturating_add(last.length);
        if usize::try_from(end).map_or(true, |e| e > tokens.len()) {
            return Err(bad(format!("a media placeholder ends at token {end}, past the {} tokens", tokens.len())));
        }
    }
    Ok(TokenizerAnswer { tokens, mm })
}

/// The media items of render features, sorted by offset.
fn media_items(f: Features) -> Result<Vec<MmFeature>, String> {
    let mut out = Vec::new();
    for (modality, hashes) in f.mm_hashes {
        let ranges = f.mm_placeholders.get(&modality).map(Vec::as_slice).unwrap_or_default();
        if ranges.len() != hashes.len() {
            return Err(format!("{modality}: {} hashes but {} placeholders", hashes.len(), ranges.len()));
        }
        if out.len().saturating_add(hashes.len()) > MAX_MM_ITEMS {
            return Err(format!("more than {MAX_MM_ITEMS} media items"));
        }
        for (identifier, p) in hashes.into_iter().zip(ranges) {
            if identifier.len() > MAX_MM_IDENTIFIER || identifier.is_empty() || p.length == 0 {
                return Err(format!("{modality}: an item with an unusable identifier or an empty placeholder"));
            }
            out.push(MmFeature { identifier, offset: p.offset, length: p.length });
        }
    }
    out.sort_by_key(|m| m.offset);
    Ok(out)
}

/// Fast path for `/tokenize` answers (`{"count":..,"max_model_len":..,"tokens":[..],..}`): the
/// first `"tokens":` key followed by an array of plain unsigned integers. A JSON string cannot
/// contain an unescaped quote, so the key cannot be matched inside a string value. Anything
/// unexpected returns `None` and the caller parses the body fully.
fn fast_tokens(body: &[u8]) -> Option<Vec<u32>> {
    const KEY: &[u8] = b"\"tokens\":";
    let at = body.windows(KEY.len()).position(|w| w == KEY)?;
    // The character before the key must be one that can precede an object key.
    let before = body.get(..at)?.iter().rev().find(|b| !b.is_ascii_whitespace())?;
    if *before != b'{' && *before != b',' {
        return None;
    }
    let ws = |b: u8| matches!(b, b' ' | b'\t' | b'\n' | b'\r');
    let mut i = at.checked_add(KEY.len())?;
    while body.get(i).copied().is_some_and(ws) {
        i = i.wrapping_add(1);
    }
    if body.get(i) != Some(&b'[') {
        return None;
    }
    let open = i;
    i = i.wrapping_add(1);
    // About one id per 6 bytes of a typical answer.
    let mut out = Vec::with_capacity(body.len().saturating_sub(i) / 6);
    while body.get(i).copied().is_some_and(ws) {
        i = i.wrapping_add(1);
    }
    if body.get(i) == Some(&b']') {
        return full_parse_agrees(body, at, open, i.wrapping_add(1)).then_some(out);
    }
    loop {
        // Fast path: an id of 1 to 7 digits directly followed by `,` or `]`, read 8 bytes at a
        // time; anything else (whitespace, longer numbers, the last bytes) takes the byte path.
        if let Some((v, n, sep)) = body.get(i..i.wrapping_add(8)).and_then(eight_digits) {
            out.push(v);
            i = i.wrapping_add(n).wrapping_add(1);
            if sep == b']' {
                return full_parse_agrees(body, at, open, i).then_some(out);
            }
            continue;
        }
        while body.get(i).copied().is_some_and(ws) {
            i = i.wrapping_add(1);
        }
        // JSON numbers have no leading zeros: `02` is the full parse's to refuse.
        if body.get(i) == Some(&b'0') && body.get(i.wrapping_add(1)).is_some_and(u8::is_ascii_digit) {
            return None;
        }
        // One unsigned integer; `v` stays below 2³² × 10 + 10, far from u64's limit.
        let mut v: u64 = 0;
        let start = i;
        while let Some(d) = body.get(i).filter(|b| b.is_ascii_digit()) {
            v = v.wrapping_mul(10).wrapping_add(u64::from(d.wrapping_sub(b'0')));
            if v > u64::from(u32::MAX) {
                return None;
            }
            i = i.wrapping_add(1);
        }
        if i == start {
            return None;
        }
        out.push(u32::try_from(v).ok()?);
        while body.get(i).copied().is_some_and(ws) {
            i = i.wrapping_add(1);
        }
        match body.get(i) {
            Some(b',') => i = i.wrapping_add(1),
            Some(b']') => return full_parse_agrees(body, at, open, i.wrapping_add(1)).then_some(out),
            _ => return None,
        }
    }
}

/// Whether the full parse reads the fast path's list (key at `at`, list at `open..end`) as the
/// answer's tokens: the key belongs to the top-level object (not a nested one), and the body
/// with the list emptied parses as an answer whose `tokens` is that empty list and that has no
/// media features, so the rest is valid JSON without a second `tokens` (the full parse refuses
/// duplicates). Costs a parse of the body without its list, a few dozen bytes for `/tokenize`.
fn full_parse_agrees(body: &[u8], at: usize, open: usize, end: usize) -> bool {
    let (mut depth, mut in_string, mut escaped) = (0u32, false, false);
    for &b in body.get(..at).unwrap_or_default() {
        if in_string {
            if escaped {
                escaped = false;
            } else if b == b'\\' {
                escaped = true;
            } else if b == b'"' {
                in_string = false;
            }
        } else {
            match b {
                b'"' => in_string = true,
                b'{' | b'[' => depth = depth.saturating_add(1),
                b'}' | b']' => depth = depth.saturating_sub(1),
                _ => {}
            }
        }
    }
    let (Some(head), Some(tail)) = (body.get(..open), body.get(end..)) else { return false };
    if depth != 1 || in_string {
        return false;
    }
    let mut rest = Vec::with_capacity(head.len().saturating_add(tail.len()).saturating_add(2));
    rest.extend_from_slice(head);
    rest.extend_from_slice(b"[]");
    rest.extend_from_slice(tail);
    matches!(
        serde_json::from_slice::<TokenizeResponse>(&rest),
        Ok(TokenizeResponse { tokens: Some(t), features: None, .. }) if t.is_empty()
    )
}

/// Reads `digits` followed by `,` or `]` from the start of an 8-byte window, 1 to 7 digits:
/// (value, number of digits, separator). SWAR: one 64-bit load finds the first non-digit and
/// converts the digits (little-endian: the first character is the lowest byte).
fn eight_digits(w: &[u8]) -> Option<(u32, usize, u8)> {
    let x = u64::from_le_bytes(<[u8; 8]>::try_from(w).ok()?);
    // A byte's high bit is set in `flags` iff it is not an ASCII digit, for every byte up to
    // and including the first non-digit (borrows and carries only come from earlier bytes,
    // which are digits there).
    let flags =
        (x.wrapping_sub(0x3030_3030_3030_3030) | x.wrapping_add(0x4646_4646_4646_4646) | x) & 0x8080_8080_8080_8080;
    let n = flags.trailing_zeros() / 8;
    // A number of several digits must not start with 0 (the byte path refuses it).
    if !(1..8).contains(&n) || (n > 1 && x & 0xff == u64::from(b'0')) {
        return None;
    }
    let sep = *w.get(usize::try_from(n).ok()?)?;
    if sep != b',' && sep != b']' {
        return None;
    }
    // Left-pad to eight digits with '0', then the standard eight-digit conversion.
    let y = x.wrapping_shl(8u32.wrapping_mul(8u32.wrapping_sub(n)))
        | 0x3030_3030_3030_3030u64.wrapping_shr(n.wrapping_mul(8));
    let mut d = y.wrapping_sub(0x3030_3030_3030_3030);
    d = d.wrapping_mul(10).wrapping_add(d.wrapping_shr(8));
    d = (d & 0x0000_00FF_0000_00FF)
        .wrapping_mul(100 + (1_000_000 << 32))
        .wrapping_add((d.wrapping_shr(16) & 0x0000_00FF_0000_00FF).wrapping_mul(1 + (10_000 << 32)))
        .wrapping_shr(32);
    Some((u32::try_from(d).ok()?, usize::try_from(n).ok()?, sep))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn tokenizer_responses() {
        assert_eq!(
            parse_tokenizer_response(br#"{"count":3,"max_model_len":9,"tokens":[1,2,3],"token_strs":null}"#).unwrap(),
            vec![1, 2, 3]
        );
        assert_eq!(parse_tokenizer_response(br#"{"request_id":"x","token_ids":[4,5]}"#).unwrap(), vec![4, 5]);
        assert_eq!(parse_tokenizer_response(br#"[{"token_ids":[6]},{"token_ids":[7]}]"#).unwrap(), vec![6]);
        assert!(parse_tokenizer_response(br#"{"error":{"code":404}}"#).is_err());
        assert!(parse_tokenizer_response(b"<html>").is_err());
        assert!(parse_tokenizer_response(br#"{"tokens":[-1]}"#).is_err());
        assert!(parse_tokenizer_response(b"[]").is_err());
        // The fast path agrees with the full parse, and defers to it on anything unusual.
        assert_eq!(parse_tokenizer_response(br#"{"tokens" : [ 1 , 22,333 ] }"#).unwrap(), vec![1, 22, 333]);
        assert_eq!(parse_tokenizer_response(br#"{"tokens":[]}"#).unwrap(), Vec::<u32>::new());
        assert_eq!(fast_tokens(br#"{"tokens":[1.5]}"#), None);
        assert!(parse_tokenizer_response(br#"{"tokens":[1.5]}"#).is_err());
        assert_eq!(fast_tokens(br#"{"tokens":[4294967296]}"#), None);
        assert!(parse_tokenizer_response(br#"{"tokens":[4294967296]}"#).is_err());
        assert_eq!(fast_tokens(br#"{"a":"x\"tokens\":[9]","tokens":[1]}"#), Some(vec![1]));
        assert_eq!(parse_tokenizer_response(br#"{"a":"x\"tokens\":[9]","tokens":[1]}"#).unwrap(), vec![1]);
        assert_eq!(fast_tokens(br#"{"tokens":[1,2"#), None);
        assert_eq!(fast_tokens(br#"{"tokens":[1,]}"#), None);
        let big: Vec<u32> = (0..5000).map(|i| i * 7919 % 150_000).collect();
        let body =
            serde_json::to_vec(&json!({"count": 5000, "max_model_len": 8192, "tokens": big, "token_strs": null}))
                .unwrap();
        assert_eq!(fast_tokens(&body).as_ref(), Some(&big));
        assert!(parse_tokenizer_response(b"[1,2]").is_err());
        // Every length of id, with and without spaces, at every alignment.
        let mut x: u64 = 1;
        for case in 0..400 {
            let ids: Vec<u32> = (0..(case % 23))
                .map(|_| {
                    x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    let digits = (x >> 60) % 10 + 1;
                    ((x >> 16) % 10u64.pow(digits as u32)).min(u64::from(u32::MAX)) as u32
                })
                .collect();
            let sep = if case % 3 == 0 { ", " } else { "," };
            let list = ids.iter().map(u32::to_string).collect::<Vec<_>>().join(sep);
            let pad = " ".repeat(case % 5);
            let body = format!(r#"{{{pad}"tokens":[{list}],"token_strs":null}}"#);
            assert_eq!(fast_tokens(body.as_bytes()), Some(ids.clone()), "{body}");
            let body = format!(r#"{{"tokens":[{list}]}}"#);
            assert_eq!(fast_tokens(body.as_bytes()), Some(ids), "{body}");
        }
        assert_eq!(fast_tokens(br#"{"tokens":[4294967295,0,7]}"#), Some(vec![u32::MAX, 0, 7]));
        assert_eq!(fast_tokens(br#"{"tokens":[12a,3]}"#), None);
        assert_eq!(fast_tokens(br#"{"tokens":[1,2,3,4,5,6,7,8,9,10"#), None);
    }

    /// Found by the `answer` fuzz target (differential against serde_json): the fast path took
    /// the first `"tokens":[..]` anywhere and ignored the rest of the body, so it accepted
    /// answers the full parse refuses, and read a nested object's list as the answer's.
    #[test]
    fn fast_path_only_where_the_full_parse_agrees() {
        let fuzzed = br#"{e token"s{"count":3,"max_mod:[el_len":9,"tokens":[1,2,3],"token_str4294,7s":nul]l}}"#;
        assert!(parse_tokenizer_response(fuzzed).is_err());
        assert!(parse_tokenizer_response(br#"{"tokens":[1,2,3]}trailing"#).is_err());
        assert!(parse_tokenizer_response(br#"{"tokens":[1],"tokens":[2]}"#).is_err());
        assert!(parse_tokenizer_response(br#"{"a":{"tokens":[5]}}"#).is_err());
        assert_eq!(parse_tokenizer_response(br#"{"a":{"tokens":[5]},"tokens":[1]}"#).unwrap(), vec![1]);
        assert_eq!(parse_tokenizer_response(br#"{"a":[{"tokens":[5]}],"token_ids":[2]}"#).unwrap(), vec![2]);
        assert!(parse_tokenizer_response(br#"[{"tokens":[1]},5]"#).is_err());
        assert!(parse_tokenizer_response(br#"{"tokens":[1],"token_ids":[-1]}"#).is_err());
        // Media features are the full parse's to check.
        let mm = br#"{"tokens":[1,2],"features":{"mm_hashes":{"image":["h"]},"mm_placeholders":{"image":[{"offset":0,"length":9}]}}}"#;
        assert!(parse_tokenizer_answer(mm).is_err());
        // The usual answers still take the fast path.
        assert_eq!(
            fast_tokens(br#"{"count":3,"max_model_len":9,"tokens":[1,2,3],"token_strs":null}"#),
            Some(vec![1, 2, 3])
        );
        assert_eq!(fast_tokens(br#" {"tokens":[]} "#), Some(vec![]));
        // Found by the same target: JSON numbers have no leading zeros (either path).
        assert!(parse_tokenizer_response(b"{\"tokens\":[\n\n02]}").is_err());
        assert!(parse_tokenizer_response(br#"{"tokens":[1,007,2,3,4,5,6]}"#).is_err());
        assert!(parse_tokenizer_response(br#"{"tokens":[1, 00]}"#).is_err());
        assert_eq!(parse_tokenizer_response(br#"{"tokens":[0,10,0, 0]}"#).unwrap(), vec![0, 10, 0, 0]);
    }
}
