//! Engines' snapshots in a JetStream object-store bucket (`[jetstream.snapshots]`), so that an
//! agent that starts late rebuilds a mirror from a snapshot and the stream's tail instead of
//! reading the whole stream (which may no longer hold an engine's first batches).
//!
//! * **Writing** (`llmgw-agent publish`): every `interval_secs`, each engine's ledger
//!   ([`crate::snapshot::ledger`]) is copied under its lock, encoded outside it, and written as
//!   one object named after the engine's subject, only when it changed since the last write.
//!   The object's metadata ([`ObjectMeta`]) says which batch S it is exact at, from which batch
//!   on it is known (`incomplete_from`), and where batch S sits in the stream (its stream
//!   sequence, and the stream's name and creation time, so that a snapshot of a stream since
//!   replaced is not taken for one of the current stream).
//! * **Reading** (the agent's consumer): at the start, for every engine whose sequence it does
//!   not know yet, the object is read and checked against the stream ([`load`]); the consumer
//!   applies it as batch S and drops the engine's messages up to its stream sequence.

use crate::config::{JetStreamConfig, SnapshotBucketConfig};
use crate::snapshot::serve::Ledgers;
use async_nats::jetstream::{self, object_store};
use llmgw_core::event::EventBatch;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::AsyncReadExt;
use tracing::{info, warn};

/// Metadata keys of an engine's object.
pub const META_SEQ: &str = "llmgw-seq";
pub const META_INCOMPLETE_FROM: &str = "llmgw-incomplete-from";
pub const META_STREAM: &str = "llmgw-stream";
pub const META_STREAM_CREATED: &str = "llmgw-stream-created-ns";
pub const META_STREAM_SEQ: &str = "llmgw-stream-seq";

/// How long reading one object may take.
const READ_TIMEOUT: Duration = Duration::from_secs(10);
/// Acknowledged batches remembered per engine (the writer looks up the stream sequence of the
/// batch its ledger copy is exact at; it is among the last few).
const ACKS_KEPT: usize = 8192;

/// What an engine's object says besides its payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectMeta {
    /// The engine's batch the snapshot is exact at.
    pub seq: u64,
    /// `Some(f)`: the snapshot holds only what batches from `f` on stored.
    pub incomplete_from: Option<u64>,
    /// The stream batch `seq` went to, and when that stream was created (Unix nanoseconds).
    pub stream: String,
    pub stream_created_ns: i128,
    /// Batch `seq`'s sequence in that stream.
    pub stream_seq: u64,
}

impl ObjectMeta {
    pub fn encode(&self) -> HashMap<String, String> {
        let mut m = HashMap::from([
            (META_SEQ.to_owned(), self.seq.to_string()),
            (META_STREAM.to_owned(), self.stream.clone()),
            (META_STREAM_CREATED.to_owned(), self.stream_created_ns.to_string()),
            (META_STREAM_SEQ.to_owned(), self.stream_seq.to_string()),
        ]);
        if let Some(f) = self.incomplete_from {
            m.insert(META_INCOMPLETE_FROM.to_owned(), f.to_string());
        }
        m
    }

    /// `None`: a key is missing or not a number.
    pub fn decode(m: &HashMap<String, String>) -> Option<ObjectMeta> {
        let num = |k: &str| m.get(k).and_then(|v| v.trim().parse::<u64>().ok());
        let incomplete_from = match m.get(META_INCOMPLETE_FROM) {
            Some(v) => Some(v.trim().parse().ok()?),
            None => None,
        };
        Some(ObjectMeta {
            seq: num(META_SEQ)?,
            incomplete_from,
            stream: m.get(META_STREAM)?.clone(),
            stream_created_ns: m.get(META_STREAM_CREATED)?.trim().parse().ok()?,
            stream_seq: num(META_STREAM_SEQ)?,
        })
    }

    /// Whether the snapshot belongs to this stream as it is now (not one deleted and made again,
    /// and not past its end).
    pub fn matches(&self, stream: &str, created_ns: i128, last_seq: u64) -> bool {
        self.stream == stream && self.stream_created_ns == created_ns && self.stream_seq <= last_seq
    }
}

