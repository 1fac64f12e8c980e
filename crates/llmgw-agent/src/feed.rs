//! The gRPC feed `llmgw.feed.v1.Feed/Subscribe`, served with llmgw-core's message structs.

use crate::hub::Hub;
use llmgw_core::feed::{Body, FeedMessage, Heartbeat, SubscribeRequest};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Certificate, Identity, ServerTlsConfig};
use tonic::{Request, Response, Status};
use tracing::{info, warn};

/// Server and client generated from `proto/llmgw/feed/v1/feed.proto`, using llmgw-core's
/// message types.
#[allow(clippy::all)]
pub mod service {
    include!(concat!(env!("OUT_DIR"), "/service/llmgw.feed.v1.rs"));
}

/// The messages generated from the `.proto` on their own (used to check field numbers).
#[allow(clippy::all)]
pub mod generated {
    include!(concat!(env!("OUT_DIR"), "/messages/llmgw.feed.v1.rs"));
}

/// Metadata key a subscriber may use instead of `SubscribeRequest.token`.
pub const TOKEN_HEADER: &str = "x-llmgw-token";

pub struct FeedService {
    hub: Arc<Hub>,
    token: Option<String>,
    gather: Duration,
}

impl FeedService {
    /// `gather`: `feed.gather_ms`, how long after a batching subscriber's queue was emptied
    /// its next messages wait, gathering what else is published.
    pub fn new(hub: Arc<Hub>, token: Option<String>, gather: Duration) -> Self {
        Self { hub, token: token.filter(|t| !t.is_empty()), gather }
    }

    fn authorised<T>(&self, req: &Request<T>, body_token: &str) -> bool {
        let Some(want) = &self.token else { return true };
        let meta = req.metadata();
        let header = meta.get(TOKEN_HEADER).and_then(|v| v.to_str().ok()).map(str::to_owned).or_else(|| {
            meta.get("authorization")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer ").map(str::to_owned))
        });
        constant_time_eq(body_token.as_bytes(), want.as_bytes())
            || header.is_some_and(|h| constant_time_eq(h.as_bytes(), want.as_bytes()))
    }
}

/// Equal tokens, in time independent of where or whether they differ, and of their lengths:
/// both are hashed (SHA-256) and the digests compared in constant time.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    use sha2::{Digest, Sha256};
    digests_equal(a, b, |x| Sha256::digest(x))
}

/// Whether `a` and `b` have the same `digest`, compared in constant time. Both are digested
/// every time, whatever their lengths and contents: nothing returns early.
fn digests_equal<D: AsRef<[u8]>>(a: &[u8], b: &[u8], mut digest: impl FnMut(&[u8]) -> D) -> bool {
    use subtle::ConstantTimeEq;
    let (da, db) = (digest(a), digest(b));
    bool::from(da.as_ref().ct_eq(db.as_ref()))
}

/// The longest subscriber name kept and logged (a client chooses it); longer ones are cut.
pub const MAX_SUBSCRIBER_NAME: usize = 64;

/// A client-chosen subscriber name made safe to store and log: control characters replaced,
/// cut to [`MAX_SUBSCRIBER_NAME`] characters. Returns the name and whether it was changed.
pub fn bounded_name(name: &str) -> (String, bool) {
    let mut changed = false;
    let mut out = String::new();
    for (i, c) in name.chars().enumerate() {
        if i >= MAX_SUBSCRIBER_NAME {
            changed = true;
            break;
        }
        if c.is_control() {
            changed = true;
            out.push('?');
        } else {
            out.push(c);
        }
    }
    (out, changed)
}

#[tonic::async_trait]
impl service::feed_server::Feed for FeedService {
    type SubscribeStream = ReceiverStream<Result<FeedMessage, Status>>;

