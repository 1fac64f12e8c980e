//! The event-source seam: what every source of KV events yields ([`SourceEvent`]), and the one
//! loop body that acts on it ([`Ingest::handle`]) for every source: the ZMQ subscriber, the
//! JetStream consumer and the per-replica publisher.
//!
//! A source turns its transport into events; [`Ingest`] owns each engine's sequence discipline
//! ([`crate::seq`]), judges every batch, fetches what a gap misses through the source's
//! [`Replay`], and hands the outcome to a [`Sink`]: the hub for the agent ([`to_hub`]), the
//! broker queue for `publish`. Adding a source is one module that yields these events.
//!
//! Joining late ([`Ingest::join`]): once subscribed (or at an engine's first batch when that
//! does not start its sequence), a source that can fetch a snapshot ([`Replay::snapshot`])
//! applies it (exact at batch S); the live batches that arrived meanwhile up to S are dropped,
//! a gap between S and the next live batch is filled from the replay socket, and only what
//! that cannot fill resets. Live batches wait in the source's subscription during the fetch.

pub mod to_hub;

use crate::seq::{Cause, SeqTracker, Verdict};
use std::collections::HashMap;

/// What a source yields for one engine.
#[derive(Debug)]
pub enum SourceEvent<'a, P: ?Sized> {
    /// A publisher connection opened.
    Connected { engine: usize },
    /// A publisher connection was lost (`still_connected`: another one is still open). The next
    /// batch may come from a restarted engine.
    Disconnected { engine: usize, still_connected: bool },
    /// One live batch with the publisher's sequence number.
    Batch { engine: usize, seq: u64, payload: &'a P },
}

/// How a fill ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FillOutcome {
    /// Nothing was missing: the sequence restarted at 0.
    Restarted,
    /// The source has no way to fetch missed batches.
    NoReplay,
    /// Missed batches were asked for; `skipped` names the replies that could not be read.
    /// `tail_from`: the source no longer held the start of the range, but held it from this
    /// batch to its end (all of those were applied; `complete` is false).
    Replayed { complete: bool, batches: u64, skipped: Vec<&'static str>, tail_from: Option<u64> },
}

/// A fill: why, which range, how it ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fill {
    pub cause: Cause,
    pub from: u64,
    pub until: u64,
    pub outcome: FillOutcome,
}

/// An engine's state as of batch `seq`, as one batch to apply to an empty mirror.
#[derive(Debug, Clone, PartialEq)]
pub struct Joined<B> {
    pub seq: u64,
    /// `Some(f)`: the snapshot holds only what batches from `f` on stored.
    pub incomplete_from: Option<u64>,
    pub batch: B,
}

/// What asking a source for a snapshot gave.
#[derive(Debug, Clone, PartialEq)]
pub enum SnapshotFetch<B> {
    /// The source has no snapshot to ask for.
    NoSource,
    /// It was asked and gave none (the reason is a metric label).
    Failed(&'static str),
    Got(Joined<B>),
}

/// Fetches batches a gap missed, from where the source keeps them.
pub trait Replay<P: ?Sized> {
    /// Hands the batches `from..until` to `apply` in order (it returns false to stop).
    fn replay(&mut self, from: u64, until: u64, apply: &mut dyn FnMut(u64, &P) -> bool) -> FillOutcome;

