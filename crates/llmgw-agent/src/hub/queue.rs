//! One feed subscriber's queue: bounded, its messages numbered without gaps, what it costs,
//! and what becomes of a message offered to it (sent, held for a snapshot being built, or an
//! overflow that makes it resync). Nothing here takes the hub lock.

use llmgw_core::feed::{BlockDeltas, Body, FeedMessage, SnapshotChunk};
use std::collections::{BTreeSet, VecDeque};
use std::sync::{Mutex, MutexGuard};
use tokio::sync::Notify;

/// Largest number of blocks in one snapshot chunk, and in one message of gathered changes.
pub const CHUNK_BLOCKS: usize = 65_536;

/// Largest number of changes (one replica's delta each) gathered into one message.
pub const BATCH_DELTAS: usize = 4_096;

/// A subscriber's pending messages, numbered without gaps from 0 across resyncs. Lock order:
/// the hub lock before a queue lock, never the reverse.
pub(super) struct SubQueue {
    pub(super) msgs: VecDeque<FeedMessage>,
    /// What `msgs` holds, as [`approx_bytes`] counts it.
    pub(super) bytes: usize,
    /// Number of the next message queued.
    pub(super) next_seq: u64,
    /// Nothing is queued until the stream task has built a fresh table and snapshot.
    pub(super) resync: bool,
    /// Tables and snapshots sent so far.
    pub(super) resyncs: u64,
    /// The snapshot being built, while `resync`.
    pub(super) building: Option<Building>,
    /// Numbers the builds, so that a builder notices its build was abandoned.
    pub(super) build_gen: u64,
    /// The queued message that later block changes join, as counted so far (so that joining
    /// one costs the same however many it holds). Cleared with `msgs`.
    pub(super) gathering: Option<Gathering>,
}

/// A queued message of block changes: its number, the changes and the blocks it holds.
#[derive(Clone, Copy, Debug)]
pub(super) struct Gathering {
    seq: u64,
    parts: usize,
    blocks: usize,
}

/// A snapshot under construction.
pub(super) struct Building {
    pub(super) generation: u64,
    /// Engines the snapshot lists (the live ones when it started).
    pub(super) listed: BTreeSet<u32>,
    /// Of those, the ones copied so far.
    pub(super) taken: BTreeSet<u32>,
    /// Published since the build started and not included in it.
    pub(super) pending: Vec<Body>,
    pub(super) pending_bytes: usize,
}

impl Building {
    /// Whether `body`, published now, must follow the snapshot.
    pub(super) fn keeps(&self, body: &Body) -> bool {
        let engine = match body {
            Body::Snapshot(s) => Some(s.replica),
            Body::Delta(d) => Some(d.replica),
            Body::Reset(r) => Some(r.replica),
            _ => None,
        };
        engine.is_none_or(|id| !self.listed.contains(&id) || self.taken.contains(&id))
    }
}

/// One feed subscription.
pub struct Subscriber {
    pub name: String,
    /// It applies `BlockDeltas`: a change published while a message of changes is still
    /// queued for it joins that message rather than queuing one of its own, and so does a load
    /// report (see [`gather`]).
    pub batches: bool,
    queue: Mutex<SubQueue>,
    pub notify: Notify,
}

/// What became of a message offered to a subscriber.
pub(super) enum Offered {
    /// Queued.
    Sent,
    /// Joined a message already queued (a subscriber that `batches`).
    Gathered,
    /// Not queued: the subscriber waits for a fresh table and snapshot (a build may keep it).
    Held,
    /// Its backlog overflowed (`by_bytes`: past the byte cap rather than the length cap), or the
    /// snapshot being built for it collected too much: it resyncs.
    Overflowed { by_bytes: bool },
}

impl Subscriber {
    /// A subscription whose first messages will be the table and a snapshot.
    pub(super) fn new(name: String, batches: bool) -> Subscriber {
        Subscriber {
            name,
            batches,
            queue: Mutex::new(SubQueue {
                msgs: VecDeque::new(),
                bytes: 0,
                next_seq: 0,
                resync: true,
                resyncs: 0,
                building: None,
                build_gen: 0,
                gathering: None,
            }),
            notify: Notify::new(),
        }
    }

