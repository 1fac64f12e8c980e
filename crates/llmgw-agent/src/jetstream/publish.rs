//! `llmgw-agent publish`: beside one vLLM replica, its KV-event batches into JetStream.
//!
//! One thread per data-parallel rank reads the replica's ZMQ publisher (on loopback, so a gap
//! is rare and the replay socket fills it); one task per rank publishes the batches in order,
//! each acknowledged by the broker before the next (vLLM sends about a hundred a second, far
//! below what a round trip allows), retrying with the same `Nats-Msg-Id` so that the broker keeps
//! one copy. While the broker is away the rank's queue fills, the ZMQ socket then drops, and the
//! gap is filled from the replica's replay socket when it can be: the stream stays in order.
//!
//! With `--snapshot-listen`, each rank's batches also go into a ledger of the engine's blocks
//! ([`crate::snapshot`]), served as snapshots to agents that start after the engine; without
//! a `[jetstream]` section the sidecar then only serves snapshots. With `[jetstream.snapshots]`
//! the ledgers' snapshots are also written into an object-store bucket
//! ([`super::snapshot_bucket`]), for agents on the JetStream path.

use super::snapshot_bucket::{write_loop, RankAcks, WrittenRank};
use super::{connect, stream_config, JetStreamError, SEQ_HEADER};
use crate::config::{subject, Config, EngineSpec, EventSource, JetStreamConfig, ZmqConfig};
use crate::ingest::{Fill, FillOutcome, Ingest, Sink, SourceEvent};
use crate::seq::Cause;
use crate::shutdown::{join_threads, shutdown_signal, JoinError};
use crate::snapshot::record::Recording;
use crate::snapshot::serve::{router, Ledgers};
use crate::zmqsub::socket::{attach, live_item, sub_socket, ZmqReplay};
use async_nats::jetstream;
use async_nats::jetstream::context::PublishErrorKind;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tracing::{info, warn};

/// Batches queued per rank between its ZMQ thread and its publishing task.
const QUEUE: usize = 4096;

/// One batch on its way to the broker.
struct Item {
    seq: u64,
    /// Counts the engine restarts this process has seen: a restarted engine numbers from 0
    /// again, and its batches must not be taken for duplicates of the old ones.
    epoch: u64,
    payload: Vec<u8>,
}

/// Counters, logged every 10 s.
#[derive(Default)]
struct Counters {
    published: AtomicU64,
    retries: AtomicU64,
    replayed: AtomicU64,
    unfilled: AtomicU64,
    /// Batches larger than the broker's max_payload: dropped (a hole consumers reset at).
    too_large: AtomicU64,
}

/// Why `publish` cannot run.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    #[error("publish needs a [jetstream] section (url, stream, subject_prefix), --snapshot-listen, or both")]
    NoJetStream,
    #[error("cannot listen for snapshots on {0}: {1}")]
    Listen(std::net::SocketAddr, std::io::Error),
    #[error("--replica is needed: the configuration has {0} replicas")]
    ReplicaNeeded(usize),
    #[error("no replica named {0:?} in the configuration")]
    NoSuchReplica(String),
    #[error("replicas.{0}: publish reads the replica's ZMQ events; give its endpoint, not events = \"jetstream\"")]
    NotZmq(String),
    #[error("cannot start runtime: {0}")]
    Runtime(std::io::Error),
    #[error("cannot start engine thread: {0}")]
    Thread(std::io::Error),
    #[error(transparent)]
    Join(#[from] JoinError),
}

/// The engines `publish` serves: the named replica's ranks (or the only replica's).
pub fn engines_of(cfg: &Config, replica: Option<&str>) -> Result<Vec<EngineSpec>, PublishError> {
    let names: Vec<&str> = cfg.replicas.iter().map(|r| r.name.as_str()).collect();
    let name = match (replica, names.as_slice()) {
        (Some(n), _) => n.to_owned(),
        (None, [only]) => (*only).to_owned(),
        (None, _) => return Err(PublishError::ReplicaNeeded(names.len())),
    };
    let engines: Vec<EngineSpec> = cfg.engines().into_iter().filter(|e| e.replica == name).collect();
    if engines.is_empty() {
        return Err(PublishError::NoSuchReplica(name));
    }
    if engines.iter().any(|e| e.source != EventSource::Zmq) {
        return Err(PublishError::NotZmq(name));
    }
    Ok(engines)
}

