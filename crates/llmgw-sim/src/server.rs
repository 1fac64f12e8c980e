//! The simulated replica's HTTP API (vLLM's paths and shapes) and its time model:
//! time to first token = queueing + uncached prompt tokens at `prefill_tps`; then one token
//! per `decode_ms × (1 + decode_slowdown × (running − 1))`; at most `max_batch` requests run,
//! the rest wait.

use crate::pool::BlockPool;
use crate::publisher::PubCmd;
use crate::tokenizer::{self, ChatMessage};
use axum::body::Body;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use llmgw_core::hash::RequestExtras;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::{Notify, Semaphore};

#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub name: String,
    pub model: String,
    pub max_model_len: usize,
    pub prefill_tps: f64,
    pub decode_ms: f64,
    pub decode_slowdown: f64,
    pub max_batch: usize,
    pub default_max_tokens: usize,
    /// `/kv_event_sources` answer (rank → publisher settings).
    pub kv_event_sources: Value,
    /// More names of the base model (vLLM's `--served-model-name` beyond the first).
    pub aliases: Vec<String>,
    /// LoRA adapters served (vLLM's `--lora-modules name=path`): requests naming one are hashed
    /// with `("lora", name, path)` and their events carry `lora_name`.
    pub lora_modules: Vec<(String, String)>,
    /// `--prefix-caching-hash-algo`, as `vllm:cache_config_info` reports it.
    pub hash_algo: String,
}

impl EngineConfig {
    /// The LoRA adapter a request's `model` names, if any.
    fn adapter(&self, body: &Value) -> Option<(String, String)> {
        let m = body.get("model").and_then(Value::as_str)?;
        self.lora_modules.iter().find(|(name, _)| name == m).cloned()
    }

    fn serves(&self, model: &str) -> bool {
        model == self.model
            || self.aliases.iter().any(|a| a == model)
            || self.lora_modules.iter().any(|(n, _)| n == model)
    }
}

pub struct Engine {
    pub cfg: EngineConfig,
    pool: Mutex<BlockPool>,
    publisher: Mutex<std::sync::mpsc::Sender<PubCmd>>,
    batch: Semaphore,
    freed: Notify,
    running: AtomicU32,
    waiting: AtomicU32,
    served: AtomicU64,
    next_id: AtomicU64,
    /// Fault injection (`POST /sim/fault`): how long `/tokenize` waits before answering.
    tokenize_delay_ms: AtomicU64,
    /// Fault injection: how long every request started from now on stalls before its prefill
    /// (a slow spell: a noisy neighbour, a stuck step).
    first_token_delay_ms: AtomicU64,
    /// Fault injection: `/metrics` answers 503 while set (the replica looks unreachable).
    metrics_down: AtomicBool,
}

impl Engine {
    pub fn new(cfg: EngineConfig, pool: BlockPool, publisher: std::sync::mpsc::Sender<PubCmd>) -> Arc<Engine> {
        let max_batch = cfg.max_batch.max(1);
        Arc::new(Engine {
            cfg,
            pool: Mutex::new(pool),
            publisher: Mutex::new(publisher),
            batch: Semaphore::new(max_batch),
            freed: Notify::new(),
            running: AtomicU32::new(0),
            waiting: AtomicU32::new(0),
            served: AtomicU64::new(0),
            next_id: AtomicU64::new(0),
            tokenize_delay_ms: AtomicU64::new(0),
            first_token_delay_ms: AtomicU64::new(0),
            metrics_down: AtomicBool::new(false),
        })
    }

    fn with_pool<T>(&self, f: impl FnOnce(&mut BlockPool) -> T) -> T {
        let mut pool = self.pool.lock().unwrap_or_else(|e| e.into_inner());
        let out = f(&mut pool);
        let events = pool.take_events();
        if !events.is_empty() {
            let tx = self.publisher.lock().unwrap_or_else(|e| e.into_inner());
            let _ = tx.send(PubCmd::Batch(events));
        }
        out
    }
}

