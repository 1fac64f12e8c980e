//! `llmgw-agent doctor`'s checks of what the replicas and Envoy do, beside what they answer
//! ([`crate::doctor`]):
//! * [`flags`]: vLLM's cache settings as its `/metrics` reports them (`vllm:cache_config_info`:
//!   `prefix_caching_hash_algo`, `block_size`, `enable_prefix_caching`) against `[hash]`;
//! * [`events`]: per configured ZMQ engine, a live batch received on its publisher (a one-token
//!   completion of a fresh prompt is sent to the replica so that it stores blocks), its blocks'
//!   hashes recomputed with `[hash]` (parity), and the replay socket asked for that batch;
//! * [`feed`], given Envoy's admin: every filter VM is connected to the agent's feed.

use crate::config::{Config, EngineSpec, EventSource, Mode, ZmqConfig};
use crate::doctor::Finding;
use llmgw_core::event::EventBatch;
use llmgw_core::mirror::EngineMirror;
use std::time::Duration;

/// How a finding names an engine: its replica, and its rank when it has several.
fn who(spec: &EngineSpec) -> String {
    if spec.dp_size > 1 {
        format!("replica {}", spec.label())
    } else {
        format!("replica {}", spec.replica)
    }
}

/// How long each probe of a replica or of Envoy's admin may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);
/// Completions sent to a replica (each then waits a second for a batch) before giving up.
const EVENT_TRIES: usize = 8;

fn ok(line: String) -> Finding {
    Finding { ok: true, line }
}

fn fail(line: String, fix: &str) -> Finding {
    Finding { ok: false, line: format!("{line}\n    fix: {fix}") }
}

/// The labels of the first `vllm:cache_config_info` sample of `engine` (or of any engine when
/// none names it) in a Prometheus text page.
pub fn cache_config(page: &str, engine: u32) -> Option<Vec<(String, String)>> {
    let mut first = None;
    for line in page.lines() {
        let Some(rest) = line.strip_prefix("vllm:cache_config_info{") else { continue };
        let Some((labels, _)) = rest.split_once('}') else { continue };
        let parsed = parse_labels(labels);
        let rank = parsed.iter().find(|(k, _)| k == "engine").map(|(_, v)| v.as_str());
        if rank == Some(engine.to_string().as_str()) {
            return Some(parsed);
        }
        first.get_or_insert(parsed);
    }
    first
}

/// `k="v",k2="v2"` (values without escaped quotes, as vLLM's cache settings are).
fn parse_labels(labels: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut rest = labels;
    while let Some((k, after)) = rest.split_once("=\"") {
        let Some((v, tail)) = after.split_once('"') else { break };
        out.push((k.trim_start_matches(',').trim().to_owned(), v.to_owned()));
        rest = tail;
    }
    out
}

/// What the cache settings a replica reports say against the engine's `[hash]` section: one
/// finding (its problems listed).
pub fn judge_flags(who: &str, labels: &[(String, String)], spec: &EngineSpec) -> Finding {
    let get = |k: &str| labels.iter().find(|(key, _)| key == k).map(|(_, v)| v.as_str());
    let want_algo = spec.hash.algo.name();
    let want_bs = spec.hash.block_size.to_string();
    let mut problems = Vec::new();
    if get("enable_prefix_caching") != Some("True") {
        problems.push((
            format!("enable_prefix_caching={}", get("enable_prefix_caching").unwrap_or("(absent)")),
            "start vLLM with --enable-prefix-caching (no KV events, no reuse without it)".to_owned(),
        ));
    }
    match get("prefix_caching_hash_algo") {
        Some(a) if a == want_algo => {}
        other => problems.push((
            format!("prefix_caching_hash_algo={} where [hash].algo = \"{want_algo}\"", other.unwrap_or("(absent)")),
            format!(
                "start vLLM with --prefix-caching-hash-algo {want_algo} (`llmgw-agent vllm-args` prints it), or set \
                 [hash].algo (and the filter's hash_algo) to the replica's"
            ),
        )),
    }
    match get("block_size") {
        Some(b) if b == want_bs => {}
        other => problems.push((
            format!("block_size={} where [hash].block_size = {want_bs}", other.unwrap_or("(absent)")),
            format!(
                "start vLLM with --block-size {want_bs}, or set [hash].block_size (and the filter's block_size) to \
                 the replica's"
            ),
        )),
    }
    if problems.is_empty() {
        return ok(format!(
            "{who}: /metrics reports prefix caching on, hash algorithm {want_algo}, block size {want_bs}, as [hash] says"
        ));
    }
    let what: Vec<&str> = problems.iter().map(|(w, _)| w.as_str()).collect();
    let fixes: Vec<&str> = problems.iter().map(|(_, f)| f.as_str()).collect();
    fail(format!("{who}: /metrics reports {}", what.join(", ")), &fixes.join("; "))
}

