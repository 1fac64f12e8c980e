//! llmgw-agent: keeps a live mirror of every vLLM engine's KV cache from its ZMQ events and
//! streams it to the llmgw filters over gRPC.
//!
//! * [`config`]: the TOML configuration and the engines it describes.
//! * [`discovery`]: replicas found by DNS, with endpoints from vLLM's `/kv_event_sources`.
//! * [`seq`]: the per-publisher sequence discipline (gaps, replay, restarts), no I/O.
//! * [`ingest`]: the event-source seam: what a source yields, and the one loop body that
//!   judges, replays and applies it for every source.
//! * [`zmqsub`]: one thread per engine with a libzmq SUB socket and replay DEALER.
//! * [`jetstream`]: events through NATS JetStream instead (publishing beside a replica,
//!   consuming in the agent).
//! * [`hub`]: mirrors, feed subscribers, snapshots and counters.
//! * [`counters`]: the discovery's and the JetStream consumer's counters the hub keeps.
//! * [`feed`]: the `llmgw.feed.v1.Feed/Subscribe` gRPC service.
//! * [`epp`]: the Gateway API Inference Extension endpoint picker (Envoy ext_proc), `[epp]`.
//! * [`http`]: `/metrics`, `/healthz`, `/readyz`, `/debug/replicas`.
//! * [`load`]: scraping each replica's `/metrics` for load and liveness.
//! * [`http_client`]: the plain-HTTP GET that load scraping and discovery use.
//! * [`vllm`]: the vLLM flags and environment matching the agent's configuration.
//! * [`launch`]: running and supervising one vLLM replica under the agent.
//! * [`shutdown`]: the stop signals, and joining engine threads.

pub mod claim_log;
pub mod config;
pub mod counters;
pub mod discovery;
pub mod doctor;
pub mod doctor_live;
pub mod epp;
pub mod feed;
pub mod http;
pub mod http_client;
pub mod hub;
pub mod ingest;
pub mod jetstream;
pub mod launch;
pub mod load;
pub mod native_tokenizer;
pub mod seq;
pub mod served_models;
pub mod shutdown;
pub mod snapshot;
pub mod vllm;
pub mod zmq_contexts;
pub mod zmqsub;

use config::{Config, EventSource};
use shutdown::{join_threads, shutdown_signal};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tracing::{info, warn};

/// Why the agent could not start or stop cleanly.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("cannot start runtime: {0}")]
    Runtime(std::io::Error),
    #[error(transparent)]
    FeedTls(#[from] feed::TlsError),
    /// A listener (`feed.listen`, `http.listen`) could not be opened.
    #[error("{field} {addr}: {source}")]
    Listen { field: &'static str, addr: SocketAddr, source: std::io::Error },
    #[error("{0}")]
    LocalAddr(std::io::Error),
    #[error("cannot start engine thread: {0}")]
    Thread(std::io::Error),
    #[error(transparent)]
    Join(#[from] shutdown::JoinError),
    #[error(transparent)]
    Epp(#[from] epp::EppError),
}

/// Runs the agent until SIGINT or SIGTERM.
pub fn run(cfg: Config) -> Result<(), RunError> {
    run_with(cfg, None)
}

/// Runs the agent, and with `launch` also supervises a vLLM process, until SIGINT or SIGTERM.
pub fn run_with(cfg: Config, launch: Option<launch::LaunchSpec>) -> Result<(), RunError> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .thread_name("llmgw-agent")
        .build()
        .map_err(RunError::Runtime)?;
    rt.block_on(run_async(cfg, launch))
}

/// A gRPC server's connections from `listener` (the feed's, the picker's), each with
/// TCP_NODELAY: without it a small message written while an earlier one is unacknowledged waits
/// for the peer's delayed ACK (about 40 ms on Linux) — the picker's answers did, at one
/// connection, before both servers accepted through here.
pub(crate) fn grpc_incoming(listener: tokio::net::TcpListener) -> tonic::transport::server::TcpIncoming {
    tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true))
}

async fn bind(field: &'static str, addr: SocketAddr) -> Result<tokio::net::TcpListener, RunError> {
    tokio::net::TcpListener::bind(addr).await.map_err(|source| RunError::Listen { field, addr, source })
}