/// Runs until SIGINT or SIGTERM; `snapshot_listen`: serve each rank's snapshot there.
pub fn run(
    cfg: Config,
    replica: Option<&str>,
    snapshot_listen: Option<std::net::SocketAddr>,
) -> Result<(), PublishError> {
    let js = cfg.jetstream.clone();
    if js.is_none() && snapshot_listen.is_none() {
        return Err(PublishError::NoJetStream);
    }
    let engines = engines_of(&cfg, replica)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .thread_name("llmgw-publish")
        .build()
        .map_err(PublishError::Runtime)?;
    rt.block_on(run_async(js, cfg.zmq.clone(), engines, snapshot_listen))
}

async fn run_async(
    js: Option<JetStreamConfig>,
    zmq_cfg: ZmqConfig,
    engines: Vec<EngineSpec>,
    snapshot_listen: Option<std::net::SocketAddr>,
) -> Result<(), PublishError> {
    let bucket = js.as_ref().and_then(|j| j.snapshots.clone());
    let ledgers = (snapshot_listen.is_some() || bucket.is_some())
        .then(|| Arc::new(Ledgers::new(engines.iter().map(|e| e.dp_rank), zmq_cfg.max_blocks_per_engine)));
    let mut server = None;
    if let (Some(addr), Some(l)) = (snapshot_listen, &ledgers) {
        let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| PublishError::Listen(addr, e))?;
        info!(listen = %addr, "serving snapshots at /snapshot");
        let app = router(l.clone());
        server = Some(tokio::spawn(async move { axum::serve(listener, app).await }));
    }
    let mut ctx = None;
    if let Some(js) = &js {
        ctx = Some(loop {
            match open(js, zmq_cfg.max_message_bytes).await {
                Ok(c) => break c,
                Err(e) => {
                    warn!(error = %e, "jetstream not reachable; retrying in 1 s");
                    tokio::select! {
                        _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                        _ = shutdown_signal() => return Ok(()),
                    }
                }
            }
        });
    }
    let stop = Arc::new(AtomicBool::new(false));
    let counters = Arc::new(Counters::default());
    let zctx = zmq::Context::new();
    let mut threads = Vec::new();
    let mut tasks = Vec::new();
    let mut written = Vec::new();
    for spec in engines {
        let acks = Arc::new(RankAcks::default());
        let (tx, rx) = tokio::sync::mpsc::channel::<Item>(QUEUE);
        let mut last = None;
        match (&ctx, &js) {
            (Some(ctx), Some(js)) => {
                let subj = subject(&js.subject_prefix, &spec.address, spec.dp_rank);
                info!(replica = %spec.label(), endpoint = %spec.endpoint, subject = %subj, stream = %js.stream, "publishing KV events to jetstream");
                last = last_published(ctx, js, &subj).await;
                if let Some(seq) = last {
                    info!(subject = %subj, seq, "the stream holds this engine's batches up to seq; continuing after it");
                }
                written.push(WrittenRank { dp_rank: spec.dp_rank, subject: subj.clone(), acks: acks.clone() });
                let rank = Rank { subj, acks: acks.clone() };
                tasks.push(tokio::spawn(publish_rank(
                    ctx.clone(),
                    js.clone(),
                    rank,
                    rx,
                    counters.clone(),
                    stop.clone(),
                )));
            }
            _ => {
                info!(replica = %spec.label(), endpoint = %spec.endpoint, "keeping the engine's blocks for snapshots");
                tasks.push(tokio::spawn(drain(rx)));
            }
        }
        if let (Some(seq), Some(l)) = (last, &ledgers) {
            // Continuing the stream's sequence: what came before it is not in this ledger.
            if let Some(mut ledger) = l.lock(spec.dp_rank) {
                ledger.mark_incomplete(seq.saturating_add(1));
            }
        }
        let queue = Queue { counters: counters.clone(), tx, epoch: 0, label: spec.label(), acks };
        let reader = Reader {
            replay: ZmqReplay::new(zctx.clone(), zmq_cfg.clone(), &spec),
            queue: Recording { inner: queue, ledgers: ledgers.clone(), dp_rank: spec.dp_rank },
            spec,
            cfg: zmq_cfg.clone(),
            ctx: zctx.clone(),
            stop: stop.clone(),
            last,
            sessions: 0,
        };
        threads.push(
            std::thread::Builder::new()
                .name(format!("zmq-{}", reader.spec.label()))
                .spawn(move || reader.run())
                .map_err(PublishError::Thread)?,
        );
    }
    let writer = match (&ctx, &js, bucket, &ledgers) {
        (Some(ctx), Some(js), Some(b), Some(l)) if !written.is_empty() => {
            Some(tokio::spawn(write_loop(ctx.clone(), js.clone(), b, l.clone(), written)))
        }
        _ => None,
    };
    let report = tokio::spawn(report(counters.clone()));
    shutdown_signal().await;
    info!("shutting down");
    stop.store(true, Ordering::SeqCst);
    report.abort();
    if let Some(w) = writer {
        w.abort();
    }
    // The ranks finish what they hold together, for 3 s at most.
    let all = futures_util::future::join_all(tasks.iter_mut());
    if tokio::time::timeout(Duration::from_secs(3), all).await.is_err() {
        for t in &tasks {
            t.abort();
        }
    }
    if let Some(s) = server {
        s.abort();
    }
    Ok(join_threads(threads).await?)
}

