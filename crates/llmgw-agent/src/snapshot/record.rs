//! The sidecar's sink: every batch and fill reaches its ledger, then the sink it wraps (the
//! broker queue, or nothing).

use super::serve::Ledgers;
use crate::ingest::{Fill, FillOutcome, Sink};
use crate::seq::Cause;
use llmgw_core::event::EventBatch;
use std::sync::Arc;

/// Records one rank's batches into its ledger before handing them on.
pub struct Recording<S> {
    pub inner: S,
    /// `None`: no snapshots are served.
    pub ledgers: Option<Arc<Ledgers>>,
    pub dp_rank: u32,
}

impl<S> Recording<S> {
    /// The publisher's connection dropped (see [`super::ledger::Ledger::suspend`]).
    pub fn suspend(&mut self) {
        self.ledger(|l| l.suspend());
    }

    fn ledger(&self, f: impl FnOnce(&mut super::ledger::Ledger)) {
        if let Some(mut l) = self.ledgers.as_ref().and_then(|l| l.lock(self.dp_rank)) {
            f(&mut l);
        }
    }
}

impl<S: Sink<[u8]>> Sink<[u8]> for Recording<S> {
    fn connected(&mut self, engine: usize) {
        self.inner.connected(engine);
    }

    fn disconnected(&mut self, engine: usize, still_connected: bool) {
        self.suspend();
        self.inner.disconnected(engine, still_connected);
    }

    fn fill_needed(&mut self, engine: usize, cause: Cause, reset: bool) {
        if reset {
            self.ledger(|l| l.reset());
        }
        self.inner.fill_needed(engine, cause, reset);
    }

    fn fill_starts_late(&mut self, engine: usize, cause: Cause, from: u64, first: u64) {
        if cause == Cause::Gap {
            // What the ledger held cannot be brought past the lost batches.
            self.ledger(|l| l.reset());
        }
        self.inner.fill_starts_late(engine, cause, from, first);
    }

    fn fill_ended(&mut self, engine: usize, fill: Fill) {
        match &fill.outcome {
            FillOutcome::Restarted | FillOutcome::Replayed { complete: true, .. } => {}
            FillOutcome::Replayed { tail_from: Some(first), .. } => {
                let first = *first;
                self.ledger(|l| l.mark_incomplete(first));
            }
            FillOutcome::NoReplay | FillOutcome::Replayed { .. } => {
                let until = fill.until;
                self.ledger(|l| {
                    l.reset();
                    l.mark_incomplete(until);
                });
            }
        }
        self.inner.fill_ended(engine, fill);
    }

    fn apply(&mut self, engine: usize, seq: u64, payload: &[u8]) -> bool {
        // A malformed batch changes nothing the agent's mirror would hold either.
        if self.ledgers.is_some() {
            if let Ok(batch) = EventBatch::decode(payload) {
                self.ledger(|l| l.apply(seq, &batch));
            }
        }
        self.inner.apply(engine, seq, payload)
    }
}
