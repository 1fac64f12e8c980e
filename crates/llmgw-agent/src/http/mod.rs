//! Observability over HTTP: `/metrics` (Prometheus text), `/healthz` (liveness), `/readyz`
//! (readiness, see [`readiness`]), `/debug/replicas`.
//!
//! [`exposition`] renders the hub state for the two read endpoints; the native tokenizer adds
//! its own metrics when it runs. `/debug/replicas` lists every engine's block keys (with a
//! known seed, a prompt-membership oracle): it answers loopback clients, or a client presenting
//! `http.debug_token`, one request at a time (others get 429).

pub mod exposition;
pub mod readiness;

use crate::epp::picker::Picker;
use crate::hub::Hub;
use crate::native_tokenizer::NativeTokenizers;
use axum::extract::{ConnectInfo, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use std::net::SocketAddr;
use std::sync::Arc;
use subtle::ConstantTimeEq;
use tokio::sync::Semaphore;

/// What the endpoints read.
#[derive(Clone)]
pub struct HttpState {
    pub hub: Arc<Hub>,
    pub native: Option<Arc<NativeTokenizers>>,
    /// The endpoint picker, when it runs (its counters and learned rates).
    pub epp: Option<Arc<Picker>>,
    /// The token a non-loopback client must present for `/debug/replicas`.
    pub debug_token: Option<String>,
    /// One `/debug/replicas` at a time (each copies every engine's keys).
    pub debug: Arc<Semaphore>,
    pub readiness: Arc<readiness::Readiness>,
}

pub fn router(
    hub: Arc<Hub>,
    native: Option<Arc<NativeTokenizers>>,
    epp: Option<Arc<Picker>>,
    debug_token: Option<String>,
    readiness: readiness::Readiness,
) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/debug/replicas", get(replicas))
        .with_state(HttpState {
            hub,
            native,
            epp,
            debug_token,
            debug: Arc::new(Semaphore::new(1)),
            readiness: Arc::new(readiness),
        })
}

/// Whether a `/debug/replicas` request from `peer` with `headers` may be answered.
fn debug_allowed(peer: &SocketAddr, headers: &HeaderMap, token: Option<&str>) -> bool {
    if peer.ip().is_loopback() {
        return true;
    }
    let Some(token) = token.filter(|t| !t.is_empty()) else { return false };
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    bool::from(given.as_bytes().ct_eq(token.as_bytes()))
}

/// Runs `f` with the hub lock on a blocking thread: the lock is a blocking mutex, and the
/// runtime's threads also serve the feed.
async fn with_state<T: Send + 'static>(hub: Arc<Hub>, f: fn(&crate::hub::HubState) -> T) -> Option<T> {
    tokio::task::spawn_blocking(move || f(&hub.state())).await.ok()
}

async fn metrics(State(st): State<HttpState>) -> impl IntoResponse {
    let mut text = with_state(st.hub, exposition::metrics_text).await.unwrap_or_default();
    if let Some(n) = &st.native {
        text.push_str(&n.metrics_text());
    }
    if let Some(e) = &st.epp {
        text.push_str(&e.metrics_text());
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text)
}

async fn healthz() -> &'static str {
    "ok\n"
}

/// 200 "ready" when [`readiness::problems`] finds none, else 503 with one line per problem.
async fn readyz(State(st): State<HttpState>) -> (StatusCode, String) {
    let views = with_state(st.hub, readiness::EngineView::of).await;
    let Some(views) = views else {
        return (StatusCode::SERVICE_UNAVAILABLE, "not ready: the hub could not be read\n".to_owned());
    };
    let problems = readiness::problems(&st.readiness, &views);
    if problems.is_empty() {
        return (StatusCode::OK, "ready\n".to_owned());
    }
    let mut body = String::from("not ready:\n");
    for p in problems {
        body.push_str(&p);
        body.push('\n');
    }
    (StatusCode::SERVICE_UNAVAILABLE, body)
}

async fn replicas(
    State(st): State<HttpState>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
) -> Response {
    if !debug_allowed(&peer, &headers, st.debug_token.as_deref()) {
        return (StatusCode::FORBIDDEN, "/debug/replicas answers loopback clients or the http.debug_token\n")
            .into_response();
    }
    let Ok(_permit) = st.debug.clone().try_acquire_owned() else {
        return (StatusCode::TOO_MANY_REQUESTS, "one /debug/replicas at a time\n").into_response();
    };
    // Copies under the lock, sorts and renders after it (on the blocking thread too: sorting
    // 100k keys an engine is not for the runtime's threads).
    let hub = st.hub;
    Json(tokio::task::spawn_blocking(move || exposition::debug_replicas(&hub)).await.unwrap_or_default())
        .into_response()
}

pub async fn serve(
    listener: tokio::net::TcpListener,
    hub: Arc<Hub>,
    native: Option<Arc<NativeTokenizers>>,
    epp: Option<Arc<Picker>>,
    debug_token: Option<String>,
    readiness: readiness::Readiness,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = router(hub, native, epp, debug_token, readiness).into_make_service_with_connect_info::<SocketAddr>();
    axum::serve(listener, app).with_graceful_shutdown(shutdown).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_debug_endpoint_answers_loopback_or_the_token_only() {
        let local: SocketAddr = "127.0.0.1:5000".parse().unwrap();
        let pod: SocketAddr = "10.0.0.7:5000".parse().unwrap();
        let mut with = HeaderMap::new();
        with.insert(header::AUTHORIZATION, "Bearer s3cret".parse().unwrap());
        let mut wrong = HeaderMap::new();
        wrong.insert(header::AUTHORIZATION, "Bearer s3cre".parse().unwrap());
        assert!(debug_allowed(&local, &HeaderMap::new(), None));
        assert!(!debug_allowed(&pod, &HeaderMap::new(), None));
        assert!(!debug_allowed(&pod, &with, None));
        assert!(!debug_allowed(&pod, &with, Some("")));
        assert!(debug_allowed(&pod, &with, Some("s3cret")));
        assert!(!debug_allowed(&pod, &wrong, Some("s3cret")));
    }
}