async fn open(js: &JetStreamConfig, max_message_bytes: i64) -> Result<jetstream::Context, JetStreamError> {
    let client = connect(js, "llmgw-publish").await?;
    let max_payload = client.server_info().max_payload;
    if i64::try_from(max_payload).is_ok_and(|m| m < max_message_bytes) {
        warn!(
            max_payload,
            max_message_bytes,
            "the broker's max_payload is below zmq.max_message_bytes: a batch larger than it is dropped \
             (consumers reset that engine); raise the broker's max_payload"
        );
    }
    let ctx = jetstream::new(client);
    ctx.get_or_create_stream(stream_config(js)).await.map_err(|e| JetStreamError::stream(&js.stream, e))?;
    Ok(ctx)
}

/// The sequence number of the last batch the stream holds for `subj` (a restarted publisher
/// continues after it instead of publishing the replica's replay buffer again).
async fn last_published(ctx: &jetstream::Context, js: &JetStreamConfig, subj: &str) -> Option<u64> {
    let stream = ctx.get_stream(&js.stream).await.ok()?;
    let m = stream.get_last_raw_message_by_subject(subj).await.ok()?;
    m.headers.get(SEQ_HEADER)?.as_str().trim().parse().ok()
}

/// One rank's subject, and where the stream sequences of its acknowledged batches go.
struct Rank {
    subj: String,
    acks: Arc<RankAcks>,
}

