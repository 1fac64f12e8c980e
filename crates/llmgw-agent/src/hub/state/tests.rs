//! Tests of `state.rs`.

use super::*;
use crate::config::Config;
use crate::hub::fixtures::*;
use crate::hub::Hub;
use llmgw_core::feed::FeedState;

#[test]
fn down_replica_leaves_and_comes_back_clean() {
    let h = hub(2, 64);
    h.state().apply(0, 0, &batch(vec![stored(vec![1, 2])]));
    let sub = h.subscribe("t".into());
    let mut fs = FeedState::default();
    for m in drain(&sub, &h) {
        fs.apply(&m).unwrap();
    }
    assert!(h.state().set_health(0, Health::Http, false, "unreachable"));
    h.state().apply(0, 1, &batch(vec![stored(vec![3])]));
    for m in drain(&sub, &h) {
        fs.apply(&m).unwrap();
    }
    assert_eq!(state_of(&fs, 2)[0], Vec::<u64>::new());
    assert!(!fs.replicas[0].up);
    // Both sources must agree before it is up again.
    assert!(!h.state().set_health(0, Health::Publisher, false, "publisher_gone"));
    assert!(!h.state().set_health(0, Health::Http, true, "reachable"));
    assert!(!h.state().engines[0].up);
    assert!(h.state().set_health(0, Health::Publisher, true, "publisher_back"));
    assert!(h.state().engines[0].rebuild.load(Ordering::SeqCst));
    for m in drain(&sub, &h) {
        fs.apply(&m).unwrap();
    }
    assert!(fs.replicas[0].up);
    assert_eq!(h.state().engines[0].mirror.len(), 0);
}

#[test]
fn discovered_engines_join_and_leave_the_table() {
    let h = hub(1, 64);
    let sub = h.subscribe("t".into());
    let mut fs = FeedState::default();
    for m in drain(&sub, &h) {
        fs.apply(&m).unwrap();
    }
    let mut spec = h.state().engines[0].spec.clone();
    spec.replica = "pool-10.0.0.7".into();
    let idx = h.state().add_engine(spec).unwrap();
    assert_eq!(idx, 1);
    h.state().apply(idx, 0, &batch(vec![stored(vec![5, 6])]));
    for m in drain(&sub, &h) {
        fs.apply(&m).unwrap();
    }
    assert_eq!(fs.replicas.len(), 2);
    assert_eq!(u32::from(fs.replicas[1].id), 1);
    assert_eq!(state_of(&fs, 2)[1], vec![5, 6]);
    h.state().remove_engine(idx);
    assert!(h.state().engines[idx].stop.load(Ordering::SeqCst));
    for m in drain(&sub, &h) {
        fs.apply(&m).unwrap();
    }
    assert_eq!(fs.replicas.len(), 1);
    assert_eq!(state_of(&fs, 2)[1], Vec::<u64>::new());
    // Late events for a removed engine change nothing; a new engine gets a fresh id.
    h.state().apply(idx, 1, &batch(vec![stored(vec![7])]));
    assert_eq!(h.state().engines[idx].mirror.len(), 0);
    // While something still holds the removed engine's stop flag (its thread), its id is
    // not reused; once released, the next engine takes it.
    let held = h.state().engines[idx].stop.clone();
    let spec = h.state().engines[0].spec.clone();
    assert_eq!(h.state().add_engine(spec.clone()), Some(2));
    assert!(!crate::http::exposition::metrics_text(&h.state()).contains("pool-10.0.0.7"));
    drop(held);
    assert_eq!(h.state().add_engine(spec), Some(1));
    for m in drain(&sub, &h) {
        fs.apply(&m).unwrap();
    }
    assert_eq!(fs.replicas.iter().map(|r| u32::from(r.id)).collect::<Vec<_>>(), vec![0, 1, 2]);
    assert_eq!(state_of(&fs, 2)[1], Vec::<u64>::new(), "the reused id starts empty");
}

#[test]
fn churning_discovery_reuses_ids_instead_of_running_out() {
    let h = hub(1, 1 << 20);
    let spec = h.state().engines[0].spec.clone();
    // 70,000 replicas come and go (more than the 65,536 ids a filter can address).
    for _ in 0..70_000 {
        let idx = h.state().add_engine(spec.clone()).unwrap();
        assert_eq!(idx, 1);
        h.state().remove_engine(idx);
    }
    assert_eq!(h.state().engines.len(), 2);
    // Ids run out only when that many are live at once: refused and counted.
    let mut st = h.state();
    for _ in 1..MAX_ENGINES {
        assert!(st.add_engine(spec.clone()).is_some());
    }
    assert_eq!(st.add_engine(spec), None);
    assert_eq!(st.discovery_refused.get(crate::counters::Refused::IdsExhausted), 1);
    let text = crate::http::exposition::metrics_text(&st);
    assert!(text.contains("llmgw_agent_discovery_refused_total{reason=\"ids_exhausted\"} 1"), "{text}");
}