    pub(super) fn queue(&self) -> MutexGuard<'_, SubQueue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn push(q: &mut SubQueue, body: Body) {
        q.bytes = q.bytes.saturating_add(approx_bytes(&body));
        let seq = q.next_seq;
        q.next_seq = q.next_seq.saturating_add(1);
        q.msgs.push_back(FeedMessage { seq, body: Some(body) });
    }

    /// Whether the next [`Self::pop`] builds a table and snapshot first (a blocking job: the
    /// feed's stream task hands it to a blocking thread).
    pub fn needs_resync(&self) -> bool {
        self.queue().resync
    }

    pub(super) fn pop_front(q: &mut SubQueue) -> Option<FeedMessage> {
        let m = q.msgs.pop_front()?;
        if let Some(b) = &m.body {
            q.bytes = q.bytes.saturating_sub(approx_bytes(b));
        }
        Some(m)
    }

    /// Messages queued, and snapshots sent.
    pub(super) fn backlog(&self) -> (usize, u64) {
        let q = self.queue();
        (q.msgs.len(), q.resyncs)
    }

    /// Offers one message body (`cost` as [`approx_bytes`] counts it) under the caps of the
    /// queue (`max` messages, `max_bytes`).
    pub(super) fn offer(&self, body: &Body, cost: usize, max: usize, max_bytes: usize) -> Offered {
        let mut q = self.queue();
        if q.resync {
            // A snapshot under construction collects what it will not include; past the caps
            // the build is abandoned and starts over.
            if let Some(b) = q.building.as_mut() {
                if b.keeps(body) {
                    if b.pending.len() >= max || b.pending_bytes.saturating_add(cost) > max_bytes {
                        q.building = None;
                        return Offered::Overflowed { by_bytes: false };
                    }
                    b.pending.push(body.clone());
                    b.pending_bytes = b.pending_bytes.saturating_add(cost);
                }
            }
            return Offered::Held;
        }
        let too_big = q.bytes.saturating_add(cost) > max_bytes;
        if !too_big && self.batches && Self::gather_into_queued(&mut q, body) {
            // The stream task is woken for the message already queued.
            return Offered::Gathered;
        }
        let offered = if q.msgs.len() >= max || too_big {
            let by_bytes = too_big && q.msgs.len() < max;
            // Too far behind: drop the backlog; a fresh table and snapshot replace it, numbered
            // from the first dropped message so the subscriber sees no gap.
            if let Some(first) = q.msgs.front() {
                q.next_seq = first.seq;
            }
            q.msgs.clear();
            q.gathering = None;
            q.bytes = 0;
            q.resync = true;
            Offered::Overflowed { by_bytes }
        } else {
            Self::push(&mut q, body.clone());
            Offered::Sent
        };
        drop(q);
        self.notify.notify_one();
        offered
    }

    /// Joins `body` to a queued message if [`gather`] allows: the last one, or the one before
    /// it where the last is of the other kind among block changes and load reports (they touch
    /// different state, so their order between them changes nothing). Keeps the queue's byte
    /// count exact.
    fn gather_into_queued(q: &mut SubQueue, body: &Body) -> bool {
        let SubQueue { msgs, bytes, gathering, .. } = q;
        for m in msgs.iter_mut().rev().take(2) {
            let seq = m.seq;
            let Some(queued) = m.body.as_mut() else { return false };
            if let Some(added) = gather(queued, seq, body, gathering) {
                *bytes = bytes.saturating_add(added);
                return true;
            }
            let changes = |b: &Body| matches!(b, Body::Delta(_) | Body::Deltas(_));
            let commute = match body {
                Body::Load(_) => changes(queued),
                b if changes(b) => matches!(queued, Body::Load(_)),
                _ => false,
            };
            if !commute {
                return false;
            }
        }
        false
    }

    /// How many times this subscriber got a table and snapshot (1 = only the initial one).
    pub fn snapshots_sent(&self) -> u64 {
        self.queue().resyncs
    }
}

