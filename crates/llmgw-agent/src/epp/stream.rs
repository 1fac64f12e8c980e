//! One ext_proc stream (one HTTP request through the gateway), as the endpoint-picker protocol
//! runs it: the request headers (the path, the subset hint), the body gathered up to the
//! configured limit, the decision, then the answer (the route on the headers, the body handed
//! back in full-duplex mode; or an immediate 503), and on the way back the endpoint that served.
//!
//! In full-duplex streamed mode (what GAIE gateways configure) the headers are answered once
//! the body is complete, or once its head reaches the limit (the rest is handed back chunk by
//! chunk as it comes). In buffered mode the headers are answered at once and the route goes on
//! the body's answer.

use super::metrics::inc;
use super::picker::{Pick, Picker};
use super::wire;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request::Request as Msg, ProcessingRequest, ProcessingResponse,
};
use std::sync::Arc;
use tokio::sync::mpsc;
use tonic::{Status, Streaming};
use tracing::debug;

/// Where the request is.
#[derive(Debug, Default)]
struct Exchange {
    path: String,
    subset: Option<Vec<String>>,
    full_duplex: bool,
    body: Vec<u8>,
    too_large: bool,
    /// Decided: later request-body chunks are handed back as they come.
    decided: bool,
    /// The primary endpoint counted in flight for this request.
    counted: Option<String>,
    served_seen: bool,
}

type Out = mpsc::Sender<Result<ProcessingResponse, Status>>;

/// Serves one stream until the data plane ends it; the request's in-flight count is released
/// at the end whatever happened.
pub async fn run(picker: Arc<Picker>, mut inbound: Streaming<ProcessingRequest>, out: Out) {
    let mut ex = Exchange::default();
    let limit = picker.max_body_bytes();
    loop {
        let msg = match inbound.message().await {
            Ok(Some(m)) => m,
            Ok(None) => break,
            Err(e) => {
                debug!(error = %e, "ext_proc stream ended");
                break;
            }
        };
        if !step(&picker, &mut ex, msg, limit, &out).await {
            break;
        }
    }
    if let Some(addr) = ex.counted.take() {
        if !ex.served_seen {
            inc(&picker.metrics.served_unreported);
        }
        picker.finished(&addr);
    }
}

async fn send(out: &Out, r: ProcessingResponse) -> bool {
    out.send(Ok(r)).await.is_ok()
}

/// Handles one message; false ends the stream.
async fn step(picker: &Picker, ex: &mut Exchange, msg: ProcessingRequest, limit: usize, out: &Out) -> bool {
    if let Some(fd) = wire::full_duplex(&msg) {
        ex.full_duplex = fd;
    }
    match msg.request {
        Some(Msg::RequestHeaders(ref h)) => {
            ex.path = wire::header(h.headers.as_ref(), ":path").unwrap_or_default();
            let (subset, dropped) = wire::subset_hint(&msg);
            if dropped > 0 {
                picker.metrics.subset_dropped.fetch_add(dropped as u64, std::sync::atomic::Ordering::Relaxed);
            }
            ex.subset = subset;
            if h.end_of_stream {
                // No body (a GET): decided now.
                return decide(picker, ex, out, true).await;
            }
            if ex.full_duplex {
                return true;
            }
            send(out, wire::headers_unchanged(true)).await
        }
        Some(Msg::RequestBody(b)) => {
            if ex.decided {
                return !ex.full_duplex || send(out, wire::streamed_body(true, b.body, b.end_of_stream)).await;
            }
            let room = limit.saturating_sub(ex.body.len());
            if b.body.len() > room {
                ex.too_large = true;
                inc(&picker.metrics.body_too_large);
            }
            if ex.too_large && !ex.full_duplex {
                // Buffered mode: the body arrives whole; its head decides.
                let head = b.body.get(..room).unwrap_or(&b.body);
                ex.body.extend_from_slice(head);
                return decide(picker, ex, out, false).await;
            }
            ex.body.extend_from_slice(&b.body);
            if b.end_of_stream || ex.too_large {
                let ok = decide(picker, ex, out, ex.full_duplex).await;
                if ok && ex.full_duplex && ex.decided {
                    let held = std::mem::take(&mut ex.body);
                    return send(out, wire::streamed_body(true, held, b.end_of_stream)).await;
                }
                return ok;
            }
            true
        }
        Some(Msg::RequestTrailers(_)) => {
            if !ex.decided {
                // The body ended with trailers rather than an end-of-stream chunk.
                if !decide(picker, ex, out, ex.full_duplex).await {
                    return false;
                }
                if ex.full_duplex && ex.decided {
                    let held = std::mem::take(&mut ex.body);
                    if !send(out, wire::streamed_body(true, held, false)).await {
                        return false;
                    }
                }
            }
            send(out, wire::trailers_unchanged(true)).await
        }
        Some(Msg::ResponseHeaders(_)) => {
            note_served(picker, ex, &msg);
            send(out, wire::headers_unchanged(false)).await
        }
        Some(Msg::ResponseBody(b)) => {
            if ex.full_duplex {
                send(out, wire::streamed_body(false, b.body, b.end_of_stream)).await
            } else {
                send(out, wire::body_unchanged(false)).await
            }
        }
        Some(Msg::ResponseTrailers(_)) => {
            note_served(picker, ex, &msg);
            send(out, wire::trailers_unchanged(false)).await
        }
        None => true,
    }
}

