//! One ext_proc stream (one HTTP request through the gateway), as the endpoint-picker protocol
//! runs it: the request headers (the path, the subset hint), the body gathered up to the
//! configured limit, the decision, then the answer (the route on the headers, the body handed
//! back in full-duplex mode; or an immediate 503), and on the way back the endpoint that served.
//!
//! In full-duplex streamed mode (what GAIE gateways configure) the headers are answered once
//! the body is complete, or once its head reaches the limit (the rest is handed back chunk by
//! chunk as it comes). In buffered mode the headers are answered at once and the route goes on
//! the body's answer.
//!
//! On the way back, the request's first token ends its prefill's count at its endpoint: the
//! first chunk of a streamed answer where the data plane streams response bodies to the picker
//! (its time from the routing then teaches the endpoint's rates), else the response headers.
//! Its end releases what it held there and times its hold.
//!
//! A request routed before its tokens came gets them from its answer where both bodies pass
//! through the picker in full-duplex mode ([`super::answer_ids`]), else from a tokenizer call
//! made once its route is answered.

use super::after_routing::Pending;
use super::answer_ids::{FromAnswer, Said};
use super::gateway::Charge;
use super::metrics::inc;
use super::picker::{Pick, Picker};
use super::wire::{self, ResponseBodies};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request::Request as Msg, ProcessingRequest, ProcessingResponse,
};
use llmgw_core::request::is_event_stream;
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
    /// How response bodies come.
    response_bodies: ResponseBodies,
    /// The request as counted in flight at its primary endpoint.
    counted: Option<Charge>,
    /// Its answer, asked for the prompt's ids.
    answer: Option<FromAnswer>,
    served_seen: bool,
}

