//! Where a new root context's feed view starts, so that its first requests are routed instead
//! of answered 503 while its own subscription syncs (then its view swaps as usual):
//!
//! * another root context of the same VM (a listener or filter-configuration change adds root
//!   contexts to running VMs) lends a copy of its synced view: replica table and index;
//! * else (a VM reloaded after a crash, a new VM) the last replica table any VM of this Envoy
//!   received, kept in proxy-wasm shared data, which outlives VMs: requests are routed by load
//!   (`not_synced`) until the snapshot completes.
//!
//! Either comes only from the same agent cluster: two listeners fed by different agents route
//! to different fleets.

use crate::host::Host;
use crate::Shared;
use llmgw_core::feed::{Body, FeedMessage, FeedView, ReplicaTable};
use prost::Message;
use std::cell::RefCell;
use std::rc::{Rc, Weak};

fn table_key(agent_cluster: &str) -> String {
    format!("llmgw.replica_table.{agent_cluster}")
}

thread_local! {
    /// The state of every root context of this VM (a VM is single-threaded).
    static ROOTS: RefCell<Vec<Weak<RefCell<Shared>>>> = const { RefCell::new(Vec::new()) };
}

/// Records a new root context's state.
pub fn register_root(shared: &Rc<RefCell<Shared>>) {
    ROOTS.with(|roots| {
        if let Ok(mut roots) = roots.try_borrow_mut() {
            roots.retain(|w| w.strong_count() > 0);
            roots.push(Rc::downgrade(shared));
        }
    });
}

/// A synced feed view held by another root context of this VM fed by `agent_cluster`, if any.
fn view_of_another_root(agent_cluster: &str) -> Option<FeedView> {
    ROOTS.with(|roots| {
        let mut roots = roots.try_borrow_mut().ok()?;
        roots.retain(|w| w.strong_count() > 0);
        roots.iter().filter_map(Weak::upgrade).find_map(|s| {
            let s = s.try_borrow().ok()?;
            let same = s.router.config().agent_cluster == agent_cluster;
            (same && s.router.feed.usable()).then(|| s.router.feed.clone())
        })
    })
}

/// Keeps a replica table the feed delivered for VMs started later (every VM writes the same
/// table; the last write wins).
pub fn remember_table(host: &dyn Host, agent_cluster: &str, table: &ReplicaTable) {
    if host.set_shared_data(&table_key(agent_cluster), &table.encode_to_vec(), None).is_err() {
        log::debug!("llmgw: the replica table could not be kept in shared data");
    }
}

/// The view a new root context fed by `agent_cluster` starts from, if there is anything to
/// start from.
pub fn initial_view(host: &dyn Host, agent_cluster: &str) -> Option<FeedView> {
    if let Some(view) = view_of_another_root(agent_cluster) {
        return Some(view);
    }
    let (bytes, _) = host.shared_data(&table_key(agent_cluster))?;
    let table = ReplicaTable::decode(bytes?.as_slice()).ok()?;
    let mut view = FeedView::default();
    view.apply(&FeedMessage { seq: 0, body: Some(Body::Replicas(table)) }).ok()?;
    Some(view)
}
