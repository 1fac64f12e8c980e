//! `llmgw-agent doctor`: checks a configuration against the running fleet before traffic
//! depends on it, one line per check and, for a problem, the fix:
//! * [`replicas`]: each configured replica's `/health` and `/v1/models` (the configured models
//!   are served);
//! * [`discovery`]: each discovery entry's DNS name, and each replica it finds: `/health`,
//!   `/v1/models` and, where discovery reads it, `/kv_event_sources`;
//! * [`tokenizers`]: every native tokenizer model is loaded as `run` would load it and
//!   compared with each configured replica serving the model, over a small corpus of completions
//!   and chats sent to both `/tokenize` endpoints;
//! * [`envoy`], given Envoy's admin: the clusters the filter needs.

use crate::config::Config;
use crate::native_tokenizer::NativeTokenizers;
use llmgw_tokenize::TokenizeRequest;
use serde_json::json;
use std::time::Duration;

/// One line of the report, and whether it is a problem.
pub struct Finding {
    pub ok: bool,
    pub line: String,
}

/// The corpus: what a gateway sends a tokenizer most (completions, chats with a system prompt,
/// several turns, text parts, unicode).
fn corpus(model: &str) -> Vec<serde_json::Value> {
    vec![
        json!({"model": model, "prompt": "Hello, world! The quick brown fox jumps over the lazy dog."}),
        json!({"model": model, "prompt": "  leading spaces, tabs\tand\nnew lines; unicode: café, 東京, 🙂"}),
        json!({"model": model, "messages": [{"role": "user", "content": "What is a KV cache?"}]}),
        json!({"model": model, "messages": [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "Name three primes."},
            {"role": "assistant", "content": "2, 3, 5."},
            {"role": "user", "content": "Three more?"}]}),
        json!({"model": model, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "First part."}, {"type": "text", "text": "Second part."}]}]}),
        json!({"model": model, "messages": [{"role": "user", "content": "Finish this: once upon"}],
               "add_generation_prompt": true}),
    ]
}

/// Checks every native tokenizer model against the configured replicas serving it.
pub async fn tokenizers(cfg: &Config) -> Vec<Finding> {
    let mut out = Vec::new();
    let Some(tcfg) = &cfg.tokenizer else {
        out.push(Finding { ok: true, line: "tokenizer: no [tokenizer] section, nothing to check".into() });
        return out;
    };
    let native = NativeTokenizers::load(tcfg);
    let engines = cfg.engines();
    for m in &native.models {
        let tok = match &m.tokenizer {
            Ok(t) => t.clone(),
            Err(e) => {
                out.push(Finding { ok: false, line: format!("tokenizer {}: refused at load: {e}", m.label) });
                continue;
            }
        };
        let names = native.names_of(m);
        let replicas: Vec<_> = engines
            .iter()
            .filter(|e| e.dp_rank == 0)
            .filter(|e| e.models.is_empty() || e.models.iter().any(|x| names.contains(x)))
            .collect();
        if replicas.is_empty() {
            out.push(Finding {
                ok: false,
                line: format!(
                    "tokenizer {}: no configured replica serves it (discovered replicas are not checked here)",
                    m.label
                ),
            });
            continue;
        }
        for r in replicas {
            let mut equal = 0usize;
            let mut problems = Vec::new();
            let cases = corpus(&m.label);
            for body in &cases {
                let native_ids = serde_json::from_value::<TokenizeRequest>(body.clone())
                    .map_err(|e| e.to_string())
                    .and_then(|req| tok.tokenize(&req).map_err(|e| e.to_string()));
                let text = body.to_string();
                let url = format!("http://{}/tokenize", r.address);
                let replica_ids = crate::http_client::post_json(&url, text.as_bytes(), Duration::from_secs(10))
                    .await
                    .map_err(|e| e.to_string())
                    .and_then(|b| {
                        crate::native_tokenizer::verify::tokens_of(&b)
                            .ok_or_else(|| "no token ids in its answer".to_owned())
                    });
                match (native_ids, replica_ids) {
                    (Ok(a), Ok(b)) if a == b => equal = equal.saturating_add(1),
                    (Ok(a), Ok(b)) => {
                        let at = a.iter().zip(&b).position(|(x, y)| x != y).unwrap_or(a.len().min(b.len()));
                        problems.push(format!(
                            "{text}: differ at token {at} (native {} tokens, replica {})",
                            a.len(),
                            b.len()
                        ));
                    }
                    (Err(e), _) => problems.push(format!("{text}: native: {e}")),
                    (_, Err(e)) => problems.push(format!("{text}: replica: {e}")),
                }
            }
            out.push(Finding {
                ok: problems.is_empty(),
                line: format!(
                    "tokenizer {} vs {} ({}): {equal}/{} equal{}",
                    m.label,
                    r.replica,
                    r.address,
                    cases.len(),
                    problems.iter().map(|p| format!("\n    {p}")).collect::<String>()
                ),
            });
        }
    }
    out
}