#[test]
fn the_table_carries_each_engines_hash_settings_and_data_parallel_size() {
    let cfg = Config::parse(
        "[hash]\nseed = \"0\"\nblock_size = 32\n[[replicas]]\nname = \"dp\"\naddress = \"127.0.0.1:1\"\n\
             endpoint = \"tcp://127.0.0.1:2\"\ndp_ranks = 2\n[[replicas]]\nname = \"one\"\naddress = \"127.0.0.1:3\"\n\
             endpoint = \"tcp://127.0.0.1:4\"\nhash = { algo = \"sha256\" }\n",
    )
    .unwrap();
    let h = Hub::new(cfg.engines(), 64, 10);
    let table = h.state().table();
    let got: Vec<_> = table
        .replicas
        .iter()
        .map(|r| (r.name.as_str(), r.dp_rank, r.dp_size, r.data_parallel(), r.hash.as_ref().unwrap().spec().unwrap()))
        .collect();
    let spec = |algo, seed: Option<&str>, block_size| llmgw_core::hash::HashSpec {
        algo,
        seed: seed.map(str::to_owned),
        block_size,
        lookahead: 0,
    };
    use llmgw_core::hash::HashAlgo::{Sha256, Sha256Cbor};
    assert_eq!(
        got,
        vec![
            ("dp", 0, 2, true, spec(Sha256Cbor, Some("0"), 32)),
            ("dp", 1, 2, true, spec(Sha256Cbor, Some("0"), 32)),
            ("one", 0, 1, false, spec(Sha256, None, 16)),
        ]
    );
}

#[test]
fn an_engine_publishing_lookahead_hashes_not_configured_is_named_once() {
    let h = hub(1, 64);
    let stored = llmgw_core::wire::WireEvent::BlockStored(llmgw_core::wire::WireBlockStored {
        block_hashes: vec![9],
        token_ids: (0..16).collect(),
        block_size: 16,
        lookahead_token_ids: Some(vec![vec![16]]),
        ..Default::default()
    });
    assert!(h.state().lookahead_alarms().is_empty());
    h.state().apply(0, 0, &batch(vec![stored.clone()]));
    assert_eq!(h.state().engines[0].mirror.stats().lookahead_tokens, Some(1));
    assert_eq!(h.state().lookahead_alarms(), vec![("r0#0".to_owned(), 1, 0)]);
    h.state().apply(0, 1, &batch(vec![stored]));
    assert!(h.state().lookahead_alarms().is_empty(), "once");
    // Configured as it publishes: nothing to say.
    h.state().engines[0].spec.hash.lookahead_tokens = 1;
    assert!(h.state().lookahead_alarms().is_empty());
}

