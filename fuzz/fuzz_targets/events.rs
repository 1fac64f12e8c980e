//! Fuzzes a stream of KV-event batches (`llmgw_fuzz::frames`: each a 2-byte length, then a
//! msgpack payload) applied one after another to an engine's mirror, with hash parity on, and
//! its net changes to the replica index. Nothing may panic, and after every batch the index
//! must hold exactly the mirror's blocks for that replica (the net changes are the whole truth).
#![no_main]

use libfuzzer_sys::fuzz_target;
use llmgw_core::event::EventBatch;
use llmgw_core::hash::{BlockHasher, HashAlgo};
use llmgw_core::index::ReplicaIndex;
use llmgw_core::mirror::EngineMirror;
use llmgw_core::ReplicaId;

fuzz_target!(|data: &[u8]| {
    let mut mirror = EngineMirror::new(BlockHasher::new(HashAlgo::Sha256Cbor, Some("0")).ok());
    mirror.set_lora_path("adapter", "/adapters/a");
    let mut index = ReplicaIndex::new();
    let r = ReplicaId(1);
    let mut changes = Vec::new();
    for payload in llmgw_fuzz::frames(data) {
        let Ok(batch) = EventBatch::decode(payload) else { continue };
        changes.clear();
        mirror.apply(&batch, &mut changes);
        index.apply(r, &changes);
        let keys = mirror.keys();
        assert_eq!(index.replica_blocks(r), keys.len() as u64, "index and mirror disagree on the block count");
        for k in &keys {
            assert!(index.holds(r, *k), "the mirror holds {k:?}, the index does not");
        }
        let _ = index.score(&keys);
        let _ = mirror.stats().parity.match_ratio();
    }
    changes.clear();
    mirror.reset(&mut changes);
    index.apply(r, &changes);
    assert_eq!(index.replica_blocks(r), 0, "a reset mirror's removals must empty the index");
    assert!(mirror.is_empty());
});
