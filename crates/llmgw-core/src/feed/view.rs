//! A subscriber's view across subscriptions: the state requests are served from, and the one a
//! resync rebuilds.

use super::messages::{Body, FeedMessage};
use super::state::{FeedError, FeedState};
use crate::allow::Allowlist;
use crate::fleet::GatewayShare;

/// A subscriber's view across subscriptions: the state requests are served from, and, while a
/// new subscription receives its snapshot, the state being rebuilt. The serving state keeps
/// serving until the new one is complete, then the new one replaces it whole (memory doubles
/// meanwhile): a reconnect never leaves requests without an index.
#[derive(Debug, Clone, Default)]
pub struct FeedView {
    serving: FeedState,
    resync: Option<FeedState>,
    /// Engines (`fleet::replica_key`) reset since [`FeedView::take_cleared`] was last called.
    cleared: Vec<u64>,
}

/// At most this many reset engines are remembered between two decisions.
const MAX_CLEARED: usize = 4096;

/// What applying a message did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    /// Applied to the state it belongs to.
    Applied,
    /// Completed a resync: the rebuilt state now serves.
    Swapped,
}

impl FeedView {
    /// The state requests are served from.
    pub fn serving(&self) -> &FeedState {
        &self.serving
    }

    /// The engines reset (restarted, their caches emptied) since the last call, by
    /// `fleet::replica_key`.
    pub fn take_cleared(&mut self) -> Vec<u64> {
        std::mem::take(&mut self.cleared)
    }

    /// Whether the serving index is complete (a snapshot was fully received) and fresh.
    pub fn usable(&self) -> bool {
        self.serving.synced && !self.serving.index_stale
    }

    /// Whether the serving index is complete but too old to credit.
    pub fn stale(&self) -> bool {
        self.serving.synced && self.serving.index_stale
    }

    /// How old the serving state is, as the subscriber judges it (the feed has no clock):
    /// `index` when nothing has come from the agent for too long, `loads` when no load report
    /// has. A swap to a rebuilt state starts fresh.
    pub fn set_staleness(&mut self, index: bool, loads: bool) {
        self.serving.index_stale = index;
        self.serving.loads_stale = loads;
    }

    /// Notes, on the loads the last report brought (those not noted yet), this gateway's
    /// requests in flight on each replica as it came (`own` by address), so that what the engine
    /// reports beyond them counts as other requests' ([`crate::fleet::Load::others`]).
    pub fn note_gateway_share(&mut self, own: &dyn Fn(&str) -> GatewayShare) {
        let target = self.resync.as_mut().unwrap_or(&mut self.serving);
        let FeedState { loads, replicas, .. } = target;
        for load in loads.iter_mut().filter(|l| l.gateway.is_none()) {
            if let Some(r) = replicas.iter().find(|r| r.id == load.replica) {
                load.gateway = Some(own(&r.address));
            }
        }
    }

    /// The state being rebuilt by a resync, if one is under way.
    pub fn resyncing_state(&self) -> Option<&FeedState> {
        self.resync.as_ref()
    }

    /// A resync is under way.
    pub fn resyncing(&self) -> bool {
        self.resync.is_some()
    }

    /// A new subscription delivered its first message: the agent starts over with its table and
    /// snapshot. A complete serving state keeps serving until the new one is complete; an
    /// incomplete one is simply rebuilt.
    pub fn begin_subscription(&mut self) {
        let fresh = FeedState::with_allowlist(self.serving.allow.clone());
        if self.serving.synced {
            self.resync = Some(fresh);
        } else {
            self.resync = None;
            self.serving = fresh;
        }
    }

    /// The destinations allowed from now on (the configuration changed).
    pub fn set_allowlist(&mut self, allow: &Allowlist) {
        self.serving.set_allowlist(allow);
        if let Some(r) = self.resync.as_mut() {
            r.set_allowlist(allow);
        }
    }

    /// Applies one message of the current subscription. On a gap the caller must resubscribe;
    /// a serving state that was complete stays usable meanwhile (missing a few changes, it is
    /// more useful than none), and a partial resync is dropped.
    pub fn apply(&mut self, msg: &FeedMessage) -> Result<Applied, FeedError> {
        let was_synced = self.serving.synced;
        let target = self.resync.as_mut().unwrap_or(&mut self.serving);
        if let Some(Body::Reset(r)) = &msg.body {
            let engine = target.replicas.iter().find(|x| u32::from(x.id) == r.replica).map(|x| x.engine);
            if let Some(e) = engine.filter(|e| !self.cleared.contains(e)) {
                if self.cleared.len() < MAX_CLEARED {
                    self.cleared.push(e);
                }
            }
        }
        match target.apply(msg) {
            Ok(()) => {
                if self.resync.as_ref().is_some_and(|r| r.synced) {
                    if let Some(mut r) = self.resync.take() {
                        r.table_version = self.serving.table_version.wrapping_add(1);
                        self.serving = r;
                        return Ok(Applied::Swapped);
                    }
                }
                Ok(Applied::Applied)
            }
            Err(e @ FeedError::Gap { .. }) => {
                if self.resync.take().is_none() {
                    self.serving.synced = was_synced;
                }
                Err(e)
            }
            Err(e) => Err(e),
        }
    }
}
