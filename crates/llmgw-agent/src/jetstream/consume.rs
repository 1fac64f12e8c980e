//! The agent's JetStream consumer: one ordered consumer over all the stream's subjects, its
//! messages handed to the ingest loop ([`crate::ingest`]) under one hub lock per chunk; after a
//! lost session it resumes after the last stream sequence applied, and a mirror that started
//! clean is rebuilt by reading the stream again for it alone. With `[jetstream.snapshots]`, an
//! engine whose sequence is not known (at the start, or rebuilding) starts from its snapshot in
//! the bucket ([`super::snapshot_bucket`]) and the stream is read from after the batch it is
//! exact at instead of from its start.

use super::snapshot_bucket::{load, Loaded};
use super::{connect, stream_config, JetStreamError, SEQ_HEADER};
use crate::config::{Config, EngineSpec, JetStreamConfig};
use crate::hub::{Hub, HubState};
use crate::ingest::to_hub::HubSink;
use crate::ingest::{FillOutcome, Ingest, Replay, Sink, SourceEvent};
use async_nats::jetstream::{self, consumer, stream};
use futures_util::StreamExt;
use llmgw_core::event::EventBatch;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::{info, warn};

/// Messages applied under one hub lock at most (those already received).
const CHUNK: usize = 256;

/// What the consumer keeps between messages: which engine a subject is, and each engine's
/// sequence discipline (in the ingest loop).
pub struct StreamIngest {
    by_subject: HashMap<String, usize>,
    engines: Vec<usize>,
    ingest: Ingest,
    /// Set by the hub when an engine's mirror starts clean (its replica came back up) and must
    /// be rebuilt from what the stream retains.
    rebuild: Vec<(usize, Arc<AtomicBool>)>,
    /// Engines started from a snapshot: the stream sequence of the batch it is exact at (their
    /// messages up to it are dropped).
    joined_at: HashMap<usize, u64>,
}

/// The stream as a source's replay: it holds what the publisher delivered, in order, so
/// batches missing from it cannot be fetched anywhere (the publisher already tried its
/// replica's replay socket).
struct StreamHoldsAll;

impl Replay<Option<EventBatch>> for StreamHoldsAll {
    fn replay(&mut self, _: u64, _: u64, _: &mut dyn FnMut(u64, &Option<EventBatch>) -> bool) -> FillOutcome {
        FillOutcome::Replayed { complete: false, batches: 0, skipped: Vec::new(), tail_from: None }
    }
}

/// The hub as the consumer's sink, under the lock it holds.
fn sink(st: &mut HubState) -> HubSink<&mut HubState> {
    HubSink::new(st, "jetstream_connected", "jetstream_gone")
}

/// Marks every engine of the stream: `link` (the consumer's connection opened or closed) and
/// `healthy` (its replicas judged up or down).
fn mark(st: &mut HubState, engines: &[usize], link: Option<bool>, healthy: Option<bool>) {
    if let Some(c) = link {
        st.jetstream.connected = c;
    }
    let mut sink = sink(st);
    for &idx in engines {
        sink.link(idx, link, healthy);
    }
}

impl StreamIngest {
    /// The engines fed from the stream (those with a subject).
    pub fn new(engines: &[EngineSpec]) -> StreamIngest {
        let by_subject: HashMap<String, usize> = engines
            .iter()
            .filter_map(|e| Some((e.source.subject()?.to_owned(), usize::try_from(e.id).ok()?)))
            .collect();
        let engines = by_subject.values().copied().collect();
        StreamIngest { by_subject, engines, ingest: Ingest::new(), rebuild: Vec::new(), joined_at: HashMap::new() }
    }

    /// Watches the hub's rebuild flags of these engines.
    pub fn watch(&mut self, hub: &Hub) {
        self.rebuild = self.engines.iter().filter_map(|&i| Some((i, hub.rebuild_flag(i)?))).collect();
    }