/// The engines whose replica's settings and events are checked: configured ones whose API
/// answers (discovered replicas are found at run time; an unreachable API is reported by
/// [`crate::doctor::replicas`] already).
async fn engines(cfg: &Config) -> Vec<EngineSpec> {
    let mut out = Vec::new();
    for spec in cfg.engines() {
        if crate::http_client::get(&format!("http://{}/health", spec.address), PROBE_TIMEOUT).await.is_ok() {
            out.push(spec);
        }
    }
    out
}

/// Each configured engine's cache settings from its replica's `/metrics`.
pub async fn flags(cfg: &Config) -> Vec<Finding> {
    let mut out = Vec::new();
    for spec in engines(cfg).await {
        let who = who(&spec);
        let url = spec.metrics_url.clone().unwrap_or_else(|| format!("http://{}/metrics", spec.address));
        let page = match crate::http_client::get(&url, PROBE_TIMEOUT).await {
            Ok(p) => p,
            Err(e) => {
                out.push(fail(
                    format!("{who}: {url}: {e}"),
                    "the replica's /metrics must answer (vLLM serves it beside its API)",
                ));
                continue;
            }
        };
        out.push(match cache_config(&page, spec.dp_rank) {
            Some(labels) => judge_flags(&who, &labels, &spec),
            None => fail(
                format!("{who}: no vllm:cache_config_info in {url}: its cache settings cannot be checked"),
                "the replica must be vLLM's OpenAI server (0.33 reports its cache settings there)",
            ),
        });
    }
    out
}

/// A one-token completion of a fresh prompt (at least two full blocks) that makes the replica
/// store new blocks, whatever it cached before. Text, not token ids: ids valid for one model's
/// vocabulary may be out of another's (vLLM refuses those), while every word is at least a token.
async fn nudge(spec: &EngineSpec, model: &str, attempt: usize) {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    let words = spec.hash.block_size.saturating_mul(3).saturating_add(1);
    let mut prompt = format!("llmgw doctor probe {nanos} {attempt}:");
    for i in 0..words {
        prompt.push_str(&format!(" w{}", nanos.wrapping_add(i.wrapping_mul(7919)) % 100_000));
    }
    let body = serde_json::json!({"model": model, "prompt": prompt, "max_tokens": 1});
    let url = format!("http://{}/v1/completions", spec.address);
    let _ = crate::http_client::post_json(&url, body.to_string().as_bytes(), PROBE_TIMEOUT).await;
}

/// The model a replica serves (its `/v1/models`' first), to name in the nudge.
async fn a_model(spec: &EngineSpec) -> Option<String> {
    let body = crate::http_client::get(&format!("http://{}/v1/models", spec.address), PROBE_TIMEOUT).await.ok()?;
    crate::served_models::parse(&body).ok()?.ids.into_iter().next()
}

/// What one engine's publisher showed: live batches (seq, payload) received.
struct Received {
    batches: Vec<(u64, Vec<u8>)>,
}

