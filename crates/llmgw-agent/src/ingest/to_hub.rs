//! The agent's sink: what a batch, a fill and a publisher's link do to the hub (mirrors,
//! health, counters), the same for every source.

use super::{Fill, FillOutcome, Sink};
use crate::hub::{Health, Hub, HubState};
use crate::seq::Cause;
use llmgw_core::event::EventBatch;
use std::sync::Arc;
use tracing::{info, warn};

/// How a sink reaches the hub state: taking the lock per call, or under a lock already held
/// (the JetStream consumer applies a chunk of messages under one).
pub trait HubAccess {
    fn with<R>(&mut self, f: impl FnOnce(&mut HubState) -> R) -> R;
}

impl HubAccess for Arc<Hub> {
    fn with<R>(&mut self, f: impl FnOnce(&mut HubState) -> R) -> R {
        f(&mut self.state())
    }
}

impl HubAccess for &mut HubState {
    fn with<R>(&mut self, f: impl FnOnce(&mut HubState) -> R) -> R {
        f(self)
    }
}

/// The hub as a [`Sink`]: raw payloads (decoded here, before the lock is taken) or payloads
/// decoded by the source (`None`: did not decode).
pub struct HubSink<A> {
    state: A,
    /// The health reason of a link that opens (`publisher_connected`, `jetstream_connected`).
    up_reason: &'static str,
    /// The health reason of a link given up on.
    down_reason: &'static str,
    /// Keep [`HubSink::last_payload`] (ZMQ's check of a reconnected publisher).
    keep_last: bool,
    /// Sequence number and digest of the last raw batch applied, when kept.
    pub last_payload: Option<(u64, u64)>,
}

impl<A: HubAccess> HubSink<A> {
    pub fn new(state: A, up_reason: &'static str, down_reason: &'static str) -> HubSink<A> {
        HubSink { state, up_reason, down_reason, keep_last: false, last_payload: None }
    }

    /// Keeps the sequence number and digest of the last raw batch applied.
    pub fn keeping_last(mut self, keep: bool) -> HubSink<A> {
        self.keep_last = keep;
        self
    }

    /// Runs `f` on the hub state.
    pub fn with<R>(&mut self, f: impl FnOnce(&mut HubState) -> R) -> R {
        self.state.with(f)
    }

    /// Records an engine's link: `connected` (a connection opened or closed) and `healthy` (its
    /// publisher judged up or down; down drops its blocks). Returns whether it went up or down.
    pub fn link(&mut self, engine: usize, connected: Option<bool>, healthy: Option<bool>) -> bool {
        let (up, down) = (self.up_reason, self.down_reason);
        self.state.with(|st| {
            if let Some(c) = connected {
                st.connection(engine, c);
            }
            match healthy {
                Some(ok) => st.set_health(engine, Health::Publisher, ok, if ok { up } else { down }),
                None => false,
            }
        })
    }

    /// Counts a batch not applied.
    pub fn skipped(&mut self, engine: usize, reason: &'static str) {
        self.state.with(|st| st.skipped(engine, reason));
    }

    /// Drops an engine's blocks.
    pub fn reset(&mut self, engine: usize, reason: &str) {
        self.state.with(|st| st.reset(engine, reason));
    }

    fn apply_decoded(&mut self, engine: usize, seq: u64, batch: Option<&EventBatch>) {
        self.state.with(|st| match batch {
            Some(batch) => st.apply(engine, seq, batch),
            None => st.skipped(engine, "malformed"),
        });
    }

    fn link_opened(&mut self, engine: usize) {
        if self.link(engine, Some(true), Some(true)) {
            info!(replica = %self.label(engine), "replica up; mirror starts clean");
        }
    }

    fn label(&mut self, engine: usize) -> String {
        self.state.with(|st| st.engines.get(engine).map(|e| e.spec.label()).unwrap_or_default())
    }

    fn fill_needed(&mut self, engine: usize, cause: Cause, reset: bool) {
        self.state.with(|st| {
            if cause == Cause::Gap {
                st.count_gap(engine);
            }
            if reset {
                st.reset(engine, cause.as_str());
            }
        });
    }