    /// The engines whose rebuild was asked for since the last call; their sequence positions
    /// are forgotten and their mirrors cleared in `hub` (messages may have reached the clean
    /// mirror before the flag was seen; the catch-up applies each once).
    pub fn take_rebuilds(&mut self, hub: &Hub) -> Vec<usize> {
        let asked: Vec<usize> =
            self.rebuild.iter().filter(|(_, f)| f.swap(false, Ordering::SeqCst)).map(|(i, _)| *i).collect();
        if !asked.is_empty() {
            let mut st = hub.state();
            for &i in &asked {
                st.reset(i, "rebuild");
            }
        }
        for &i in &asked {
            self.ingest.forget(i);
            self.joined_at.remove(&i);
        }
        asked
    }

    /// The engine a subject belongs to.
    pub fn engine_of(&self, subject: &str) -> Option<usize> {
        self.by_subject.get(subject).copied()
    }

    pub fn engines(&self) -> impl Iterator<Item = usize> + '_ {
        self.engines.iter().copied()
    }

    /// Applies one message (under the hub lock the caller holds).
    pub fn on_message(&mut self, st: &mut HubState, subject: &str, seq: Option<&str>, payload: &[u8]) {
        self.on_batch(st, subject, seq, EventBatch::decode(payload).ok());
    }

    /// Applies one message whose payload was decoded before the hub lock was taken (`None`: it
    /// did not decode).
    pub fn on_batch(&mut self, st: &mut HubState, subject: &str, seq: Option<&str>, batch: Option<EventBatch>) {
        st.jetstream.messages = st.jetstream.messages.saturating_add(1);
        let Some(&engine) = self.by_subject.get(subject) else {
            st.jetstream.unknown_subject = st.jetstream.unknown_subject.saturating_add(1);
            return;
        };
        st.received(engine);
        let Some(seq) = seq.and_then(|s| s.trim().parse::<u64>().ok()) else {
            st.jetstream.bad_header = st.jetstream.bad_header.saturating_add(1);
            st.skipped(engine, "bad_seq");
            return;
        };
        let event = SourceEvent::Batch { engine, seq, payload: &batch };
        self.ingest.handle(event, &mut StreamHoldsAll, &mut sink(st));
    }

    /// Forgets every engine's sequence (a consumer that starts over from the stream's start).
    pub fn forget(&mut self) {
        self.ingest.forget_all();
        self.joined_at.clear();
    }

    /// Forgets these engines' sequences.
    pub fn forget_engines(&mut self, engines: &HashSet<usize>) {
        self.ingest.retain(|i| !engines.contains(&i));
        self.joined_at.retain(|i, _| !engines.contains(i));
    }

    /// The engines whose sequence is not known, with their subjects (their snapshots are asked
    /// for).
    pub fn unknown(&self) -> Vec<(usize, String)> {
        let mut v: Vec<(usize, String)> =
            self.by_subject.iter().filter(|(_, &e)| !self.ingest.knows(e)).map(|(s, &e)| (e, s.clone())).collect();
        v.sort_unstable();
        v
    }

    /// Starts an engine from its snapshot: applied as its batch S, its sequence then S, and its
    /// messages up to the snapshot's stream sequence dropped.
    pub fn join_snapshot(&mut self, st: &mut HubState, engine: usize, loaded: Loaded) {
        let Loaded { meta, batch } = loaded;
        let mut sink = sink(st);
        if Sink::<Option<EventBatch>>::apply(&mut sink, engine, meta.seq, &Some(batch)) {
            Sink::<Option<EventBatch>>::snapshot_joined(&mut sink, engine, meta.seq, meta.incomplete_from);
            self.ingest.resume_after(engine, meta.seq);
            self.joined_at.insert(engine, meta.stream_seq);
        }
    }

    /// Whether a message is one an engine's snapshot already holds (dropped); the first past it
    /// ends the engine's join, so that a sequence going back after it is a restart.
    pub fn covered(&mut self, engine: Option<usize>, stream_seq: Option<u64>) -> bool {
        let (Some(e), Some(s)) = (engine, stream_seq) else { return false };
        match self.joined_at.get(&e) {
            Some(&t) if s <= t => true,
            Some(_) => {
                self.joined_at.remove(&e);
                false
            }
            None => false,
        }
    }
}