/// Receives on the engine's publisher, nudging the replica, until a batch whose blocks could be
/// verified came (or [`EVENT_TRIES`] nudges went unanswered).
async fn receive(spec: &EngineSpec, zmq_cfg: &ZmqConfig, model: &str) -> Result<Received, String> {
    let ctx = zmq::Context::new();
    let sub = crate::zmqsub::socket::sub_socket(&ctx, zmq_cfg, spec).map_err(|e| e.to_string())?;
    crate::zmqsub::socket::attach(&sub, spec).map_err(|e| match (spec.mode, e) {
        (Mode::Bind, zmq::Error::EADDRINUSE) => format!(
            "{} is in use: the agent running here binds it (mode = \"bind\"); its /debug/replicas shows `received`",
            spec.endpoint
        ),
        (_, e) => format!("{}: {e}", spec.endpoint),
    })?;
    sub.set_rcvtimeo(1000).map_err(|e| e.to_string())?;
    let mut sub = Some(sub);
    let mut got = Received { batches: Vec::new() };
    let mut mirror = EngineMirror::new(spec.hasher());
    let mut changes = Vec::new();
    for attempt in 0..EVENT_TRIES {
        nudge(spec, model, attempt).await;
        let Some(s) = sub.take() else { break };
        // Until the receive times out (a second without a batch).
        let (s, frames) = tokio::task::spawn_blocking(move || {
            let mut all = Vec::new();
            while let Ok(f) = s.recv_multipart(0) {
                all.push(f);
                if all.len() >= 64 {
                    break;
                }
            }
            (s, all)
        })
        .await
        .map_err(|e| e.to_string())?;
        sub = Some(s);
        for f in frames {
            if let Ok((seq, payload)) = crate::zmqsub::socket::live_item(&f) {
                if let Ok(batch) = EventBatch::decode(payload) {
                    mirror.apply(&batch, &mut changes);
                }
                got.batches.push((seq, payload.to_vec()));
            }
        }
        let p = &mirror.stats().parity;
        if p.matched.saturating_add(p.mismatched) > 0 {
            break;
        }
    }
    Ok(got)
}

/// Each configured ZMQ engine: a live batch, parity on it, and its replay socket.
pub async fn events(cfg: &Config) -> Vec<Finding> {
    let mut out = Vec::new();
    for spec in engines(cfg).await.into_iter().filter(|s| s.source == EventSource::Zmq) {
        let who = who(&spec);
        let Some(model) = a_model(&spec).await else {
            out.push(fail(
                format!("{who}: no model to send a completion to (its /v1/models lists none)"),
                "the replica must serve a model",
            ));
            continue;
        };
        let got = match receive(&spec, &cfg.zmq, &model).await {
            Ok(g) => g,
            Err(e) => {
                out.push(fail(format!("{who}: KV events: {e}"), "check the replica's --kv-events-config"));
                continue;
            }
        };
        let Some((seq, payload)) = got.batches.last().cloned() else {
            out.push(fail(
                format!(
                    "{who}: no KV-event batch on {} (topic {:?}) after {EVENT_TRIES} completions",
                    spec.endpoint, spec.topic
                ),
                "start vLLM with the --kv-events-config that `llmgw-agent vllm-args` prints (publisher, endpoint, \
                 topic) and check that this host reaches its port",
            ));
            continue;
        };
        out.push(ok(format!(
            "{who}: {} KV-event batch(es) received on {}, the last seq {seq}",
            got.batches.len(),
            spec.endpoint
        )));
        out.push(parity(&who, &spec, &got));
        out.push(replay(&who, &spec, &cfg.zmq, seq, payload).await);
    }
    out
}

