//! KV events through NATS JetStream, for fleets where every agent subscribing to every
//! publisher costs too much (the README's "Past one agent's reach").
//!
//! * **Publishing** (`llmgw-agent publish`, beside each vLLM replica): one thread per
//!   data-parallel rank subscribes to the replica's ZMQ publisher on loopback, fills any gap from
//!   its replay socket, and publishes every batch, unchanged, to the JetStream stream on the
//!   engine's subject ([`subject`]) with vLLM's sequence number in the `Llmgw-Seq` header and a
//!   `Nats-Msg-Id` the broker deduplicates a retried publish by.
//! * **Consuming** (`llmgw-agent run` with replicas whose `events = "jetstream"`): one ordered
//!   consumer per agent over all the stream's subjects: one connection instead of one per
//!   replica, and a restarted agent rebuilds its mirrors from what the stream retains instead of
//!   asking every replica. Messages that arrived together are applied under one hub lock.
//!
//! The broker stores, fans out and replays; nothing here relays. The sequence discipline is the
//! ZMQ path's ([`crate::seq`]): the stream is ordered per subject, so a hole in a subject's
//! sequence is a batch the publisher could not deliver (the mirror is reset, as after a gap that
//! replay could not fill), and a sequence going back is an engine restart.

use crate::config::{Config, EngineSpec, JetStreamConfig};
use crate::hub::{Health, Hub, HubState};
use crate::seq::{SeqTracker, Verdict};
use async_nats::jetstream::{self, consumer, stream};
use futures_util::StreamExt;
use llmgw_core::event::EventBatch;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::{info, warn};

pub mod publish;

/// Header carrying vLLM's sequence number of the batch (decimal).
pub const SEQ_HEADER: &str = "Llmgw-Seq";

/// Messages applied under one hub lock at most (those already received).
const CHUNK: usize = 256;

/// The subject an engine's batches are published on: `{prefix}.{address}.{rank}`, the address
/// with every character other than a letter or digit replaced by `_` (subject tokens cannot hold
/// `.` or `:`). Both ends derive it from the address the filter routes to.
pub fn subject(prefix: &str, address: &str, rank: u32) -> String {
    let token: String = address.chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '_' }).collect();
    format!("{prefix}.{token}.{rank}")
}

/// The stream both ends create if it is missing (the same settings, so either may be first).
pub fn stream_config(cfg: &JetStreamConfig) -> stream::Config {
    stream::Config {
        name: cfg.stream.clone(),
        subjects: vec![format!("{}.>", cfg.subject_prefix)],
        max_messages_per_subject: cfg.max_messages_per_subject,
        max_bytes: cfg.max_bytes,
        max_age: Duration::from_secs(cfg.max_age_secs),
        storage: if cfg.memory_storage { stream::StorageType::Memory } else { stream::StorageType::File },
        discard: stream::DiscardPolicy::Old,
        duplicate_window: Duration::from_secs(120),
        ..Default::default()
    }
}

/// Connects to the broker with the configured token and TLS.
pub async fn connect(cfg: &JetStreamConfig, name: &str) -> Result<async_nats::Client, String> {
    let mut opts = async_nats::ConnectOptions::new().name(name).connection_timeout(Duration::from_secs(5));
    if let Some(t) = cfg.token.as_deref().filter(|t| !t.is_empty()) {
        opts = opts.token(t.to_owned());
    }
    if let Some(ca) = &cfg.tls_ca {
        opts = opts.add_root_certificates(ca.clone()).require_tls(true);
    }
    opts.connect(cfg.url.as_str()).await.map_err(|e| format!("jetstream.url {}: {e}", cfg.url))
}

