//! The feed from the agent to each filter VM: its messages ([`messages`], the wire form) and a
//! subscriber's state built from them ([`state`], in the fleet's domain types), across
//! subscriptions ([`view`]).

pub mod messages;
pub mod state;
pub mod view;

pub use messages::{
    BlockDelta, BlockDeltas, Body, FeedMessage, HashSettings, Heartbeat, KvCacheGroup, LoadReport, LoraAdapter,
    Replica, ReplicaLoad, ReplicaReset, ReplicaTable, SnapshotChunk, SnapshotComplete, SubscribeRequest,
};
pub use state::{FeedError, FeedState};
pub use view::{Applied, FeedView};

#[cfg(test)]
#[allow(clippy::arithmetic_side_effects)]
mod tests {
    use super::*;
    use crate::hash::BlockKey;
    use prost::Message;

    fn msg(seq: u64, body: Body) -> FeedMessage {
        FeedMessage { seq, body: Some(body) }
    }

    #[test]
    fn snapshot_then_deltas() {
        let mut st = FeedState::default();
        let table = ReplicaTable {
            replicas: vec![
                Replica {
                    id: 0,
                    name: "a".into(),
                    address: "127.0.0.1:8001".into(),
                    models: vec!["m".into()],
                    up: true,
                    dp_rank: 0,
                    hash: None,
                    dp_size: 0,
                    kv_groups: vec![],
                    lora_adapters: vec![],
                    mirror_incomplete: false,
                },
                Replica {
                    id: 1,
                    name: "b".into(),
                    address: "127.0.0.1:8002".into(),
                    models: vec!["m".into()],
                    up: true,
                    dp_rank: 0,
                    hash: None,
                    dp_size: 0,
                    kv_groups: vec![],
                    lora_adapters: vec![],
                    mirror_incomplete: false,
                },
            ],
        };
        let msgs = vec![
            msg(0, Body::Replicas(table)),
            msg(1, Body::Snapshot(SnapshotChunk { replica: 0, first: true, blocks: vec![1, 2, 3] })),
            msg(2, Body::Snapshot(SnapshotChunk { replica: 1, first: true, blocks: vec![1] })),
            msg(3, Body::SnapshotComplete(SnapshotComplete {})),
            msg(4, Body::Delta(BlockDelta { replica: 1, added: vec![2], removed: vec![] })),
            msg(5, Body::Delta(BlockDelta { replica: 0, added: vec![], removed: vec![2] })),
        ];
        for m in &msgs {
            // Through the wire, as the filter receives them.
            let decoded = FeedMessage::decode(m.encode_to_vec().as_slice()).unwrap();
            assert_eq!(&decoded, m);
            st.apply(&decoded).unwrap();
        }
        assert!(st.synced);
        let s = st.index.score(&[BlockKey(1), BlockKey(2), BlockKey(3)]);
        assert_eq!(s.leading, vec![1, 2]);
        st.apply(&msg(6, Body::Reset(ReplicaReset { replica: 1, reason: "restart".into() }))).unwrap();
        assert_eq!(st.index.score(&[BlockKey(1), BlockKey(2), BlockKey(3)]).leading, vec![1, 0]);
        assert_eq!(st.apply(&msg(8, Body::Heartbeat(Heartbeat {}))), Err(FeedError::Gap { expected: 7, got: 8 }));
        assert!(!st.synced);
        st.restart();
        let bad = msg(0, Body::Delta(BlockDelta { replica: 70_000, added: vec![1], removed: vec![] }));
        assert_eq!(st.apply(&bad), Err(FeedError::BadReplica(70_000)));
        assert_eq!(st.rejected, 1);
    }

