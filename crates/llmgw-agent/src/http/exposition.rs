//! What the agent's HTTP server shows: `/debug/replicas` (JSON) and `/metrics` (Prometheus
//! text), both read from the hub state under its lock. `/debug/replicas` holds the lock only
//! to copy; its sort and JSON come after.

use crate::config::EngineSpec;
use crate::counters::Refused;
use crate::hub::{EngineCounters, EngineState, Hub, HubState};
use llmgw_core::feed::ReplicaLoad;
use llmgw_core::mirror::MirrorStats;
use llmgw_core::BlockKey;
use serde_json::{json, Value};
use std::fmt::Write as _;
use std::time::Instant;

/// Block keys `/debug/replicas` lists per engine (at most; any of them past that).
const DEBUG_KEYS: usize = 100_000;

/// `/debug/replicas`: what it shows is copied under the hub lock ([`DebugCopy::collect`]), then
/// the keys are sorted and the JSON built with the lock released ([`DebugCopy::render`]).
pub fn debug_replicas(hub: &Hub) -> Value {
    debug_replicas_with(hub, DebugCopy::render)
}

/// [`debug_replicas`] with the render step given (tests look at the lock from inside it).
fn debug_replicas_with(hub: &Hub, render: impl FnOnce(DebugCopy) -> Value) -> Value {
    let copy = DebugCopy::collect(&hub.state());
    render(copy)
}

/// What `/debug/replicas` shows of the hub state, owned: taking it holds the lock only for
/// copies (the keys unsorted).
pub struct DebugCopy {
    engines: Vec<EngineCopy>,
    subscribers: usize,
    feed: Vec<(String, usize, u64)>,
}

struct EngineCopy {
    spec: EngineSpec,
    up: bool,
    http_ok: bool,
    publisher_ok: bool,
    connected: bool,
    blocks: usize,
    /// At most [`DEBUG_KEYS`], in no order.
    keys: Vec<BlockKey>,
    last_seq: Option<u64>,
    incomplete_from: Option<u64>,
    last_event_age_secs: Option<f64>,
    stats: MirrorStats,
    counters: EngineCounters,
    load: Option<ReplicaLoad>,
    /// The models the feed says it serves (configured, or read from its `/v1/models`).
    models: Vec<String>,
    /// The LoRA adapters its `/v1/models` lists: (name, path).
    adapters: Vec<(String, String)>,
}

impl DebugCopy {
    /// Copies, under the lock the caller holds, what [`DebugCopy::render`] shows.
    pub fn collect(st: &HubState) -> DebugCopy {
        let now = Instant::now();
        let engines = st
            .live()
            .map(|e| EngineCopy {
                spec: e.spec.clone(),
                up: e.up,
                http_ok: e.http_ok,
                publisher_ok: e.publisher_ok,
                connected: e.connected,
                blocks: e.mirror.len(),
                keys: e.mirror.some_keys(DEBUG_KEYS),
                last_seq: e.last_seq,
                incomplete_from: e.incomplete_from,
                last_event_age_secs: e.last_event.map(|t| now.saturating_duration_since(t).as_secs_f64()),
                stats: e.mirror.stats().clone(),
                counters: e.counters.clone(),
                load: e.load.clone(),
                models: e.models().to_vec(),
                adapters: e.adapters.iter().map(|a| (a.name.clone(), a.path.clone())).collect(),
            })
            .collect();
        DebugCopy { engines, subscribers: st.live_subscribers(), feed: st.subscriber_lags() }
    }

    /// Sorts the keys and builds the JSON; needs no lock.
    pub fn render(self) -> Value {
        let engines: Vec<Value> = self.engines.into_iter().map(EngineCopy::render).collect();
        let subs: Vec<Value> = self
            .feed
            .into_iter()
            .map(|(name, queued, snapshots)| json!({"name": name, "queued": queued, "snapshots": snapshots}))
            .collect();
        json!({ "replicas": engines, "subscribers": self.subscribers, "feed": subs })
    }
}

