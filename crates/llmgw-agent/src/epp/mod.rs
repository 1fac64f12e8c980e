//! The agent as a Gateway API Inference Extension endpoint picker (EPP, protocol v1.0.0): Envoy's
//! ext_proc filter asks it, over gRPC, where each request goes; it answers with the
//! `x-gateway-destination-endpoint` header and the `envoy.lb` dynamic metadata (the primary
//! endpoint and an ordered fallback list), decided by the routing core the wasm filter runs,
//! over the agent's own mirror (fed in-process: no feed stream, no per-VM index copy).
//!
//! * [`wire`]: the protocol's fields on ext_proc messages (wire types only).
//! * [`stream`]: one ext_proc stream, from request headers to the endpoint that served.
//! * [`picker`]: the core's router over the hub, the subset hint and the fallback list.
//! * [`gateway`]: the picker's own traffic as the core asks for it (in flight, avoided).
//! * [`tokenize`]: the tokenizer calls the core asks for.
//! * [`after_routing`], [`answer_ids`]: the tokens of a request routed before they came, from a
//!   call made after routing or from its answer.
//! * [`metrics`]: the `llmgw_epp_*` counters.
//!
//! Served on `[epp] listen` with the gRPC health service (`liveness`, `readiness`, and the
//! ext_proc service's name; the last two serve once the index holds its first snapshot).

pub mod after_routing;
pub mod answer_ids;
pub mod gateway;
pub mod learned;
pub mod metrics;
pub mod picker;
pub mod stream;
pub mod tokenize;
pub mod turns;
pub mod wire;

use crate::config::EppConfig;
use crate::hub::Hub;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use llmgw_core::config::Compiled;
use llmgw_core::flow::Router;
use metrics::{inc, EppMetrics};
use picker::Picker;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, Semaphore};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use tonic_health::ServingStatus;

/// Why the picker could not start.
#[derive(Debug, thiserror::Error)]
pub enum EppError {
    #[error("epp.routing {path}: {source}")]
    Read { path: String, source: std::io::Error },
    #[error("epp.routing {path}: {message}")]
    Routing { path: String, message: String },
}

/// The routing configuration: the filter's JSON document named by `epp.routing`, or its
/// defaults.
pub fn routing(cfg: &EppConfig) -> Result<Compiled, EppError> {
    let (text, path) = match &cfg.routing {
        Some(p) => {
            let path = p.display().to_string();
            let text = std::fs::read(p).map_err(|source| EppError::Read { path: path.clone(), source })?;
            (text, path)
        }
        None => (Vec::new(), "(defaults)".to_owned()),
    };
    Compiled::from_json(&text, None).map_err(|e| EppError::Routing { path, message: e.to_string() })
}

/// A random key for the tokenization cache's tags (clients choose the bodies hashed).
fn cache_key() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(0x6c6c_6d67_7765_7070);
    h.finish()
}

/// A picker fed from `hub` (the feeding task is spawned here).
pub fn picker(cfg: &EppConfig, compiled: Compiled, hub: Arc<Hub>) -> Arc<Picker> {
    let gateway = gateway::Gateway::new(Duration::from_millis(cfg.avoid_ms));
    let mut router = Router::new(compiled, cache_key());
    // Calls after routing: a conversation's next turn is routed on the tokens of the turn before
    // (a key of its own for their tags).
    router.set_background_calls(Some(cache_key()));
    let p = Arc::new(Picker::new(router, gateway, Arc::new(EppMetrics::default()), cfg.max_fallbacks));
    tokio::spawn(p.clone().follow(hub));
    p
}

/// The ext_proc service.
pub struct EppService {
    picker: Arc<Picker>,
    streams: Arc<Semaphore>,
}

impl EppService {
    pub fn new(picker: Arc<Picker>, max_streams: usize) -> EppService {
        EppService { picker, streams: Arc::new(Semaphore::new(max_streams)) }
    }
}

#[tonic::async_trait]
impl ExternalProcessor for EppService {
    type ProcessStream = ReceiverStream<Result<ProcessingResponse, Status>>;

    async fn process(
        &self,
        req: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let Ok(permit) = self.streams.clone().try_acquire_owned() else {
            inc(&self.picker.metrics.streams_refused);
            return Err(Status::resource_exhausted("llmgw endpoint picker: epp.max_streams streams are being served"));
        };
        inc(&self.picker.metrics.streams);
        let (tx, rx) = mpsc::channel(16);
        let picker = self.picker.clone();
        let inbound = req.into_inner();
        tokio::spawn(async move {
            stream::run(picker, inbound, tx).await;
            drop(permit);
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// Marks `readiness` and the ext_proc service serving once the index is synced.
async fn report_health(picker: Arc<Picker>, reporter: tonic_health::server::HealthReporter) {
    reporter.set_service_status("liveness", ServingStatus::Serving).await;
    let mut was = None;
    loop {
        let synced = picker.synced();
        if was != Some(synced) {
            let status = if synced { ServingStatus::Serving } else { ServingStatus::NotServing };
            reporter.set_service_status("readiness", status).await;
            reporter.set_service_status("", status).await;
            if synced {
                reporter.set_serving::<ExternalProcessorServer<EppService>>().await;
            } else {
                reporter.set_not_serving::<ExternalProcessorServer<EppService>>().await;
            }
            was = Some(synced);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Serves the picker on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    picker: Arc<Picker>,
    max_streams: usize,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), tonic::transport::Error> {
    let (reporter, health) = tonic_health::server::health_reporter();
    let health_task = tokio::spawn(report_health(picker.clone(), reporter));
    let svc = ExternalProcessorServer::new(EppService::new(picker, max_streams));
    let served = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(Duration::from_secs(20)))
        .add_service(health)
        .add_service(svc)
        .serve_with_incoming_shutdown(crate::grpc_incoming(listener), shutdown)
        .await;
    health_task.abort();
    served
}
