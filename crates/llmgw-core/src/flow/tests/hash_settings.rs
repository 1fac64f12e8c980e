//! How the request path hashes: as the profile or the feed says the replicas do, with EAGLE
//! lookahead, hybrid engines' groups, media items, and a catch-all profile over replicas that
//! hash differently.

use super::*;

/// The serving table as the feed would send it again, with replica `id`'s KV-cache groups
/// from `groups`.
fn wire_table(r: &Router, groups: impl Fn(u32) -> Vec<crate::feed::KvCacheGroup>) -> ReplicaTable {
    let replicas = r
        .feed
        .serving()
        .replicas
        .iter()
        .map(|x| Replica {
            id: u32::from(x.id),
            name: x.name.clone(),
            address: x.address.clone(),
            models: x.models.clone(),
            up: x.up,
            dp_rank: x.rank,
            hash: x.hash.as_ref().and_then(|h| h.as_ref().ok()).map(crate::feed::HashSettings::from_spec),
            dp_size: if x.dp_rank.is_some() { 2 } else { 1 },
            kv_groups: groups(u32::from(x.id)),
            lora_adapters: vec![],
            mirror_incomplete: false,
        })
        .collect();
    ReplicaTable { replicas }
}

/// A router with `profile_json` as its only profile (model "m"), whose feed knows A and B
/// with the given hash settings, B holding `on_b`.
fn router_with_hash(
    profile_json: &str,
    a: Option<crate::feed::HashSettings>,
    b: Option<crate::feed::HashSettings>,
    on_b: Vec<u64>,
) -> Router {
    let json = format!(r#"{{"profiles":[{profile_json}]}}"#);
    let mut r = Router::new(Compiled::from_json(json.as_bytes(), None).unwrap(), 2);
    let replica = |id: u32, address: &str, hash| Replica {
        id,
        name: format!("r{id}"),
        address: address.into(),
        models: vec![],
        up: true,
        dp_rank: 0,
        hash,
        dp_size: 1,
        kv_groups: vec![],
        lora_adapters: vec![],
        mirror_incomplete: false,
    };
    r.feed.begin_subscription();
    for (seq, body) in [
        Msg::Replicas(ReplicaTable { replicas: vec![replica(0, A, a), replica(1, B, b)] }),
        Msg::Snapshot(SnapshotChunk { replica: 1, first: true, blocks: on_b }),
        Msg::SnapshotComplete(SnapshotComplete {}),
    ]
    .into_iter()
    .enumerate()
    {
        r.feed.apply(&FeedMessage { seq: seq as u64, body: Some(body) }).unwrap();
    }
    r
}

#[test]
fn a_profile_without_hash_settings_hashes_as_the_feed_says_the_replicas_do() {
    // The replicas hash with seed "0" and 4-token blocks; the profile names neither (its own
    // defaults would be no seed and 16-token blocks, which match nothing).
    let tokens: Vec<u32> = (0..32).collect();
    let mut r = router_with_hash(
        r#"{"name":"p","models":["m"],"kv_events":true}"#,
        Some(settings("0", BS as u32)),
        Some(settings("0", BS as u32)),
        keys(&tokens),
    );
    let bytes = format!(r#"{{"model":"m","prompt":{tokens:?}}}"#);
    let got = routed(r.on_body(&body(COMPLETIONS, bytes.as_bytes()), &(), 0));
    assert_eq!((got.address.as_str(), got.decision.outcome, got.decision.matched), (B, Outcome::Exact, 8));
    assert!(!got.report.hash_mismatch);
    assert_eq!(r.take_hash_note(), None);
    // Without settings in the feed (an older agent), the profile's defaults apply.
    let mut old = router_with_hash(r#"{"name":"p","models":["m"],"kv_events":true}"#, None, None, keys(&tokens));
    let got = routed(old.on_body(&body(COMPLETIONS, bytes.as_bytes()), &(), 0));
    assert_eq!(got.report.fallback, Some(Fallback::NoMatch));
}

#[test]
fn a_profile_pinning_another_seed_counts_names_both_values_and_falls_back() {
    let tokens: Vec<u32> = (0..32).collect();
    let mut r = router_with_hash(
        &format!(r#"{{"name":"p","models":["m"],"kv_events":true,"block_size":{BS},"seed":"1"}}"#),
        Some(settings("0", BS as u32)),
        Some(settings("0", BS as u32)),
        keys(&tokens),
    );
    let bytes = format!(r#"{{"model":"m","prompt":{tokens:?}}}"#);
    let got = routed(r.on_body(&body(COMPLETIONS, bytes.as_bytes()), &(), 0));
    assert_eq!(got.report.fallback, Some(Fallback::HashMismatch));
    assert!(got.report.hash_mismatch);
    assert_eq!(got.decision.outcome, Outcome::Approx);
    assert_eq!(got.report.matched_blocks, None);
    let note = r.take_hash_note().unwrap();
    assert!(
        note.contains(r#"replica `r1` rank 0 (127.0.0.1:8002) hashes with seed "0" (profile `p` uses "1")"#),
        "{note}"
    );
    assert!(note.contains(r#"replica `r0`"#) && note.ends_with("routing by the fallback"), "{note}");
    // Counted on every request, logged once.
    let got = routed(r.on_body(&body(COMPLETIONS, bytes.as_bytes()), &(), 0));
    assert!(got.report.hash_mismatch);
    assert_eq!(r.take_hash_note(), None);
}

#[test]
fn a_replica_hashing_otherwise_is_never_credited_while_the_others_route_exactly() {
    let tokens: Vec<u32> = (0..32).collect();
    // A says it hashes with seed "1", B with "0"; the profile pins "0". B holds the prompt.
    let mut r = router_with_hash(
        &format!(r#"{{"name":"p","models":["m"],"kv_events":true,"block_size":{BS},"seed":"0"}}"#),
        Some(settings("1", BS as u32)),
        Some(settings("0", BS as u32)),
        keys(&tokens),
    );
    let bytes = format!(r#"{{"model":"m","prompt":{tokens:?}}}"#);
    let got = routed(r.on_body(&body(COMPLETIONS, bytes.as_bytes()), &(), 0));
    assert_eq!((got.address.as_str(), got.decision.outcome), (B, Outcome::Exact));
    assert!(got.report.hash_mismatch);
    let note = r.take_hash_note().unwrap();
    assert!(
        note.contains(r#"replica `r0` rank 0 (127.0.0.1:8001) hashes with seed "1" (profile `p` uses "0")"#),
        "{note}"
    );
    assert!(!note.contains("`r1`") && note.ends_with("its blocks are not credited"), "{note}");
    // Another block size is a mismatch too, named with both values.
    let mut r = router_with_hash(
        r#"{"name":"p","models":["m"],"kv_events":true,"block_size":16}"#,
        Some(settings("0", BS as u32)),
        None,
        vec![],
    );
    let got = routed(r.on_body(&body(COMPLETIONS, bytes.as_bytes()), &(), 0));
    assert_eq!(got.report.fallback, Some(Fallback::HashMismatch));
    assert!(r.take_hash_note().unwrap().contains("block_size 4 (profile `p` uses 16)"));
}

#[test]
fn an_eagle_engines_lookahead_hashes_are_matched_from_the_profile_or_the_feed() {
    // 33 tokens, lookahead 1: the engine hashes 8 blocks of 4, each also over the next token.
    let tokens: Vec<u32> = (0..33).collect();
    let mut h = BlockHasher::new(HashAlgo::Sha256Cbor, Some("0")).unwrap();
    let ex = RequestExtras { lookahead: 1, ..RequestExtras::default() };
    let eagle: Vec<u64> = h.hash_request(&tokens, BS, &ex).unwrap().iter().map(|b| b.key.0).collect();
    assert_eq!(eagle.len(), 8);
    let bytes = format!(r#"{{"model":"m","prompt":{tokens:?}}}"#);
    let eagle_settings = || crate::feed::HashSettings { lookahead_tokens: 1, ..settings("0", BS as u32) };
    // The profile says lookahead 1 (the feed says nothing).
    let mut r = router_with_hash(
        &format!(r#"{{"name":"p","models":["m"],"kv_events":true,"block_size":{BS},"seed":"0","lookahead_tokens":1}}"#),
        None,
        None,
        eagle.clone(),
    );
    let got = routed(r.on_body(&body(COMPLETIONS, bytes.as_bytes()), &(), 0));
    assert_eq!((got.address.as_str(), got.decision.outcome, got.decision.matched), (B, Outcome::Exact, 8));
    // The feed says lookahead 1 (the profile says nothing about it).
    let mut r = router_with_hash(
        &format!(r#"{{"name":"p","models":["m"],"kv_events":true,"block_size":{BS},"seed":"0"}}"#),
        Some(eagle_settings()),
        Some(eagle_settings()),
        eagle.clone(),
    );
    let got = routed(r.on_body(&body(COMPLETIONS, bytes.as_bytes()), &(), 0));
    assert_eq!((got.address.as_str(), got.decision.outcome, got.decision.matched), (B, Outcome::Exact, 8));
    // A profile pinning lookahead 0 against such engines: a mismatch naming both values.
    let mut r = router_with_hash(
        &format!(r#"{{"name":"p","models":["m"],"kv_events":true,"block_size":{BS},"seed":"0","lookahead_tokens":0}}"#),
        Some(eagle_settings()),
        Some(eagle_settings()),
        eagle,
    );
    let got = routed(r.on_body(&body(COMPLETIONS, bytes.as_bytes()), &(), 0));
    assert_eq!(got.report.fallback, Some(Fallback::HashMismatch));
    assert!(r.take_hash_note().unwrap().contains("lookahead_tokens 1 (profile `p` uses 0)"));
}

#[test]
fn a_hybrid_engine_is_scored_as_vllms_coordinator_hits_it() {
    use crate::feed::KvCacheGroup;
    use crate::hash::group_key;
    // B: full attention (group 0) plus a sliding window of 8 tokens (group 1): a hit needs the
    // 2 blocks before its end cached in group 1 too.
    let tokens: Vec<u32> = (0..33).collect();
    let k = keys(&tokens);
    let group = |group_idx, kind: &str, sliding_window| KvCacheGroup {
        group_idx,
        kind: kind.into(),
        block_size: BS as u32,
        sliding_window,
    };
    let hybrid = vec![group(0, "full_attention", 0), group(1, "sliding_window", 8)];
    let mut on_b = k.clone();
    // The window group keeps only the last two blocks of the prompt (as vLLM's does).
    on_b.extend([6, 7].map(|i| group_key(BlockKey(k[i]), 1).0));
    let mut r = router_with_hash(
        &format!(r#"{{"name":"p","models":["m"],"kv_events":true,"block_size":{BS},"seed":"0"}}"#),
        None,
        None,
        on_b,
    );
    let table = wire_table(&r, |id| if id == 1 { hybrid.clone() } else { vec![] });
    r.feed.apply(&FeedMessage { seq: 3, body: Some(Msg::Replicas(table)) }).unwrap();
    // The whole prompt and more: every group hits all 8 blocks.
    let longer: Vec<u32> = (0..40).collect();
    let body_of = |t: &[u32]| format!(r#"{{"model":"m","prompt":{t:?}}}"#);
    let got = routed(r.on_body(&body(COMPLETIONS, body_of(&longer).as_bytes()), &(), 0));
    assert_eq!((got.address.as_str(), got.decision.outcome, got.decision.matched), (B, Outcome::Exact, 8));
    // Exactly the prompt: vLLM never hits the last token, so 7 blocks are the most it can
    // hit, and the window group has no 2 cached blocks ending there (6 is, 5 is not).
    let got = routed(r.on_body(&body(COMPLETIONS, body_of(&tokens[..32]).as_bytes()), &(), 0));
    assert_eq!(got.report.matched_blocks, Some(0));
    // Sharing the first 5 blocks only: group 0 holds them, group 1 holds none of blocks 3 and
    // 4, so vLLM hits nothing (group 0 alone would claim 5).
    let mut diverging: Vec<u32> = (0..20).collect();
    diverging.extend(1000..1020);
    let got = routed(r.on_body(&body(COMPLETIONS, body_of(&diverging).as_bytes()), &(), 0));
    assert_eq!((got.report.matched_blocks, got.report.fallback), (Some(0), Some(Fallback::NoMatch)));
    assert!(!got.report.hybrid_unsupported);
    // A Mamba group is not modelled: scored by group 0 alone, and said so.
    let table =
        wire_table(&r, |id| if id == 1 { vec![group(0, "full_attention", 0), group(1, "mamba", 0)] } else { vec![] });
    r.feed.apply(&FeedMessage { seq: 4, body: Some(Msg::Replicas(table)) }).unwrap();
    let got = routed(r.on_body(&body(COMPLETIONS, body_of(&diverging).as_bytes()), &(), 0));
    assert_eq!(got.report.matched_blocks, Some(5));
    assert!(got.report.hybrid_unsupported);
}

#[test]
fn a_chat_with_an_image_is_rendered_and_hashed_with_its_media_items() {
    use crate::hash::MmFeature;
    let tokens: Vec<u32> = (0..33).collect();
    let image = MmFeature { identifier: "9f2c-image-hash".into(), offset: 5, length: 10 };
    let mut h = BlockHasher::new(HashAlgo::Sha256Cbor, Some("0")).unwrap();
    let with_image = RequestExtras { mm: vec![image.clone()], ..RequestExtras::default() };
    let mm_keys: Vec<u64> = h.hash_request(&tokens, BS, &with_image).unwrap().iter().map(|b| b.key.0).collect();
    // B holds the blocks as vLLM hashed them for this image; A holds the same tokens hashed
    // without it (block 0, before the image, is the same in both).
    let mut r = router("", mm_keys.clone(), true);
    r.feed
        .apply(&FeedMessage {
            seq: 3,
            body: Some(Msg::Snapshot(SnapshotChunk { replica: 0, first: true, blocks: keys(&tokens) })),
        })
        .unwrap();
    let chat = br#"{"model":"m","messages":[{"role":"user","content":[
        {"type":"text","text":"What is in this picture?"},
        {"type":"image_url","image_url":{"url":"data:image/png;base64,iVBORw0KGgo="}}]}]}"#;
    let reply = format!(
        r#"{{"request_id":"x","token_ids":{tokens:?},"features":{{"mm_hashes":{{"image":["9f2c-image-hash"]}},
            "mm_placeholders":{{"image":[{{"offset":5,"length":10}}]}}}},"sampling_params":{{}}}}"#
    )
    .into_bytes();
    for round in 0..2 {
        // The profile tokenizes with /tokenize, but a chat with media goes to render, unchanged.
        let call = tokenize(r.on_body(&body("/v1/chat/completions", chat), &(), round));
        assert_eq!((call.path, call.body.as_slice()), ("/v1/chat/completions/render", &chat[..]));
        // Never cached: each round asks again.
        assert_eq!(call.report.tokenizer_cache, None, "round {round}");
        let read = || reply.clone();
        let got = routed(r.on_tokenizer_reply(
            *call.pending,
            &TokenizerReply::Answered { status: Some(b"200"), body: &read },
            &(),
            round,
        ));
        assert_eq!((got.address.as_str(), got.decision.outcome, got.decision.matched), (B, Outcome::Exact, 8));
    }
    // A text-only chat still uses /tokenize.
    let text = br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;
    assert_eq!(tokenize(r.on_body(&body("/v1/chat/completions", text), &(), 9)).path, "/tokenize");
    // Features that do not pair hashes with placeholders are a bad answer.
    let call = tokenize(r.on_body(&body("/v1/chat/completions", chat), &(), 10));
    let bad = format!(r#"{{"token_ids":{tokens:?},"features":{{"mm_hashes":{{"image":["a","b"]}},"mm_placeholders":{{"image":[{{"offset":5,"length":10}}]}}}}}}"#).into_bytes();
    let read = || bad.clone();
    let got = routed(r.on_tokenizer_reply(
        *call.pending,
        &TokenizerReply::Answered { status: Some(b"200"), body: &read },
        &(),
        10,
    ));
    assert_eq!(got.report.tokenizer_failure, Some(TokenizerFailure::BadResponse));
}

#[test]
fn a_catch_all_profile_over_replicas_hashing_differently_keeps_each_models_tokenizations() {
    // Model m1 runs on A with seed "0", model m2 on B with seed "1"; one catch-all profile
    // names no hash settings, so each request hashes as its model's replicas do.
    let json = format!(r#"{{"profiles":[{{"name":"any","models":["*"],"kv_events":true,"block_size":{BS}}}]}}"#);
    let mut r = Router::new(Compiled::from_json(json.as_bytes(), None).unwrap(), 2);
    let text: Vec<u32> = (0..32).collect();
    let ids: Vec<u32> = (500..532).collect();
    let seeded = |seed: &str, tokens: &[u32]| {
        let mut h = BlockHasher::new(HashAlgo::Sha256Cbor, Some(seed)).unwrap();
        h.hash_request(tokens, BS, &RequestExtras::default()).unwrap().iter().map(|b| b.key.0).collect::<Vec<_>>()
    };
    let replica = |id: u32, address: &str, model: &str, seed: &str| Replica {
        id,
        name: format!("r{id}"),
        address: address.into(),
        models: vec![model.into()],
        up: true,
        dp_rank: 0,
        hash: Some(settings(seed, BS as u32)),
        dp_size: 1,
        kv_groups: vec![],
        lora_adapters: vec![],
        mirror_incomplete: false,
    };
    r.feed.begin_subscription();
    for (seq, b) in [
        Msg::Replicas(ReplicaTable { replicas: vec![replica(0, A, "m1", "0"), replica(1, B, "m2", "1")] }),
        Msg::Snapshot(SnapshotChunk { replica: 0, first: true, blocks: seeded("0", &text) }),
        Msg::Snapshot(SnapshotChunk { replica: 1, first: true, blocks: seeded("1", &ids) }),
        Msg::SnapshotComplete(SnapshotComplete {}),
    ]
    .into_iter()
    .enumerate()
    {
        r.feed.apply(&FeedMessage { seq: seq as u64, body: Some(b) }).unwrap();
    }
    let m1 = br#"{"model":"m1","prompt":"a text prompt"}"#;
    let m2 = format!(r#"{{"model":"m2","prompt":{ids:?}}}"#);
    let call = tokenize(r.on_body(&body(COMPLETIONS, m1), &(), 0));
    let got = routed(answer(&mut r, *call.pending, &text, 0));
    assert_eq!((got.address.as_str(), got.decision.outcome, got.decision.matched), (A, Outcome::Exact, 8));
    for round in 1..3 {
        let got = routed(r.on_body(&body(COMPLETIONS, m2.as_bytes()), &(), round));
        assert_eq!((got.address.as_str(), got.decision.outcome, got.decision.matched), (B, Outcome::Exact, 8));
        // Back to m1: its tokenization is still cached and still hashes as A does.
        let got = routed(r.on_body(&body(COMPLETIONS, m1), &(), round));
        assert_eq!((got.address.as_str(), got.decision.matched), (A, 8), "round {round}");
        assert!(got.report.tokenizer_cache.is_some_and(CacheLookup::is_hit), "round {round}");
    }
}