impl EngineCopy {
    fn render(self) -> Value {
        let EngineCopy {
            spec,
            up,
            http_ok,
            publisher_ok,
            connected,
            blocks,
            mut keys,
            last_seq,
            incomplete_from,
            last_event_age_secs,
            stats: s,
            counters: c,
            load,
            models,
            adapters,
        } = self;
        keys.sort_unstable();
        let p = &s.parity;
        json!({
            "id": spec.id,
            "replica": spec.replica,
            "dp_rank": spec.dp_rank,
            "address": spec.address,
            "models": models,
            "lora_adapters": adapters.into_iter().map(|(name, path)| json!({"name": name, "path": path})).collect::<Vec<_>>(),
            "endpoint": spec.endpoint,
            "mode": match spec.mode { crate::config::Mode::Bind => "bind", crate::config::Mode::Connect => "connect" },
            "up": up,
            "http_ok": http_ok,
            "publisher_ok": publisher_ok,
            "connected": connected,
            "blocks": blocks,
            "block_keys": keys,
            "last_seq": last_seq,
            // Blocks stored before this batch are unknown (`null`: the mirror is complete).
            "incomplete_from": incomplete_from,
            "incomplete_starts": c.incomplete_starts,
            "snapshot": {"joins": c.snapshot_joins, "failures": c.snapshot_failures},
            "last_event_age_secs": last_event_age_secs,
            "hash": {
                "algo": spec.hash.algo.name(),
                // A Secret's seed is named by where it was read, never shown.
                "seed": if spec.hash.seed_source.is_secret() {
                    json!(spec.hash.seed_source.describe(None))
                } else {
                    json!(spec.hash.seed)
                },
                "block_size": spec.hash.block_size,
                "lookahead_tokens": spec.hash.lookahead_tokens,
            },
            // Lookahead hashing as the engine's own events show it (EAGLE-family engines).
            "lookahead_tokens_seen": s.lookahead_tokens,
            "parity": {
                "matched": p.matched,
                "mismatched": p.mismatched,
                "unverifiable": p.unverifiable,
                "match_ratio": p.match_ratio(),
                "last_mismatch": p.last_mismatch.map(|(a, b)| json!({"published": a, "recomputed": b})),
                // Blocks not credited because their recomputed hash differed (and those after
                // them in the same event).
                "rejected": {"hash_mismatch": p.rejected_mismatch, "after_mismatch": p.rejected_after_mismatch},
            },
            "received": c.received,
            "applied": c.applied,
            "skipped": c.skipped,
            "gaps": c.gaps,
            "replays": {"complete": c.replays_complete, "incomplete": c.replays_incomplete, "batches": c.replayed_batches},
            "resets": c.resets,
            "disconnects": c.disconnects,
            "clears": s.clears,
            "ignored": {"medium": s.ignored_medium, "locality": s.ignored_locality, "group": s.ignored_group},
            "load": load.as_ref().map(|l| json!({"running": l.running, "waiting": l.waiting, "kv_cache_usage": l.kv_cache_usage})),
        })
    }
}