/// Where the consumer is in the stream.
#[derive(Debug, Default, PartialEq)]
struct Position {
    /// The last stream sequence applied.
    last: Option<u64>,
    /// Reading the stream again from its start up to this sequence, applying only these
    /// engines' messages (their mirrors started clean); the others already have them.
    catch_up: Option<(u64, HashSet<usize>)>,
}

impl Position {
    /// Whether a message (its stream sequence, its engine) is to be applied: during a catch-up
    /// only the rebuilding engines' messages up to where it ends are.
    fn admit(&mut self, stream_seq: Option<u64>, engine: Option<usize>) -> bool {
        if let (Some((until, engines)), Some(s)) = (&self.catch_up, stream_seq) {
            if s <= *until {
                return engine.is_some_and(|e| engines.contains(&e));
            }
            self.catch_up = None;
        }
        if stream_seq.is_some() {
            self.last = self.last.max(stream_seq);
        }
        true
    }
}

/// The consumer: reads the stream until `stop`, reconnecting after any failure. After a lost
/// session it resumes after the last stream sequence it applied, so nothing is applied twice;
/// an engine whose mirror started clean (its replica, or the broker, was away long enough for it
/// to be marked down) is rebuilt by reading the stream again from its start for it alone.
pub async fn consume(cfg: Config, hub: Arc<Hub>, stop: Arc<AtomicBool>) {
    let Some(js) = cfg.jetstream.clone() else { return };
    let mut ingest = StreamIngest::new(&cfg.engines());
    ingest.watch(&hub);
    let mut pos = Position::default();
    let mut lost_since = Some(Instant::now());
    let down_after = Duration::from_millis(cfg.zmq.down_after_disconnect_ms);
    let mut delay = Duration::from_millis(100);
    while !stop.load(Ordering::SeqCst) {
        let r = session(&js, &hub, &mut ingest, &mut pos, &mut lost_since, down_after).await;
        let engines: Vec<usize> = ingest.engines().collect();
        mark(&mut hub.state(), &engines, Some(false), None);
        match r {
            Ok(()) => {
                // A rebuild was asked for: read again at once.
                delay = Duration::from_millis(100);
                continue;
            }
            Err(e) => warn!(url = %js.url, stream = %js.stream, error = %e, "jetstream consumer failed; reconnecting"),
        }
        let since = *lost_since.get_or_insert_with(Instant::now);
        if down_after > Duration::ZERO && since.elapsed() >= down_after {
            mark(&mut hub.state(), &engines, None, Some(false));
        }
        tokio::time::sleep(delay).await;
        delay = (delay.saturating_mul(2)).min(Duration::from_millis(500));
    }
}

