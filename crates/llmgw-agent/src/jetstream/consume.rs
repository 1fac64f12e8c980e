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
mod tests {
    use super::*;
    use crate::config::subject;
    use crate::hub::fixtures::{batch, stored};
    use crate::hub::Health;
    use llmgw_core::wire::{encode_batch, Encoding, HashForm, WireBatch};

    fn payload(hashes: Vec<u64>) -> Vec<u8> {
        let w = WireBatch { ts: 1.0, events: vec![stored(hashes)], data_parallel_rank: None };
        encode_batch(&w, Encoding::Tagged, HashForm::Int)
    }

    fn setup() -> (Arc<Hub>, StreamIngest) {
        let cfg = Config::parse(
            "[jetstream]\nurl = \"nats://127.0.0.1:4222\"\n\
             [[replicas]]\nname = \"a\"\naddress = \"127.0.0.1:8000\"\nevents = \"jetstream\"\n\
             [[replicas]]\nname = \"b\"\naddress = \"127.0.0.1:8001\"\nendpoint = \"tcp://127.0.0.1:5557\"\n",
        )
        .unwrap();
        let engines = cfg.engines();
        let hub = Hub::new(engines.clone(), 4096, 1 << 20);
        for e in &engines {
            hub.state().set_health(e.id as usize, Health::Publisher, true, "test");
        }
        (hub, StreamIngest::new(&engines))
    }

    #[test]
    fn a_pull_asks_for_no_more_bytes_than_the_queue_holds() {
        // 1 GiB over the broker's default 1 MiB payload: the client's own batch (500) binds.
        assert_eq!(pull_batch(1 << 30, 1 << 20), 500);
        // 256 MiB over 8 MiB messages: 32 messages in flight at most, 256 MiB.
        assert_eq!(pull_batch(256 << 20, 8 << 20), 32);
        // A payload past the whole queue still reads one message at a time.
        assert_eq!(pull_batch(1 << 20, 64 << 20), 1);
        assert_eq!(pull_batch(1 << 20, 0), 500);
    }

    #[test]
    fn subjects_are_derived_from_the_address_and_rank() {
        assert_eq!(subject("llmgw.kv", "10.0.0.5:8000", 0), "llmgw.kv.10_0_0_5_8000.0");
        assert_eq!(subject("p", "[fd00::1]:80", 2), "p._fd00__1__80.2");
    }

    #[test]
    fn only_jetstream_engines_have_subjects() {
        let (_hub, ingest) = setup();
        assert_eq!(ingest.engines().collect::<Vec<_>>(), vec![0]);
    }

    #[test]
    fn batches_apply_in_sequence_and_a_restart_or_hole_resets_the_mirror() {
        let (hub, mut ingest) = setup();
        let subj = subject("llmgw.kv", "127.0.0.1:8000", 0);
        let mut st = hub.state();
        ingest.on_message(&mut st, &subj, Some("0"), &payload(vec![1, 2]));
        ingest.on_message(&mut st, &subj, Some("1"), &payload(vec![3]));
        assert_eq!(st.engines[0].mirror.len(), 3);
        assert!(st.engines[0].counters.resets.is_empty());
        // A hole: batch 2 never reached the stream. What the mirror held may be wrong: reset.
        ingest.on_message(&mut st, &subj, Some("3"), &payload(vec![4]));
        assert_eq!(st.engines[0].counters.resets.get("gap_unrepaired"), Some(&1));
        assert_eq!(st.engines[0].counters.gaps, 1);
        assert_eq!(st.engines[0].mirror.len(), 1);
        // The sequence going back: the engine restarted, its cache is empty.
        ingest.on_message(&mut st, &subj, Some("0"), &payload(vec![9]));
        assert_eq!(st.engines[0].counters.resets.get("restart"), Some(&1));
        assert_eq!(st.engines[0].mirror.len(), 1);
        let _ = batch(vec![]);
    }

    #[test]
    fn unknown_subjects_and_missing_sequence_headers_are_counted_not_applied() {
        let (hub, mut ingest) = setup();
        let mut st = hub.state();
        ingest.on_message(&mut st, "llmgw.kv.nobody.0", Some("0"), &payload(vec![1]));
        let subj = subject("llmgw.kv", "127.0.0.1:8000", 0);
        ingest.on_message(&mut st, &subj, None, &payload(vec![1]));
        ingest.on_message(&mut st, &subj, Some("x"), &payload(vec![1]));
        assert_eq!(st.jetstream.unknown_subject, 1);
        assert_eq!(st.jetstream.bad_header, 2);
        assert_eq!(st.jetstream.messages, 3);
        assert_eq!(st.engines[0].mirror.len(), 0);
        assert_eq!(st.engines[0].counters.skipped.get("bad_seq"), Some(&2));
    }