/// The bucket, made if it is missing.
pub async fn open_bucket(
    ctx: &jetstream::Context,
    js: &JetStreamConfig,
    cfg: &SnapshotBucketConfig,
) -> Result<object_store::ObjectStore, super::NatsError> {
    if let Ok(s) = ctx.get_object_store(&cfg.bucket).await {
        return Ok(s);
    }
    let storage =
        if js.memory_storage { jetstream::stream::StorageType::Memory } else { jetstream::stream::StorageType::File };
    let config = object_store::Config {
        bucket: cfg.bucket.clone(),
        description: Some("llmgw: one snapshot of each engine's KV cache".to_owned()),
        max_bytes: cfg.bucket_max_bytes,
        storage,
        ..Default::default()
    };
    Ok(ctx.create_object_store(config).await?)
}

/// The stream sequences the broker acknowledged for one engine's batches.
#[derive(Default)]
pub struct RankAcks {
    /// The publisher's count of engine restarts (batches of two epochs may share a number).
    epoch: AtomicU64,
    /// (epoch, engine sequence, stream sequence), oldest first.
    recent: Mutex<VecDeque<(u64, u64, u64)>>,
}

impl RankAcks {
    pub fn set_epoch(&self, epoch: u64) {
        self.epoch.store(epoch, Ordering::SeqCst);
    }

    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::SeqCst)
    }

    /// The broker stored batch `seq` of `epoch` at `stream_seq`.
    pub fn acked(&self, epoch: u64, seq: u64, stream_seq: u64) {
        let mut r = self.recent.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if r.len() >= ACKS_KEPT {
            r.pop_front();
        }
        r.push_back((epoch, seq, stream_seq));
    }

    /// Where batch `seq` of `epoch` is in the stream, if it was acknowledged lately.
    pub fn stream_seq(&self, epoch: u64, seq: u64) -> Option<u64> {
        let r = self.recent.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        r.iter().rev().find(|(e, s, _)| *e == epoch && *s == seq).map(|(_, _, t)| *t)
    }
}

/// One engine the writer keeps an object of.
pub struct WrittenRank {
    pub dp_rank: u32,
    /// Its subject, which names its object.
    pub subject: String,
    pub acks: Arc<RankAcks>,
}

/// What a round did for one engine.
#[derive(Debug, PartialEq, Eq)]
enum Round {
    /// Written, or nothing new to write.
    Done,
    /// The batch the ledger is at is not acknowledged yet: try again soon.
    Pending,
}

/// Writes the engines' snapshots every `interval_secs` while they change (runs until aborted).
pub async fn write_loop(
    ctx: jetstream::Context,
    js: JetStreamConfig,
    cfg: SnapshotBucketConfig,
    ledgers: Arc<Ledgers>,
    ranks: Vec<WrittenRank>,
) {
    let interval = Duration::from_secs(cfg.interval_secs);
    let mut store = None;
    // Per rank: the (epoch, seq, incomplete_from) last written.
    let mut written: HashMap<u32, (u64, u64, Option<u64>)> = HashMap::new();
    let mut wait = interval;
    info!(bucket = %cfg.bucket, interval_secs = cfg.interval_secs, "writing snapshots to the object store");
    loop {
        tokio::time::sleep(wait).await;
        wait = interval;
        if store.is_none() {
            match open_bucket(&ctx, &js, &cfg).await {
                Ok(s) => store = Some(s),
                Err(e) => {
                    ledgers.bucket.failures.fetch_add(1, Ordering::Relaxed);
                    warn!(bucket = %cfg.bucket, error = %e, "snapshot bucket not available");
                    continue;
                }
            }
        }
        let Some(s) = &store else { continue };
        let info: Result<_, super::NatsError> = match ctx.get_stream(&js.stream).await {
            Ok(mut st) => {
                st.info().await.map(|i| (i.created.unix_timestamp_nanos(), i.state.last_sequence)).map_err(Into::into)
            }
            Err(e) => Err(e.into()),
        };
        let (created, last) = match info {
            Ok(i) => i,
            Err(e) => {
                warn!(stream = %js.stream, error = %e, "stream not available; snapshots not written");
                continue;
            }
        };
        for r in &ranks {
            let at = (js.stream.as_str(), created, last);
            if write_rank(s, &cfg, &ledgers, r, at, &mut written).await == Round::Pending {
                wait = interval.min(Duration::from_millis(250));
            }
        }
    }
}