    async fn subscribe(&self, req: Request<SubscribeRequest>) -> Result<Response<Self::SubscribeStream>, Status> {
        let peer = req.remote_addr();
        if !self.authorised(&req, &req.get_ref().token) {
            let mut st = self.hub.state();
            st.feed.rejected_token = st.feed.rejected_token.saturating_add(1);
            warn!(?peer, "feed subscription rejected: bad or missing token");
            return Err(Status::unauthenticated("bad or missing token"));
        }
        let req = req.into_inner();
        let (name, cut) = bounded_name(&req.subscriber);
        if cut {
            let mut st = self.hub.state();
            st.feed.names_cut = st.feed.names_cut.saturating_add(1);
        }
        info!(subscriber = %name, ?peer, batches = req.batches, "feed subscriber connected");
        let Some(sub) = self.hub.try_subscribe(name, req.batches) else {
            warn!(?peer, "feed subscription refused: feed.max_subscribers are connected");
            return Err(Status::resource_exhausted("too many feed subscribers"));
        };
        let hub = self.hub.clone();
        let gather = if sub.batches { self.gather } else { Duration::ZERO };
        let (tx, rx) = mpsc::channel(64);
        tokio::spawn(async move {
            loop {
                // Building a snapshot takes the hub lock once per engine: on a blocking
                // thread, not this runtime's.
                if sub.needs_resync() {
                    let (s, h) = (sub.clone(), hub.clone());
                    if tokio::task::spawn_blocking(move || s.prepare(&h)).await.is_err() {
                        break;
                    }
                }
                match sub.pop(&hub) {
                    Some(m) => {
                        if tx.send(Ok(m)).await.is_err() {
                            break;
                        }
                    }
                    None => {
                        // The queue is empty: what is published within `gather` of now waits
                        // for what follows it, joined to one message (a change after a quiet
                        // spell goes at once).
                        let emptied = tokio::time::Instant::now();
                        tokio::select! {
                            _ = sub.notify.notified() => {}
                            _ = tx.closed() => break,
                        }
                        if !gather.is_zero() {
                            tokio::select! {
                                _ = tokio::time::sleep_until(emptied.checked_add(gather).unwrap_or(emptied)) => {}
                                _ = tx.closed() => break,
                            }
                        }
                    }
                }
            }
            info!(subscriber = %sub.name, "feed subscriber gone");
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// A PEM file of `[feed]` that cannot be read.
#[derive(Debug, thiserror::Error)]
#[error("feed.{field} {}: {source}", path.display())]
pub struct TlsError {
    pub field: &'static str,
    pub path: std::path::PathBuf,
    pub source: std::io::Error,
}

/// The feed's TLS settings from `[feed]` (`None` without `tls_cert`), the PEM files read now so
/// that a missing or unreadable file is an error at start naming it.
pub fn tls_config(cfg: &crate::config::FeedConfig) -> Result<Option<ServerTlsConfig>, TlsError> {
    let (Some(cert), Some(key)) = (&cfg.tls_cert, &cfg.tls_key) else { return Ok(None) };
    let read = |field: &'static str, p: &std::path::Path| {
        std::fs::read(p).map_err(|source| TlsError { field, path: p.to_owned(), source })
    };
    let mut tls = ServerTlsConfig::new().identity(Identity::from_pem(read("tls_cert", cert)?, read("tls_key", key)?));
    if let Some(ca) = &cfg.client_ca {
        tls = tls.client_ca_root(Certificate::from_pem(read("client_ca", ca)?));
    }
    Ok(Some(tls))
}

/// Serves the feed on `listener` until `shutdown` resolves, over TLS when `tls` is set.
pub async fn serve(
    listener: tokio::net::TcpListener,
    hub: Arc<Hub>,
    token: Option<String>,
    tls: Option<ServerTlsConfig>,
    gather: Duration,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), tonic::transport::Error> {
    let svc = service::feed_server::FeedServer::new(FeedService::new(hub, token, gather));
    let mut builder = tonic::transport::Server::builder();
    if let Some(tls) = tls {
        builder = builder.tls_config(tls)?;
    }
    builder
        .http2_keepalive_interval(Some(Duration::from_secs(20)))
        .add_service(svc)
        .serve_with_incoming_shutdown(crate::grpc_incoming(listener), shutdown)
        .await
}

/// Sends a heartbeat to every subscriber every `period`.
pub async fn heartbeats(hub: Arc<Hub>, period: Duration) {
    let mut t = tokio::time::interval(period);
    t.tick().await;
    loop {
        t.tick().await;
        hub.state().publish(Body::Heartbeat(Heartbeat {}));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_compare_equal_only_when_equal_whatever_their_lengths() {
        assert!(constant_time_eq(b"secret-token", b"secret-token"));
        assert!(!constant_time_eq(b"secret-token", b"secret-tokeN"));
        assert!(!constant_time_eq(b"secret-token", b"secret"));
        assert!(!constant_time_eq(b"", b"x"));
        assert!(constant_time_eq(b"", b""));
    }

    #[test]
    fn both_tokens_are_digested_whatever_their_lengths_and_contents() {
        let pairs: [(&[u8], &[u8]); 6] = [
            (b"secret-token", b"secret-token"),
            (b"secret-token", b"secret-tokeN"),
            (b"secret-token", b"secret"),
            (b"s", b"secret-token"),
            (b"", b"x"),
            (b"", b""),
        ];
        for (a, b) in pairs {
            let mut seen: Vec<Vec<u8>> = Vec::new();
            let equal = digests_equal(a, b, |x| {
                seen.push(x.to_vec());
                <sha2::Sha256 as sha2::Digest>::digest(x)
            });
            assert_eq!(seen, vec![a.to_vec(), b.to_vec()], "{a:?} against {b:?}");
            assert_eq!(equal, a == b, "{a:?} against {b:?}");
        }
    }

    #[test]
    fn subscriber_names_are_bounded_and_printable() {
        assert_eq!(bounded_name("vm-1"), ("vm-1".to_owned(), false));
        let (long, cut) = bounded_name(&"é".repeat(10_000));
        assert!(cut && long.chars().count() == MAX_SUBSCRIBER_NAME);
        let (ctl, cut) = bounded_name("a\nb\u{1b}[31m");
        assert!(cut && !ctl.chars().any(char::is_control), "{ctl:?}");
    }
}