/// How long each probe of a replica or of Envoy's admin may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

fn ok(line: String) -> Finding {
    Finding { ok: true, line }
}

fn fail(line: String, fix: &str) -> Finding {
    Finding { ok: false, line: format!("{line}\n    fix: {fix}") }
}

/// The model ids a `/v1/models` answer lists (`{"data": [{"id": ...}]}`), LoRA adapters included.
fn model_ids(body: &str) -> Option<Vec<String>> {
    serde_json::from_str::<serde_json::Value>(body)
        .ok()?
        .get("data")?
        .as_array()?
        .iter()
        .map(|m| m.get("id").and_then(serde_json::Value::as_str).map(str::to_owned))
        .collect()
}

/// One replica's API at `address`: `/health` answers 200, and `/v1/models` lists every model
/// of `models` (the configuration's; empty: any). `who` names it, `field` the configuration
/// entry, `where_set` the settings that give its address.
async fn replica_api(who: &str, address: &str, models: &[String], field: &str, where_set: &str) -> Vec<Finding> {
    let mut out = Vec::new();
    let health = format!("http://{address}/health");
    match crate::http_client::get(&health, PROBE_TIMEOUT).await {
        Ok(_) => out.push(ok(format!("{who}: /health at {address} answers 200"))),
        Err(e) => {
            out.push(fail(
                format!("{who}: /health at {address}: {e}"),
                &format!(
                    "{where_set} must give the replica's vLLM API (host:port); check that vLLM runs there and \
                     that this host may reach it (a NetworkPolicy, a firewall)"
                ),
            ));
            // Without the API, /v1/models says nothing more.
            return out;
        }
    }
    let url = format!("http://{address}/v1/models");
    let served = match crate::http_client::get(&url, PROBE_TIMEOUT).await {
        Ok(body) => model_ids(&body).ok_or_else(|| "no model list (data[].id) in its answer".to_owned()),
        Err(e) => Err(e.to_string()),
    };
    match served {
        Err(e) => out.push(fail(
            format!("{who}: /v1/models at {address}: {e}"),
            "the replica must be vLLM's OpenAI-compatible server (vllm serve)",
        )),
        Ok(served) => {
            let missing: Vec<&String> = models.iter().filter(|m| !served.contains(m)).collect();
            if missing.is_empty() {
                let which = if models.is_empty() {
                    "the configuration names no model: the agent tells the filter it serves these".to_owned()
                } else {
                    format!("every configured model ({}) among them", models.join(", "))
                };
                out.push(ok(format!("{who}: /v1/models serves {}; {which}", served.join(", "))));
            } else {
                let missing: Vec<&str> = missing.iter().map(|m| m.as_str()).collect();
                out.push(fail(
                    format!(
                        "{who}: /v1/models serves {}, not {} (requests for it would find no replica)",
                        served.join(", "),
                        missing.join(", ")
                    ),
                    &format!(
                        "set {field}.models to the names the replica serves, or start vLLM with \
                         --served-model-name {} (or load the LoRA adapter of that name)",
                        missing.join(" ")
                    ),
                ));
            }
        }
    }
    out
}

/// Each configured replica's API: `/health` and `/v1/models`.
pub async fn replicas(cfg: &Config) -> Vec<Finding> {
    let mut out = Vec::new();
    for (i, r) in cfg.replicas.iter().enumerate() {
        let who = format!("replica {}", r.name);
        let field = format!("replicas[{i}]");
        out.extend(replica_api(&who, &r.address, &r.models, &field, &format!("{field}.address")).await);
    }
    out
}