/// Counters of the consuming side, shown in `/metrics`.
#[derive(Debug, Default, Clone)]
pub struct JetStreamCounters {
    /// Whether the consumer is connected and reading.
    pub connected: bool,
    pub sessions: u64,
    pub messages: u64,
    /// Messages on a subject no configured engine has (not applied).
    pub unknown_subject: u64,
    /// Messages without a readable `Llmgw-Seq` header (not applied).
    pub bad_header: u64,
    /// Hub-lock acquisitions that applied messages (messages / chunks = messages per lock).
    pub chunks: u64,
}

/// What the consumer keeps between messages: each engine's sequence discipline.
pub struct Ingest {
    by_subject: HashMap<String, usize>,
    trackers: HashMap<usize, SeqTracker>,
}

impl Ingest {
    /// The engines fed from the stream (those with a subject).
    pub fn new(engines: &[EngineSpec]) -> Ingest {
        let by_subject =
            engines.iter().filter_map(|e| Some((e.subject.clone()?, usize::try_from(e.id).ok()?))).collect();
        Ingest { by_subject, trackers: HashMap::new() }
    }

    pub fn engines(&self) -> impl Iterator<Item = usize> + '_ {
        self.by_subject.values().copied()
    }

    /// Applies one message (under the hub lock the caller holds).
    pub fn on_message(&mut self, st: &mut HubState, subject: &str, seq: Option<&str>, payload: &[u8]) {
        st.jetstream.messages = st.jetstream.messages.saturating_add(1);
        let Some(&idx) = self.by_subject.get(subject) else {
            st.jetstream.unknown_subject = st.jetstream.unknown_subject.saturating_add(1);
            return;
        };
        st.received(idx);
        let Some(seq) = seq.and_then(|s| s.trim().parse::<u64>().ok()) else {
            st.jetstream.bad_header = st.jetstream.bad_header.saturating_add(1);
            st.skipped(idx, "bad_seq");
            return;
        };
        let tracker = self.trackers.entry(idx).or_default();
        if let Verdict::Fill { from, until, reset, cause } = tracker.observe(seq) {
            if cause == crate::seq::Cause::Gap {
                st.count_gap(idx);
            }
            if reset {
                st.reset(idx, cause.as_str());
            }
            // The stream holds what the publisher delivered, in order: batches missing from it
            // cannot be fetched anywhere (the publisher already tried its replica's replay).
            if from < until {
                st.count_replay(idx, false, 0);
                st.reset(idx, &format!("{}_unrepaired", cause.as_str()));
            }
        }
        match EventBatch::decode(payload) {
            Ok(batch) => st.apply(idx, seq, &batch),
            Err(_) => st.skipped(idx, "malformed"),
        }
        tracker.applied(seq);
    }

    /// Forgets every engine's sequence (a consumer that starts over from the stream's start).
    pub fn forget(&mut self) {
        self.trackers.clear();
    }
}

/// The consumer: reads the stream until `stop`, reconnecting after any failure. After a lost
/// session it resumes after the last stream sequence it applied, so nothing is applied twice.
pub async fn consume(cfg: Config, hub: Arc<Hub>, stop: Arc<AtomicBool>) {
    let Some(js) = cfg.jetstream.clone() else { return };
    let mut ingest = Ingest::new(&cfg.engines());
    let mut last_stream_seq: Option<u64> = None;
    let mut lost_since = Some(Instant::now());
    let down_after = Duration::from_millis(cfg.zmq.down_after_disconnect_ms);
    let mut delay = Duration::from_millis(100);
    while !stop.load(Ordering::SeqCst) {
        let r = session(&js, &hub, &mut ingest, &mut last_stream_seq, &mut lost_since).await;
        {
            let mut st = hub.state();
            st.jetstream.connected = false;
            for idx in ingest.engines() {
                st.connection(idx, false);
            }
        }
        if let Err(e) = r {
            warn!(url = %js.url, stream = %js.stream, error = %e, "jetstream consumer failed; reconnecting");
        }
        let since = *lost_since.get_or_insert_with(Instant::now);
        if down_after > Duration::ZERO && since.elapsed() >= down_after {
            let mut st = hub.state();
            for idx in ingest.engines() {
                st.set_health(idx, Health::Publisher, false, "jetstream_gone");
            }
        }
        tokio::time::sleep(delay).await;
        delay = (delay.saturating_mul(2)).min(Duration::from_millis(500));
    }
}