    /// The engine's state at some batch, for an engine first heard after its start.
    fn snapshot(&mut self) -> SnapshotFetch<Box<P>> {
        SnapshotFetch::NoSource
    }
}

/// A source that keeps nothing to replay.
pub struct NoReplay;

impl<P: ?Sized> Replay<P> for NoReplay {
    fn replay(&mut self, _: u64, _: u64, _: &mut dyn FnMut(u64, &P) -> bool) -> FillOutcome {
        FillOutcome::NoReplay
    }
}

/// Where batches and what becomes of them go.
pub trait Sink<P: ?Sized> {
    /// A publisher connection opened.
    fn connected(&mut self, engine: usize);
    /// A publisher connection was lost.
    fn disconnected(&mut self, engine: usize, still_connected: bool);
    /// The sequence asks for a fill: before anything is fetched (`reset`: the mirror is stale).
    fn fill_needed(&mut self, engine: usize, cause: Cause, reset: bool);
    /// The source no longer holds the batches `from..first` of a fill: called before batch
    /// `first`, the first it does hold, is applied (the batches before it are lost for good).
    fn fill_starts_late(&mut self, _engine: usize, _cause: Cause, _from: u64, _first: u64) {}
    /// How the fill went (after the replayed batches were applied).
    fn fill_ended(&mut self, engine: usize, fill: Fill);
    /// One batch, live or replayed, in sequence order; false when the sink takes no more.
    fn apply(&mut self, engine: usize, seq: u64, payload: &P) -> bool;
    /// A snapshot was applied as batch `seq` (called after [`Sink::apply`] took it).
    fn snapshot_joined(&mut self, _engine: usize, _seq: u64, _incomplete_from: Option<u64>) {}
    /// A snapshot was asked for and none came: the engine starts from the replay buffer.
    fn snapshot_failed(&mut self, _engine: usize, _reason: &'static str) {}
    /// A live batch the applied snapshot already covers: dropped.
    fn covered_by_snapshot(&mut self, _engine: usize, _seq: u64) {}
}

/// Every engine's sequence discipline; the one place a batch's verdict is acted on.
#[derive(Debug, Default)]
pub struct Ingest {
    trackers: HashMap<usize, SeqTracker>,
    /// Engines joined from a snapshot at this batch, until a batch past it or a disconnect.
    joins: HashMap<usize, u64>,
}

impl Ingest {
    pub fn new() -> Ingest {
        Ingest::default()
    }

    /// Starts an engine as if this process had already seen batches up to `seq` (a restarted
    /// publisher continuing after what the stream holds).
    pub fn resume_after(&mut self, engine: usize, seq: u64) {
        self.trackers.entry(engine).or_default().applied(seq);
    }

    /// Whether an engine's sequence is known (a batch or a snapshot was applied).
    pub fn knows(&self, engine: usize) -> bool {
        self.trackers.get(&engine).is_some_and(|t| t.expected().is_some())
    }

    /// Acts on one event. Returns false when the sink took no more.
    pub fn handle<P: ?Sized>(
        &mut self,
        event: SourceEvent<'_, P>,
        replay: &mut dyn Replay<P>,
        sink: &mut dyn Sink<P>,
    ) -> bool {
        match event {
            SourceEvent::Connected { engine } => sink.connected(engine),
            SourceEvent::Disconnected { engine, still_connected } => {
                self.trackers.entry(engine).or_default().mark_reconnect();
                // A batch at or below the snapshot's may now come from a restarted engine.
                self.joins.remove(&engine);
                sink.disconnected(engine, still_connected);
            }
            SourceEvent::Batch { engine, seq, payload } => return self.batch(engine, seq, payload, replay, sink),
        }
        true
    }

    fn batch<P: ?Sized>(
        &mut self,
        engine: usize,
        seq: u64,
        payload: &P,
        replay: &mut dyn Replay<P>,
        sink: &mut dyn Sink<P>,
    ) -> bool {
        if let Some(at) = self.joins.get(&engine).copied() {
            if seq <= at {
                // Received while the snapshot was fetched (no reconnect since): it holds it.
                sink.covered_by_snapshot(engine, seq);
                return true;
            }
            self.joins.remove(&engine);
        }
        let first = self.trackers.get(&engine).is_none_or(|t| t.expected().is_none());
        if first && seq > 0 {
            if !self.join(engine, replay, sink) {
                return false;
            }
            if self.joins.get(&engine).is_some_and(|at| seq <= *at) {
                sink.covered_by_snapshot(engine, seq);
                return true;
            }
        }
        let tracker = self.trackers.entry(engine).or_default();
        // After a join: apply, or a gap from the snapshot to this batch, filled below.
        let verdict = tracker.observe(seq);
        if let Verdict::Fill { from, until, reset, cause } = verdict {
            sink.fill_needed(engine, cause, reset);
            let outcome = if from >= until {
                FillOutcome::Restarted
            } else {
                let mut first = true;
                replay.replay(from, until, &mut |s, p| {
                    if std::mem::take(&mut first) && s > from {
                        sink.fill_starts_late(engine, cause, from, s);
                    }
                    sink.apply(engine, s, p)
                })
            };
            sink.fill_ended(engine, Fill { cause, from, until, outcome });
        }
        let taken = sink.apply(engine, seq, payload);
        if taken {
            tracker.applied(seq);
        }
        taken
    }