    #[test]
    fn a_mirror_started_clean_is_rebuilt_by_reading_the_stream_again_for_it_alone() {
        let (hub, mut ingest) = setup();
        ingest.watch(&hub);
        let mut pos = Position::default();
        // Before anything was applied the first read starts at the stream's start anyway.
        hub.state().engines[0].rebuild.store(true, Ordering::SeqCst);
        assert!(!ask_rebuilds(&mut ingest, &mut pos, &hub));
        assert!(pos.catch_up.is_none());
        pos.last = Some(41);
        assert!(!ask_rebuilds(&mut ingest, &mut pos, &hub));
        // The replica came back up (its mirror clean): read again up to 41, for engine 0 only.
        let subj = subject("llmgw.kv", "127.0.0.1:8000", 0);
        ingest.on_message(&mut hub.state(), &subj, Some("0"), &payload(vec![1]));
        hub.state().set_health(0, Health::Publisher, false, "test");
        hub.state().set_health(0, Health::Publisher, true, "test");
        assert!(ask_rebuilds(&mut ingest, &mut pos, &hub));
        assert_eq!(pos.catch_up, Some((41, HashSet::from([0]))));
        // Its sequence position was forgotten: batch 0 read again applies without a reset.
        ingest.on_message(&mut hub.state(), &subj, Some("0"), &payload(vec![1]));
        assert!(!hub.state().engines[0].counters.resets.contains_key("restart"));
        assert_eq!(hub.state().engines[0].mirror.len(), 1);
    }

    #[test]
    fn a_batch_that_reached_the_clean_mirror_before_the_rebuild_is_not_counted_twice() {
        let (hub, mut ingest) = setup();
        ingest.watch(&hub);
        let mut pos = Position { last: Some(0), ..Position::default() };
        let subj = subject("llmgw.kv", "127.0.0.1:8000", 0);
        let removal = |hashes: Vec<u64>| {
            let w =
                WireBatch { ts: 1.0, events: vec![crate::hub::fixtures::removed(hashes)], data_parallel_rank: None };
            encode_batch(&w, Encoding::Tagged, HashForm::Int)
        };
        ingest.on_message(&mut hub.state(), &subj, Some("0"), &payload(vec![1]));
        // Down (its blocks leave), up again (a rebuild asked for); batch 1 reaches the clean
        // mirror before the consumer takes the request.
        hub.state().set_health(0, Health::Publisher, false, "test");
        hub.state().set_health(0, Health::Publisher, true, "test");
        ingest.on_message(&mut hub.state(), &subj, Some("1"), &payload(vec![2]));
        pos.last = Some(1);
        assert!(ask_rebuilds(&mut ingest, &mut pos, &hub));
        // The catch-up reads 0 and 1 again; then the engine removes block 2 once.
        ingest.on_message(&mut hub.state(), &subj, Some("0"), &payload(vec![1]));
        ingest.on_message(&mut hub.state(), &subj, Some("1"), &payload(vec![2]));
        ingest.on_message(&mut hub.state(), &subj, Some("2"), &removal(vec![2]));
        assert_eq!(hub.state().engines[0].mirror.len(), 1, "block 2 is gone, not held by a second count");
        assert_eq!(hub.state().engines[0].counters.resets.get("rebuild"), Some(&1));
    }

    #[test]
    fn a_catch_up_applies_only_the_rebuilding_engines_messages_until_it_ends() {
        let mut pos = Position { last: Some(10), catch_up: Some((10, HashSet::from([1]))) };
        assert!(!pos.admit(Some(3), Some(0)), "engine 0 has it already");
        assert!(pos.admit(Some(4), Some(1)), "engine 1 is rebuilding");
        assert!(!pos.admit(Some(5), None), "no engine");
        assert!(pos.admit(Some(10), Some(1)));
        assert_eq!(pos.last, Some(10));
        // Past where it ends: every engine again, and the position moves on.
        assert!(pos.admit(Some(11), Some(0)));
        assert_eq!(pos.catch_up, None);
        assert_eq!(pos.last, Some(11));
    }

