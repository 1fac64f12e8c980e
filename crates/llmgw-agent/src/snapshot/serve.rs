//! The sidecar's snapshot endpoint: `GET /snapshot?dp_rank=R`, its `/metrics`, and `/healthz`
//! (200 while it serves: the probes of the shipped manifests).
//!
//! Serving never holds up event ingestion for long: under the engine's lock only a flat copy
//! of the ledger is taken (its duration is a metric); sorting and encoding happen outside it,
//! on a blocking thread. One snapshot is built at a time; a request meanwhile gets 429.

use super::ledger::Ledger;
use super::{INCOMPLETE_HEADER, SEQ_HEADER};
use axum::extract::{RawQuery, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;
use tokio::sync::Semaphore;

/// One engine (data-parallel rank) of the sidecar's replica.
pub struct RankLedger {
    pub dp_rank: u32,
    pub ledger: Mutex<Ledger>,
    /// The batch the snapshot last written to the bucket is exact at (-1: none written).
    pub bucket_seq: std::sync::atomic::AtomicI64,
}

/// What the sidecar's snapshot endpoint serves, shared with its engine threads.
pub struct Ledgers {
    pub ranks: Vec<RankLedger>,
    /// One snapshot built at a time.
    building: Semaphore,
    served: AtomicU64,
    busy: AtomicU64,
    unavailable: AtomicU64,
    /// The longest an engine's lock was held to copy its ledger, in microseconds.
    copy_max_us: AtomicU64,
    /// Writes to the `[jetstream.snapshots]` bucket.
    pub bucket: BucketCounters,
}

/// What the sidecar's writes of snapshots into an object-store bucket came to.
#[derive(Default)]
pub struct BucketCounters {
    pub writes: AtomicU64,
    pub failures: AtomicU64,
    /// Snapshots over `max_object_bytes`, not written.
    pub too_large: AtomicU64,
    /// Bytes of the last snapshot written.
    pub last_bytes: AtomicU64,
}

impl Ledgers {
    /// One ledger per rank, each holding at most `max_blocks` distinct blocks.
    pub fn new(ranks: impl IntoIterator<Item = u32>, max_blocks: usize) -> Ledgers {
        Ledgers {
            ranks: ranks
                .into_iter()
                .map(|r| RankLedger {
                    dp_rank: r,
                    ledger: Mutex::new(Ledger::new(max_blocks)),
                    bucket_seq: std::sync::atomic::AtomicI64::new(-1),
                })
                .collect(),
            building: Semaphore::new(1),
            served: AtomicU64::new(0),
            busy: AtomicU64::new(0),
            unavailable: AtomicU64::new(0),
            copy_max_us: AtomicU64::new(0),
            bucket: BucketCounters::default(),
        }
    }

    /// The ledger of `dp_rank`, locked (a poisoned lock still holds a usable ledger).
    pub fn lock(&self, dp_rank: u32) -> Option<MutexGuard<'_, Ledger>> {
        let r = self.ranks.iter().find(|r| r.dp_rank == dp_rank)?;
        Some(r.ledger.lock().unwrap_or_else(std::sync::PoisonError::into_inner))
    }
}

pub fn router(ledgers: Arc<Ledgers>) -> Router {
    Router::new()
        .route("/snapshot", get(snapshot))
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .with_state(ledgers)
}

/// `dp_rank=R` in a query string (default 0).
fn dp_rank(query: Option<&str>) -> Option<u32> {
    let Some(q) = query else { return Some(0) };
    match q.split('&').find_map(|kv| kv.strip_prefix("dp_rank=")) {
        Some(v) => v.parse().ok(),
        None => Some(0),
    }
}

async fn snapshot(State(l): State<Arc<Ledgers>>, RawQuery(query): RawQuery) -> Response {
    let Some(rank) = dp_rank(query.as_deref()) else {
        return (StatusCode::BAD_REQUEST, "dp_rank must be a number\n").into_response();
    };
    let Ok(_permit) = l.building.try_acquire() else {
        l.busy.fetch_add(1, Ordering::Relaxed);
        return (StatusCode::TOO_MANY_REQUESTS, "a snapshot is being built; retry\n").into_response();
    };
    let started = Instant::now();
    let copy = match l.lock(rank) {
        Some(ledger) => ledger.copy(),
        None => return (StatusCode::NOT_FOUND, format!("no engine with dp_rank {rank}\n")).into_response(),
    };
    let us = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX);
    l.copy_max_us.fetch_max(us, Ordering::Relaxed);
    let encoded = tokio::task::spawn_blocking(move || copy.encode(rank)).await.ok().flatten();
    let Some(snap) = encoded else {
        l.unavailable.fetch_add(1, Ordering::Relaxed);
        return (StatusCode::SERVICE_UNAVAILABLE, "no batch from this engine yet\n").into_response();
    };
    l.served.fetch_add(1, Ordering::Relaxed);
    let mut resp = snap.payload.into_response();
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/vnd.msgpack"));
    h.insert(SEQ_HEADER, HeaderValue::from(snap.seq));
    if let Some(f) = snap.incomplete_from {
        h.insert(INCOMPLETE_HEADER, HeaderValue::from(f));
    }
    resp
}