async fn run_async(cfg: Config, launch: Option<launch::LaunchSpec>) -> Result<(), RunError> {
    let engines = cfg.engines();
    let hub = hub::Hub::new(engines.clone(), cfg.feed.max_queue, cfg.zmq.max_blocks_per_engine);
    {
        let mut st = hub.state();
        st.max_backlog_bytes = cfg.feed.max_backlog_bytes;
        st.max_subscribers = cfg.feed.max_subscribers;
    }
    let feed_tls = feed::tls_config(&cfg.feed)?;
    let feed_listener = bind("feed.listen", cfg.feed.listen).await?;
    let http_listener = bind("http.listen", cfg.http.listen).await?;
    if !cfg.http.listen.ip().is_loopback() {
        warn!(listen = %cfg.http.listen, "observability endpoints listen on a non-loopback address");
    }
    info!(
        feed = %feed_listener.local_addr().map_err(RunError::LocalAddr)?,
        tls = feed_tls.is_some(),
        http = %http_listener.local_addr().map_err(RunError::LocalAddr)?,
        engines = engines.len(),
        "llmgw-agent listening"
    );

    let stop = Arc::new(AtomicBool::new(false));
    // A libzmq context holds at most 1,023 sockets (ZMQ_MAX_SOCKETS, which the zmq crate cannot
    // raise without unsafe code) and an engine uses up to four (SUB, its monitor pair, a replay
    // DEALER): past about 250 engines a context refuses sockets ("Too many open files"). Each
    // group of engines, configured or discovered, gets a context of its own.
    let contexts = Arc::new(zmq_contexts::ContextPool::new(zmq_contexts::ENGINES_PER_CONTEXT));
    let mut threads = Vec::new();
    for spec in engines.iter().filter(|e| e.source == EventSource::Zmq) {
        let t = zmqsub::Engine::spawn(spec.clone(), hub.clone(), cfg.zmq.clone(), contexts.next(), stop.clone())
            .map_err(RunError::Thread)?;
        threads.push(t);
    }

    let (tx, rx) = tokio::sync::watch::channel(false);
    let wait = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|v| *v).await;
    };
    let feed_task = tokio::spawn(feed::serve(
        feed_listener,
        hub.clone(),
        cfg.feed.token.clone(),
        feed_tls,
        Duration::from_millis(cfg.feed.gather_ms),
        wait(rx.clone()),
    ));
    // The native tokenizer: models loaded (seconds for large vocabularies) off the runtime's
    // threads, then its own listener.
    let native = match &cfg.tokenizer {
        Some(t) => {
            let t = t.clone();
            let listener = bind("tokenizer.listen", t.listen).await?;
            let loaded = tokio::task::spawn_blocking(move || native_tokenizer::NativeTokenizers::load(&t))
                .await
                .map_err(|e| RunError::Thread(std::io::Error::other(e.to_string())))?;
            let loaded = Arc::new(loaded);
            info!(listen = %listener.local_addr().map_err(RunError::LocalAddr)?, models = loaded.models.len(), "native tokenizer listening");
            let state = native_tokenizer::server::state(loaded.clone(), hub.clone());
            Some((loaded, tokio::spawn(native_tokenizer::server::serve(listener, state, wait(rx.clone())))))
        }
        None => None,
    };
    // The endpoint picker: the routing core over this hub, answering Envoy's ext_proc.
    let epp = match &cfg.epp {
        Some(e) => {
            let compiled = epp::routing(e)?;
            let listener = bind("epp.listen", e.listen).await?;
            info!(listen = %listener.local_addr().map_err(RunError::LocalAddr)?, "endpoint picker listening");
            let picker = epp::picker(e, compiled, hub.clone());
            Some((picker.clone(), tokio::spawn(epp::serve(listener, picker, e.max_streams, wait(rx.clone())))))
        }
        None => None,
    };
    let http_task = tokio::spawn(http::serve(
        http_listener,
        hub.clone(),
        native.as_ref().map(|(n, _)| n.clone()),
        epp.as_ref().map(|(m, _)| m.clone()),
        cfg.http.debug_token.clone(),
        http::readiness::Readiness::from_config(&cfg),
        wait(rx.clone()),
    ));
    let mut background = vec![
        tokio::spawn(feed::heartbeats(hub.clone(), Duration::from_secs_f64(cfg.feed.heartbeat_secs))),
        tokio::spawn(parity_watch(hub.clone(), cfg.parity.warn_mismatch_ratio, cfg.parity.min_verified)),
    ];
    if engines.iter().any(|e| matches!(e.source, EventSource::JetStream { .. })) {
        background.push(tokio::spawn(jetstream::consume::consume(cfg.clone(), hub.clone(), stop.clone())));
    }
    for i in 0..cfg.discovery.len() {
        background.push(tokio::spawn(discovery::run(cfg.clone(), i, hub.clone(), contexts.clone(), stop.clone())));
    }
    background.extend(engines.iter().filter_map(|spec| served_models::spawn(&hub, spec, &cfg.load)));
    if cfg.load.enabled {
        for spec in &engines {
            background.push(tokio::spawn(load::scrape_engine(hub.clone(), spec.clone(), cfg.load.clone())));
        }
    }

    let supervisor = launch.map(|spec| tokio::spawn(launch::supervise(cfg.clone(), spec, hub.clone(), rx.clone())));

    shutdown_signal().await;
    info!("shutting down");
    let _ = tx.send(true);
    if let Some(s) = supervisor {
        match s.await {
            Ok(Err(e)) => warn!(error = %e, "launcher failed"),
            Err(e) => warn!(error = %e, "launcher task failed"),
            Ok(Ok(())) => {}
        }
    }
    stop.store(true, Ordering::SeqCst);
    for b in background {
        b.abort();
    }
    let _ = tokio::time::timeout(Duration::from_secs(3), feed_task).await;
    let _ = tokio::time::timeout(Duration::from_secs(3), http_task).await;
    if let Some((_, task)) = native {
        let _ = tokio::time::timeout(Duration::from_secs(3), task).await;
    }
    if let Some((_, task)) = epp {
        let _ = tokio::time::timeout(Duration::from_secs(3), task).await;
    }
    Ok(join_threads(threads).await?)
}