pub fn router(engine: Arc<Engine>) -> Router {
    Router::new()
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/v1/models", get(models))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/v1/completions/render", post(render_completion))
        .route("/v1/chat/completions/render", post(render_chat))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/metrics", get(metrics))
        .route("/kv_event_sources", get(kv_event_sources))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .route("/sim/restart", post(restart))
        .route("/sim/probe", post(probe))
        .route("/sim/fault", post(fault))
        .route("/sim/blocks", get(blocks))
        .with_state(engine)
}

fn bad_request(msg: impl Into<String>) -> Response {
    let msg = msg.into();
    (StatusCode::BAD_REQUEST, Json(json!({"error": {"message": msg, "type": "BadRequestError", "code": 400}})))
        .into_response()
}

#[allow(clippy::result_large_err)]
fn check_model(e: &Engine, body: &Value) -> Result<(), Response> {
    match body.get("model").and_then(Value::as_str) {
        Some(m) if !e.cfg.serves(m) => Err((
            StatusCode::NOT_FOUND,
            Json(json!({"error": {"message": format!("The model `{m}` does not exist."), "type": "NotFoundError", "code": 404}})),
        )
            .into_response()),
        _ => Ok(()),
    }
}

fn messages_of(body: &Value) -> Option<Vec<ChatMessage>> {
    let msgs = body.get("messages")?.as_array()?;
    Some(
        msgs.iter()
            .map(|m| {
                let role = m.get("role").and_then(Value::as_str).unwrap_or("user").to_owned();
                let content = match m.get("content") {
                    Some(Value::String(s)) => s.clone(),
                    Some(Value::Array(parts)) => parts
                        .iter()
                        .filter_map(|p| p.get("text").and_then(Value::as_str))
                        .collect::<Vec<_>>()
                        .join("\n"),
                    _ => String::new(),
                };
                ChatMessage { role, content }
            })
            .collect(),
    )
}

/// Token ids of a completion prompt: text (with BOS unless add_special_tokens is false) or ids.
fn prompt_tokens(body: &Value, default_special: bool) -> Result<Vec<u32>, String> {
    let special = body.get("add_special_tokens").and_then(Value::as_bool).unwrap_or(default_special);
    match body.get("prompt") {
        Some(Value::String(s)) => Ok(tokenizer::encode(s, special)),
        Some(Value::Array(items)) if items.iter().all(Value::is_u64) => items
            .iter()
            .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()).ok_or("token id out of range".into()))
            .collect(),
        Some(Value::Array(items)) => match items.first() {
            Some(Value::String(s)) => Ok(tokenizer::encode(s, special)),
            _ => Err("unsupported prompt".into()),
        },
        _ => Err("prompt is required".into()),
    }
}

fn chat_tokens(body: &Value) -> Option<Vec<u32>> {
    let msgs = messages_of(body)?;
    let gen = body.get("add_generation_prompt").and_then(Value::as_bool).unwrap_or(true);
    let mut t = tokenizer::apply_chat_template(&msgs, gen);
    if body.get("add_special_tokens").and_then(Value::as_bool).unwrap_or(false) {
        t.insert(0, tokenizer::BOS);
    }
    Some(t)
}

/// The prompt tokens of a chat body (one with `messages`, which wins as in vLLM) or a
/// completion body.
#[allow(clippy::result_large_err)]
fn body_tokens(body: &Value) -> Result<Vec<u32>, Response> {
    if body.get("messages").is_some() {
        chat_tokens(body).ok_or_else(|| bad_request("messages must be a list"))
    } else {
        prompt_tokens(body, true).map_err(bad_request)
    }
}