/// The received batches' blocks rehashed with `[hash]`.
fn parity(who: &str, spec: &EngineSpec, got: &Received) -> Finding {
    let mut mirror = EngineMirror::new(spec.hasher());
    let mut changes = Vec::new();
    for (_, payload) in &got.batches {
        if let Ok(batch) = EventBatch::decode(payload) {
            mirror.apply(&batch, &mut changes);
        }
    }
    let p = &mirror.stats().parity;
    let h = &spec.hash;
    let settings = format!(
        "algo {}, seed {}, block size {}",
        h.algo.name(),
        h.seed_source.describe(h.seed.as_deref()),
        h.block_size
    );
    if p.mismatched > 0 {
        return fail(
            format!(
                "{who}: hash parity: {} of {} blocks hash otherwise than [hash] says ({settings})",
                p.mismatched,
                p.mismatched.saturating_add(p.matched)
            ),
            "start every replica with the PYTHONHASHSEED and --prefix-caching-hash-algo `llmgw-agent vllm-args` \
             prints, or set [hash] (and the filter's profile) to the replicas' settings",
        );
    }
    if p.matched == 0 {
        return fail(
            format!(
                "{who}: hash parity: none of the received blocks could be recomputed ({} unverifiable)",
                p.unverifiable
            ),
            "send the replica a fresh prompt of a few blocks and run doctor again",
        );
    }
    ok(format!("{who}: hash parity: {} blocks recomputed with {settings}, all equal", p.matched))
}

/// The replay socket answers with the batch just received.
async fn replay(who: &str, spec: &EngineSpec, zmq_cfg: &ZmqConfig, seq: u64, payload: Vec<u8>) -> Finding {
    let Some(endpoint) = spec.replay_endpoint.clone() else {
        return fail(
            format!("{who}: no replay_endpoint configured: a missed batch cannot be fetched again"),
            "set replay_endpoint (vLLM's kv-events replay_endpoint, e.g. tcp://HOST:5558)",
        );
    };
    let mut zc = zmq_cfg.clone();
    zc.replay_timeout_ms = zc.replay_timeout_ms.min(3000);
    let ep = endpoint.clone();
    let answer = tokio::task::spawn_blocking(move || {
        let ctx = zmq::Context::new();
        let d = crate::zmqsub::socket::replay_dealer(&ctx, &zc, &ep)?;
        crate::zmqsub::socket::probe(&d, seq, |p| p == payload.as_slice())
    })
    .await;
    match answer {
        Ok(Ok(Some(true))) => ok(format!("{who}: replay socket {endpoint} answers with batch {seq}")),
        Ok(Ok(Some(false))) => fail(
            format!("{who}: replay socket {endpoint} answers, without batch {seq} as published"),
            "replay_endpoint must be the replay socket of the same publisher as endpoint",
        ),
        Ok(Ok(None)) => fail(
            format!("{who}: replay socket {endpoint} did not answer within {} ms", zmq_cfg.replay_timeout_ms.min(3000)),
            "set replay_endpoint to vLLM's kv-events replay_endpoint (offset by the rank, as the publisher's)",
        ),
        Ok(Err(e)) => fail(format!("{who}: replay socket {endpoint}: {e}"), "replay_endpoint must be tcp://HOST:PORT"),
        Err(e) => fail(format!("{who}: replay socket {endpoint}: {e}"), "run doctor again"),
    }
}