/// Logs a warning when an engine's hash parity drops below the threshold.
async fn parity_watch(hub: Arc<hub::Hub>, threshold: f64, min_verified: u64) {
    let mut t = tokio::time::interval(Duration::from_secs(2));
    let mut claims = claim_log::ClaimLog::new(Duration::from_secs(60));
    loop {
        t.tick().await;
        let engines: Vec<claim_log::EngineClaims> = hub
            .state()
            .engines
            .iter()
            .filter(|e| !e.gone)
            .map(|e| {
                let p = &e.mirror.stats().parity;
                claim_log::EngineClaims {
                    label: e.spec.label(),
                    rejected: p.rejected(),
                    last_mismatch: p.last_mismatch,
                }
            })
            .collect();
        for w in claims.due(std::time::Instant::now(), engines) {
            warn!(
                replica = %w.label,
                rejected = w.new,
                rejected_total = w.total,
                last_published = ?w.last_mismatch.map(|(p, _)| p),
                last_recomputed = ?w.last_mismatch.map(|(_, r)| r),
                "block claims rejected: this replica published blocks whose token ids do not hash to the keys it \
                 claims (another seed or hash algorithm than [hash] says, or forged stores); they are not \
                 credited to it (llmgw_agent_block_claims_rejected_total; logged at most once a minute)"
            );
        }
        let alarms = hub.state().parity_alarms(threshold, min_verified);
        for (replica, ratio, matched, mismatched) in alarms {
            warn!(
                %replica,
                mismatch_ratio = ratio,
                matched,
                mismatched,
                "block hashes published by this replica do not match the configured hashing: \
                 its PYTHONHASHSEED or --prefix-caching-hash-algo likely differ from the agent's [hash] settings \
                 (requests will not score against its cache)"
            );
        }
        for (replica, seen, configured) in hub.state().lookahead_alarms() {
            warn!(
                %replica,
                lookahead_seen = seen,
                lookahead_configured = configured,
                "this replica's events show lookahead block hashing (EAGLE-family speculative decoding) \
                 other than its [hash] lookahead_tokens: the filters hash as configured and will not \
                 score against its cache until lookahead_tokens matches"
            );
        }
    }
}