    /// A gap whose start the replay buffer no longer holds: the mirror's state before the gap
    /// cannot be brought forward, so it is dropped before the batches the buffer holds apply.
    /// (After any other cause the mirror starts clean already.)
    fn fill_starts_late(&mut self, engine: usize, cause: Cause) {
        if cause == Cause::Gap {
            self.reset(engine, "gap_unrepaired");
        }
    }

    fn fill_ended(&mut self, engine: usize, fill: Fill) {
        let Fill { cause, from, until, outcome } = fill;
        let label = self.label(engine);
        let (complete, tail_from) = match outcome {
            FillOutcome::Restarted => {
                info!(replica = %label, cause = cause.as_str(), "sequence restarted at 0");
                return;
            }
            FillOutcome::NoReplay => (false, None),
            FillOutcome::Replayed { complete, batches, skipped, tail_from } => {
                self.state.with(|st| {
                    for reason in skipped {
                        st.skipped(engine, reason);
                    }
                    st.count_replay(engine, complete, batches);
                });
                (complete, tail_from)
            }
        };
        if complete {
            info!(replica = %label, cause = cause.as_str(), from, until, "missing batches replayed");
        } else if let Some(first) = tail_from {
            warn!(replica = %label, cause = cause.as_str(), lacks = %format!("{from}..{first}"), kept = %format!("{first}..{until}"),
                "replay buffer no longer holds the first missing batches; applied those it holds; \
                 engine incomplete: blocks stored before batch {first} and still cached are unknown until stored again");
            self.state.with(|st| st.mark_incomplete(engine, first));
        } else {
            warn!(replica = %label, cause = cause.as_str(), from, until,
                "missing batches could not be replayed; mirror reset; \
                 engine incomplete: blocks stored before batch {until} and still cached are unknown until stored again");
            self.reset(engine, &format!("{}_unrepaired", cause.as_str()));
            self.state.with(|st| st.mark_incomplete(engine, until));
        }
    }
}

impl<A: HubAccess> HubSink<A> {
    fn snapshot_joined(&mut self, engine: usize, seq: u64, incomplete_from: Option<u64>) {
        let label = self.label(engine);
        match incomplete_from {
            None => info!(replica = %label, seq, "joined from the sidecar's snapshot; mirror complete"),
            Some(f) => warn!(replica = %label, seq, incomplete_from = f,
                "joined from the sidecar's snapshot, which lacks what batches before {f} stored; engine incomplete"),
        }
        self.state.with(|st| st.joined_snapshot(engine, incomplete_from));
    }
}

/// A digest of a payload, to recognise the same batch again.
pub fn payload_digest(payload: &[u8]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    payload.hash(&mut h);
    h.finish()
}

/// The link and fill reactions are the same whatever the payload.
macro_rules! hub_sink_common {
    () => {
        fn connected(&mut self, engine: usize) {
            self.link_opened(engine);
        }
        fn disconnected(&mut self, engine: usize, still_connected: bool) {
            self.link(engine, Some(still_connected), None);
        }
        fn fill_needed(&mut self, engine: usize, cause: Cause, reset: bool) {
            HubSink::fill_needed(self, engine, cause, reset);
        }
        fn fill_starts_late(&mut self, engine: usize, cause: Cause, _from: u64, _first: u64) {
            HubSink::fill_starts_late(self, engine, cause);
        }
        fn fill_ended(&mut self, engine: usize, fill: Fill) {
            HubSink::fill_ended(self, engine, fill);
        }
        fn snapshot_joined(&mut self, engine: usize, seq: u64, incomplete_from: Option<u64>) {
            HubSink::snapshot_joined(self, engine, seq, incomplete_from);
        }
        fn snapshot_failed(&mut self, engine: usize, reason: &'static str) {
            self.state.with(|st| st.snapshot_failed(engine, reason));
        }
        fn covered_by_snapshot(&mut self, engine: usize, _seq: u64) {
            self.skipped(engine, "covered_by_snapshot");
        }
    };
}

impl<A: HubAccess> Sink<[u8]> for HubSink<A> {
    hub_sink_common!();