async fn write_rank(
    store: &object_store::ObjectStore,
    cfg: &SnapshotBucketConfig,
    ledgers: &Ledgers,
    r: &WrittenRank,
    (stream, created, last): (&str, i128, u64),
    written: &mut HashMap<u32, (u64, u64, Option<u64>)>,
) -> Round {
    // The epoch is read under the ledger's lock: the ledger and it describe the same engine.
    let Some((copy, epoch)) = ledgers.lock(r.dp_rank).map(|l| (l.copy(), r.acks.epoch())) else { return Round::Done };
    let Some(seq) = copy.seq else { return Round::Done };
    let key = (epoch, seq, copy.incomplete_from);
    if written.get(&r.dp_rank) == Some(&key) {
        return Round::Done;
    }
    let Some(stream_seq) = r.acks.stream_seq(epoch, seq).filter(|t| *t <= last) else { return Round::Pending };
    let rank = r.dp_rank;
    let Some(snap) = tokio::task::spawn_blocking(move || copy.encode(rank)).await.ok().flatten() else {
        return Round::Done;
    };
    let bytes = u64::try_from(snap.payload.len()).unwrap_or(u64::MAX);
    written.insert(r.dp_rank, key);
    if bytes > cfg.max_object_bytes {
        ledgers.bucket.too_large.fetch_add(1, Ordering::Relaxed);
        warn!(subject = %r.subject, bytes, max_object_bytes = cfg.max_object_bytes,
            "snapshot larger than jetstream.snapshots.max_object_bytes: not written (agents read the stream instead)");
        return Round::Done;
    }
    let meta_seq = snap.seq;
    let meta = ObjectMeta {
        seq: snap.seq,
        incomplete_from: snap.incomplete_from,
        stream: stream.to_owned(),
        stream_created_ns: created,
        stream_seq,
    };
    let object =
        object_store::ObjectMetadata { name: r.subject.clone(), metadata: meta.encode(), ..Default::default() };
    match store.put(object, &mut snap.payload.as_slice()).await {
        Ok(_) => {
            ledgers.bucket.writes.fetch_add(1, Ordering::Relaxed);
            ledgers.bucket.last_bytes.store(bytes, Ordering::Relaxed);
            if let Some(rl) = ledgers.ranks.iter().find(|x| x.dp_rank == r.dp_rank) {
                rl.bucket_seq.store(i64::try_from(meta_seq).unwrap_or(i64::MAX), Ordering::Relaxed);
            }
        }
        Err(e) => {
            written.remove(&r.dp_rank);
            ledgers.bucket.failures.fetch_add(1, Ordering::Relaxed);
            warn!(subject = %r.subject, bytes, error = %e, "snapshot not written");
        }
    }
    Round::Done
}

/// An engine's snapshot as the consumer applies it.
#[derive(Debug)]
pub struct Loaded {
    pub meta: ObjectMeta,
    /// The payload, decoded.
    pub batch: EventBatch,
}

/// Reads the snapshots of `engines` (engine, subject) for the stream as it is now (its name,
/// creation time, last sequence). An engine without an object is left out; one whose object
/// cannot be used gets the reason (a metric label).
pub async fn load(
    ctx: &jetstream::Context,
    cfg: &SnapshotBucketConfig,
    (stream, created, last): (&str, i128, u64),
    engines: &[(usize, String)],
) -> Vec<(usize, Result<Loaded, &'static str>)> {
    let store = match ctx.get_object_store(&cfg.bucket).await {
        Ok(s) => s,
        Err(e) => {
            info!(bucket = %cfg.bucket, error = %e, "no snapshot bucket; reading the stream from its start");
            return Vec::new();
        }
    };
    let mut out = Vec::new();
    for (engine, subject) in engines {
        let r = tokio::time::timeout(READ_TIMEOUT, read(&store, subject, cfg.max_object_bytes)).await;
        let r = match r {
            Err(_) => Err("timeout"),
            Ok(None) => continue,
            Ok(Some(r)) => r,
        };
        let r = r.and_then(|(meta, payload)| {
            if !meta.matches(stream, created, last) {
                return Err("stale");
            }
            let batch = EventBatch::decode(&payload).map_err(|_| "malformed")?;
            Ok(Loaded { meta, batch })
        });
        if let Err(reason) = &r {
            warn!(subject = %subject, reason, "snapshot in the bucket not used; this engine is read from the stream's start");
        }
        out.push((*engine, r));
    }
    out
}

