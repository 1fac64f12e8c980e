//! Feed subscribers: subscribing, and a fresh table and snapshot for a new subscriber or one
//! that fell behind (its queue is [`super::queue`]).
//!
//! A snapshot is built engine by engine, taking the hub lock once per engine for the copy of
//! its keys (sorting and chunking happen outside), so ingestion is never stalled for longer
//! than one engine's copy. Meanwhile the subscriber collects what is published: a change to an
//! engine already copied is kept (it happened after its copy), one to an engine not yet copied
//! is dropped (its copy will include it), anything else is kept; all of it follows the
//! snapshot, in order. (Replaying everything would be correct too, since a subscriber's index
//! is a set per replica and the changes are applied in order; dropping what the copies already
//! include only saves messages.)

use super::queue::{snapshot_chunks, Building, Subscriber};
use super::Hub;
use llmgw_core::feed::{Body, FeedMessage, LoadReport, ReplicaLoad, SnapshotComplete};
use std::collections::BTreeSet;
use std::sync::Arc;

/// Builds that may be abandoned (the subscriber's backlog overflowed meanwhile) before one is
/// made under the hub lock throughout.
const INCREMENTAL_ATTEMPTS: u32 = 3;

impl Subscriber {
    /// The next message for this subscription, building a fresh table and snapshot first if
    /// it is new or fell behind. `None` when nothing is queued (wait on `notify`).
    pub fn pop(&self, hub: &Hub) -> Option<FeedMessage> {
        self.prepare(hub);
        Self::pop_front(&mut self.queue())
    }

    /// Builds the table and snapshot if a resync is due (what [`Self::pop`] would do first).
    pub fn prepare(&self, hub: &Hub) {
        if self.needs_resync() {
            self.resync(hub);
        }
    }

    /// Builds the table and snapshot engine by engine; after [`INCREMENTAL_ATTEMPTS`]
    /// abandoned builds, under the hub lock throughout.
    fn resync(&self, hub: &Hub) {
        for _ in 0..INCREMENTAL_ATTEMPTS {
            let Some((generation, mut bodies, ids)) = self.build_begin(hub) else { return };
            let mut complete = true;
            for id in ids {
                match self.build_engine(hub, generation, id) {
                    Some(chunks) => bodies.extend(chunks),
                    None => {
                        complete = false;
                        break;
                    }
                }
            }
            if complete && self.build_finish(hub, generation, bodies) {
                return;
            }
        }
        let st = hub.state();
        let mut q = self.queue();
        if q.resync {
            q.msgs.clear();
            q.gathering = None;
            q.bytes = 0;
            q.building = None;
            for body in st.snapshot_bodies() {
                Self::push(&mut q, body);
            }
            q.resync = false;
            q.resyncs = q.resyncs.saturating_add(1);
        }
    }

    /// Starts a build: the table, and the engines it will copy. `None` if no resync is due.
    fn build_begin(&self, hub: &Hub) -> Option<(u64, Vec<Body>, Vec<u32>)> {
        let st = hub.state();
        let mut q = self.queue();
        if !q.resync {
            return None;
        }
        let ids: Vec<u32> = st.live().map(|e| e.spec.id).collect();
        q.build_gen = q.build_gen.saturating_add(1);
        let generation = q.build_gen;
        q.building = Some(Building {
            generation,
            listed: ids.iter().copied().collect(),
            taken: BTreeSet::new(),
            pending: Vec::new(),
            pending_bytes: 0,
        });
        Some((generation, vec![Body::Replicas(st.table())], ids))
    }

    /// Copies engine `id`'s keys (one short hold of the hub lock) and chunks them outside it.
    /// `None` if the build was abandoned.
    fn build_engine(&self, hub: &Hub, generation: u64, id: u32) -> Option<Vec<Body>> {
        let mut keys = {
            let st = hub.state();
            let mut q = self.queue();
            let b = q.building.as_mut().filter(|b| b.generation == generation)?;
            b.taken.insert(id);
            let e = st.engines.get(usize::try_from(id).ok()?).filter(|e| !e.gone);
            e.map(|e| if e.up { e.mirror.keys_unsorted() } else { Vec::new() }).unwrap_or_default()
        };
        keys.sort_unstable();
        Some(snapshot_chunks(id, &keys))
    }

