//! Observability over HTTP: `/metrics` (Prometheus text), `/healthz`, `/debug/replicas`.

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
    let text = hub.state().metrics_text();
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text)
}

async fn healthz() -> &'static str {
    "ok\n"
}

async fn replicas(State(hub): State<Arc<Hub>>) -> impl IntoResponse {
    Json(hub.state().debug_json())
}

pub async fn serve(
    listener: tokio::net::TcpListener,
    hub: Arc<Hub>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(hub)).with_graceful_shutdown(shutdown).await
}
