//! Differential: the tokenizer-answer parser (a fast path for `/tokenize` answers, serde for the
//! rest) against a plain serde_json reading of the same bytes. Both must accept the same bodies
//! with the same token ids, and refuse the same bodies. Answers carrying render `features`
//! (media items, checked by the parser beyond what JSON says) are only checked for no panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use llmgw_core::request::parse_tokenizer_answer;
use serde::Deserialize;

/// The documented shape: `tokens` (a `/tokenize` answer) or else `token_ids` (a render
/// answer), each an array of u32; a top-level array of such objects means its first.
#[derive(Deserialize)]
struct Reference {
    #[serde(default)]
    tokens: Option<Vec<u32>>,
    #[serde(default)]
    token_ids: Option<Vec<u32>>,
    #[serde(default)]
    features: Option<serde::de::IgnoredAny>,
}

fn reference(body: &[u8]) -> Option<(Option<Vec<u32>>, bool)> {
    let first = body.iter().find(|b| !b.is_ascii_whitespace());
    let r: Reference = if first == Some(&b'[') {
        let mut items: Vec<Reference> = serde_json::from_slice(body).ok()?;
        if items.is_empty() {
            return Some((None, false));
        }
        items.swap_remove(0)
    } else {
        serde_json::from_slice(body).ok()?
    };
    Some((r.tokens.or(r.token_ids), r.features.is_some()))
}

fuzz_target!(|data: &[u8]| {
    let ours = parse_tokenizer_answer(data);
    let theirs = reference(data);
    match (&ours, &theirs) {
        // Media items are validated further by the parser: no reference for them.
        (_, Some((_, true))) => {}
        (Ok(a), Some((Some(t), false))) => assert_eq!(&a.tokens, t, "token ids differ from serde_json's"),
        (Err(_), None | Some((None, _))) => {}
        (Ok(a), _) => panic!("accepted {:?}, which serde_json refuses", a.tokens),
        (Err(e), Some((Some(t), _))) => panic!("refused ({e}) what serde_json reads as {t:?}"),
    }
    if let Ok(a) = &ours {
        assert!(a.mm.windows(2).all(|w| w[0].offset <= w[1].offset), "media items not sorted by offset");
    }
});