async fn session(
    cfg: &JetStreamConfig,
    hub: &Hub,
    ingest: &mut Ingest,
    last_stream_seq: &mut Option<u64>,
    lost_since: &mut Option<Instant>,
) -> Result<(), String> {
    let client = connect(cfg, "llmgw-agent").await?;
    let ctx = jetstream::new(client);
    let stream =
        ctx.get_or_create_stream(stream_config(cfg)).await.map_err(|e| format!("stream {}: {e}", cfg.stream))?;
    let deliver_policy = match last_stream_seq.and_then(|s| s.checked_add(1)) {
        Some(start_sequence) => consumer::DeliverPolicy::ByStartSequence { start_sequence },
        None => consumer::DeliverPolicy::All,
    };
    let c = stream
        .create_consumer(consumer::pull::OrderedConfig {
            filter_subject: format!("{}.>", cfg.subject_prefix),
            deliver_policy,
            ..Default::default()
        })
        .await
        .map_err(|e| format!("consumer on {}: {e}", cfg.stream))?;
    let mut messages = c.messages().await.map_err(|e| format!("consumer on {}: {e}", cfg.stream))?.ready_chunks(CHUNK);
    {
        let mut st = hub.state();
        st.jetstream.connected = true;
        st.jetstream.sessions = st.jetstream.sessions.saturating_add(1);
        for idx in ingest.engines() {
            st.connection(idx, true);
            st.set_health(idx, Health::Publisher, true, "jetstream_connected");
        }
    }
    *lost_since = None;
    info!(url = %cfg.url, stream = %cfg.stream, from = ?last_stream_seq, "consuming KV events from jetstream");
    while let Some(chunk) = messages.next().await {
        let mut st = hub.state();
        st.jetstream.chunks = st.jetstream.chunks.saturating_add(1);
        for m in chunk {
            let m = m.map_err(|e| format!("consumer on {}: {e}", cfg.stream))?;
            if let Ok(info) = m.info() {
                *last_stream_seq = Some(info.stream_sequence);
            }
            let seq = m.headers.as_ref().and_then(|h| h.get(SEQ_HEADER)).map(|v| v.as_str());
            ingest.on_message(&mut st, m.subject.as_str(), seq, &m.payload);
        }
    }
    Err("message stream ended".to_owned())
}

#[cfg(test)]
#[allow(clippy::arithmetic_side_effects)]
mod tests {
    use super::*;
    use crate::hub::fixtures::{batch, stored};
    use llmgw_core::wire::{encode_batch, Encoding, HashForm, WireBatch};

    fn payload(hashes: Vec<u64>) -> Vec<u8> {
        let w = WireBatch { ts: 1.0, events: vec![stored(hashes)], data_parallel_rank: None };
        encode_batch(&w, Encoding::Tagged, HashForm::Int)
    }

    fn setup() -> (Arc<Hub>, Ingest) {
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
        (hub, Ingest::new(&engines))
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
    fn a_first_message_past_zero_starts_the_mirror_there() {
        // A stream that no longer retains an engine's first batches (max_messages_per_subject):
        // the mirror starts from the oldest retained one, as after an unfilled replay.
        let (hub, mut ingest) = setup();
        let subj = subject("llmgw.kv", "127.0.0.1:8000", 0);
        let mut st = hub.state();
        ingest.on_message(&mut st, &subj, Some("5"), &payload(vec![1, 2]));
        assert_eq!(st.engines[0].mirror.len(), 2);
        assert_eq!(st.engines[0].counters.resets.get("initial_unrepaired"), Some(&1));
    }
}