/// As vLLM's: the base model under each of its names, then each adapter with its `parent` and
/// its path as `root`.
async fn models(State(e): State<Arc<Engine>>) -> Json<Value> {
    let c = &e.cfg;
    let base = std::iter::once(&c.model).chain(&c.aliases).map(|name| {
        json!({"id": name, "object": "model", "owned_by": "llmgw-sim", "root": c.model,
               "parent": null, "max_model_len": c.max_model_len})
    });
    let adapters = c.lora_modules.iter().map(
        |(name, path)| json!({"id": name, "object": "model", "owned_by": "llmgw-sim", "root": path, "parent": c.model}),
    );
    Json(json!({"object": "list", "data": base.chain(adapters).collect::<Vec<_>>()}))
}

async fn tokenize(State(e): State<Arc<Engine>>, Json(body): Json<Value>) -> Response {
    if let Err(r) = check_model(&e, &body) {
        return r;
    }
    let delay = e.tokenize_delay_ms.load(Ordering::Relaxed);
    if delay > 0 {
        tokio::time::sleep(Duration::from_millis(delay)).await;
    }
    // As in vLLM, a body with messages is the chat form.
    let tokens = match body_tokens(&body) {
        Ok(t) => t,
        Err(r) => return r,
    };
    Json(json!({"count": tokens.len(), "max_model_len": e.cfg.max_model_len, "tokens": tokens, "token_strs": null}))
        .into_response()
}

async fn detokenize(Json(body): Json<Value>) -> Response {
    let tokens: Vec<u32> = body
        .get("tokens")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok())).collect())
        .unwrap_or_default();
    Json(json!({"prompt": tokenizer::decode(&tokens)})).into_response()
}

fn render_reply(e: &Engine, tokens: Vec<u32>) -> Response {
    Json(json!({"request_id": format!("render-{}", e.next_id.fetch_add(1, Ordering::Relaxed)), "token_ids": tokens, "features": null}))
        .into_response()
}

async fn render_completion(State(e): State<Arc<Engine>>, Json(body): Json<Value>) -> Response {
    if let Err(r) = check_model(&e, &body) {
        return r;
    }
    match prompt_tokens(&body, true) {
        Ok(t) => render_reply(&e, t),
        Err(m) => bad_request(m),
    }
}

async fn render_chat(State(e): State<Arc<Engine>>, Json(body): Json<Value>) -> Response {
    if let Err(r) = check_model(&e, &body) {
        return r;
    }
    match chat_tokens(&body) {
        Some(t) => render_reply(&e, t),
        None => bad_request("messages must be a list"),
    }
}

async fn completions(State(e): State<Arc<Engine>>, Json(body): Json<Value>) -> Response {
    if let Err(r) = check_model(&e, &body) {
        return r;
    }
    match prompt_tokens(&body, true) {
        Ok(t) => generate(e, body, t, false).await,
        Err(m) => bad_request(m),
    }
}