    fn loaded(seq: u64, stream_seq: u64, hashes: Vec<u64>) -> Loaded {
        let meta = super::super::snapshot_bucket::ObjectMeta {
            seq,
            incomplete_from: None,
            stream: "LLMGW_KV".to_owned(),
            stream_created_ns: 1,
            stream_seq,
        };
        Loaded { meta, batch: EventBatch::decode(&payload(hashes)).unwrap() }
    }

    #[test]
    fn a_snapshot_join_is_batch_s_and_the_engines_messages_up_to_its_stream_sequence_are_dropped() {
        let (hub, mut ingest) = setup();
        let subj = subject("llmgw.kv", "127.0.0.1:8000", 0);
        assert_eq!(ingest.unknown(), vec![(0, subj.clone())]);
        ingest.join_snapshot(&mut hub.state(), 0, loaded(7, 100, vec![1, 2]));
        assert!(ingest.unknown().is_empty());
        {
            let st = hub.state();
            assert_eq!((st.engines[0].mirror.len(), st.engines[0].counters.snapshot_joins), (2, 1));
        }
        // Up to the snapshot's stream sequence: held already. After it: batch 8 follows 7.
        assert!(ingest.covered(Some(0), Some(100)));
        assert!(!ingest.covered(None, Some(100)) && !ingest.covered(Some(0), None));
        assert!(!ingest.covered(Some(0), Some(101)));
        ingest.on_message(&mut hub.state(), &subj, Some("8"), &payload(vec![3]));
        let st = hub.state();
        assert_eq!(st.engines[0].mirror.len(), 3);
        assert!(st.engines[0].counters.resets.is_empty() && st.engines[0].incomplete_from.is_none());
    }

    #[test]
    fn after_a_snapshot_join_a_sequence_going_back_is_an_engine_restart() {
        let (hub, mut ingest) = setup();
        let subj = subject("llmgw.kv", "127.0.0.1:8000", 0);
        ingest.join_snapshot(&mut hub.state(), 0, loaded(7, 100, vec![1, 2]));
        assert!(!ingest.covered(Some(0), Some(101)));
        ingest.on_message(&mut hub.state(), &subj, Some("0"), &payload(vec![9]));
        let st = hub.state();
        assert_eq!(st.engines[0].counters.resets.get("restart"), Some(&1));
        assert_eq!(st.engines[0].mirror.len(), 1);
    }

    #[test]
    fn the_stream_is_read_from_after_the_earliest_snapshot_and_a_catch_up_never_skips_the_others() {
        let at = |p: consumer::DeliverPolicy| match p {
            consumer::DeliverPolicy::ByStartSequence { start_sequence } => Some(start_sequence),
            _ => None,
        };
        let first = Position::default();
        assert_eq!(at(start_policy(&first, None)), None, "no snapshot: from the start");
        assert_eq!(at(start_policy(&first, Some(40))), Some(41));
        let resumed = Position { last: Some(50), catch_up: None };
        assert_eq!(at(start_policy(&resumed, Some(40))), Some(51), "after what was applied");
        // Rebuilding engine 1 from a snapshot at 60 while the others applied up to 50: from 51.
        let catch_up = Position { last: Some(50), catch_up: Some((50, HashSet::from([1]))) };
        assert_eq!(at(start_policy(&catch_up, Some(60))), Some(51));
        assert_eq!(at(start_policy(&catch_up, Some(30))), Some(31));
        assert_eq!(at(start_policy(&catch_up, None)), None);
    }

    #[test]
    fn a_first_message_past_zero_starts_the_mirror_there() {
        // A stream that no longer retains an engine's first batches (max_messages_per_subject):
        // the mirror starts from the oldest retained one, as after an unfilled replay.
        let (hub, mut ingest) = setup();
        let subj = subject("llmgw.kv", "127.0.0.1:8000", 0);
        let mut st = hub.state();
        ingest.on_message(&mut st, &subj, Some("5"), &payload(vec![1, 2]));
        assert_eq!(st.engines[0].mirror.len(), 2);
        assert_eq!(st.engines[0].counters.resets.get("initial_unrepaired"), Some(&1));
        // It says so: blocks stored before batch 5 are unknown.
        assert_eq!(st.engines[0].incomplete_from, Some(5));
        assert_eq!(st.engines[0].counters.incomplete_starts, 1);
    }
}