/// Reads the stream until an error (`Err`) or a rebuild request (`Ok`, read again at once).
async fn session(
    cfg: &JetStreamConfig,
    hub: &Hub,
    ingest: &mut StreamIngest,
    pos: &mut Position,
    lost_since: &mut Option<Instant>,
    down_after: Duration,
) -> Result<(), JetStreamError> {
    let client = connect(cfg, "llmgw-agent").await?;
    let ctx = jetstream::new(client.clone());
    let mut stream =
        ctx.get_or_create_stream(stream_config(cfg)).await.map_err(|e| JetStreamError::stream(&cfg.stream, e))?;
    let created = stream.cached_info().created;
    if let Some((_, engines)) = &pos.catch_up {
        // Reading from the start again: what the rebuilding engines applied so far comes again.
        ingest.forget_engines(engines);
    }
    // The engines read from the start (all of them at first, or the rebuilding ones): from their
    // snapshots instead, if the bucket holds them for this stream.
    let reading: Vec<usize> = match (&pos.catch_up, pos.last) {
        (Some((_, engines)), _) => engines.iter().copied().collect(),
        (None, None) => ingest.engines().collect(),
        (None, Some(_)) => Vec::new(),
    };
    let mut snapshots = Vec::new();
    if let (Some(sc), false) = (&cfg.snapshots, reading.is_empty()) {
        let info = stream.cached_info();
        let at = (cfg.stream.as_str(), info.created.unix_timestamp_nanos(), info.state.last_sequence);
        let wanted: Vec<(usize, String)> = ingest.unknown().into_iter().filter(|(e, _)| reading.contains(e)).collect();
        snapshots = load(&ctx, sc, at, &wanted).await;
    }
    // When every engine read from the start has a snapshot: the earliest one's stream sequence.
    let snapshot_start = {
        let mut joined: HashMap<usize, u64> = ingest.joined_at.clone();
        joined.extend(snapshots.iter().filter_map(|(e, r)| Some((*e, r.as_ref().ok()?.meta.stream_seq))));
        let mut at = reading.iter().map(|e| joined.get(e).copied());
        at.try_fold(u64::MAX, |m, t| t.map(|t| m.min(t))).filter(|_| !reading.is_empty())
    };
    let deliver_policy = start_policy(pos, snapshot_start);
    let max_batch = pull_batch(cfg.max_queued_bytes, client.server_info().max_payload);
    let c = stream
        .create_consumer(consumer::pull::OrderedConfig {
            filter_subject: format!("{}.>", cfg.subject_prefix),
            deliver_policy,
            max_batch,
            ..Default::default()
        })
        .await
        .map_err(|e| JetStreamError::consumer(&cfg.stream, e))?;
    let mut messages = c.messages().await.map_err(|e| JetStreamError::consumer(&cfg.stream, e))?.ready_chunks(CHUNK);
    let engines: Vec<usize> = ingest.engines().collect();
    {
        let mut st = hub.state();
        st.jetstream.sessions = st.jetstream.sessions.saturating_add(1);
        mark(&mut st, &engines, Some(true), Some(true));
    }
    // Replicas that came up with clean mirrors (the broker back): read again for them.
    if ask_rebuilds(ingest, pos, hub) {
        return Ok(());
    }
    if !snapshots.is_empty() {
        let mut st = hub.state();
        for (engine, r) in snapshots {
            match r {
                Ok(loaded) => ingest.join_snapshot(&mut st, engine, loaded),
                Err(reason) => Sink::<Option<EventBatch>>::snapshot_failed(&mut sink(&mut st), engine, reason),
            }
        }
    }
    if let (None, None, Some(t)) = (&pos.catch_up, pos.last, snapshot_start) {
        // Read from after the earliest snapshot: as if everything before it had been applied.
        pos.last = Some(t);
    }
    *lost_since = None;
    info!(url = %cfg.url, stream = %cfg.stream, pull_batch = max_batch, from = ?pos.last, rebuilding = ?pos.catch_up.as_ref().map(|c| c.1.len()), "consuming KV events from jetstream");
    // The client reconnects by itself and the message stream then just waits: the connection's
    // state, looked at every 100 ms, says when the broker has been away too long.
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    let mut away: Option<Instant> = None;
    let mut marked_down = false;
    let mut checked = Instant::now();
    loop {
        let chunk = tokio::select! {
            chunk = messages.next() => chunk,
            _ = tick.tick() => {
                let connected = client.connection_state() == async_nats::connection::State::Connected;
                if !connected {
                    let since = *away.get_or_insert_with(Instant::now);
                    if !marked_down && down_after > Duration::ZERO && since.elapsed() >= down_after {
                        marked_down = true;
                        mark(&mut hub.state(), &engines, Some(false), Some(false));
                        warn!(url = %cfg.url, "jetstream broker away: its replicas are marked down");
                    }
                } else if away.take().is_some() && std::mem::take(&mut marked_down) {
                    // Back: the replicas come up with clean mirrors, rebuilt from the stream.
                    mark(&mut hub.state(), &engines, Some(true), Some(true));
                }
                if connected && checked.elapsed() >= Duration::from_secs(1) {
                    checked = Instant::now();
                    if let Some(why) = stream_replaced(&mut stream, created, pos.last).await {
                        // The batches the mirrors were built from are gone: start over.
                        let mut st = hub.state();
                        st.jetstream.stream_replaced = st.jetstream.stream_replaced.saturating_add(1);
                        for &idx in &engines {
                            st.reset(idx, "stream_replaced");
                        }
                        *pos = Position::default();
                        ingest.forget();
                        return Err(JetStreamError::Replaced { stream: cfg.stream.clone(), why });
                    }
                }
                if ask_rebuilds(ingest, pos, hub) {
                    return Ok(());
                }
                continue;
            }
        };
        let Some(chunk) = chunk else { break };
        if ask_rebuilds(ingest, pos, hub) {
            return Ok(());
        }
        // Decoded before the hub lock is taken, as on the ZMQ path.
        let mut ready = Vec::with_capacity(chunk.len());
        for m in chunk {
            let m = m.map_err(|e| JetStreamError::consumer(&cfg.stream, e))?;
            let stream_seq = m.info().map(|i| i.stream_sequence).ok();
            let engine = ingest.engine_of(m.subject.as_str());
            if !pos.admit(stream_seq, engine) || ingest.covered(engine, stream_seq) {
                continue;
            }
            let batch = EventBatch::decode(&m.payload).ok();
            ready.push((m, batch));
        }
        let mut st = hub.state();
        st.jetstream.chunks = st.jetstream.chunks.saturating_add(1);
        for (m, batch) in ready {
            let seq = m.headers.as_ref().and_then(|h| h.get(SEQ_HEADER)).map(|v| v.as_str());
            ingest.on_batch(&mut st, m.subject.as_str(), seq, batch);
        }
    }
    Err(JetStreamError::Ended)
}