    /// Queues the snapshot, then what was published meanwhile. False if the build was
    /// abandoned.
    fn build_finish(&self, hub: &Hub, generation: u64, mut bodies: Vec<Body>) -> bool {
        let st = hub.state();
        let mut q = self.queue();
        let Some(b) = q.building.take_if(|b| b.generation == generation) else { return false };
        bodies.push(Body::SnapshotComplete(SnapshotComplete {}));
        let loads: Vec<ReplicaLoad> = st.live().filter_map(|e| e.load.clone()).collect();
        if !loads.is_empty() {
            bodies.push(Body::Load(LoadReport { loads }));
        }
        q.msgs.clear();
        q.gathering = None;
        q.bytes = 0;
        for body in bodies.into_iter().chain(b.pending) {
            Self::push(&mut q, body);
        }
        q.resync = false;
        q.resyncs = q.resyncs.saturating_add(1);
        true
    }
}

impl Hub {
    /// Registers a subscriber unless `feed.max_subscribers` are live (then counted, `None`);
    /// `batches`: it applies `BlockDeltas`.
    pub fn try_subscribe(&self, name: String, batches: bool) -> Option<Arc<Subscriber>> {
        {
            let mut st = self.state();
            if st.live_subscribers() >= st.max_subscribers {
                st.feed.subscribers_refused = st.feed.subscribers_refused.saturating_add(1);
                return None;
            }
        }
        Some(self.subscribe_as(name, batches))
    }

    /// Registers a subscriber that takes one message per change; its first messages will be
    /// the table and a snapshot.
    pub fn subscribe(&self, name: String) -> Arc<Subscriber> {
        self.subscribe_as(name, false)
    }