/// Publishes one rank's batches in order, each acknowledged before the next.
async fn publish_rank(
    ctx: jetstream::Context,
    js: JetStreamConfig,
    Rank { subj, acks }: Rank,
    mut rx: tokio::sync::mpsc::Receiver<Item>,
    counters: Arc<Counters>,
    stop: Arc<AtomicBool>,
) {
    // Distinguishes this process's message ids from an earlier one's (the broker keeps ids for
    // its duplicate window, 2 minutes).
    let boot = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    while let Some(item) = rx.recv().await {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(SEQ_HEADER, item.seq.to_string().as_str());
        let id = format!("{subj}:{boot}:{}:{}", item.epoch, item.seq);
        headers.insert(async_nats::header::NATS_MESSAGE_ID, id.as_str());
        let payload = bytes::Bytes::from(item.payload);
        let mut delay = Duration::from_millis(50);
        loop {
            let r = match ctx.publish_with_headers(subj.clone(), headers.clone(), payload.clone()).await {
                Ok(ack) => ack.await,
                Err(e) => Err(e),
            };
            match r {
                Ok(ack) => {
                    acks.acked(item.epoch, item.seq, ack.sequence);
                    counters.published.fetch_add(1, Ordering::Relaxed);
                    break;
                }
                Err(e) if e.kind() == PublishErrorKind::MaxPayloadExceeded => {
                    // Never accepted however often it is sent: leave the hole.
                    counters.too_large.fetch_add(1, Ordering::Relaxed);
                    warn!(subject = %subj, seq = item.seq, bytes = payload.len(), error = %e, "batch larger than the broker accepts: dropped; consumers will reset this engine");
                    break;
                }
                Err(e) if e.kind() == PublishErrorKind::StreamNotFound => {
                    // The stream was deleted (or the broker restarted without it): make it again.
                    counters.retries.fetch_add(1, Ordering::Relaxed);
                    warn!(subject = %subj, seq = item.seq, error = %e, "stream missing; creating it again");
                    if let Err(e) = ctx.get_or_create_stream(stream_config(&js)).await {
                        warn!(stream = %js.stream, error = %e, "cannot create the stream");
                    }
                    tokio::time::sleep(delay).await;
                    delay = delay.saturating_mul(2).min(Duration::from_secs(1));
                }
                Err(e) if stop.load(Ordering::SeqCst) => {
                    warn!(subject = %subj, seq = item.seq, error = %e, "batch not published at shutdown");
                    return;
                }
                Err(e) => {
                    counters.retries.fetch_add(1, Ordering::Relaxed);
                    warn!(subject = %subj, seq = item.seq, error = %e, "publish failed; retrying");
                    tokio::time::sleep(delay).await;
                    delay = delay.saturating_mul(2).min(Duration::from_secs(1));
                }
            }
        }
    }
}

/// Without a broker: the batches only fed the ledger.
async fn drain(mut rx: tokio::sync::mpsc::Receiver<Item>) {
    while rx.recv().await.is_some() {}
}

async fn report(c: Arc<Counters>) {
    let mut t = tokio::time::interval(Duration::from_secs(10));
    t.tick().await;
    loop {
        t.tick().await;
        info!(
            published = c.published.load(Ordering::Relaxed),
            retries = c.retries.load(Ordering::Relaxed),
            replayed = c.replayed.load(Ordering::Relaxed),
            unfilled_gaps = c.unfilled.load(Ordering::Relaxed),
            too_large = c.too_large.load(Ordering::Relaxed),
            "jetstream publisher"
        );
    }
}

/// Where one rank's batches go: the queue to its publishing task, numbered by engine epoch.
struct Queue {
    counters: Arc<Counters>,
    tx: tokio::sync::mpsc::Sender<Item>,
    /// Counts the engine restarts this process has seen.
    epoch: u64,
    /// For logs.
    label: String,
    /// Told the epoch (the snapshot writer pairs it with the ledger).
    acks: Arc<RankAcks>,
}

impl Sink<[u8]> for Queue {
    fn connected(&mut self, _: usize) {}

    fn disconnected(&mut self, _: usize, _: bool) {}

    fn fill_needed(&mut self, _: usize, cause: Cause, _: bool) {
        if cause == Cause::Restart || cause == Cause::Reconnect {
            self.epoch = self.epoch.saturating_add(1);
            self.acks.set_epoch(self.epoch);
        }
    }