/// `/metrics` in Prometheus text format.
pub fn metrics_text(st: &HubState) -> String {
    let mut s = String::new();
    let lbl = |e: &EngineState| format!("replica=\"{}\",dp_rank=\"{}\"", esc(&e.spec.replica), e.spec.dp_rank);
    let mut counter = |name: &str, help: &str, kind: &str, rows: Vec<(String, f64)>| {
        let _ = writeln!(s, "# HELP llmgw_agent_{name} {help}");
        let _ = writeln!(s, "# TYPE llmgw_agent_{name} {kind}");
        for (labels, v) in rows {
            if labels.is_empty() {
                let _ = writeln!(s, "llmgw_agent_{name} {v}");
            } else {
                let _ = writeln!(s, "llmgw_agent_{name}{{{labels}}} {v}");
            }
        }
    };
    let per =
        |f: &dyn Fn(&EngineState) -> u64| -> Vec<(String, f64)> { st.live().map(|e| (lbl(e), f(e) as f64)).collect() };
    let js = &st.jetstream;
    for (name, help, kind, v) in [
        (
            "jetstream_connected",
            "Whether the JetStream consumer is connected and reading.",
            "gauge",
            u64::from(js.connected),
        ),
        (
            "jetstream_sessions_total",
            "JetStream consumer sessions started (the first, then one per reconnect).",
            "counter",
            js.sessions,
        ),
        ("jetstream_messages_total", "Messages read from the JetStream stream.", "counter", js.messages),
        (
            "jetstream_unknown_subject_total",
            "JetStream messages on a subject no configured engine has (not applied).",
            "counter",
            js.unknown_subject,
        ),
        (
            "jetstream_bad_header_total",
            "JetStream messages without a readable Llmgw-Seq header (not applied).",
            "counter",
            js.bad_header,
        ),
        (
            "jetstream_stream_replaced_total",
            "Times the JetStream stream was found deleted, recreated or behind what was applied (its mirrors reset and read again).",
            "counter",
            js.stream_replaced,
        ),
        (
            "jetstream_chunks_total",
            "Hub-lock acquisitions applying JetStream messages (messages per lock = messages / chunks).",
            "counter",
            js.chunks,
        ),
    ] {
        counter(name, help, kind, vec![(String::new(), v as f64)]);
    }
    counter(
        "events_received_total",
        "Live event batches received from the publisher.",
        "counter",
        per(&|e| e.counters.received),
    );
    counter(
        "events_applied_total",
        "Event batches (live or replayed) applied to the mirror.",
        "counter",
        per(&|e| e.counters.applied),
    );
    let mut skipped = Vec::new();
    for e in st.live() {
        for (reason, n) in &e.counters.skipped {
            skipped.push((format!("{},reason=\"{reason}\"", lbl(e)), *n as f64));
        }
    }
    counter("events_skipped_total", "Event batches not applied, by reason.", "counter", skipped);
    let mut ignored = Vec::new();
    for e in st.live() {
        let m = e.mirror.stats();
        for (reason, n) in [("medium", m.ignored_medium), ("locality", m.ignored_locality), ("group", m.ignored_group)]
        {
            ignored.push((format!("{},reason=\"{reason}\"", lbl(e)), n as f64));
        }
    }
    counter(
        "events_ignored_total",
        "Events not mirrored: offloaded tiers (medium CPU/STORAGE or a connector's), remote locality, \
         KV-cache group index past the bound.",
        "counter",
        ignored,
    );
    counter("gaps_total", "Sequence gaps detected.", "counter", per(&|e| e.counters.gaps));
    let mut replays = Vec::new();
    for e in st.live() {
        replays.push((format!("{},result=\"complete\"", lbl(e)), e.counters.replays_complete as f64));
        replays.push((format!("{},result=\"incomplete\"", lbl(e)), e.counters.replays_incomplete as f64));
    }
    counter("replays_total", "Replay requests, by whether they covered the missing range.", "counter", replays);
    counter("replayed_batches_total", "Batches applied from replay.", "counter", per(&|e| e.counters.replayed_batches));
    let mut resets = Vec::new();
    for e in st.live() {
        for (reason, n) in &e.counters.resets {
            resets.push((format!("{},reason=\"{}\"", lbl(e), esc(reason)), *n as f64));
        }
    }
    counter("resets_total", "Mirror resets, by reason.", "counter", resets);
    counter("publisher_disconnects_total", "Publisher connections lost.", "counter", per(&|e| e.counters.disconnects));
    counter(
        "block_limit_hits_total",
        "Resets because an engine exceeded the block limit.",
        "counter",
        per(&|e| e.counters.block_limit_hits),
    );
    counter(
        "parity_matched_total",
        "Stored blocks whose recomputed hash matched.",
        "counter",
        per(&|e| e.mirror.stats().parity.matched),
    );
    counter(
        "parity_mismatched_total",
        "Stored blocks whose recomputed hash differed.",
        "counter",
        per(&|e| e.mirror.stats().parity.mismatched),
    );
    counter(
        "parity_unverifiable_total",
        "Stored blocks whose hash could not be recomputed.",
        "counter",
        per(&|e| e.mirror.stats().parity.unverifiable),
    );
    let mut rejected = Vec::new();
    for e in st.live() {
        let p = &e.mirror.stats().parity;
        for (reason, n) in [("hash_mismatch", p.rejected_mismatch), ("after_mismatch", p.rejected_after_mismatch)] {
            rejected.push((format!("{},reason=\"{reason}\"", lbl(e)), n as f64));
        }
    }
    counter(
        "block_claims_rejected_total",
        "Stored blocks not credited to the engine: their recomputed hash differed (hash_mismatch), or they \
         continue from such a block in the same event (after_mismatch). Claims that cannot be recomputed are \
         credited (parity_unverifiable_total).",
        "counter",
        rejected,
    );
    let ratio: Vec<(String, f64)> =
        st.live().filter_map(|e| e.mirror.stats().parity.match_ratio().map(|r| (lbl(e), r))).collect();
    counter("parity_match_ratio", "Share of verified blocks whose hash matched.", "gauge", ratio);
    counter("blocks", "Blocks held per engine.", "gauge", per(&|e| e.mirror.len() as u64));
    counter(
        "engine_incomplete",
        "1 while the mirror lacks blocks the engine stored before the agent could see them (its replay \
         buffer no longer held them, or a gap could not be filled).",
        "gauge",
        per(&|e| u64::from(e.incomplete_from.is_some())),
    );
    counter(
        "incomplete_starts_total",
        "Times an engine's mirror (re)started without the engine's earlier batches.",
        "counter",
        per(&|e| e.counters.incomplete_starts),
    );
    counter(
        "snapshot_joins_total",
        "Times an engine's mirror started from its sidecar's snapshot (replicas[].snapshot_url).",
        "counter",
        per(&|e| e.counters.snapshot_joins),
    );
    let mut snap_failures = Vec::new();
    for e in st.live() {
        for (reason, n) in &e.counters.snapshot_failures {
            snap_failures.push((format!("{},reason=\"{reason}\"", lbl(e)), *n as f64));
        }
    }
    counter(
        "snapshot_failures_total",
        "Snapshots asked for and not had (the engine then starts from its replay buffer), by reason.",
        "counter",
        snap_failures,
    );
    counter(
        "block_limit",
        "Blocks one engine may hold (zmq.max_blocks_per_engine); past it its mirror is reset.",
        "gauge",
        vec![(String::new(), st.max_blocks as f64)],
    );
    let max_blocks = u64::try_from(st.max_blocks).unwrap_or(u64::MAX);
    counter(
        "engine_block_limit",
        "Blocks this engine's mirror may hold: twice its KV cache (vllm:cache_config_info) when \
         known, within block_limit.",
        "gauge",
        per(&|e| e.block_limit.and_then(|l| u64::try_from(l).ok()).map_or(max_blocks, |l| l.min(max_blocks))),
    );
    counter("replica_up", "1 when the replica is up.", "gauge", per(&|e| u64::from(e.up)));
    counter(
        "publisher_connected",
        "1 while the publisher connection is up.",
        "gauge",
        per(&|e| u64::from(e.connected)),
    );
    let last: Vec<(String, f64)> = st.live().filter_map(|e| e.last_seq.map(|q| (lbl(e), q as f64))).collect();
    counter("last_seq", "Last publisher sequence number applied.", "gauge", last);
    counter("subscribers", "Live feed subscribers.", "gauge", vec![(String::new(), st.live_subscribers() as f64)]);
    counter(
        "feed_subscriptions_total",
        "Feed subscriptions accepted.",
        "counter",
        vec![(String::new(), st.feed.subscriptions as f64)],
    );
    counter(
        "feed_messages_total",
        "Feed messages queued to subscribers (after their snapshot).",
        "counter",
        vec![(String::new(), st.feed.messages as f64)],
    );
    counter(
        "feed_overflows_total",
        "Subscribers that fell behind and were sent a fresh snapshot.",
        "counter",
        vec![(String::new(), st.feed.overflows as f64)],
    );
    counter(
        "feed_backlog_bytes_overflows_total",
        "Of the overflows, subscribers whose queued bytes passed feed.max_backlog_bytes.",
        "counter",
        vec![(String::new(), st.feed.backlog_bytes_overflows as f64)],
    );
    counter(
        "feed_gathered_total",
        "Block changes and load reports that joined a message already queued for a subscriber \
         (feed.gather_ms) instead of being sent on their own.",
        "counter",
        vec![(String::new(), st.feed.gathered as f64)],
    );
    counter(
        "feed_subscribers_refused_total",
        "Subscriptions refused because feed.max_subscribers were connected.",
        "counter",
        vec![(String::new(), st.feed.subscribers_refused as f64)],
    );
    counter(
        "feed_rejected_total",
        "Subscriptions rejected for a bad token.",
        "counter",
        vec![(String::new(), st.feed.rejected_token as f64)],
    );
    counter(
        "feed_names_cut_total",
        "Subscriber names cut to 64 characters or with control characters replaced.",
        "counter",
        vec![(String::new(), st.feed.names_cut as f64)],
    );
    counter(
        "discovery_refused_total",
        "Discovered replicas refused, by reason: a /kv_event_sources answer unparseable, naming another host's \
         sockets or too many ranks; or every replica id in use.",
        "counter",
        Refused::ALL
            .iter()
            .map(|r| (format!("reason=\"{}\"", r.label()), st.discovery_refused.get(*r) as f64))
            .collect(),
    );
    s
}

