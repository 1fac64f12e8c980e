//! The native tokenizer's HTTP face: `POST /tokenize` as vLLM answers it, and the render
//! endpoints (`/v1/chat/completions/render`, `/v1/completions/render`) for text, answering
//! their token ids (`token_ids`; the sampling parameters and the rest of vLLM's render answer are
//! left out: the filter reads the ids). Whatever it does not
//! answer natively — a model it does not hold or refused or switched off, media, a request's
//! own template, anything it could not parse or render — gets `421 Misdirected Request`, which
//! the filter takes as "ask a replica" (never as a tokenizer failure): the native tokenizer
//! only ever speeds up a request, it never changes how one ends.

use super::{verify, NativeModel, NativeTokenizers};
use crate::hub::Hub;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use llmgw_tokenize::wire::{ErrorBody, ErrorDetail};
use llmgw_tokenize::{TokenizeAnswer, TokenizeRequest};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::Semaphore;

/// Shared by the handlers.
#[derive(Clone)]
pub struct ServerState {
    pub native: Arc<NativeTokenizers>,
    pub hub: Arc<Hub>,
    /// Tokenizations running at once.
    pub work: Arc<Semaphore>,
    /// Replica checks in flight.
    pub checks: Arc<Semaphore>,
}

pub fn router(state: ServerState) -> Router {
    let limit = state.native.config.max_body_bytes;
    Router::new()
        .route("/tokenize", post(tokenize))
        .route("/v1/completions/render", post(render_completion))
        .route("/v1/chat/completions/render", post(render_chat))
        .route("/health", get(|| async { "ok\n" }))
        .layer(DefaultBodyLimit::max(limit))
        .with_state(state)
}

/// A new server state for `native`: work bounded by `max_concurrent` (0: one per CPU).
pub fn state(native: Arc<NativeTokenizers>, hub: Arc<Hub>) -> ServerState {
    let cpus = std::thread::available_parallelism().map_or(2, usize::from);
    let work = match native.config.max_concurrent {
        0 => cpus,
        n => n,
    };
    let checks = native.config.max_verify_in_flight.max(1);
    ServerState { native, hub, work: Arc::new(Semaphore::new(work)), checks: Arc::new(Semaphore::new(checks)) }
}

fn decline(model: Option<&NativeModel>, why: &str) -> Response {
    if let Some(m) = model {
        m.counters.declined.fetch_add(1, Ordering::Relaxed);
    }
    let body = ErrorBody { error: ErrorDetail { message: format!("declined: {why}"), kind: "Misdirected", code: 421 } };
    let text = serde_json::to_string(&body).unwrap_or_default();
    (StatusCode::MISDIRECTED_REQUEST, [(header::CONTENT_TYPE, "application/json")], text).into_response()
}

/// Which endpoint a request came to: the answer's shape and the replica path it is checked on.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Tokenize,
    ChatRender,
    CompletionRender,
}

impl Endpoint {
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Tokenize => "/tokenize",
            Endpoint::ChatRender => "/v1/chat/completions/render",
            Endpoint::CompletionRender => "/v1/completions/render",
        }
    }
}

async fn tokenize(st: State<ServerState>, body: Bytes) -> Response {
    answer(st, body, Endpoint::Tokenize).await
}

async fn render_chat(st: State<ServerState>, body: Bytes) -> Response {
    answer(st, body, Endpoint::ChatRender).await
}

async fn render_completion(st: State<ServerState>, body: Bytes) -> Response {
    answer(st, body, Endpoint::CompletionRender).await
}

async fn answer(State(st): State<ServerState>, body: Bytes, endpoint: Endpoint) -> Response {
    let req: TokenizeRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return decline(None, &format!("unparsed request: {e}")),
    };
    // A render body is a generation request of its own kind: a chat's messages, or one prompt
    // string (a list of prompts or token ids goes to the replicas).
    let fits = matches!(
        (endpoint, &req),
        (Endpoint::Tokenize, _)
            | (Endpoint::ChatRender, TokenizeRequest::Chat(_))
            | (Endpoint::CompletionRender, TokenizeRequest::Completion(_))
    );
    if !fits {
        return decline(None, "a render body of another kind");
    }
    let Some(model) = st.native.model(req.model()).cloned() else {
        return decline(None, "no native tokenizer for this model");
    };
    if model.disabled.load(Ordering::Relaxed) {
        model.counters.disabled.fetch_add(1, Ordering::Relaxed);
        return decline(None, "switched off after a difference from the replicas");
    }
    let tokenizer = match &model.tokenizer {
        Ok(t) => t.clone(),
        Err(why) => return decline(Some(&model), &format!("refused at load: {why}")),
    };
    let Ok(_permit) = st.work.clone().acquire_owned().await else {
        return decline(Some(&model), "shutting down");
    };
    let started = Instant::now();
    let result =
        tokio::task::spawn_blocking(move || tokenizer.tokenize(&req).map(|ids| (ids, tokenizer.max_model_len))).await;
    let elapsed = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX);
    model.counters.busy_us.fetch_add(elapsed, Ordering::Relaxed);
    let (ids, max_model_len) = match result {
        Ok(Ok(answer)) => answer,
        Ok(Err(e)) => return decline(Some(&model), &e.to_string()),
        Err(_) => return decline(Some(&model), "tokenizer task failed"),
    };
    let n = model.counters.answered.fetch_add(1, Ordering::Relaxed);
    model.counters.answered_tokens.fetch_add(ids.len() as u64, Ordering::Relaxed);
    // The ids go into the answer and, once it is written, to the check: never copied.
    let (text, ids) = match endpoint {
        Endpoint::Tokenize => {
            let answer = TokenizeAnswer { count: ids.len(), max_model_len, tokens: ids, token_strs: None };
            (serde_json::to_string(&answer), answer.tokens)
        }
        Endpoint::ChatRender => (
            serde_json::to_string(
                &serde_json::json!({"request_id": "llmgw-native", "token_ids": ids, "features": null}),
            ),
            ids,
        ),
        // vLLM answers a completion render with a list, one entry per prompt.
        Endpoint::CompletionRender => (
            serde_json::to_string(
                &serde_json::json!([{"request_id": "llmgw-native", "token_ids": ids, "features": null}]),
            ),
            ids,
        ),
    };
    let text = text.unwrap_or_default();
    if verify::chosen(n, st.native.config.verify_first, st.native.config.verify_fraction) {
        let check = verify::Check { model, body, native: ids, n, path: endpoint.path() };
        verify::spawn_check(&st.native, &st.hub, &st.checks, check);
    }
    ([(header::CONTENT_TYPE, "application/json")], text).into_response()
}

pub async fn serve(
    listener: tokio::net::TcpListener,
    state: ServerState,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(state)).with_graceful_shutdown(shutdown).await
}