    fn apply(&mut self, engine: usize, seq: u64, payload: &[u8]) -> bool {
        if self.keep_last {
            self.last_payload = Some((seq, payload_digest(payload)));
        }
        match EventBatch::decode(payload) {
            Ok(batch) => self.apply_decoded(engine, seq, Some(&batch)),
            Err(e) => {
                warn!(replica = %self.label(engine), seq, error = %e, "malformed event batch skipped");
                self.apply_decoded(engine, seq, None);
            }
        }
        true
    }
}

impl<A: HubAccess> Sink<Option<EventBatch>> for HubSink<A> {
    hub_sink_common!();

    fn apply(&mut self, engine: usize, seq: u64, batch: &Option<EventBatch>) -> bool {
        self.apply_decoded(engine, seq, batch.as_ref());
        true
    }
}

#[cfg(test)]
#[allow(clippy::arithmetic_side_effects)]
mod tests {
    use super::*;
    use crate::hub::fixtures::{batch, hub, stored};
    use crate::ingest::{Ingest, Replay, SourceEvent};
    use llmgw_core::wire::WireEvent;

    /// A replay buffer holding only some batches (vLLM's keeps the last `buffer_steps`).
    struct Held(Vec<(u64, Option<EventBatch>)>);

    impl Replay<Option<EventBatch>> for Held {
        fn replay(
            &mut self,
            from: u64,
            until: u64,
            apply: &mut dyn FnMut(u64, &Option<EventBatch>) -> bool,
        ) -> FillOutcome {
            let mut fill = crate::seq::Fill::new(from, until);
            let mut n = 0;
            for (s, b) in &self.0 {
                if fill.step(*s) == crate::seq::FillStep::Apply {
                    n += 1;
                    apply(*s, b);
                }
            }
            let tail_from = fill.late_start().filter(|_| fill.reached_end());
            FillOutcome::Replayed { complete: fill.complete(), batches: n, skipped: vec![], tail_from }
        }
    }

    fn keys(h: &Arc<Hub>) -> Vec<u64> {
        let mut k: Vec<u64> = h.state().engines[0].mirror.some_keys(64).into_iter().map(|k| k.0).collect();
        k.sort_unstable();
        k
    }

    fn live(ingest: &mut Ingest, held: &mut Held, sink: &mut HubSink<Arc<Hub>>, seq: u64, hashes: Vec<u64>) {
        let b = Some(batch(vec![stored(hashes)]));
        ingest.handle(SourceEvent::Batch { engine: 0, seq, payload: &b }, held, sink);
    }

    #[test]
    fn a_late_start_keeps_what_the_replay_buffer_holds_and_marks_the_engine_incomplete() {
        let h = hub(1, 64);
        let mut sink = HubSink::new(h.clone(), "up", "down");
        let mut ingest = Ingest::new();
        // Batches 0..=4 stored 10..=14; the buffer holds only 3 and 4.
        let mut held = Held((3..5).map(|s| (s, Some(batch(vec![stored(vec![10 + s])])))).collect());
        live(&mut ingest, &mut held, &mut sink, 5, vec![15]);
        assert_eq!(keys(&h), [13, 14, 15]);
        let st = h.state();
        let e = &st.engines[0];
        assert_eq!(e.incomplete_from, Some(3));
        assert_eq!(e.counters.incomplete_starts, 1);
        assert!(e.counters.resets.is_empty(), "{:?}", e.counters.resets);
        assert_eq!(
            (e.counters.replays_complete, e.counters.replays_incomplete, e.counters.replayed_batches),
            (0, 1, 2)
        );
    }

    #[test]
    fn a_gap_the_buffer_lost_the_start_of_resets_then_keeps_what_it_holds() {
        let h = hub(1, 64);
        let mut sink = HubSink::new(h.clone(), "up", "down");
        let mut ingest = Ingest::new();
        let mut held = Held((5..7).map(|s| (s, Some(batch(vec![stored(vec![10 + s])])))).collect());
        live(&mut ingest, &mut held, &mut sink, 0, vec![10]);
        live(&mut ingest, &mut held, &mut sink, 7, vec![17]);
        assert_eq!(keys(&h), [15, 16, 17]);
        let st = h.state();
        assert_eq!(st.engines[0].incomplete_from, Some(5));
        assert_eq!(st.engines[0].counters.resets.get("gap_unrepaired"), Some(&1));
    }

