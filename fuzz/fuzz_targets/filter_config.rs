//! Fuzzes the filter's JSON configuration: parse, validate and compile; an accepted one must
//! drive a router (a completion with token ids and a chat, for a listed and an unlisted model)
//! without panicking, and reconfigure a running router.
#![no_main]

use libfuzzer_sys::fuzz_target;
use llmgw_core::config::Compiled;
use llmgw_core::flow::{Body, Router};

const BODIES: [(&str, &[u8]); 3] = [
    ("/v1/completions", br#"{"model":"m","prompt":[1,2,3,4,5,6,7,8,9]}"#),
    ("/v1/chat/completions", br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#),
    ("/v1/completions", br#"{"model":"other","prompt":"some text"}"#),
];

fuzz_target!(|data: &[u8]| {
    let Ok(compiled) = Compiled::from_json(data, Some(llmgw_fuzz::MEMO)) else { return };
    // Accepted once, accepted again (`Compiled` is not `Clone`: the reconfigure takes a second).
    let again = Compiled::from_json(data, Some(llmgw_fuzz::MEMO)).expect("accepted once, refused the second time");
    // The tokenization cache is sized by the configuration (up to 4 GiB, allocated as it fills):
    // the bodies here add a few entries at most.
    let mut router = Router::new(compiled, 7);
    router.feed.begin_subscription();
    for m in llmgw_fuzz::fixture_feed() {
        let _ = router.feed.apply(&m);
    }
    for (path, bytes) in BODIES {
        let _ = router.on_body(&Body { path, bytes, too_large: false }, &llmgw_fuzz::Counts, 1);
    }
    let _ = router.take_hash_note();
    let mut fixture = llmgw_fuzz::fixture_router();
    fixture.reconfigure(again);
    for (path, bytes) in BODIES {
        let _ = fixture.on_body(&Body { path, bytes, too_large: false }, &llmgw_fuzz::Counts, 1);
    }
});