    /// Joins an engine whose sequence is not known yet from its source's snapshot: the
    /// snapshot is applied as its batch S, and live batches up to S are dropped until the
    /// publisher's connection drops. Nothing happens when the sequence is known or the source
    /// has no snapshot. Returns false when the sink took no more.
    pub fn join<P: ?Sized>(&mut self, engine: usize, replay: &mut dyn Replay<P>, sink: &mut dyn Sink<P>) -> bool {
        if self.trackers.get(&engine).is_some_and(|t| t.expected().is_some()) {
            return true;
        }
        match replay.snapshot() {
            SnapshotFetch::NoSource => true,
            SnapshotFetch::Failed(reason) => {
                sink.snapshot_failed(engine, reason);
                true
            }
            SnapshotFetch::Got(snap) => {
                if !sink.apply(engine, snap.seq, &snap.batch) {
                    return false;
                }
                sink.snapshot_joined(engine, snap.seq, snap.incomplete_from);
                self.trackers.entry(engine).or_default().applied(snap.seq);
                self.joins.insert(engine, snap.seq);
                true
            }
        }
    }

    /// The reconnected publisher was verified to be the same engine.
    pub fn confirm_same_publisher(&mut self, engine: usize) {
        if let Some(t) = self.trackers.get_mut(&engine) {
            t.confirm_same_publisher();
        }
    }

    /// Forgets an engine's sequence: its next batch is handled like a first one.
    pub fn forget(&mut self, engine: usize) {
        self.trackers.remove(&engine);
        self.joins.remove(&engine);
    }

    /// Forgets every engine's sequence.
    pub fn forget_all(&mut self) {
        self.trackers.clear();
        self.joins.clear();
    }

    /// Forgets the sequences of the engines `keep` refuses.
    pub fn retain(&mut self, mut keep: impl FnMut(usize) -> bool) {
        self.trackers.retain(|i, _| keep(*i));
        self.joins.retain(|i, _| keep(*i));
    }
}

#[cfg(test)]
#[allow(clippy::arithmetic_side_effects)]
mod tests {
    use super::*;

    /// Records what reaches it.
    #[derive(Default)]
    struct Log(Vec<String>);

    impl Sink<u8> for Log {
        fn connected(&mut self, e: usize) {
            self.0.push(format!("up {e}"));
        }
        fn disconnected(&mut self, e: usize, still: bool) {
            self.0.push(format!("down {e} {still}"));
        }
        fn fill_needed(&mut self, e: usize, cause: Cause, reset: bool) {
            self.0.push(format!("fill {e} {} reset={reset}", cause.as_str()));
        }
        fn fill_starts_late(&mut self, e: usize, cause: Cause, from: u64, first: u64) {
            self.0.push(format!("late {e} {} {from}..{first}", cause.as_str()));
        }
        fn fill_ended(&mut self, e: usize, f: Fill) {
            self.0.push(format!("filled {e} {}..{} {:?}", f.from, f.until, f.outcome));
        }
        fn apply(&mut self, e: usize, seq: u64, p: &u8) -> bool {
            self.0.push(format!("apply {e} {seq} {p}"));
            *p != 0
        }
        fn snapshot_joined(&mut self, e: usize, seq: u64, incomplete_from: Option<u64>) {
            self.0.push(format!("joined {e} at {seq} incomplete_from={incomplete_from:?}"));
        }
        fn snapshot_failed(&mut self, e: usize, reason: &'static str) {
            self.0.push(format!("no snapshot {e} {reason}"));
        }
        fn covered_by_snapshot(&mut self, e: usize, seq: u64) {
            self.0.push(format!("covered {e} {seq}"));
        }
    }