fn esc(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hub::fixtures::*;

    #[test]
    fn rejected_block_claims_are_counted_by_reason_and_not_held() {
        let h = hub(1, 64);
        // Two blocks whose token ids hash to neither key: the first is a mismatch, the second
        // continues from it.
        let forged = llmgw_core::wire::WireEvent::BlockStored(llmgw_core::wire::WireBlockStored {
            block_hashes: vec![9, 10],
            token_ids: vec![3; 32],
            block_size: 16,
            ..Default::default()
        });
        h.state().apply(0, 0, &batch(vec![forged]));
        let text = metrics_text(&h.state());
        let line = |reason: &str, n: u64| {
            format!("llmgw_agent_block_claims_rejected_total{{replica=\"r0\",dp_rank=\"0\",reason=\"{reason}\"}} {n}\n")
        };
        assert!(text.contains(&line("hash_mismatch", 1)) && text.contains(&line("after_mismatch", 1)), "{text}");
        assert!(text.contains("llmgw_agent_blocks{replica=\"r0\",dp_rank=\"0\"} 0"), "{text}");
    }

    #[test]
    fn metrics_name_every_engine() {
        let h = hub(2, 64);
        h.state().apply(1, 0, &batch(vec![stored(vec![1, 2])]));
        h.state().skipped(0, "malformed");
        let text = metrics_text(&h.state());
        assert!(text.contains("llmgw_agent_blocks{replica=\"r1\",dp_rank=\"0\"} 2"), "{text}");
        assert!(text.contains("llmgw_agent_events_skipped_total{replica=\"r0\",dp_rank=\"0\",reason=\"malformed\"} 1"));
        assert!(text.contains("llmgw_agent_subscribers 0"));
        assert!(text.contains("llmgw_agent_block_limit 1073741824\n"), "{text}");
        h.state().discovery_refused.count(Refused::ForeignHost);
        h.state().discovery_refused.count(Refused::ForeignHost);
        h.state().discovery_refused.count(Refused::Unparseable);
        let text = metrics_text(&h.state());
        for (reason, n) in [("unparseable", 1), ("foreign_host", 2), ("too_many_ranks", 0), ("ids_exhausted", 0)] {
            let row = format!("llmgw_agent_discovery_refused_total{{reason=\"{reason}\"}} {n}\n");
            assert!(text.contains(&row), "{row} in {text}");
        }
        // An offloaded tier's store is counted, not mirrored.
        let cpu = llmgw_core::wire::WireEvent::BlockStored(llmgw_core::wire::WireBlockStored {
            block_hashes: vec![5],
            block_size: 16,
            medium: Some("CPU".into()),
            ..Default::default()
        });
        h.state().apply(0, 1, &batch(vec![cpu]));
        let text = metrics_text(&h.state());
        assert!(text.contains("llmgw_agent_events_ignored_total{replica=\"r0\",dp_rank=\"0\",reason=\"medium\"} 1"));
        assert_eq!(h.state().engines[0].mirror.len(), 0);
    }

    #[test]
    fn debug_lists_each_engine_with_its_keys_sorted() {
        let h = hub(2, 64);
        h.state().apply(0, 3, &batch(vec![stored(vec![9, 4, 7, 1])]));
        h.state().skipped(1, "malformed");
        h.state().set_load(
            0,
            llmgw_core::feed::ReplicaLoad { replica: 0, running: 2, waiting: 1, kv_cache_usage: 0.5, gpu_blocks: 0 },
        );
        let _sub = h.subscribe("t".into());
        let got = debug_replicas(&h);
        let engine = |id: u32, keys: Vec<u64>, last_seq: Option<u64>, load: Value, applied: u64, skipped: Value| {
            json!({
                "id": id, "replica": format!("r{id}"), "dp_rank": 0, "address": format!("127.0.0.1:{}", 8000 + id),
                "models": [], "lora_adapters": [], "endpoint": format!("tcp://127.0.0.1:{}", 5000 + id), "mode": "connect",
                "up": true, "http_ok": true, "publisher_ok": true, "connected": false,
                "blocks": keys.len(), "block_keys": keys, "last_seq": last_seq, "last_event_age_secs": null,
                "incomplete_from": null, "incomplete_starts": 0,
                "snapshot": {"joins": 0, "failures": {}},
                "hash": {"algo": "sha256_cbor", "seed": null, "block_size": 16, "lookahead_tokens": 0},
                "lookahead_tokens_seen": null,
                "parity": {"matched": 0, "mismatched": 0, "unverifiable": if keys.is_empty() { 0 } else { 4 },
                           "match_ratio": null, "last_mismatch": null,
                           "rejected": {"hash_mismatch": 0, "after_mismatch": 0}},
                "received": 0, "applied": applied, "skipped": skipped, "gaps": 0,
                "replays": {"complete": 0, "incomplete": 0, "batches": 0},
                "resets": {}, "disconnects": 0, "clears": 0,
                "ignored": {"medium": 0, "locality": 0, "group": 0},
                "load": load,
            })
        };
        let want = json!({
            "replicas": [
                engine(0, vec![1, 4, 7, 9], Some(3), json!({"running": 2, "waiting": 1, "kv_cache_usage": 0.5}), 1, json!({})),
                engine(1, vec![], None, Value::Null, 0, json!({"malformed": 1})),
            ],
            "subscribers": 1,
            "feed": [{"name": "t", "queued": 0, "snapshots": 0}],
        });
        assert_eq!(got, want);
    }

    #[test]
    fn debug_sorts_and_renders_with_the_hub_lock_released() {
        let h = hub(1, 64);
        h.state().apply(0, 0, &batch(vec![stored(vec![3, 1, 2])]));
        let mut free = None;
        let got = debug_replicas_with(&h, |copy| {
            // `try_lock` from the thread that would hold it: it fails instead of deadlocking.
            let held = h.try_state();
            free = Some(held.is_some());
            // Rendering while this thread holds the lock: a render that locked would not end.
            copy.render()
        });
        assert_eq!(free, Some(true), "the hub lock was held while rendering");
        assert_eq!(got["replicas"][0]["block_keys"], json!([1, 2, 3]));
    }
}