async fn chat_completions(State(e): State<Arc<Engine>>, Json(body): Json<Value>) -> Response {
    if let Err(r) = check_model(&e, &body) {
        return r;
    }
    match chat_tokens(&body) {
        Some(t) => generate(e, body, t, true).await,
        None => bad_request("messages must be a list"),
    }
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// Runs one request through the time model; streams SSE chunks or returns one JSON body.
async fn generate(e: Arc<Engine>, body: Value, prompt: Vec<u32>, chat: bool) -> Response {
    if prompt.len() >= e.cfg.max_model_len {
        return bad_request(format!("prompt of {} tokens exceeds max_model_len {}", prompt.len(), e.cfg.max_model_len));
    }
    let max_tokens = body
        .get("max_completion_tokens")
        .or_else(|| body.get("max_tokens"))
        .and_then(Value::as_u64)
        .map_or(e.cfg.default_max_tokens, |m| m as usize)
        .min(e.cfg.max_model_len.saturating_sub(prompt.len()));
    let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
    // As vLLM 0.33: the prompt's ids in a stream's first chunk, each chunk's own beside it.
    let return_ids = stream && body.get("return_token_ids").and_then(Value::as_bool).unwrap_or(false);
    let lora = e.cfg.adapter(&body);
    let lora_name = lora.as_ref().map(|(name, _)| name.clone());
    let extras = RequestExtras {
        cache_salt: body.get("cache_salt").and_then(Value::as_str).map(str::to_owned),
        lora,
        ..Default::default()
    };
    let id = format!("{}-{}", if chat { "chatcmpl" } else { "cmpl" }, e.next_id.fetch_add(1, Ordering::Relaxed));
    let (tx, rx) = tokio::sync::mpsc::channel::<Value>(64);
    let engine = e.clone();
    let task_id = id.clone();
    let started = Instant::now();
    tokio::spawn(async move {
        let e = engine;
        e.waiting.fetch_add(1, Ordering::Relaxed);
        let permit = e.batch.acquire().await;
        // Admission: wait for blocks when the pool is full.
        let (seq, cached) = loop {
            match e.with_pool(|p| p.admit(prompt.clone(), extras.clone(), lora_name.clone())) {
                Ok(x) => break x,
                Err(_) => {
                    let _ = tokio::time::timeout(Duration::from_millis(50), e.freed.notified()).await;
                }
            }
        };
        e.waiting.fetch_sub(1, Ordering::Relaxed);
        e.running.fetch_add(1, Ordering::Relaxed);
        let uncached = prompt.len().saturating_sub(cached);
        let stall = e.first_token_delay_ms.load(Ordering::Relaxed);
        if stall > 0 {
            tokio::time::sleep(Duration::from_millis(stall)).await;
        }
        tokio::time::sleep(Duration::from_secs_f64(uncached as f64 / e.cfg.prefill_tps.max(1.0))).await;
        let generated = tokenizer::generated_tokens(&prompt, max_tokens);
        let mut produced = 0usize;
        let mut finish = "length";
        for (i, &t) in generated.iter().enumerate() {
            if i > 0 {
                let running = f64::from(e.running.load(Ordering::Relaxed).max(1));
                let step = e.cfg.decode_ms * (1.0 + e.cfg.decode_slowdown * (running - 1.0));
                tokio::time::sleep(Duration::from_secs_f64(step / 1000.0)).await;
            }
            if e.with_pool(|p| p.append(seq, t)).is_err() {
                finish = "abort";
                break;
            }
            produced = produced.saturating_add(1);
            let text = format!(" w{t}");
            let mut chunk = if chat {
                json!({"id": task_id, "object": "chat.completion.chunk", "created": unix_now(), "model": e.cfg.model,
                       "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": null}]})
            } else {
                json!({"id": task_id, "object": "text_completion", "created": unix_now(), "model": e.cfg.model,
                       "choices": [{"index": 0, "text": text, "finish_reason": null}]})
            };
            if return_ids {
                if let Some(c) = chunk.pointer_mut("/choices/0").and_then(Value::as_object_mut) {
                    c.insert("token_ids".into(), json!([t]));
                }
                // A chat's on the chunk, a completion's on its choice.
                let at = if chat {
                    chunk.as_object_mut()
                } else {
                    chunk.pointer_mut("/choices/0").and_then(Value::as_object_mut)
                };
                if let (0, Some(c)) = (i, at) {
                    c.insert("prompt_token_ids".into(), json!(prompt));
                }
            }
            if tx.send(chunk).await.is_err() {
                finish = "abort";
                break;
            }
        }
        e.with_pool(|p| p.finish(seq));
        e.running.fetch_sub(1, Ordering::Relaxed);
        e.served.fetch_add(1, Ordering::Relaxed);
        drop(permit);
        e.freed.notify_waiters();
        let usage = json!({"prompt_tokens": prompt.len(), "completion_tokens": produced,
                           "total_tokens": prompt.len().saturating_add(produced),
                           "prompt_tokens_details": {"cached_tokens": cached}});
        let _ = tx.send(json!({"__final": true, "finish_reason": finish, "usage": usage})).await;
    });
    let name = e.cfg.name.clone();
    if stream {
        let s = futures_util::stream::unfold(rx, |mut rx| async move {
            match rx.recv().await {
                Some(v) if v.get("__final").is_some() => {
                    Some((Ok::<_, std::convert::Infallible>("data: [DONE]\n\n".to_owned()), rx))
                }
                Some(v) => Some((Ok(format!("data: {v}\n\n")), rx)),
                None => None,
            }
        });
        return Response::builder()
            .header(header::CONTENT_TYPE, "text/event-stream")
            .header("x-llmgw-sim-replica", name)
            .body(Body::from_stream(s))
            .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response());
    }
    let mut rx = rx;
    let mut text = String::new();
    let mut fin = json!(null);
    while let Some(v) = rx.recv().await {
        if v.get("__final").is_some() {
            fin = v;
            break;
        }
        let piece = v.pointer(if chat { "/choices/0/delta/content" } else { "/choices/0/text" });
        text.push_str(piece.and_then(Value::as_str).unwrap_or_default());
    }
    let choice = if chat {
        json!({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": fin.get("finish_reason")})
    } else {
        json!({"index": 0, "text": text, "finish_reason": fin.get("finish_reason")})
    };
    let reply = json!({"id": id, "object": if chat { "chat.completion" } else { "text_completion" },
                       "created": unix_now(), "model": e.cfg.model, "choices": [choice], "usage": fin.get("usage"),
                       "llmgw_sim": {"replica": name, "elapsed_ms": started.elapsed().as_secs_f64() * 1000.0}});
    ([("x-llmgw-sim-replica", e.cfg.name.clone())], Json(reply)).into_response()
}

async fn metrics(State(e): State<Arc<Engine>>) -> Response {
    if e.metrics_down.load(Ordering::Relaxed) {
        return StatusCode::SERVICE_UNAVAILABLE.into_response();
    }
    let (usage, stats, block_size) = e.with_pool(|p| (p.usage(), p.stats(), p.block_size()));
    let m = &e.cfg.model;
    let algo = &e.cfg.hash_algo;
    // As vLLM's info gauge: the cache configuration as labels, permanently 1.
    let body = format!(
        "# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{{block_size=\"{block_size}\",\
         enable_prefix_caching=\"True\",engine=\"0\",prefix_caching_hash_algo=\"{algo}\"}} 1.0\n\
         # TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{model_name=\"{m}\"}} {}\n\
         # TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{{model_name=\"{m}\"}} {}\n\
         # TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{{model_name=\"{m}\"}} {usage}\n\
         # TYPE vllm:prefix_cache_queries counter\nvllm:prefix_cache_queries_total{{model_name=\"{m}\"}} {}\n\
         # TYPE vllm:prefix_cache_hits counter\nvllm:prefix_cache_hits_total{{model_name=\"{m}\"}} {}\n\
         # TYPE vllm:request_success counter\nvllm:request_success_total{{model_name=\"{m}\"}} {}\n",
        e.running.load(Ordering::Relaxed),
        e.waiting.load(Ordering::Relaxed),
        stats.queries_tokens,
        stats.hits_tokens,
        e.served.load(Ordering::Relaxed),
    );
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], body).into_response()
}