#[test]
fn every_kv_cache_group_is_mirrored_apart_and_named_in_the_table() {
    use llmgw_core::hash::group_key;
    use llmgw_core::wire::{WireBlockRemoved, WireBlockStored, WireEvent};
    let h = hub(1, 64);
    let sub = h.subscribe("t".into());
    let mut fs = FeedState::default();
    for m in drain(&sub, &h) {
        fs.apply(&m).unwrap();
    }
    // vLLM 0.33 with a hybrid spec: the same hashes in group 0 (full attention) and, for
    // the blocks still inside the window, group 1 (sliding window). No token ids: these
    // made-up hashes are credited unverified (with tokens that do not hash to them, the
    // claims would be rejected).
    let store = |group: i64, kind: &str, window: Option<i64>, hashes: Vec<u64>| {
        WireEvent::BlockStored(WireBlockStored {
            block_hashes: hashes,
            token_ids: Vec::new(),
            block_size: 16,
            group_idx: Some(group),
            kv_cache_spec_kind: Some(kind.into()),
            kv_cache_spec_sliding_window: window,
            ..Default::default()
        })
    };
    h.state().apply(
        0,
        0,
        &batch(vec![store(0, "full_attention", None, vec![1, 2, 3]), store(1, "sliding_window", Some(32), vec![3])]),
    );
    let mirror_keys = h.state().engines[0].mirror.keys();
    let mut want = vec![
        llmgw_core::BlockKey(1),
        llmgw_core::BlockKey(2),
        llmgw_core::BlockKey(3),
        group_key(llmgw_core::BlockKey(3), 1),
    ];
    want.sort_unstable();
    assert_eq!(mirror_keys, want);
    for m in drain(&sub, &h) {
        fs.apply(&m).unwrap();
    }
    let groups = &fs.replicas[0].kv_groups;
    assert_eq!(groups.len(), 2, "{groups:?}");
    assert_eq!((groups[1].idx, groups[1].kind), (1, llmgw_core::fleet::KvGroupKind::Sliding { window: 32 }));
    assert!(fs.index.holds(llmgw_core::ReplicaId(0), group_key(llmgw_core::BlockKey(3), 1)));
    // A removal names its group: group 1's copy goes, group 0's stays.
    let rm =
        WireEvent::BlockRemoved(WireBlockRemoved { block_hashes: vec![3], group_idx: Some(1), ..Default::default() });
    h.state().apply(0, 1, &batch(vec![rm]));
    assert!(h.state().engines[0].mirror.contains(llmgw_core::BlockKey(3)));
    assert!(!h.state().engines[0].mirror.contains(group_key(llmgw_core::BlockKey(3), 1)));
    // Group indexes past the bound are counted, not mirrored.
    h.state().apply(0, 2, &batch(vec![store(99, "full_attention", None, vec![7])]));
    assert_eq!(h.state().engines[0].mirror.stats().ignored_group, 1);
}

#[test]
fn flood_past_the_block_limit_resets_the_engine() {
    let cfg =
        Config::parse("[[replicas]]\nname = \"r\"\naddress = \"127.0.0.1:1\"\nendpoint = \"tcp://127.0.0.1:2\"\n")
            .unwrap();
    let h = Hub::new(cfg.engines(), 64, 10);
    h.state().apply(0, 0, &batch(vec![stored((1..=10).collect())]));
    assert_eq!(h.state().engines[0].mirror.len(), 10);
    let sub = h.subscribe("t".into());
    let _ = crate::hub::fixtures::drain(&sub, &h);
    h.state().apply(0, 1, &batch(vec![stored((11..=1000).collect())]));
    // Subscribers see the reset, never the flood's blocks.
    let msgs = crate::hub::fixtures::drain(&sub, &h);
    assert!(msgs.iter().all(|m| !matches!(m.body, Some(Body::Delta(_)))), "{msgs:?}");
    assert!(msgs.iter().any(|m| matches!(m.body, Some(Body::Reset(_)))));
    let st = h.state();
    assert_eq!(st.engines[0].mirror.len(), 0);
    assert_eq!(st.engines[0].counters.block_limit_hits, 1);
    assert_eq!(st.engines[0].counters.resets.get("block_limit"), Some(&1));
}

#[test]
fn an_engine_that_reports_its_cache_size_is_held_to_twice_it() {
    let cfg =
        Config::parse("[[replicas]]\nname = \"r\"\naddress = \"127.0.0.1:1\"\nendpoint = \"tcp://127.0.0.1:2\"\n")
            .unwrap();
    let h = Hub::new(cfg.engines(), 64, 1 << 24);
    // 3,000 blocks of KV cache: 6,000 at most in its mirror (the configured 16 Mi is no bound).
    h.state().set_engine_blocks(0, 3000);
    h.state().apply(0, 0, &batch(vec![stored((1..=6000).collect())]));
    assert_eq!(h.state().engines[0].mirror.len(), 6000);
    h.state().apply(0, 1, &batch(vec![stored((6001..=6001).collect())]));
    let st = h.state();
    assert_eq!(st.engines[0].mirror.len(), 0);
    assert_eq!(st.engines[0].counters.block_limit_hits, 1);
    drop(st);
    // A tiny reported cache still leaves room for MIN_BLOCK_LIMIT blocks; the configured
    // limit stays the ceiling.
    let h = Hub::new(cfg.engines(), 64, 5000);
    h.state().set_engine_blocks(0, 10);
    h.state().apply(0, 0, &batch(vec![stored((1..=4096).collect())]));
    assert_eq!(h.state().engines[0].mirror.len(), 4096);
    h.state().set_engine_blocks(0, 1 << 40);
    h.state().apply(0, 1, &batch(vec![stored((4097..=5001).collect())]));
    assert_eq!(h.state().engines[0].counters.block_limit_hits, 1);
}
