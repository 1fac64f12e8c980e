//! Observability over HTTP: `/metrics` (Prometheus text), `/healthz`, `/debug/replicas`.
//!
//! [`exposition`] renders the hub state for the two read endpoints.

pub mod exposition;

use crate::hub::Hub;
use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};
use std::sync::Arc;

pub fn router(hub: Arc<Hub>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/debug/replicas", get(replicas))
        .with_state(hub)
}

async fn metrics(State(hub): State<Arc<Hub>>) -> impl IntoResponse {
    let text = exposition::metrics_text(&hub.state());
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text)
}

async fn healthz() -> &'static str {
    "ok\n"
}

async fn replicas(State(hub): State<Arc<Hub>>) -> impl IntoResponse {
    Json(exposition::debug_json(&hub.state()))
}

pub async fn serve(
    listener: tokio::net::TcpListener,
    hub: Arc<Hub>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(hub)).with_graceful_shutdown(shutdown).await
}