    /// What a fill could not fetch stays a hole in the stream, which the consumers treat as a gap.
    fn fill_ended(&mut self, _: usize, fill: Fill) {
        let Fill { from, until, outcome, .. } = fill;
        let complete = match outcome {
            FillOutcome::Restarted => return,
            FillOutcome::NoReplay => {
                self.counters.unfilled.fetch_add(1, Ordering::Relaxed);
                warn!(replica = %self.label, from, until, "batches missed and no replay endpoint: consumers will reset this engine");
                return;
            }
            FillOutcome::Replayed { complete, batches, .. } => {
                self.counters.replayed.fetch_add(batches, Ordering::Relaxed);
                complete
            }
        };
        if !complete {
            self.counters.unfilled.fetch_add(1, Ordering::Relaxed);
            warn!(replica = %self.label, from, until, "missed batches could not be replayed: consumers will reset this engine");
        }
    }

    /// Queues a batch for the broker; false once the publishing task is gone.
    fn apply(&mut self, _: usize, seq: u64, payload: &[u8]) -> bool {
        self.tx.blocking_send(Item { seq, epoch: self.epoch, payload: payload.to_vec() }).is_ok()
    }
}

/// One rank's ZMQ side.
struct Reader {
    spec: EngineSpec,
    cfg: ZmqConfig,
    ctx: zmq::Context,
    stop: Arc<AtomicBool>,
    queue: Recording<Queue>,
    replay: ZmqReplay,
    /// The last batch the stream already holds for this engine.
    last: Option<u64>,
    /// Sockets opened (names each one's monitor).
    sessions: u64,
}

impl Reader {
    fn run(mut self) {
        let mut ingest = Ingest::new();
        if let Some(seq) = self.last {
            ingest.resume_after(0, seq);
        }
        while !self.stop.load(Ordering::SeqCst) {
            if let Err(e) = self.session(&mut ingest) {
                warn!(replica = %self.spec.label(), endpoint = %self.spec.endpoint, error = %e, "zmq socket failed; retrying in 1 s");
                std::thread::sleep(Duration::from_secs(1));
            }
        }
    }

    fn session(&mut self, ingest: &mut Ingest) -> Result<(), zmq::Error> {
        let sub = sub_socket(&self.ctx, &self.cfg, &self.spec)?;
        // A lost connection may be an engine restart: the ledger serves nothing until the next
        // batch is judged (only the ledger is told; the stream's sequence rules stay as they were).
        let mon_ep = format!("inproc://llmgw-publish-monitor-{}-{}", self.spec.dp_rank, self.sessions);
        self.sessions = self.sessions.wrapping_add(1);
        sub.monitor(&mon_ep, zmq::SocketEvent::DISCONNECTED as i32)?;
        let mon = self.ctx.socket(zmq::PAIR)?;
        mon.set_linger(0)?;
        mon.connect(&mon_ep)?;
        attach(&sub, &self.spec)?;
        while !self.stop.load(Ordering::SeqCst) {
            let (sub_ready, mon_ready) = {
                let mut items = [sub.as_poll_item(zmq::POLLIN), mon.as_poll_item(zmq::POLLIN)];
                zmq::poll(&mut items, 200)?;
                let [a, b] = &items;
                (a.is_readable(), b.is_readable())
            };
            if sub_ready {
                // Bounded, so a busy engine's batches leave room for the monitor's events.
                for _ in 0..4096 {
                    let frames = match sub.recv_multipart(zmq::DONTWAIT) {
                        Ok(f) => f,
                        Err(zmq::Error::EAGAIN) => break,
                        Err(e) => return Err(e),
                    };
                    let Ok((seq, payload)) = live_item(&frames) else { continue };
                    let event = SourceEvent::Batch { engine: 0, seq, payload };
                    if !ingest.handle(event, &mut self.replay, &mut self.queue) {
                        return Ok(());
                    }
                }
            }
            if mon_ready {
                loop {
                    match mon.recv_multipart(zmq::DONTWAIT) {
                        Ok(frames) if crate::zmqsub::monitor_event(&frames) == Some(false) => self.queue.suspend(),
                        Ok(_) => {}
                        Err(zmq::Error::EAGAIN) => break,
                        Err(e) => return Err(e),
                    }
                }
            }
        }
        Ok(())
    }
}