async fn kv_event_sources(State(e): State<Arc<Engine>>) -> Json<Value> {
    Json(e.cfg.kv_event_sources.clone())
}

async fn reset_prefix_cache(State(e): State<Arc<Engine>>) -> Response {
    if e.with_pool(|p| p.reset_prefix_cache()) {
        StatusCode::OK.into_response()
    } else {
        (StatusCode::CONFLICT, "blocks in use").into_response()
    }
}

/// Simulates an engine restart: the cache is empty and the publisher's sequence restarts at 0.
async fn restart(State(e): State<Arc<Engine>>) -> Response {
    // One step under the pool's lock (taken before the publisher's, as in `with_pool`): another
    // request's events must not be published between the cache's reset and the publisher's,
    // under the old engine's sequence (the agent then dropped them with the old engine's blocks).
    let mut pool = e.pool.lock().unwrap_or_else(|p| p.into_inner());
    pool.restart();
    let tx = e.publisher.lock().unwrap_or_else(|p| p.into_inner());
    let _ = tx.send(PubCmd::Restart);
    StatusCode::OK.into_response()
}

/// Benchmark oracle: how many leading blocks of this request (a chat or completion body) the
/// pool holds now, of its full prompt blocks, and the engine's load. Admits nothing.
async fn probe(State(e): State<Arc<Engine>>, Json(body): Json<Value>) -> Response {
    let tokens = match body_tokens(&body) {
        Ok(t) => t,
        Err(r) => return r,
    };
    let extras = RequestExtras {
        cache_salt: body.get("cache_salt").and_then(Value::as_str).map(str::to_owned),
        lora: e.cfg.adapter(&body),
        ..Default::default()
    };
    let (cached, block_size, usage) = e.with_pool(|p| (p.probe(&tokens, &extras), p.block_size(), p.usage()));
    Json(json!({
        "cached_blocks": cached,
        "total_blocks": tokens.len() / block_size,
        "prompt_tokens": tokens.len(),
        "running": e.running.load(Ordering::Relaxed),
        "waiting": e.waiting.load(Ordering::Relaxed),
        "kv_cache_usage": usage,
    }))
    .into_response()
}

