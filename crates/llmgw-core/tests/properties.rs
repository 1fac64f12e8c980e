//! Random event streams against naive models: the mirror (reference counts, net changes,
//! filtering), the index (holders, per-replica counts, leading-prefix scores) and the wire
//! codec (both encodings, both hash forms).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::arithmetic_side_effects
)]

use llmgw_core::event::EventBatch;
use llmgw_core::hash::BlockKey;
use llmgw_core::index::ReplicaId;
use llmgw_core::index::ReplicaIndex;
use llmgw_core::mirror::{EngineMirror, NetChange};
use llmgw_core::wire::{
    decode_batch, encode_batch, Encoding, HashForm, WireBatch, WireBlockRemoved, WireBlockStored, WireEvent,
};
use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet};

/// Small key space so that duplicates, re-stores and removals of unheld blocks are common.
fn key() -> impl Strategy<Value = u64> {
    prop_oneof![0u64..48, Just(u64::MAX), any::<u64>()]
}

fn medium() -> impl Strategy<Value = Option<String>> {
    prop_oneof![8 => Just(Some("GPU".to_owned())), 1 => Just(None), 1 => Just(Some("CPU".to_owned()))]
}

fn group() -> impl Strategy<Value = Option<i64>> {
    prop_oneof![8 => Just(Some(0)), 1 => Just(None), 1 => Just(Some(1)), 1 => Just(Some(20)), 1 => Just(Some(-1))]
}

fn locality() -> impl Strategy<Value = Option<String>> {
    prop_oneof![8 => Just(None), 1 => Just(Some("LOCAL".to_owned())), 1 => Just(Some("REMOTE".to_owned()))]
}

fn event() -> impl Strategy<Value = WireEvent> {
    prop_oneof![
        6 => (prop::collection::vec(key(), 1..6), medium(), group(), locality(), prop::option::of(key())).prop_map(
            |(hashes, medium, group_idx, locality, parent)| {
                let n = hashes.len();
                WireEvent::BlockStored(WireBlockStored {
                    block_hashes: hashes,
                    parent_block_hash: parent,
                    token_ids: vec![7; n * 4],
                    block_size: 4,
                    medium,
                    group_idx,
                    locality,
                    extra_keys: Some(vec![None; n]),
                    ..Default::default()
                })
            }
        ),
        5 => (key(), medium(), group(), locality()).prop_map(|(h, medium, group_idx, locality)| {
            WireEvent::BlockRemoved(WireBlockRemoved { block_hashes: vec![h], medium, group_idx, locality, ownership: None })
        }),
        1 => Just(WireEvent::AllBlocksCleared),
        1 => Just(WireEvent::Unknown { type_name: "FutureEvent".to_owned() }),
    ]
}

fn batch() -> impl Strategy<Value = WireBatch> {
    (prop::collection::vec(event(), 0..12), any::<u32>()).prop_map(|(events, t)| WireBatch {
        ts: f64::from(t),
        events,
        data_parallel_rank: Some(0),
    })
}

/// (replica, batch, or an explicit reset of that replica)
fn stream() -> impl Strategy<Value = Vec<(u16, Option<WireBatch>)>> {
    prop::collection::vec((0u16..3, prop_oneof![20 => batch().prop_map(Some), 1 => Just(None)]), 1..40)
}

/// The group an event is mirrored in (every group below the bound; each apart), if any.
fn relevant(medium: &Option<String>, group: Option<i64>, locality: &Option<String>) -> Option<u32> {
    let g = u32::try_from(group.unwrap_or(0)).ok().filter(|&g| g < llmgw_core::hash::MAX_KV_GROUPS)?;
    (matches!(medium.as_deref(), None | Some("GPU")) && matches!(locality.as_deref(), None | Some("LOCAL")))
        .then_some(g)
}

fn in_group(k: u64, g: u32) -> u64 {
    llmgw_core::hash::group_key(llmgw_core::BlockKey(k), g).0
}

fn naive_apply(model: &mut BTreeMap<u64, u32>, b: &WireBatch) {
    for ev in &b.events {
        match ev {
            WireEvent::BlockStored(s) => {
                if let Some(g) = relevant(&s.medium, s.group_idx, &s.locality) {
                    s.block_hashes.iter().for_each(|k| *model.entry(in_group(*k, g)).or_default() += 1)
                }
            }
            WireEvent::BlockRemoved(r) => {
                let Some(g) = relevant(&r.medium, r.group_idx, &r.locality) else { continue };
                for k in &r.block_hashes {
                    let k = in_group(*k, g);
                    if let Some(c) = model.get_mut(&k) {
                        *c -= 1;
                        if *c == 0 {
                            model.remove(&k);
                        }
                    }
                }
            }
            WireEvent::AllBlocksCleared => model.clear(),
            _ => {}
        }
    }
}

