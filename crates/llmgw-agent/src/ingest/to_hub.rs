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

    fn fill_ended(&mut self, engine: usize, fill: Fill) {
        let Fill { cause, from, until, outcome } = fill;
        let label = self.label(engine);
        let complete = match outcome {
            FillOutcome::Restarted => {
                info!(replica = %label, cause = cause.as_str(), "sequence restarted at 0");
                return;
            }
            FillOutcome::NoReplay => false,
            FillOutcome::Replayed { complete, batches, skipped } => {
                self.state.with(|st| {
                    for reason in skipped {
                        st.skipped(engine, reason);
                    }
                    st.count_replay(engine, complete, batches);
                });
                complete
            }
        };
        if complete {
            info!(replica = %label, cause = cause.as_str(), from, until, "missing batches replayed");
        } else {
            warn!(replica = %label, cause = cause.as_str(), from, until, "missing batches could not be replayed; mirror reset");
            self.reset(engine, &format!("{}_unrepaired", cause.as_str()));
        }
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
        fn fill_ended(&mut self, engine: usize, fill: Fill) {
            HubSink::fill_ended(self, engine, fill);
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
