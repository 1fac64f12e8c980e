//! What the agent's HTTP server shows: `/debug/replicas` (JSON) and `/metrics` (Prometheus
//! text), both read from the hub state under its lock.

use crate::hub::{EngineState, HubState};
use serde_json::{json, Value};
use std::fmt::Write as _;
use std::time::Instant;

/// Block keys `/debug/replicas` lists per engine (at most; any of them past that).
const DEBUG_KEYS: usize = 100_000;

/// `/debug/replicas`.
pub fn debug_json(st: &HubState) -> Value {
    let now = Instant::now();
    let engines: Vec<Value> = st
        .live()
        .map(|e| {
            let s = e.mirror.stats();
            let p = &s.parity;
            // A bounded copy under the lock, no sort of every key: `/debug` is for people.
            let mut blocks = e.mirror.some_keys(DEBUG_KEYS);
            blocks.sort_unstable();
            json!({
                "id": e.spec.id,
                "replica": e.spec.replica,
                "dp_rank": e.spec.dp_rank,
                "address": e.spec.address,
                "models": e.spec.models,
                "endpoint": e.spec.endpoint,
                "mode": match e.spec.mode { crate::config::Mode::Bind => "bind", crate::config::Mode::Connect => "connect" },
                "up": e.up,
                "http_ok": e.http_ok,
                "publisher_ok": e.publisher_ok,
                "connected": e.connected,
                "blocks": e.mirror.len(),
                "block_keys": blocks,
                "last_seq": e.last_seq,
                "last_event_age_secs": e.last_event.map(|t| now.saturating_duration_since(t).as_secs_f64()),
                "hash": {
                    "algo": e.spec.hash.algo.name(),
                    "seed": e.spec.hash.seed,
                    "block_size": e.spec.hash.block_size,
                    "lookahead_tokens": e.spec.hash.lookahead_tokens,
                },
                // Lookahead hashing as the engine's own events show it (EAGLE-family engines).
                "lookahead_tokens_seen": s.lookahead_tokens,
                "parity": {
                    "matched": p.matched,
                    "mismatched": p.mismatched,
                    "unverifiable": p.unverifiable,
                    "match_ratio": p.match_ratio(),
                    "last_mismatch": p.last_mismatch.map(|(a, b)| json!({"published": a, "recomputed": b})),
                },
                "received": e.counters.received,
                "applied": e.counters.applied,
                "skipped": e.counters.skipped,
                "gaps": e.counters.gaps,
                "replays": {"complete": e.counters.replays_complete, "incomplete": e.counters.replays_incomplete, "batches": e.counters.replayed_batches},
                "resets": e.counters.resets,
                "disconnects": e.counters.disconnects,
                "clears": s.clears,
                "ignored": {"medium": s.ignored_medium, "locality": s.ignored_locality, "group": s.ignored_group},
                "load": e.load.as_ref().map(|l| json!({"running": l.running, "waiting": l.waiting, "kv_cache_usage": l.kv_cache_usage})),
            })
        })
        .collect();
    let subs: Vec<Value> = st
        .subscriber_lags()
        .into_iter()
        .map(|(name, queued, snapshots)| json!({"name": name, "queued": queued, "snapshots": snapshots}))
        .collect();
    json!({ "replicas": engines, "subscribers": st.live_subscribers(), "feed": subs })
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
    let ratio: Vec<(String, f64)> =
        st.live().filter_map(|e| e.mirror.stats().parity.match_ratio().map(|r| (lbl(e), r))).collect();
    counter("parity_match_ratio", "Share of verified blocks whose hash matched.", "gauge", ratio);
    counter("blocks", "Blocks held per engine.", "gauge", per(&|e| e.mirror.len() as u64));
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
        "Discovered replicas' /kv_event_sources answers refused (unparseable, naming another host's sockets, too many ranks).",
        "counter",
        vec![(String::new(), st.discovery_refused as f64)],
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
    fn metrics_name_every_engine() {
        let h = hub(2, 64);
        h.state().apply(1, 0, &batch(vec![stored(vec![1, 2])]));
        h.state().skipped(0, "malformed");
        let text = metrics_text(&h.state());
        assert!(text.contains("llmgw_agent_blocks{replica=\"r1\",dp_rank=\"0\"} 2"), "{text}");
        assert!(text.contains("llmgw_agent_events_skipped_total{replica=\"r0\",dp_rank=\"0\",reason=\"malformed\"} 1"));
        assert!(text.contains("llmgw_agent_subscribers 0"));
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
}