/// Joins `body` to `queued` (message `seq`, not yet sent) where that changes nothing a
/// subscriber ends up with, and returns the bytes ([`approx_bytes`]) it adds: a replica's block
/// changes join earlier changes (as `BlockDeltas`, applied in order) up to [`CHUNK_BLOCKS`]
/// blocks and [`BATCH_DELTAS`] changes in one message; a load report replaces or adds its
/// replicas' entries in an earlier load report. Anything else (tables, snapshots, resets,
/// heartbeats) stays a message of its own. `gathering` keeps the counts of the message changes
/// join, so that a join costs the same however many it holds.
pub(super) fn gather(queued: &mut Body, seq: u64, body: &Body, gathering: &mut Option<Gathering>) -> Option<usize> {
    match (queued, body) {
        (queued @ (Body::Delta(_) | Body::Deltas(_)), Body::Delta(d)) => {
            let n = delta_blocks(d);
            let mut g = match *gathering {
                Some(g) if g.seq == seq => g,
                _ => match &*queued {
                    Body::Delta(first) => Gathering { seq, parts: 1, blocks: delta_blocks(first) },
                    Body::Deltas(ds) => Gathering {
                        seq,
                        parts: ds.deltas.len(),
                        blocks: ds.deltas.iter().map(delta_blocks).fold(0, usize::saturating_add),
                    },
                    _ => return None,
                },
            };
            if g.parts >= BATCH_DELTAS || g.blocks.saturating_add(n) > CHUNK_BLOCKS {
                return None;
            }
            // approx_bytes: a delta 8 per block + 64; gathered, 8 per block + 16 per part + 64.
            let added = match queued {
                Body::Delta(first) => {
                    let first = std::mem::take(first);
                    *queued = Body::Deltas(BlockDeltas { deltas: vec![first, d.clone()] });
                    n.saturating_mul(8).saturating_add(32)
                }
                Body::Deltas(ds) => {
                    ds.deltas.push(d.clone());
                    n.saturating_mul(8).saturating_add(16)
                }
                _ => return None,
            };
            g.parts = g.parts.saturating_add(1);
            g.blocks = g.blocks.saturating_add(n);
            *gathering = Some(g);
            Some(added)
        }
        (Body::Load(earlier), Body::Load(l)) => {
            let before = earlier.loads.len();
            for load in &l.loads {
                match earlier.loads.iter_mut().find(|x| x.replica == load.replica) {
                    Some(x) => *x = load.clone(),
                    None => earlier.loads.push(load.clone()),
                }
            }
            Some(earlier.loads.len().saturating_sub(before).saturating_mul(24))
        }
        _ => None,
    }
}

fn delta_blocks(d: &llmgw_core::feed::BlockDelta) -> usize {
    d.added.len().saturating_add(d.removed.len())
}

/// Counters not tied to one engine.
#[derive(Debug, Default, Clone)]
pub struct FeedCounters {
    pub subscriptions: u64,
    pub messages: u64,
    pub overflows: u64,
    pub rejected_token: u64,
    /// Subscriber names longer than the limit or holding control characters (cut, replaced).
    pub names_cut: u64,
    /// Of `overflows`, those past `feed.max_backlog_bytes` (rather than `feed.max_queue`).
    pub backlog_bytes_overflows: u64,
    /// Subscriptions refused because `feed.max_subscribers` were live.
    pub subscribers_refused: u64,
    /// Changes and load reports that joined a message already queued for a subscriber.
    pub gathered: u64,
}

/// What a queued message costs, roughly: its block keys and loads, plus a little.
pub(super) fn approx_bytes(body: &Body) -> usize {
    let n = match body {
        Body::Snapshot(s) => s.blocks.len().saturating_mul(8),
        Body::Delta(d) => delta_blocks(d).saturating_mul(8),
        Body::Deltas(ds) => ds
            .deltas
            .iter()
            .map(|d| delta_blocks(d).saturating_mul(8).saturating_add(16))
            .fold(0, usize::saturating_add),
        Body::Load(l) => l.loads.len().saturating_mul(24),
        Body::Replicas(t) => t.replicas.len().saturating_mul(128),
        _ => 0,
    };
    n.saturating_add(64)
}

/// One engine's snapshot chunks: the first flagged (empty when it holds nothing), at most
/// [`CHUNK_BLOCKS`] blocks each.
pub(super) fn snapshot_chunks(id: u32, keys: &[llmgw_core::BlockKey]) -> Vec<Body> {
    if keys.is_empty() {
        return vec![Body::Snapshot(SnapshotChunk { replica: id, first: true, blocks: Vec::new() })];
    }
    keys.chunks(CHUNK_BLOCKS)
        .enumerate()
        .map(|(i, chunk)| {
            Body::Snapshot(SnapshotChunk { replica: id, first: i == 0, blocks: chunk.iter().map(|k| k.0).collect() })
        })
        .collect()
}