async fn metrics(State(l): State<Arc<Ledgers>>) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "# HELP llmgw_publish_snapshots_total Snapshot requests by outcome.");
    let _ = writeln!(out, "# TYPE llmgw_publish_snapshots_total counter");
    for (outcome, c) in [("served", &l.served), ("busy", &l.busy), ("unavailable", &l.unavailable)] {
        let _ = writeln!(out, "llmgw_publish_snapshots_total{{outcome=\"{outcome}\"}} {}", c.load(Ordering::Relaxed));
    }
    let _ = writeln!(out, "# HELP llmgw_publish_snapshot_copy_max_seconds The longest an engine's events waited while a snapshot copied its ledger.");
    let _ = writeln!(out, "# TYPE llmgw_publish_snapshot_copy_max_seconds gauge");
    let _ =
        writeln!(out, "llmgw_publish_snapshot_copy_max_seconds {}", l.copy_max_us.load(Ordering::Relaxed) as f64 / 1e6);
    let _ = writeln!(
        out,
        "# HELP llmgw_publish_bucket_writes_total Snapshots written to the object-store bucket, by outcome."
    );
    let _ = writeln!(out, "# TYPE llmgw_publish_bucket_writes_total counter");
    let b = &l.bucket;
    for (outcome, c) in [("written", &b.writes), ("failed", &b.failures), ("too_large", &b.too_large)] {
        let _ =
            writeln!(out, "llmgw_publish_bucket_writes_total{{outcome=\"{outcome}\"}} {}", c.load(Ordering::Relaxed));
    }
    let _ = writeln!(out, "# HELP llmgw_publish_bucket_last_bytes Bytes of the last snapshot written to the bucket.");
    let _ = writeln!(out, "# TYPE llmgw_publish_bucket_last_bytes gauge");
    let _ = writeln!(out, "llmgw_publish_bucket_last_bytes {}", b.last_bytes.load(Ordering::Relaxed));
    let _ = writeln!(out, "# HELP llmgw_publish_bucket_seq The batch an engine's last snapshot written to the bucket is exact at (-1: none).");
    let _ = writeln!(out, "# TYPE llmgw_publish_bucket_seq gauge");
    for r in &l.ranks {
        let _ = writeln!(
            out,
            "llmgw_publish_bucket_seq{{dp_rank=\"{}\"}} {}",
            r.dp_rank,
            r.bucket_seq.load(Ordering::Relaxed)
        );
    }
    let _ = writeln!(out, "# HELP llmgw_publish_ledger_blocks Distinct blocks the sidecar's ledger holds per engine.");
    let _ = writeln!(out, "# TYPE llmgw_publish_ledger_blocks gauge");
    let _ = writeln!(out, "# HELP llmgw_publish_ledger_incomplete 1 while an engine's ledger lacks what batches before its incomplete_from stored.");
    let _ = writeln!(out, "# TYPE llmgw_publish_ledger_incomplete gauge");
    let _ = writeln!(out, "# HELP llmgw_publish_ledger_limit_hits_total Times an engine's ledger passed --snapshot-max-blocks and was dropped.");
    let _ = writeln!(out, "# TYPE llmgw_publish_ledger_limit_hits_total counter");
    for r in &l.ranks {
        let (blocks, incomplete, hits) = {
            let g = r.ledger.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            (g.len(), g.incomplete_from().is_some(), g.limit_hits)
        };
        let rank = r.dp_rank;
        let _ = writeln!(out, "llmgw_publish_ledger_blocks{{dp_rank=\"{rank}\"}} {blocks}");
        let _ = writeln!(out, "llmgw_publish_ledger_incomplete{{dp_rank=\"{rank}\"}} {}", u8::from(incomplete));
        let _ = writeln!(out, "llmgw_publish_ledger_limit_hits_total{{dp_rank=\"{rank}\"}} {hits}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::dp_rank;

    #[test]
    fn the_rank_comes_from_the_query() {
        assert_eq!(dp_rank(None), Some(0));
        assert_eq!(dp_rank(Some("dp_rank=3")), Some(3));
        assert_eq!(dp_rank(Some("x=1&dp_rank=2")), Some(2));
        assert_eq!(dp_rank(Some("dp_rank=x")), None);
    }
}