/// Envoy's admin at `admin`: each filter VM's `llmgw_feed_connected` gauge is 1, and how many
/// blocks its index holds.
pub async fn feed(admin: &str) -> Vec<Finding> {
    let base = admin.trim_end_matches('/');
    let base = if base.contains("://") { base.to_owned() } else { format!("http://{base}") };
    let url = format!("{base}/stats?filter=llmgw_(feed_connected|index_blocks|fallbacks_total)");
    let body = match crate::http_client::get(&url, PROBE_TIMEOUT).await {
        Ok(b) => b,
        Err(e) => return vec![fail(format!("envoy: admin {url}: {e}"), "--envoy-admin must be Envoy's admin address")],
    };
    // `wasmcustom.llmgw_feed_connected.vm.NAME: 1`
    let gauge = |name: &str| -> Vec<(String, u64)> {
        let prefix = format!("wasmcustom.{name}.vm.");
        body.lines()
            .filter_map(|l| {
                let (k, v) = l.split_once(": ")?;
                Some((k.strip_prefix(&prefix)?.to_owned(), v.trim().parse().ok()?))
            })
            .collect()
    };
    let connected = gauge("llmgw_feed_connected");
    let blocks = gauge("llmgw_index_blocks");
    let counter = |reason: &str| -> u64 {
        let key = format!("wasmcustom.llmgw_fallbacks_total.reason.{reason}: ");
        body.lines().find_map(|l| l.strip_prefix(&key)?.trim().parse().ok()).unwrap_or(0)
    };
    if connected.is_empty() {
        return vec![fail(
            format!("envoy: no filter VM reports llmgw_feed_connected at {base}"),
            "the llmgw filter is not loaded, or has not started (see Envoy's log for the filter's errors)",
        )];
    }
    let down: Vec<&str> = connected.iter().filter(|(_, v)| *v != 1).map(|(vm, _)| vm.as_str()).collect();
    let held: Vec<String> = blocks.iter().map(|(vm, v)| format!("{vm}={v}")).collect();
    let fallbacks = format!("not_synced {}, stale {}", counter("not_synced"), counter("stale"));
    if down.is_empty() {
        vec![ok(format!(
            "envoy: every filter VM ({}) is connected to the agent's feed; index blocks {}; fallbacks so far: {fallbacks}",
            connected.len(),
            held.join(" ")
        ))]
    } else {
        vec![fail(
            format!(
                "envoy: filter VM(s) {} not connected to the agent's feed ({} of {}); fallbacks so far: {fallbacks}",
                down.join(", "),
                down.len(),
                connected.len()
            ),
            "the llmgw_agent cluster must reach the agent's feed.listen over HTTP/2 (and carry its token, when \
             feed.token is set); see the agent's log",
        )]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: &str = "# TYPE vllm:cache_config_info gauge\n\
        vllm:cache_config_info{block_size=\"16\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",engine=\"0\",\
        prefix_caching_hash_algo=\"sha256\"} 1.0\n\
        vllm:cache_config_info{block_size=\"32\",enable_prefix_caching=\"True\",engine=\"1\",\
        prefix_caching_hash_algo=\"sha256\"} 1.0\n";

    fn spec(toml: &str) -> EngineSpec {
        let cfg = Config::parse(&format!(
            "{toml}[[replicas]]\nname = \"a\"\naddress = \"127.0.0.1:8000\"\nendpoint = \"tcp://127.0.0.1:1\"\n"
        ))
        .unwrap();
        cfg.engines().remove(0)
    }

    #[test]
    fn the_cache_settings_of_the_engine_are_read() {
        let labels = cache_config(PAGE, 1).unwrap();
        assert!(labels.contains(&("block_size".into(), "32".into())), "{labels:?}");
        assert!(cache_config(PAGE, 0).unwrap().contains(&("cache_dtype".into(), "auto".into())));
        assert_eq!(cache_config("vllm:num_requests_running 1\n", 0), None);
    }

    #[test]
    fn each_setting_that_differs_is_named_with_its_fix() {
        let labels = cache_config(PAGE, 0).unwrap();
        let same = spec("[hash]\nalgo = \"sha256\"\nblock_size = 16\n");
        assert!(judge_flags("a", &labels, &same).ok);
        let other = spec("[hash]\nalgo = \"sha256_cbor\"\nblock_size = 32\n");
        let f = judge_flags("a", &labels, &other);
        assert!(!f.ok);
        assert!(f.line.contains("prefix_caching_hash_algo=sha256 where [hash].algo = \"sha256_cbor\""), "{}", f.line);
        assert!(f.line.contains("block_size=16 where [hash].block_size = 32"), "{}", f.line);
        assert!(f.line.contains("--prefix-caching-hash-algo sha256_cbor"), "{}", f.line);
        let off = cache_config(&PAGE.replace("\"True\"", "\"False\""), 0).unwrap();
        assert!(judge_flags("a", &off, &same).line.contains("--enable-prefix-caching"));
    }
}