/// Decides and answers: the route on the headers (`on_headers`, or on the buffered body), or an
/// immediate answer. False ends the stream.
async fn decide(picker: &Picker, ex: &mut Exchange, out: &Out, on_headers: bool) -> bool {
    let bytes = if ex.too_large || !ex.body.is_empty() { ex.body.as_slice() } else { &[] };
    match picker.pick(&ex.path, bytes, ex.too_large, ex.subset.as_deref()).await {
        Pick::Route(dest) => {
            ex.decided = true;
            ex.counted = dest.endpoints.first().cloned();
            let r = if on_headers { wire::route_headers(&dest) } else { wire::route_body(&dest) };
            send(out, r).await
        }
        Pick::Reject { status, body, details } => {
            let _ = send(out, wire::immediate(status, body, details)).await;
            false
        }
    }
}

/// Reads the endpoint that served the request; one other than the primary means the data
/// plane could not use the primary: it is avoided for a while.
fn note_served(picker: &Picker, ex: &mut Exchange, msg: &ProcessingRequest) {
    let Some(served) = wire::served_endpoint(msg) else { return };
    if ex.served_seen {
        return;
    }
    ex.served_seen = true;
    if let Some(primary) = &ex.counted {
        if &served != primary {
            inc(&picker.metrics.served_by_fallback);
            picker.gateway.avoid(primary);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::epp::gateway::Gateway;
    use crate::epp::metrics::EppMetrics;
    use envoy_types::pb::envoy::config::core::v3::Metadata;
    use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};
    use llmgw_core::config::Compiled;
    use llmgw_core::flow::{ReplicaAvoidance, Router};
    use std::sync::atomic::Ordering;
    use std::time::Duration;

    fn served(addr: &str) -> ProcessingRequest {
        let mut lb = Struct::default();
        lb.fields.insert(wire::SERVED_KEY.to_owned(), Value { kind: Some(Kind::StringValue(addr.to_owned())) });
        let mut m = Metadata::default();
        m.filter_metadata.insert(wire::LB_NAMESPACE.to_owned(), lb);
        ProcessingRequest { metadata_context: Some(m), ..Default::default() }
    }

    #[test]
    fn a_response_served_by_a_fallback_makes_the_primary_avoided() {
        let router = Router::new(Compiled::from_json(b"", None).unwrap(), 1);
        let p = Picker::new(router, Gateway::new(Duration::from_secs(60)), Arc::new(EppMetrics::default()), 2);
        let mut ex = Exchange { counted: Some("10.0.0.1:8000".into()), ..Default::default() };
        note_served(&p, &mut ex, &served("10.0.0.1:8000"));
        assert!(!p.gateway.snapshot(None).avoided("10.0.0.1:8000"), "served by the primary");
        let mut ex = Exchange { counted: Some("10.0.0.1:8000".into()), ..Default::default() };
        note_served(&p, &mut ex, &served("10.0.0.2:8000"));
        assert!(p.gateway.snapshot(None).avoided("10.0.0.1:8000"));
        assert_eq!(p.metrics.served_by_fallback.load(Ordering::Relaxed), 1);
    }
}