    /// Replays from a fixed list.
    struct Held(Vec<(u64, u8)>);

    impl Replay<u8> for Held {
        fn replay(&mut self, from: u64, until: u64, apply: &mut dyn FnMut(u64, &u8) -> bool) -> FillOutcome {
            let mut n = 0;
            for (s, p) in self.0.iter().filter(|(s, _)| (from..until).contains(s)) {
                n += 1;
                if !apply(*s, p) {
                    break;
                }
            }
            let tail_from = self.0.iter().map(|(s, _)| *s).find(|s| (from..until).contains(s)).filter(|s| *s > from);
            FillOutcome::Replayed { complete: n == until - from, batches: n, skipped: vec![], tail_from }
        }
    }

    /// A replay buffer and a snapshot source (asked once).
    struct WithSnapshot(Held, Option<SnapshotFetch<Box<u8>>>);

    impl Replay<u8> for WithSnapshot {
        fn replay(&mut self, from: u64, until: u64, apply: &mut dyn FnMut(u64, &u8) -> bool) -> FillOutcome {
            self.0.replay(from, until, apply)
        }
        fn snapshot(&mut self) -> SnapshotFetch<Box<u8>> {
            self.1.take().unwrap_or(SnapshotFetch::NoSource)
        }
    }

    fn snap(seq: u64, payload: u8) -> Option<SnapshotFetch<Box<u8>>> {
        Some(SnapshotFetch::Got(Joined { seq, incomplete_from: None, batch: Box::new(payload) }))
    }

    fn batch(engine: usize, seq: u64, payload: &u8) -> SourceEvent<'_, u8> {
        SourceEvent::Batch { engine, seq, payload }
    }

    #[test]
    fn a_gap_is_filled_by_the_sources_replay_before_the_live_batch() {
        let (mut ingest, mut sink, mut held) = (Ingest::new(), Log::default(), Held(vec![(1, 11), (2, 12)]));
        assert!(ingest.handle(batch(0, 0, &10), &mut held, &mut sink));
        assert!(ingest.handle(batch(0, 3, &13), &mut held, &mut sink));
        let want = [
            "apply 0 0 10",
            "fill 0 gap reset=false",
            "apply 0 1 11",
            "apply 0 2 12",
            "filled 0 1..3 Replayed { complete: true, batches: 2, skipped: [], tail_from: None }",
            "apply 0 3 13",
        ];
        assert_eq!(sink.0, want);
    }

    #[test]
    fn a_replay_buffer_that_lost_the_start_still_gives_what_it_holds() {
        let (mut ingest, mut sink, mut held) = (Ingest::new(), Log::default(), Held(vec![(3, 13), (4, 14)]));
        assert!(ingest.handle(batch(0, 5, &15), &mut held, &mut sink));
        let want = [
            "fill 0 initial reset=false",
            "late 0 initial 0..3",
            "apply 0 3 13",
            "apply 0 4 14",
            "filled 0 0..5 Replayed { complete: false, batches: 2, skipped: [], tail_from: Some(3) }",
            "apply 0 5 15",
        ];
        assert_eq!(sink.0, want);
    }

    #[test]
    fn engines_keep_their_own_sequences_and_a_disconnect_makes_a_jump_a_restart() {
        let (mut ingest, mut sink) = (Ingest::new(), Log::default());
        ingest.handle(batch(0, 0, &1), &mut NoReplay, &mut sink);
        ingest.handle(batch(1, 0, &1), &mut NoReplay, &mut sink);
        ingest.handle(SourceEvent::Disconnected { engine: 1, still_connected: false }, &mut NoReplay, &mut sink);
        ingest.handle(batch(0, 1, &1), &mut NoReplay, &mut sink);
        ingest.handle(batch(1, 5, &1), &mut NoReplay, &mut sink);
        ingest.handle(batch(1, 0, &1), &mut NoReplay, &mut sink);
        let want = [
            "apply 0 0 1",
            "apply 1 0 1",
            "down 1 false",
            "apply 0 1 1",
            "fill 1 reconnect reset=true",
            "filled 1 0..5 NoReplay",
            "apply 1 5 1",
            "fill 1 restart reset=true",
            "filled 1 0..0 Restarted",
            "apply 1 0 1",
        ];
        assert_eq!(sink.0, want);
    }