impl Exchange {
    /// Whether the request's whole body is handed back through the picker and its answer
    /// streamed through it both ways: its body can ask for the prompt's ids, and its answer can
    /// be handed back without them.
    fn can_carry_ids(&self) -> bool {
        self.full_duplex
            && !self.too_large
            && !self.body.is_empty()
            && self.response_bodies == ResponseBodies::Streamed { full_duplex: true }
    }
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
    if let Some(charge) = ex.counted.take() {
        if !ex.served_seen {
            inc(&picker.metrics.served_unreported);
        }
        picker.finished(charge);
    }
    // A stream cut before its answer's first event: the call is made after all.
    if let Some(p) = ex.answer.take().and_then(FromAnswer::unanswered) {
        picker.after_routing(p);
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
    if let Some(rb) = wire::response_bodies(&msg) {
        ex.response_bodies = rb;
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
        Some(Msg::ResponseHeaders(ref h)) => {
            note_served(picker, ex, &msg);
            // Only a streamed 200 answer's first chunk is its first token, and only where the
            // chunks come here; otherwise the headers end the prefill's count, and teach nothing.
            let status = wire::header(h.headers.as_ref(), ":status");
            let streamed =
                wire::header(h.headers.as_ref(), "content-type").is_some_and(|v| is_event_stream(v.as_bytes()));
            if status.as_deref() != Some("200") || !streamed || h.end_of_stream || !ex.response_bodies.chunked() {
                if let Some(c) = ex.counted.as_mut() {
                    if status.as_deref() != Some("200") {
                        c.failed();
                    }
                    picker.gateway.first_token(c, false);
                }
                // No stream to read the ids from: left as it comes, and the call made.
                if let Some(p) = ex.answer.take().and_then(FromAnswer::unanswered) {
                    inc(&picker.metrics.answer_ids_missing);
                    picker.after_routing(p);
                }
            }
            send(out, wire::headers_unchanged(false)).await
        }
        Some(Msg::ResponseBody(b)) => {
            if !b.body.is_empty() || b.end_of_stream {
                if let Some(c) = ex.counted.as_mut() {
                    picker.gateway.first_token(c, ex.response_bodies.chunked());
                }
            }
            let full_duplex = match ex.response_bodies {
                ResponseBodies::Streamed { full_duplex } => full_duplex,
                ResponseBodies::Whole => false,
                // Not said: as the request's body comes.
                ResponseBodies::Unsent => ex.full_duplex,
            };
            if !full_duplex {
                return send(out, wire::body_unchanged(false)).await;
            }
            let Some(a) = ex.answer.as_mut() else {
                return send(out, wire::streamed_body(false, b.body, b.end_of_stream)).await;
            };
            let back = a.chunk(&b.body, b.end_of_stream);
            if !send(out, wire::streamed_body(false, back, b.end_of_stream)).await {
                return false;
            }
            // Read once the chunk went back, off its first token's way.
            if a.overflowed() {
                inc(&picker.metrics.answer_event_too_large);
            }
            match a.take() {
                Some(Said::Ids(p, ids)) => {
                    inc(&picker.metrics.answer_ids_read);
                    picker.ids_from_answer(p, &ids);
                }
                Some(Said::Missing(p)) => {
                    inc(&picker.metrics.answer_ids_missing);
                    picker.after_routing(p);
                }
                None => {}
            }
            true
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
        Pick::Route(dest, charge, pending) => {
            ex.decided = true;
            ex.counted = Some(charge);
            if let Some(p) = pending {
                ask_for_ids(picker, ex, p);
            }
            let r = if on_headers { wire::route_headers(&dest) } else { wire::route_body(&dest) };
            send(out, r).await
        }
        Pick::Reject { status, body, details } => {
            let _ = send(out, wire::immediate(status, body, details)).await;
            false
        }
    }
}

/// A request routed before its tokens came: its body (handed back next) asks for the prompt's
/// ids in its answer where the answer can carry them back, else the call is made now.
fn ask_for_ids(picker: &Picker, ex: &mut Exchange, p: Pending) {
    if !p.call.from_answer || !ex.can_carry_ids() {
        return picker.after_routing(p);
    }
    match FromAnswer::ask(&ex.body, p) {
        Ok((asked, answer)) => {
            ex.body = asked;
            ex.answer = Some(answer);
        }
        Err(p) => picker.after_routing(p),
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
    if let Some(primary) = ex.counted.as_ref().map(|c| &c.address) {
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
    use llmgw_core::flow::{InFlightCounts, LearnedRates, ReplicaAvoidance, Router};
    use std::sync::atomic::Ordering;
    use std::time::Duration;

    fn picker() -> Picker {
        let router = Router::new(Compiled::from_json(b"", None).unwrap(), 1);
        Picker::new(router, Gateway::new(Duration::from_secs(60)), Arc::new(EppMetrics::default()), 2)
    }

    fn response_headers(status: &str) -> ProcessingRequest {
        use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
        use envoy_types::pb::envoy::service::ext_proc::v3::HttpHeaders;
        let headers = [(":status", status), ("content-type", "text/event-stream; charset=utf-8")]
            .iter()
            .map(|(k, v)| HeaderValue { key: (*k).to_owned(), raw_value: v.as_bytes().to_vec(), ..Default::default() })
            .collect();
        let h = HttpHeaders { headers: Some(HeaderMap { headers }), ..Default::default() };
        ProcessingRequest { request: Some(Msg::ResponseHeaders(h)), ..Default::default() }
    }

    fn response_chunk(data: &[u8]) -> ProcessingRequest {
        use envoy_types::pb::envoy::service::ext_proc::v3::HttpBody;
        let b = HttpBody { body: data.to_vec(), end_of_stream: false, ..Default::default() };
        ProcessingRequest { request: Some(Msg::ResponseBody(b)), ..Default::default() }
    }

    #[tokio::test]
    async fn a_streamed_answers_first_chunk_ends_its_prefill_and_teaches_the_rates_only_where_chunks_come_here() {
        const A: &str = "10.0.0.1:8000";
        // (how bodies come, the status, or none where the headers are not sent to the picker).
        let cases = [
            (ResponseBodies::Streamed { full_duplex: true }, Some("200"), true),
            (ResponseBodies::Streamed { full_duplex: false }, Some("200"), true),
            (ResponseBodies::Streamed { full_duplex: true }, Some("503"), false),
            // The headers come before the first token; with no chunks to time, they end the
            // prefill's count and teach nothing.
            (ResponseBodies::Unsent, Some("200"), false),
            (ResponseBodies::Whole, Some("200"), false),
            // A whole body comes at the answer's end: not its first token's time.
            (ResponseBodies::Whole, None, false),
        ];
        for (bodies, status, teaches) in cases {
            let p = picker();
            let (tx, mut rx) = mpsc::channel(16);
            let charge = Charge::new(A.into(), 300, None, Some(crate::epp::learned::basis(300)));
            p.gateway.started(&charge);
            let mut ex = Exchange { response_bodies: bodies, counted: Some(charge), ..Default::default() };
            if let Some(status) = status {
                assert!(step(&p, &mut ex, response_headers(status), 1024, &tx).await);
                let after_headers = p.gateway.snapshot(None).pending_tokens(A);
                assert_eq!(after_headers, if teaches { 300 } else { 0 }, "{bodies:?} {status}");
                rx.recv().await.unwrap().unwrap();
            }
            assert!(step(&p, &mut ex, response_chunk(b"data: {}\n\n"), 1024, &tx).await);
            let s = p.gateway.snapshot(None);
            assert_eq!(s.pending_tokens(A), 0, "{bodies:?} {status:?}");
            assert_eq!(s.learned_rates(A).is_some(), teaches, "{bodies:?} {status:?}");
            // The chunk is handed back in full-duplex mode, and only there.
            let answer = rx.recv().await.unwrap().unwrap();
            let back = match answer.response {
                Some(envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response::ResponseBody(b)) => {
                    b.response.and_then(|c| c.body_mutation).is_some()
                }
                other => panic!("{other:?}"),
            };
            assert_eq!(back, bodies == ResponseBodies::Streamed { full_duplex: true }, "{bodies:?}");
        }
    }

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
        let mut ex =
            Exchange { counted: Some(Charge::new("10.0.0.1:8000".into(), 0, None, None)), ..Default::default() };
        note_served(&p, &mut ex, &served("10.0.0.1:8000"));
        assert!(!p.gateway.snapshot(None).avoided("10.0.0.1:8000"), "served by the primary");
        let mut ex =
            Exchange { counted: Some(Charge::new("10.0.0.1:8000".into(), 0, None, None)), ..Default::default() };
        note_served(&p, &mut ex, &served("10.0.0.2:8000"));
        assert!(p.gateway.snapshot(None).avoided("10.0.0.1:8000"));
        assert_eq!(p.metrics.served_by_fallback.load(Ordering::Relaxed), 1);
    }
}
