//! The agent's shared state: one mirror per engine, the feed subscribers and the counters.
//!
//! Engine threads apply batches here; every net change is pushed, under the same lock, to each
//! subscriber's bounded queue with that subscription's next sequence number. A new subscriber,
//! or one whose queue overflowed, is marked `resync`: while marked it receives nothing, and its
//! stream task then builds the replica table and snapshot under the hub lock, so the snapshot
//! and the deltas that follow it are consistent.
//!
//! * [`state`]: engines (mirror, health, counters), the replica table, and publishing to the
//!   subscribers' queues.
//! * [`queue`]: one subscriber's bounded queue.
//! * [`subscribers`]: subscribing, snapshots for new and lagging subscribers.
//!
//! What the HTTP server shows of this state is in [`crate::http::exposition`].

mod queue;
mod state;
mod subscribers;

pub use queue::{FeedCounters, Subscriber, CHUNK_BLOCKS};
pub use state::{EngineCounters, EngineState, Health, HubState};

use crate::config::EngineSpec;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

pub struct Hub {
    state: Mutex<HubState>,
    pub started: Instant,
}

impl Hub {
    pub fn new(specs: Vec<EngineSpec>, max_queue: usize, max_blocks: usize) -> Arc<Hub> {
        Arc::new(Hub { state: Mutex::new(HubState::new(specs, max_queue, max_blocks)), started: Instant::now() })
    }

    /// The state, under the hub lock. A thread that panicked while holding it cannot leave it
    /// half-updated in a way later readers depend on, so a poisoned lock is used as is.
    pub fn state(&self) -> MutexGuard<'_, HubState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The state if the hub lock is free (tests check what runs outside it).
    #[cfg(test)]
    pub(crate) fn try_state(&self) -> Option<MutexGuard<'_, HubState>> {
        self.state.try_lock().ok()
    }

    pub fn engine_count(&self) -> usize {
        self.state().engines.len()
    }

    pub fn rebuild_flag(&self, engine: usize) -> Option<Arc<AtomicBool>> {
        self.state().engines.get(engine).map(|e| e.rebuild.clone())
    }
}

/// Hubs and batches for the tests of the hub and of what the HTTP server shows.
#[cfg(test)]
#[allow(clippy::arithmetic_side_effects)]
pub(crate) mod fixtures {
    use super::*;
    use crate::config::Config;
    use llmgw_core::event::EventBatch;
    use llmgw_core::feed::{FeedMessage, FeedState};
    use llmgw_core::wire::{encode_batch, Encoding, HashForm, WireBatch, WireBlockRemoved, WireBlockStored, WireEvent};

    pub fn hub(engines: u32, max_queue: usize) -> Arc<Hub> {
        let mut text = String::new();
        for i in 0..engines {
            text.push_str(&format!(
                "[[replicas]]\nname = \"r{i}\"\naddress = \"127.0.0.1:{}\"\nendpoint = \"tcp://127.0.0.1:{}\"\n",
                8000 + i,
                5000 + i
            ));
        }
        let cfg = Config::parse(&text).unwrap();
        Hub::new(cfg.engines(), max_queue, 1 << 30)
    }

    pub fn stored(hashes: Vec<u64>) -> WireEvent {
        WireEvent::BlockStored(WireBlockStored { block_hashes: hashes, block_size: 16, ..Default::default() })
    }

    pub fn removed(hashes: Vec<u64>) -> WireEvent {
        WireEvent::BlockRemoved(WireBlockRemoved { block_hashes: hashes, ..Default::default() })
    }

    pub fn batch(events: Vec<WireEvent>) -> EventBatch {
        let w = WireBatch { ts: 1.0, events, data_parallel_rank: None };
        EventBatch::decode(&encode_batch(&w, Encoding::Tagged, HashForm::Int)).unwrap()
    }

    pub fn drain(sub: &Subscriber, hub: &Hub) -> Vec<FeedMessage> {
        std::iter::from_fn(|| sub.pop(hub)).collect()
    }

    /// A small deterministic generator (no dependency needed).
    pub struct Lcg(pub u64);
    impl Lcg {
        pub fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            self.0 >> 33
        }
    }

    pub fn state_of(st: &FeedState, engines: u32) -> Vec<Vec<u64>> {
        (0..engines)
            .map(|r| {
                let mut v: Vec<u64> = (1..=64u64)
                    .filter(|k| st.index.score(&[llmgw_core::BlockKey(*k)]).leading[r as usize] == 1)
                    .collect();
                v.sort_unstable();
                v
            })
            .collect()
    }
}
