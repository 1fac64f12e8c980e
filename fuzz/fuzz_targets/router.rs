//! Drives the filter's request path, `llmgw_core::flow::Router`, through its public API with a
//! fuzzed request: the first byte picks the path, whether the body counts as too large, and
//! how the tokenizer call (if one is asked for) comes back; the body runs up to the first NUL
//! byte, and the tokenizer's answer body follows it (default: nine token ids). The same body is
//! then sent again (the tokenization cache's paths). No panic; a route names a known replica.
#![no_main]

use libfuzzer_sys::fuzz_target;
use llmgw_core::flow::{Body, Step, TokenizerReply};

const PATHS: [&str; 4] = ["/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/completions?x=1"];

fuzz_target!(|data: &[u8]| {
    let Some((&sel, rest)) = data.split_first() else { return };
    let (bytes, answer) = llmgw_fuzz::split_nul(rest);
    let answer = answer.unwrap_or(br#"{"count":9,"max_model_len":64,"tokens":[1,2,3,4,5,6,7,8,9],"token_strs":null}"#);
    let path = PATHS[usize::from(sel & 3)];
    let too_large = sel & 4 != 0;
    let mut router = llmgw_fuzz::fixture_router();
    let body = Body { path, bytes, too_large };
    for round in 0..2u64 {
        let now = round * 1_000_000;
        let mut step = router.on_body(&body, &llmgw_fuzz::Counts, now);
        if let Step::Tokenize(t) = step {
            let read = || answer.to_vec();
            let reply = match (sel >> 3) & 3 {
                0 => TokenizerReply::Answered { status: Some(b"200"), body: &read },
                1 => TokenizerReply::Answered { status: Some(b"503"), body: &read },
                2 => TokenizerReply::Reset,
                _ => TokenizerReply::Refused,
            };
            step = router.on_tokenizer_reply(*t.pending, &reply, &llmgw_fuzz::Counts, now);
        }
        match &step {
            Step::Route(r) | Step::RouteThenTokenize(r, _) => {
                assert!(r.address == llmgw_fuzz::A || r.address == llmgw_fuzz::B, "routed to {}", r.address);
                let _ = r.explain("vm");
            }
            Step::Reject(r) => assert_eq!(r.status, 503),
            Step::Tokenize(_) => panic!("a tokenizer reply led to another tokenizer call"),
        }
        let _ = router.take_hash_note();
    }
});