    #[test]
    fn an_unfillable_start_resets_and_a_clear_or_a_new_engine_makes_the_mirror_complete() {
        let h = hub(1, 64);
        let mut sink = HubSink::new(h.clone(), "up", "down");
        let mut ingest = Ingest::new();
        // A hole after the buffer's first batch: nothing can be trusted but the live batch.
        let mut held = Held(vec![(1, Some(batch(vec![stored(vec![11])]))), (3, None)]);
        live(&mut ingest, &mut held, &mut sink, 4, vec![14]);
        assert_eq!(keys(&h), [14]);
        assert_eq!(h.state().engines[0].incomplete_from, Some(4));
        assert_eq!(h.state().engines[0].counters.resets.get("initial_unrepaired"), Some(&1));
        // The engine's cache cleared: what the mirror holds from here on is all it holds.
        let cleared = Some(batch(vec![WireEvent::AllBlocksCleared, stored(vec![20])]));
        ingest.handle(SourceEvent::Batch { engine: 0, seq: 5, payload: &cleared }, &mut held, &mut sink);
        assert_eq!(h.state().engines[0].incomplete_from, None);
        // Incomplete again, then a restarted engine (sequence back to 0) starts complete.
        live(&mut ingest, &mut Held(vec![]), &mut sink, 9, vec![29]);
        assert_eq!(h.state().engines[0].incomplete_from, Some(9));
        live(&mut ingest, &mut held, &mut sink, 0, vec![30]);
        assert_eq!(keys(&h), [30]);
        assert_eq!(h.state().engines[0].incomplete_from, None);
        assert_eq!(h.state().engines[0].counters.incomplete_starts, 2);
    }

    #[test]
    fn the_feed_marks_an_incomplete_engine_and_says_again_when_it_is_complete() {
        use crate::hub::fixtures::drain;
        use llmgw_core::feed::{Body, FeedState};
        let h = hub(1, 64);
        let sub = h.subscribe("t".into());
        let mut fs = FeedState::default();
        let mut tables = 0;
        let mut read = |fs: &mut FeedState| {
            for m in drain(&sub, &h) {
                tables += usize::from(matches!(m.body, Some(Body::Replicas(_))));
                fs.apply(&m).unwrap();
            }
            tables
        };
        assert_eq!(read(&mut fs), 1);
        assert!(!fs.replicas[0].incomplete);
        let mut sink = HubSink::new(h.clone(), "up", "down");
        let mut ingest = Ingest::new();
        // A late start: the buffer holds 3 and 4 only.
        let mut held = Held((3..5).map(|s| (s, Some(batch(vec![stored(vec![10 + s])])))).collect());
        live(&mut ingest, &mut held, &mut sink, 5, vec![15]);
        assert_eq!(read(&mut fs), 2, "the table goes out again");
        assert!(fs.replicas[0].incomplete);
        // More batches, and a later start of what is missing, change nothing the filters see.
        live(&mut ingest, &mut held, &mut sink, 6, vec![16]);
        h.state().mark_incomplete(0, 6);
        assert_eq!(read(&mut fs), 2);
        // A clear of the engine's whole cache: complete, and the table says so.
        let cleared = Some(batch(vec![WireEvent::AllBlocksCleared, stored(vec![20])]));
        ingest.handle(SourceEvent::Batch { engine: 0, seq: 7, payload: &cleared }, &mut held, &mut sink);
        assert_eq!(read(&mut fs), 3);
        assert!(!fs.replicas[0].incomplete);
        // A snapshot that is itself incomplete marks it; a complete one clears it.
        h.state().joined_snapshot(0, Some(2));
        assert_eq!(read(&mut fs), 4);
        assert!(fs.replicas[0].incomplete);
        h.state().joined_snapshot(0, None);
        assert_eq!(read(&mut fs), 5);
        assert!(!fs.replicas[0].incomplete);
        // A new subscriber's table carries the flag too.
        h.state().mark_incomplete(0, 9);
        assert!(h.state().table().replicas[0].mirror_incomplete);
    }
}