/// Fault injection for the fault suite (every field optional):
/// `{"tokenize_delay_ms": N}` delays every later `/tokenize` answer by N ms (0: none);
/// `{"first_token_delay_ms": N}` stalls every request started later by N ms before its prefill
/// (0: none);
/// `{"drop_batches": N, "replayable": bool}` numbers the next N event batches but does not
/// publish them (a sequence gap); with `replayable` false (default true) they are missing from
/// the replay buffer too, so a replay cannot fill the gap; `{"metrics_down": bool}` makes
/// `/metrics` answer 503 (true) or answer again (false).
async fn fault(State(e): State<Arc<Engine>>, Json(body): Json<Value>) -> Response {
    if let Some(v) = body.get("tokenize_delay_ms") {
        let Some(ms) = v.as_u64().filter(|ms| *ms <= 600_000) else {
            return bad_request("tokenize_delay_ms: expected 0..=600000");
        };
        e.tokenize_delay_ms.store(ms, Ordering::Relaxed);
    }
    if let Some(v) = body.get("first_token_delay_ms") {
        let Some(ms) = v.as_u64().filter(|ms| *ms <= 600_000) else {
            return bad_request("first_token_delay_ms: expected 0..=600000");
        };
        e.first_token_delay_ms.store(ms, Ordering::Relaxed);
    }
    if let Some(v) = body.get("metrics_down") {
        let Some(down) = v.as_bool() else { return bad_request("metrics_down: expected true or false") };
        e.metrics_down.store(down, Ordering::Relaxed);
    }
    if let Some(v) = body.get("drop_batches") {
        let Some(count) = v.as_u64().and_then(|n| usize::try_from(n).ok()) else {
            return bad_request("drop_batches: expected a count");
        };
        let replayable = body.get("replayable").and_then(Value::as_bool).unwrap_or(true);
        let tx = e.publisher.lock().unwrap_or_else(|p| p.into_inner());
        let _ = tx.send(PubCmd::Drop { count, replayable });
    }
    StatusCode::OK.into_response()
}

/// The block keys the pool caches now (the ground truth an agent's mirror is checked against).
async fn blocks(State(e): State<Arc<Engine>>) -> Json<Value> {
    let keys = e.with_pool(|p| p.cached_keys());
    Json(json!({"keys": keys}))
}
