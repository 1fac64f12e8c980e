//! Fuzzes the feed as the filter consumes it: a stream of protobuf `FeedMessage`s
//! (`llmgw_fuzz::frames`) decoded with prost and applied to a router's `FeedView` the way the
//! filter's feed client does (a new subscription on the first message, and again after a
//! sequence gap), then requests routed on the resulting state. No panic; a route names an
//! address from the serving replica table.
#![no_main]

use libfuzzer_sys::fuzz_target;
use llmgw_core::config::Compiled;
use llmgw_core::feed::{FeedError, FeedMessage};
use llmgw_core::flow::{Body, Router, Step};
use prost::Message;

fuzz_target!(|data: &[u8]| {
    let cfg = Compiled::from_json(llmgw_fuzz::ROUTER_CONFIG.as_bytes(), Some(llmgw_fuzz::MEMO)).unwrap();
    let mut router = Router::new(cfg, 3);
    let mut fresh = true;
    for frame in llmgw_fuzz::frames(data) {
        let Ok(msg) = FeedMessage::decode(frame) else { continue };
        if fresh {
            fresh = false;
            router.feed.begin_subscription();
        }
        if let Err(FeedError::Gap { .. }) = router.feed.apply(&msg) {
            fresh = true;
        }
        let serving = router.feed.serving();
        let _ = serving.index.entries();
        let _ = serving.index.memory_bytes();
    }
    let prompts: [&[u8]; 3] = [
        br#"{"model":"m","prompt":[1,2,3,4,5,6,7,8,9,10,11,12,13]}"#,
        br#"{"model":"plain","prompt":"hello there"}"#,
        br#"{"model":"m","prompt":"hello"}"#,
    ];
    for bytes in prompts {
        let step = router.on_body(&Body { path: "/v1/completions", bytes, too_large: false }, &llmgw_fuzz::Counts, 5);
        let target = match &step {
            Step::Route(r) | Step::RouteThenTokenize(r, _) => Some(&r.address),
            Step::Tokenize(t) => Some(&t.target),
            Step::Reject(_) => None,
        };
        if let Some(address) = target {
            let serving = router.feed.serving();
            assert!(serving.replicas.iter().any(|r| &r.address == address), "{address} is not in the replica table");
        }
    }
});