fn naive_leading(set: &BTreeSet<u64>, keys: &[u64]) -> u32 {
    keys.iter().take_while(|k| set.contains(k)).count() as u32
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn mirror_and_index_match_a_naive_model(stream in stream(), queries in prop::collection::vec(prop::collection::vec(0u64..48, 0..10), 1..8)) {
        let mut mirrors: Vec<EngineMirror> = (0..3).map(|_| EngineMirror::new(None)).collect();
        let mut models: Vec<BTreeMap<u64, u32>> = vec![BTreeMap::new(); 3];
        let mut index = ReplicaIndex::new();
        let mut changes = Vec::new();
        for (r, step) in &stream {
            let r = *r;
            let i = usize::from(r);
            let before: BTreeSet<u64> = models[i].keys().copied().collect();
            changes.clear();
            match step {
                Some(b) => {
                    naive_apply(&mut models[i], b);
                    mirrors[i].apply(&EventBatch::from(b.clone()), &mut changes);
                }
                None => {
                    models[i].clear();
                    mirrors[i].reset(&mut changes);
                }
            }
            let after: BTreeSet<u64> = models[i].keys().copied().collect();
            // Net changes are exactly the difference, each key at most once.
            let added: Vec<u64> = changes.iter().filter(|c| matches!(c, NetChange::Added(_))).map(|c| c.key().0).collect();
            let removed: Vec<u64> = changes.iter().filter(|c| matches!(c, NetChange::Removed(_))).map(|c| c.key().0).collect();
            let added_set: BTreeSet<u64> = added.iter().copied().collect();
            let removed_set: BTreeSet<u64> = removed.iter().copied().collect();
            prop_assert_eq!(added.len(), added_set.len());
            prop_assert_eq!(removed.len(), removed_set.len());
            prop_assert_eq!(&added_set, &after.difference(&before).copied().collect::<BTreeSet<_>>());
            prop_assert_eq!(&removed_set, &before.difference(&after).copied().collect::<BTreeSet<_>>());
            for (k, c) in &models[i] {
                prop_assert_eq!(mirrors[i].count(BlockKey(*k)), *c);
            }
            prop_assert_eq!(mirrors[i].keys(), after.iter().copied().map(BlockKey).collect::<Vec<_>>());
            index.apply(ReplicaId(r), &changes);
        }
        let universe: BTreeSet<u64> = stream
            .iter()
            .filter_map(|(_, b)| b.as_ref())
            .flat_map(|b| b.events.iter())
            .flat_map(|e| match e {
                WireEvent::BlockStored(s) => s.block_hashes.clone(),
                WireEvent::BlockRemoved(r) => r.block_hashes.clone(),
                _ => Vec::new(),
            })
            .chain(0..48)
            .collect();
        for (i, model) in models.iter().enumerate() {
            let r = i as u16;
            let set: BTreeSet<u64> = model.keys().copied().collect();
            for k in &universe {
                prop_assert_eq!(index.holds(ReplicaId(r), BlockKey(*k)), set.contains(k), "replica {} key {}", r, k);
            }
            prop_assert_eq!(index.replica_blocks(ReplicaId(r)), set.len() as u64);
            for q in &queries {
                let s = index.score(&q.iter().copied().map(BlockKey).collect::<Vec<_>>());
                prop_assert_eq!(s.leading.get(i).copied().unwrap_or(0), naive_leading(&set, q));
            }
        }
    }

    #[test]
    fn codec_round_trips(b in batch()) {
        // The positional (≤ 0.23) form has no fields newer than 0.23.
        let mut legacy = b.clone();
        for ev in &mut legacy.events {
            match ev {
                WireEvent::BlockStored(s) => {
                    s.locality = None;
                    s.ownership = None;
                    s.session_id = None;
                    s.lookahead_token_ids = None;
                }
                WireEvent::BlockRemoved(r) => {
                    r.locality = None;
                    r.ownership = None;
                }
                _ => {}
            }
        }
        for (enc, want) in [(Encoding::Tagged, &b), (Encoding::Positional, &legacy)] {
            for form in [HashForm::Int, HashForm::Bytes] {
                let bytes = encode_batch(&b, enc, form);
                prop_assert_eq!(&decode_batch(&bytes).unwrap(), want);
            }
        }
    }

    #[test]
    fn decoder_never_panics_on_mutations(b in batch(), flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6), cut in any::<prop::sample::Index>()) {
        let whole = encode_batch(&b, Encoding::Tagged, HashForm::Int);
        let mut bytes = whole.clone();
        for (at, v) in flips {
            let i = at.index(bytes.len());
            bytes[i] = v;
        }
        let _ = decode_batch(&bytes);
        // A strict prefix of a valid batch is incomplete. (Not of a mutated one: a flipped
        // length byte can make a prefix a complete batch.)
        let n = cut.index(whole.len());
        prop_assert!(decode_batch(&whole[..n]).is_err());
        let _ = decode_batch(&bytes[..cut.index(bytes.len())]);
    }

    #[test]
    fn index_snapshots_replace_a_replica(keys_a in prop::collection::btree_set(any::<u64>(), 0..300), keys_b in prop::collection::btree_set(any::<u64>(), 0..300)) {
        let mut index = ReplicaIndex::new();
        let holders = |ix: &ReplicaIndex, r: u16| -> BTreeSet<u64> {
            keys_a.iter().chain(&keys_b).copied().filter(|k| ix.holds(ReplicaId(r), BlockKey(*k))).collect()
        };
        index.replace_replica(ReplicaId(5), keys_a.iter().copied().map(BlockKey));
        index.replace_replica(ReplicaId(1), keys_b.iter().copied().map(BlockKey));
        index.replace_replica(ReplicaId(40), keys_a.iter().copied().map(BlockKey)); // another page
        prop_assert_eq!(&holders(&index, 5), &keys_a);
        index.replace_replica(ReplicaId(5), keys_b.iter().copied().map(BlockKey));
        prop_assert_eq!(&holders(&index, 5), &keys_b);
        prop_assert_eq!(&holders(&index, 1), &keys_b);
        prop_assert_eq!(&holders(&index, 40), &keys_a);
        index.clear_replica(ReplicaId(40));
        prop_assert_eq!(index.entries(), 2 * keys_b.len() as u64);
        index.clear_replica(ReplicaId(1));
        index.clear_replica(ReplicaId(5));
        prop_assert_eq!(index.entries(), 0);
    }
}