    /// Registers a subscriber (`batches`: it applies `BlockDeltas`); its first messages will
    /// be the table and a snapshot.
    pub fn subscribe_as(&self, name: String, batches: bool) -> Arc<Subscriber> {
        let sub = Arc::new(Subscriber::new(name, batches));
        let mut st = self.state();
        st.subscribers.retain(|w| w.strong_count() > 0);
        st.subscribers.push(Arc::downgrade(&sub));
        st.feed.subscriptions = st.feed.subscriptions.saturating_add(1);
        drop(st);
        sub.notify.notify_one();
        sub
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hub::fixtures::*;
    use crate::hub::CHUNK_BLOCKS;
    use llmgw_core::feed::FeedState;
    use llmgw_core::feed::{BlockDelta, SnapshotChunk};
    use llmgw_core::wire::WireEvent;

    #[test]
    fn snapshot_is_table_chunks_complete_and_seq_counts_up() {
        let h = hub(2, 64);
        h.state().apply(0, 0, &batch(vec![stored(vec![1, 2, 3])]));
        let sub = h.subscribe("t".into());
        let msgs = drain(&sub, &h);
        let seqs: Vec<u64> = msgs.iter().map(|m| m.seq).collect();
        assert_eq!(seqs, vec![0, 1, 2, 3]);
        assert!(matches!(&msgs[0].body, Some(Body::Replicas(t)) if t.replicas.len() == 2));
        assert_eq!(
            msgs[1].body,
            Some(Body::Snapshot(SnapshotChunk { replica: 0, first: true, blocks: vec![1, 2, 3] }))
        );
        assert_eq!(msgs[2].body, Some(Body::Snapshot(SnapshotChunk { replica: 1, first: true, blocks: vec![] })));
        assert_eq!(msgs[3].body, Some(Body::SnapshotComplete(SnapshotComplete {})));
        h.state().apply(1, 0, &batch(vec![stored(vec![9])]));
        h.state().reset(0, "restart");
        let msgs = drain(&sub, &h);
        assert_eq!(msgs.len(), 2);
        assert_eq!(msgs[0].seq, 4);
        assert_eq!(msgs[0].body, Some(Body::Delta(BlockDelta { replica: 1, added: vec![9], removed: vec![] })));
        assert_eq!(msgs[1].seq, 5);
        assert!(matches!(&msgs[1].body, Some(Body::Reset(r)) if r.replica == 0 && r.reason == "restart"));
    }

    #[test]
    fn each_load_goes_out_alone_as_it_is_read_and_only_for_an_up_engine() {
        use crate::hub::Health;
        let h = hub(2, 64);
        let sub = h.subscribe("t".into());
        drain(&sub, &h);
        let load = |replica| ReplicaLoad { replica, running: 2, waiting: 0, kv_cache_usage: 0.5, gpu_blocks: 192 };
        {
            let mut st = h.state();
            st.set_load(1, load(1));
            st.set_load(0, load(0));
            st.publish_load(0);
        }
        let msgs = drain(&sub, &h);
        assert_eq!(msgs.len(), 1);
        assert_eq!(msgs[0].body, Some(Body::Load(LoadReport { loads: vec![load(0)] })), "engine 1's is not waited for");
        // An engine marked down publishes no load (only its new state and reset).
        {
            let mut st = h.state();
            st.set_health(1, Health::Http, false, "unreachable");
            st.publish_load(1);
        }
        let msgs = drain(&sub, &h);
        assert!(!msgs.is_empty() && msgs.iter().all(|m| !matches!(m.body, Some(Body::Load(_)))), "{msgs:?}");
    }

    #[test]
    fn a_batching_subscriber_gets_what_waits_together_and_ends_with_the_same_index() {
        let h = hub(2, 64);
        let (plain, batching) = (h.subscribe("plain".into()), h.subscribe_as("batching".into(), true));
        let (mut sp, mut sb) = (FeedState::default(), FeedState::default());
        for (st, sub) in [(&mut sp, &plain), (&mut sb, &batching)] {
            drain(sub, &h).iter().for_each(|m| st.apply(m).unwrap());
        }
        let load = |replica, running| ReplicaLoad { replica, running, waiting: 0, kv_cache_usage: 0.5, gpu_blocks: 9 };
        {
            let mut st = h.state();
            st.apply(0, 0, &batch(vec![stored(vec![1, 2])]));
            st.apply(1, 0, &batch(vec![stored(vec![2])]));
            st.apply(0, 1, &batch(vec![removed(vec![2]), stored(vec![3])]));
            st.set_load(0, load(0, 1));
            st.set_load(1, load(1, 1));
            st.publish_load(0);
            st.publish_load(1);
            st.set_load(0, load(0, 4));
            st.publish_load(0);
            st.publish(Body::Heartbeat(llmgw_core::feed::Heartbeat {}));
            // After the heartbeat: a message of its own.
            st.apply(1, 1, &batch(vec![removed(vec![2])]));
        }
        {
            // The queue's byte count, kept as changes joined, is what its messages cost.
            let q = batching.queue();
            let cost: usize =
                q.msgs.iter().filter_map(|m| m.body.as_ref()).map(super::super::queue::approx_bytes).sum();
            assert_eq!(q.bytes, cost);
        }
        let (p, b) = (drain(&plain, &h), drain(&batching, &h));
        assert_eq!(p.len(), 8);
        let seqs: Vec<u64> = b.iter().map(|m| m.seq).collect();
        assert_eq!(seqs, vec![4, 5, 6, 7], "numbered on from the snapshot, without gaps");
        assert!(matches!(&b[0].body, Some(Body::Deltas(d)) if d.deltas.len() == 3), "{:?}", b[0]);
        assert_eq!(b[1].body, Some(Body::Load(LoadReport { loads: vec![load(0, 4), load(1, 1)] })));
        assert_eq!(b[3].body, Some(Body::Delta(BlockDelta { replica: 1, added: vec![], removed: vec![2] })));
        assert_eq!(h.state().feed.gathered, 4);
        // Applied in order, both end with the same blocks.
        p.iter().for_each(|m| sp.apply(m).unwrap());
        b.iter().for_each(|m| sb.apply(m).unwrap());
        assert_eq!(state_of(&sb, 2), state_of(&sp, 2));
        assert_eq!(state_of(&sb, 2), vec![vec![1, 3], vec![]]);
        // Changes and loads in turn: each joins its kind's message, past the other kind's.
        {
            let mut st = h.state();
            st.apply(0, 2, &batch(vec![stored(vec![5])]));
            st.publish_load(0);
            st.apply(1, 2, &batch(vec![stored(vec![5])]));
            st.publish_load(1);
        }
        let b = drain(&batching, &h);
        assert!(matches!(&b[0].body, Some(Body::Deltas(d)) if d.deltas.len() == 2), "{b:?}");
        assert!(matches!(&b[1].body, Some(Body::Load(l)) if l.loads.len() == 2), "{b:?}");
        assert_eq!(b.len(), 2);
        // At most BATCH_DELTAS changes in one message.
        let most = super::super::queue::BATCH_DELTAS as u64;
        {
            let mut st = h.state();
            for i in 0..=most {
                st.apply(1, 3 + i, &batch(vec![stored(vec![1_000_000 + i])]));
            }
        }
        let b = drain(&batching, &h);
        assert!(matches!(&b[0].body, Some(Body::Deltas(d)) if d.deltas.len() as u64 == most));
        assert_eq!(b.len(), 2);
        // A change too large to join goes alone.
        h.state().apply(0, 3, &batch(vec![stored(vec![7])]));
        h.state().apply(0, 4, &batch(vec![stored((100..100 + CHUNK_BLOCKS as u64).collect())]));
        assert_eq!(drain(&batching, &h).len(), 2);
    }

    #[test]
    fn large_snapshot_is_chunked() {
        let h = hub(1, 64);
        let keys: Vec<u64> = (1..=(CHUNK_BLOCKS as u64 * 2 + 5)).collect();
        h.state().apply(0, 0, &batch(vec![stored(keys.clone())]));
        let sub = h.subscribe("t".into());
        let chunks: Vec<SnapshotChunk> = drain(&sub, &h)
            .into_iter()
            .filter_map(|m| match m.body {
                Some(Body::Snapshot(c)) => Some(c),
                _ => None,
            })
            .collect();
        assert_eq!(chunks.len(), 3);
        assert!(chunks[0].first && !chunks[1].first && !chunks[2].first);
        assert!(chunks.iter().all(|c| c.blocks.len() <= CHUNK_BLOCKS));
        let all: Vec<u64> = chunks.into_iter().flat_map(|c| c.blocks).collect();
        assert_eq!(all, keys);
    }

    #[test]
    fn late_subscriber_snapshot_plus_deltas_equal_agent_state_after_random_stream() {
        let engines = 3u32;
        let h = hub(engines, 1 << 20);
        let mut rng = Lcg(7);
        let mut early = h.subscribe("early".into());
        let mut early_state = FeedState::default();
        let mut late: Option<(Arc<Subscriber>, FeedState)> = None;
        for step in 0..3000u64 {
            let e = (rng.next() % u64::from(engines)) as usize;
            let n = 1 + rng.next() % 4;
            let keys: Vec<u64> = (0..n).map(|_| 1 + rng.next() % 64).collect();
            let ev = match rng.next() % 20 {
                0 => WireEvent::AllBlocksCleared,
                1..=9 => removed(keys),
                _ => stored(keys),
            };
            {
                let mut st = h.state();
                if rng.next().is_multiple_of(200) {
                    st.reset(e, "test");
                } else {
                    st.apply(e, step, &batch(vec![ev]));
                }
            }
            if step == 1500 {
                late = Some((h.subscribe("late".into()), FeedState::default()));
            }
            if step.is_multiple_of(97) {
                for m in drain(&early, &h) {
                    early_state.apply(&m).unwrap();
                }
            }
        }
        let (late_sub, mut late_state) = late.unwrap();
        for m in drain(&late_sub, &h) {
            late_state.apply(&m).unwrap();
        }
        for m in drain(&early, &h) {
            early_state.apply(&m).unwrap();
        }
        let truth: Vec<Vec<u64>> =
            h.state().engines.iter().map(|e| e.mirror.keys().iter().map(|k| k.0).collect()).collect();
        assert!(late_state.synced && early_state.synced);
        assert_eq!(state_of(&late_state, engines), truth);
        assert_eq!(state_of(&early_state, engines), truth);
        assert!(truth.iter().any(|t| !t.is_empty()));
        early = late_sub;
        assert_eq!(early.snapshots_sent(), 1);
    }

    #[test]
    fn lagging_subscriber_gets_fresh_snapshot_not_a_backlog() {
        let h = hub(1, 16);
        let sub = h.subscribe("slow".into());
        let mut fs = FeedState::default();
        for m in drain(&sub, &h) {
            fs.apply(&m).unwrap();
        }
        for i in 0..100u64 {
            h.state().apply(0, i, &batch(vec![stored(vec![i + 1])]));
        }
        assert_eq!(h.state().feed.overflows, 1);
        let msgs = drain(&sub, &h);
        // Table + one chunk + complete: no backlog of 100 deltas.
        assert!(msgs.len() <= 4, "{}", msgs.len());
        // Numbered right after what the subscriber had received.
        assert_eq!(msgs[0].seq, 3);
        for m in &msgs {
            fs.apply(m).unwrap();
        }
        assert!(matches!(&msgs[0].body, Some(Body::Replicas(_))));
        assert_eq!(state_of(&fs, 1)[0], (1..=64).collect::<Vec<u64>>());
        assert_eq!(sub.snapshots_sent(), 2);
    }

    #[test]
    fn a_subscriber_whose_backlog_passes_the_byte_cap_is_resynced_and_nothing_is_lost() {
        // The message cap (4096) is far away; the byte cap is 1 MiB.
        let h = hub(1, 4096);
        h.state().max_backlog_bytes = 1 << 20;
        let sub = h.subscribe("stuck".into());
        let mut fs = FeedState::default();
        for m in drain(&sub, &h) {
            fs.apply(&m).unwrap();
        }
        // 20 batches of 10,000 blocks: 1.6 MB of keys queued for a subscriber that reads none.
        for i in 0..20u64 {
            h.state().apply(0, i, &batch(vec![stored((i * 10_000 + 1..=(i + 1) * 10_000).collect())]));
        }
        let counters = h.state().feed.clone();
        assert_eq!((counters.overflows, counters.backlog_bytes_overflows), (1, 1));
        let msgs = drain(&sub, &h);
        for m in &msgs {
            fs.apply(m).unwrap();
        }
        assert!(fs.synced);
        assert_eq!(fs.index.entries(), 200_000, "a fresh snapshot holds every block");
        assert_eq!(sub.snapshots_sent(), 2);
    }

    #[test]
    fn a_snapshot_built_engine_by_engine_while_events_arrive_equals_the_agents_state() {
        let engines = 4u32;
        let h = hub(engines, 1 << 16);
        let mut rng = Lcg(7);
        let mut seq = vec![0u64; engines as usize];
        let mut step = |h: &Hub, rng: &mut Lcg| {
            let e = (rng.next() % u64::from(engines)) as usize;
            let k = 1 + rng.next() % 64;
            let ev = if rng.next().is_multiple_of(3) { removed(vec![k]) } else { stored(vec![k]) };
            let mut st = h.state();
            if rng.next().is_multiple_of(50) {
                st.reset(e, "test");
            } else {
                st.apply(e, seq[e], &batch(vec![ev]));
                seq[e] += 1;
            }
        };
        for _ in 0..200 {
            step(&h, &mut rng);
        }
        let sub = h.subscribe("late".into());
        // The build's steps, with events between every one (as ingestion threads would do).
        let (generation, mut bodies, ids) = sub.build_begin(&h).unwrap();
        for _ in 0..20 {
            step(&h, &mut rng);
        }
        for id in ids {
            bodies.extend(sub.build_engine(&h, generation, id).unwrap());
            for _ in 0..20 {
                step(&h, &mut rng);
            }
        }
        assert!(sub.build_finish(&h, generation, bodies));
        for _ in 0..20 {
            step(&h, &mut rng);
        }
        let mut fs = FeedState::default();
        for m in drain(&sub, &h) {
            fs.apply(&m).unwrap();
        }
        let truth: Vec<Vec<u64>> =
            h.state().engines.iter().map(|e| e.mirror.keys().iter().map(|k| k.0).collect()).collect();
        assert!(fs.synced);
        assert_eq!(state_of(&fs, engines), truth);
        assert_eq!(sub.snapshots_sent(), 1);
    }

    #[test]
    fn a_build_whose_backlog_overflows_is_abandoned_and_started_over() {
        let h = hub(2, 16);
        let sub = h.subscribe("slow".into());
        let (generation, bodies, _) = sub.build_begin(&h).unwrap();
        for i in 0..20u64 {
            h.state().apply(0, i, &batch(vec![stored(vec![i + 1])]));
            h.state().publish(Body::Heartbeat(llmgw_core::feed::Heartbeat {}));
        }
        assert!(sub.build_engine(&h, generation, 0).is_none(), "abandoned");
        assert!(!sub.build_finish(&h, generation, bodies));
        // The next pop builds afresh: nothing lost.
        let mut fs = FeedState::default();
        for m in drain(&sub, &h) {
            fs.apply(&m).unwrap();
        }
        assert!(fs.synced);
        assert_eq!(state_of(&fs, 2)[0], (1..=20).collect::<Vec<u64>>());
    }

    #[test]
    fn subscriptions_past_the_cap_are_refused_and_counted_until_one_leaves() {
        let h = hub(1, 64);
        h.state().max_subscribers = 2;
        let a = h.try_subscribe("a".into(), false).unwrap();
        let _b = h.try_subscribe("b".into(), false).unwrap();
        assert!(h.try_subscribe("c".into(), false).is_none());
        assert_eq!(h.state().feed.subscribers_refused, 1);
        drop(a);
        assert!(h.try_subscribe("c".into(), false).is_some());
    }
}