    #[test]
    fn a_batch_the_sink_refuses_is_not_counted_as_seen() {
        let (mut ingest, mut sink) = (Ingest::new(), Log::default());
        ingest.resume_after(0, 4);
        assert!(!ingest.handle(batch(0, 5, &0), &mut NoReplay, &mut sink));
        assert!(ingest.handle(batch(0, 5, &1), &mut NoReplay, &mut sink));
        assert_eq!(sink.0, ["apply 0 5 0", "apply 0 5 1"]);
    }

    #[test]
    fn a_snapshot_ahead_of_the_first_live_batch_drops_the_live_batches_it_covers() {
        let (mut ingest, mut sink) = (Ingest::new(), Log::default());
        let mut src = WithSnapshot(Held(vec![]), snap(7, 70));
        for seq in 5..=8 {
            assert!(ingest.handle(batch(0, seq, &(seq as u8)), &mut src, &mut sink));
        }
        let want = [
            "apply 0 7 70",
            "joined 0 at 7 incomplete_from=None",
            "covered 0 5",
            "covered 0 6",
            "covered 0 7",
            "apply 0 8 8",
        ];
        assert_eq!(sink.0, want);
        // After a disconnect, a batch at or below the snapshot's is a restarted engine's.
        ingest.handle(SourceEvent::Disconnected { engine: 0, still_connected: false }, &mut src, &mut sink);
        ingest.handle(batch(0, 0, &1), &mut src, &mut sink);
        let after = ["down 0 false", "fill 0 reconnect reset=true", "filled 0 0..0 Restarted", "apply 0 0 1"];
        assert_eq!(sink.0[6..], after);
    }

    #[test]
    fn a_gap_between_the_snapshot_and_the_first_live_batch_is_filled_by_replay() {
        let (mut ingest, mut sink) = (Ingest::new(), Log::default());
        let mut src = WithSnapshot(Held(vec![(2, 12), (3, 13), (4, 14), (5, 15)]), snap(3, 30));
        assert!(ingest.handle(batch(0, 6, &16), &mut src, &mut sink));
        let want = [
            "apply 0 3 30",
            "joined 0 at 3 incomplete_from=None",
            "fill 0 gap reset=false",
            "apply 0 4 14",
            "apply 0 5 15",
            "filled 0 4..6 Replayed { complete: true, batches: 2, skipped: [], tail_from: None }",
            "apply 0 6 16",
        ];
        assert_eq!(sink.0, want);
    }

    #[test]
    fn a_gap_the_replay_cannot_fill_goes_the_unrepaired_way_and_no_snapshot_falls_back_to_replay() {
        let (mut ingest, mut sink) = (Ingest::new(), Log::default());
        // The replay buffer lost 4..=6: the snapshot cannot be brought to 7.
        let mut src = WithSnapshot(Held(vec![(7, 17), (8, 18)]), snap(3, 30));
        assert!(ingest.handle(batch(0, 9, &19), &mut src, &mut sink));
        let want = [
            "apply 0 3 30",
            "joined 0 at 3 incomplete_from=None",
            "fill 0 gap reset=false",
            "late 0 gap 4..7",
            "apply 0 7 17",
            "apply 0 8 18",
            "filled 0 4..9 Replayed { complete: false, batches: 2, skipped: [], tail_from: Some(7) }",
            "apply 0 9 19",
        ];
        assert_eq!(sink.0, want);
        // The source was asked and had none: the replay buffer's batches, as without a source.
        let (mut ingest, mut sink) = (Ingest::new(), Log::default());
        let mut src = WithSnapshot(Held(vec![(1, 11)]), Some(SnapshotFetch::Failed("timeout")));
        assert!(ingest.handle(batch(0, 2, &12), &mut src, &mut sink));
        assert_eq!(sink.0[..3], ["no snapshot 0 timeout", "fill 0 initial reset=false", "late 0 initial 0..1"]);
    }
}
