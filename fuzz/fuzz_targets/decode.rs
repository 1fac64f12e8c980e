//! Fuzzes the KV-event decoder and the mirror behind it: any byte string must decode to a batch
//! or a typed error, never panic, and a decoded batch must apply cleanly.
#![no_main]

use libfuzzer_sys::fuzz_target;
use llmgw_core::event::EventBatch;
use llmgw_core::hash::{BlockHasher, HashAlgo};
use llmgw_core::index::ReplicaIndex;
use llmgw_core::mirror::EngineMirror;

fuzz_target!(|data: &[u8]| {
    if let Ok(batch) = EventBatch::decode(data) {
        let mut mirror = EngineMirror::new(BlockHasher::new(HashAlgo::Sha256Cbor, Some("0")).ok());
        let mut changes = Vec::new();
        mirror.apply(&batch, &mut changes);
        let mut index = ReplicaIndex::new();
        index.apply(llmgw_core::ReplicaId(0), &changes);
        let keys = mirror.keys();
        let _ = index.score(&keys);
    }
});