/// Each discovery entry: its DNS name resolves, and each replica found answers `/health` and
/// `/v1/models` and, where the entry reads it, `/kv_event_sources` with a ZMQ publisher.
pub async fn discovery(cfg: &Config) -> Vec<Finding> {
    let mut out = Vec::new();
    for (i, d) in cfg.discovery.iter().enumerate() {
        let field = format!("discovery[{i}]");
        let ips: Vec<std::net::IpAddr> = match tokio::net::lookup_host((d.dns.as_str(), d.port)).await {
            Ok(addrs) => {
                let mut ips: Vec<_> = addrs.map(|a| a.ip()).collect();
                ips.sort_unstable();
                ips.dedup();
                ips
            }
            Err(e) => {
                out.push(fail(
                    format!("discovery {}: {} does not resolve: {e}", d.name, d.dns),
                    &format!("{field}.dns must name the replicas' headless Service (one address per replica)"),
                ));
                continue;
            }
        };
        if ips.is_empty() {
            out.push(fail(
                format!("discovery {}: {} resolves to no address", d.name, d.dns),
                "the Service has no ready replica yet, or names the wrong pods",
            ));
            continue;
        }
        out.push(ok(format!("discovery {}: {} resolves to {} replica(s)", d.name, d.dns, ips.len())));
        for ip in ips {
            let address = std::net::SocketAddr::new(ip, d.port).to_string();
            let who = format!("discovery {} replica {address}", d.name);
            let api = replica_api(&who, &address, &d.models, &field, &format!("{field}.dns and .port")).await;
            let reachable = api.first().is_some_and(|f| f.ok);
            out.extend(api);
            if !reachable || d.sources != crate::config::Sources::KvEventSources {
                continue;
            }
            let url = format!("http://{address}/kv_event_sources");
            out.push(match crate::http_client::get(&url, PROBE_TIMEOUT).await {
                Err(e) => fail(
                    format!("{who}: /kv_event_sources: {e}"),
                    &format!(
                        "vLLM 0.33 serves it; for a server without it set {field}.sources = \"static\" with \
                         events_port (and replay_port)"
                    ),
                ),
                Ok(body) => match crate::discovery::parse_sources(ip, &body) {
                    Err(e) => fail(
                        format!("{who}: /kv_event_sources refused: {e}"),
                        "the replica must publish on its own address (tcp://*:PORT), ranks numbered from 0",
                    ),
                    Ok(s) if s.is_empty() => fail(
                        format!("{who}: /kv_event_sources lists no ZMQ publisher"),
                        "start vLLM with the --kv-events-config that `llmgw-agent vllm-args` prints",
                    ),
                    Ok(s) => ok(format!(
                        "{who}: /kv_event_sources lists {} publisher(s): {}",
                        s.len(),
                        s.iter().map(|x| x.endpoint.as_str()).collect::<Vec<_>>().join(", ")
                    )),
                },
            });
        }
    }
    out
}

/// The clusters the filter needs in Envoy: the agent's feed, the replicas (the route's
/// ORIGINAL_DST cluster) and the tokenizer callouts.
/// (name, what it is, the fix when it is missing).
pub const ENVOY_CLUSTERS: [(&str, &str, &str); 3] = [
    (
        "llmgw_agent",
        "the filter's agent_cluster: the agent's gRPC feed (HTTP/2 to feed.listen)",
        "add it as envoy/llmgw-local.yaml does, or set the filter's agent_cluster to the cluster you named",
    ),
    (
        "llmgw_replicas",
        "the route's cluster: ORIGINAL_DST on x-gateway-destination-endpoint",
        "add it as envoy/llmgw-local.yaml does and route the inference paths to it",
    ),
    (
        "llmgw_tokenizer",
        "the filter's tokenizer_cluster: ORIGINAL_DST for tokenizer callouts",
        "add it as envoy/llmgw-local.yaml does, or set the filter's tokenizer_cluster to the cluster you named",
    ),
];

/// Envoy's admin at `admin` (`http://host:port` or `host:port`): its `/clusters` lists each
/// cluster of [`ENVOY_CLUSTERS`].
pub async fn envoy(admin: &str) -> Vec<Finding> {
    let base = admin.trim_end_matches('/');
    let base = if base.contains("://") { base.to_owned() } else { format!("http://{base}") };
    let url = format!("{base}/clusters");
    let body = match crate::http_client::get(&url, PROBE_TIMEOUT).await {
        Ok(b) => b,
        Err(e) => {
            return vec![fail(
                format!("envoy: admin {url}: {e}"),
                "--envoy-admin must be Envoy's admin address (the bootstrap's admin.address)",
            )]
        }
    };
    // Lines are `NAME::...`; a cluster without hosts still has its `NAME::default_priority::...`.
    let names: std::collections::BTreeSet<&str> = body.lines().filter_map(|l| l.split("::").next()).collect();
    ENVOY_CLUSTERS
        .iter()
        .map(|(name, what, fix)| {
            if names.contains(name) {
                ok(format!("envoy: cluster {name} present ({what})"))
            } else {
                fail(format!("envoy: cluster {name} missing from {url} ({what})"), fix)
            }
        })
        .collect()
}