/// Where a session reads the stream from: after the last message applied; for a catch-up or a
/// first read, from the start, or after the earliest snapshot (`snapshot_start`) when every
/// engine read from the start has one (a catch-up still reads the other engines' messages after
/// what was applied).
fn start_policy(pos: &Position, snapshot_start: Option<u64>) -> consumer::DeliverPolicy {
    let after = |t: u64| consumer::DeliverPolicy::ByStartSequence { start_sequence: t.saturating_add(1) };
    match (&pos.catch_up, pos.last, snapshot_start) {
        (None, Some(last), _) => after(last),
        (Some((until, _)), _, Some(t)) => after(t.min(*until)),
        (None, None, Some(t)) => after(t),
        _ => consumer::DeliverPolicy::All,
    }
}

/// The most messages one pull asks for: as many of the broker's largest (`max_payload`) as
/// `max_queued_bytes` holds, within the client's own batch (500) and at least 1. What the
/// consumer holds unapplied stays within the bytes; the rest waits in the stream.
fn pull_batch(max_queued_bytes: i64, max_payload: usize) -> i64 {
    let payload = i64::try_from(max_payload).unwrap_or(i64::MAX).max(1);
    max_queued_bytes.checked_div(payload).unwrap_or(1).clamp(1, 500)
}

/// Whether the stream was deleted, recreated or emptied behind the consumer's back (a broker
/// restarted with memory storage, a store wiped): the ordered consumer would wait on it forever.
async fn stream_replaced(
    stream: &mut stream::Stream,
    created: async_nats::datetime::DateTime,
    last: Option<u64>,
) -> Option<&'static str> {
    match stream.info().await {
        // JetStream's API error 10059; the client passes it on only as text.
        Err(e) if e.to_string().contains("stream not found") => Some("was deleted"),
        Err(_) => None,
        Ok(info) if info.created != created => Some("was recreated"),
        Ok(info) if last.is_some_and(|l| info.state.last_sequence < l) => Some("is behind what was applied"),
        Ok(_) => None,
    }
}

/// Takes the hub's rebuild requests: true when they need the stream read again from its start
/// (nothing to do before anything was applied: the first read starts there anyway).
fn ask_rebuilds(ingest: &mut StreamIngest, pos: &mut Position, hub: &Hub) -> bool {
    let asked = ingest.take_rebuilds(hub);
    let Some(last) = pos.last else { return false };
    if asked.is_empty() {
        return false;
    }
    info!(engines = asked.len(), up_to = last, "rebuilding mirrors from the stream");
    let (until, engines) = pos.catch_up.get_or_insert_with(|| (last, HashSet::new()));
    *until = (*until).max(last);
    engines.extend(asked);
    true
}

#[cfg(test)]
#[allow(clippy::arithmetic_side_effects)]
mod tests;