/// One object: `None` when there is none; its metadata and payload, or why not.
async fn read(
    store: &object_store::ObjectStore,
    name: &str,
    max: u64,
) -> Option<Result<(ObjectMeta, Vec<u8>), &'static str>> {
    let mut object = match store.get(name).await {
        Ok(o) => o,
        Err(e) if e.kind() == object_store::GetErrorKind::NotFound => return None,
        Err(_) => return Some(Err("io")),
    };
    if u64::try_from(object.info.size).unwrap_or(u64::MAX) > max {
        return Some(Err("too_large"));
    }
    let Some(meta) = ObjectMeta::decode(&object.info.metadata) else { return Some(Err("malformed")) };
    let mut payload = Vec::new();
    if (&mut object).take(max.saturating_add(1)).read_to_end(&mut payload).await.is_err() {
        return Some(Err("io"));
    }
    if u64::try_from(payload.len()).unwrap_or(u64::MAX) > max {
        return Some(Err("too_large"));
    }
    Some(Ok((meta, payload)))
}

#[cfg(test)]
#[allow(clippy::arithmetic_side_effects)]
mod tests {
    use super::*;

    fn meta(incomplete_from: Option<u64>) -> ObjectMeta {
        ObjectMeta {
            seq: 41,
            incomplete_from,
            stream: "LLMGW_KV".to_owned(),
            stream_created_ns: 1_700_000_000_123_456_789,
            stream_seq: 977,
        }
    }

    #[test]
    fn metadata_round_trips_with_and_without_incomplete_from() {
        for m in [meta(None), meta(Some(12))] {
            assert_eq!(ObjectMeta::decode(&m.encode()), Some(m.clone()));
        }
        assert!(!meta(None).encode().contains_key(META_INCOMPLETE_FROM));
    }

    #[test]
    fn metadata_missing_a_key_or_holding_a_non_number_is_refused() {
        for key in [META_SEQ, META_STREAM, META_STREAM_CREATED, META_STREAM_SEQ] {
            let mut m = meta(None).encode();
            m.remove(key);
            assert_eq!(ObjectMeta::decode(&m), None, "without {key}");
        }
        for key in [META_SEQ, META_INCOMPLETE_FROM, META_STREAM_CREATED, META_STREAM_SEQ] {
            let mut m = meta(Some(3)).encode();
            m.insert(key.to_owned(), "x".to_owned());
            assert_eq!(ObjectMeta::decode(&m), None, "{key} = x");
        }
    }

    #[test]
    fn a_snapshot_of_another_or_a_remade_stream_or_past_its_end_does_not_match() {
        let m = meta(None);
        assert!(m.matches("LLMGW_KV", m.stream_created_ns, 977));
        assert!(!m.matches("OTHER", m.stream_created_ns, 977));
        assert!(!m.matches("LLMGW_KV", m.stream_created_ns + 1, 977));
        assert!(!m.matches("LLMGW_KV", m.stream_created_ns, 976), "the stream ends before batch S");
    }

    #[test]
    fn acks_are_found_by_epoch_and_sequence_and_the_oldest_forgotten() {
        let a = RankAcks::default();
        a.acked(0, 5, 100);
        a.acked(1, 5, 200);
        assert_eq!((a.stream_seq(0, 5), a.stream_seq(1, 5), a.stream_seq(1, 6)), (Some(100), Some(200), None));
        for s in 0..ACKS_KEPT as u64 {
            a.acked(2, s, s);
        }
        assert_eq!(a.stream_seq(0, 5), None);
        assert_eq!(a.stream_seq(2, 0), Some(0));
    }
}
