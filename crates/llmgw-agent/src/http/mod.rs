//! Observability over HTTP: `/metrics` (Prometheus text), `/healthz`, `/debug/replicas`.
//!
//! [`exposition`] renders the hub state for the two read endpoints; the native tokenizer adds
//! its own metrics when it runs.

pub mod exposition;

use crate::hub::Hub;
use crate::native_tokenizer::NativeTokenizers;
use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};
use std::sync::Arc;

/// What the endpoints read.
#[derive(Clone)]
pub struct HttpState {
    pub hub: Arc<Hub>,
    pub native: Option<Arc<NativeTokenizers>>,
}

pub fn router(hub: Arc<Hub>, native: Option<Arc<NativeTokenizers>>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/debug/replicas", get(replicas))
        .with_state(HttpState { hub, native })
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
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(hub, native)).with_graceful_shutdown(shutdown).await
}