    #[test]
    fn a_batch_of_deltas_applies_in_order_and_refuses_only_its_bad_parts() {
        let mut view = FeedView::default();
        snapshot(&mut view, 0, vec![1]);
        view.apply(&msg(3, table(&[0, 1]))).unwrap();
        let d = |replica, added: Vec<u64>, removed: Vec<u64>| BlockDelta { replica, added, removed };
        let batch = BlockDeltas {
            deltas: vec![
                d(0, vec![5], vec![]),
                d(70_000, vec![6], vec![]),
                d(1, vec![5, 6], vec![]),
                // Removed after it was added, by a later part: gone.
                d(0, vec![], vec![5, 1]),
                d(0, vec![1], vec![]),
            ],
        };
        // Through the wire, as the filter receives it.
        let m = msg(4, Body::Deltas(batch));
        let decoded = FeedMessage::decode(m.encode_to_vec().as_slice()).unwrap();
        assert_eq!(decoded, m);
        assert_eq!(view.apply(&decoded), Err(FeedError::BadReplica(70_000)));
        let index = &view.serving().index;
        assert_eq!(index.score(&[BlockKey(1)]).leading, vec![1, 0]);
        assert_eq!(index.score(&[BlockKey(5)]).leading, vec![0, 1]);
        assert_eq!(index.score(&[BlockKey(6)]).leading, vec![0, 1]);
        // The refused part did not break the sequence.
        assert_eq!(view.apply(&msg(5, Body::Heartbeat(Heartbeat {}))), Ok(Applied::Applied));
    }

    fn table(ids: &[u32]) -> Body {
        Body::Replicas(ReplicaTable {
            replicas: ids
                .iter()
                .map(|&id| Replica {
                    id,
                    name: format!("r{id}"),
                    address: format!("127.0.0.1:{}", 8000 + id),
                    models: vec![],
                    up: true,
                    dp_rank: 0,
                    hash: None,
                    dp_size: 0,
                    kv_groups: vec![],
                    lora_adapters: vec![],
                    mirror_incomplete: false,
                })
                .collect(),
        })
    }

    fn snapshot(view: &mut FeedView, seq0: u64, blocks: Vec<u64>) -> Vec<Applied> {
        view.begin_subscription();
        [
            table(&[0]),
            Body::Snapshot(SnapshotChunk { replica: 0, first: true, blocks }),
            Body::SnapshotComplete(SnapshotComplete {}),
        ]
        .into_iter()
        .enumerate()
        .map(|(i, b)| view.apply(&msg(seq0 + i as u64, b)).unwrap())
        .collect()
    }

    #[test]
    fn the_old_index_serves_until_the_resync_is_complete() {
        let mut view = FeedView::default();
        assert!(!view.usable());
        // A first subscription builds the serving state in place.
        assert_eq!(snapshot(&mut view, 0, vec![1, 2]), vec![Applied::Applied; 3]);
        assert!(view.usable() && !view.resyncing());
        // A resubscription: until its snapshot completes, requests see the old blocks.
        view.begin_subscription();
        assert!(view.resyncing());
        view.apply(&msg(0, table(&[0]))).unwrap();
        view.apply(&msg(1, Body::Snapshot(SnapshotChunk { replica: 0, first: true, blocks: vec![7] }))).unwrap();
        assert!(view.usable());
        assert_eq!(view.serving().index.score(&[BlockKey(1), BlockKey(2)]).leading, vec![2]);
        assert_eq!(view.serving().index.score(&[BlockKey(7)]).leading, vec![0]);
        assert_eq!(view.apply(&msg(2, Body::SnapshotComplete(SnapshotComplete {}))), Ok(Applied::Swapped));
        assert!(!view.resyncing());
        assert_eq!(view.serving().index.score(&[BlockKey(1), BlockKey(2)]).leading, vec![0]);
        assert_eq!(view.serving().index.score(&[BlockKey(7)]).leading, vec![1]);
    }

    #[test]
    fn a_gap_drops_a_partial_resync_and_keeps_a_complete_index_serving() {
        let mut view = FeedView::default();
        snapshot(&mut view, 0, vec![1]);
        // A gap on the serving subscription: still usable.
        let gap = view.apply(&msg(9, Body::Heartbeat(Heartbeat {})));
        assert_eq!(gap, Err(FeedError::Gap { expected: 3, got: 9 }));
        assert!(view.usable());
        // A gap during a resync: the partial state goes, the old one stays.
        view.begin_subscription();
        view.apply(&msg(0, table(&[0]))).unwrap();
        assert!(view.apply(&msg(5, Body::Heartbeat(Heartbeat {}))).is_err());
        assert!(!view.resyncing() && view.usable());
        assert_eq!(view.serving().index.score(&[BlockKey(1)]).leading, vec![1]);
        // An incomplete serving state is rebuilt in place by the next subscription.
        let mut fresh = FeedView::default();
        fresh.begin_subscription();
        fresh.apply(&msg(0, table(&[0]))).unwrap();
        fresh.begin_subscription();
        assert!(!fresh.resyncing() && fresh.serving().replicas.is_empty());
    }
}
