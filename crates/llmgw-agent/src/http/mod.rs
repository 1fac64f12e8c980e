//! Observability over HTTP: `/metrics` (Prometheus text), `/healthz` (liveness), `/readyz`
//! (readiness, see [`readiness`]), `/debug/replicas`.
//!
//! [`exposition`] renders the hub state for the two read endpoints; the native tokenizer adds
//! its own metrics when it runs.

pub mod exposition;
pub mod readiness;

use crate::hub::Hub;
use crate::native_tokenizer::NativeTokenizers;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};
use std::sync::Arc;

/// What the endpoints read.
#[derive(Clone)]
pub struct HttpState {
    pub hub: Arc<Hub>,
    pub native: Option<Arc<NativeTokenizers>>,
    pub readiness: Arc<readiness::Readiness>,
}

pub fn router(hub: Arc<Hub>, native: Option<Arc<NativeTokenizers>>, readiness: readiness::Readiness) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/debug/replicas", get(replicas))
        .with_state(HttpState { hub, native, readiness: Arc::new(readiness) })
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

async fn replicas(State(st): State<HttpState>) -> impl IntoResponse {
    // Copies under the lock, sorts and renders after it (on the blocking thread too: sorting
    // 100k keys an engine is not for the runtime's threads).
    let hub = st.hub;
    Json(tokio::task::spawn_blocking(move || exposition::debug_replicas(&hub)).await.unwrap_or_default())
}

pub async fn serve(
    listener: tokio::net::TcpListener,
    hub: Arc<Hub>,
    native: Option<Arc<NativeTokenizers>>,
    readiness: readiness::Readiness,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(hub, native, readiness)).with_graceful_shutdown(shutdown).await
}
