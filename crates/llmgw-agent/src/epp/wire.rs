//! The endpoint-picker protocol (Gateway API Inference Extension, v1.0.0) over Envoy's ext_proc
//! messages: what the picker reads from a `ProcessingRequest` (headers, the body mode, the
//! subset hint, the endpoint that served) and the `ProcessingResponse`s it answers with (the
//! destination header and `envoy.lb` metadata, body chunks handed back, immediate answers).
//! Wire types only: no routing here.

use envoy_types::pb::envoy::config::core::v3::{
    header_value_option::HeaderAppendAction, HeaderValue, HeaderValueOption,
};
use envoy_types::pb::envoy::config::core::v3::{HeaderMap, Metadata};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation, processing_response, BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse,
    ImmediateResponse, ProcessingRequest, ProcessingResponse, StreamedBodyResponse, TrailersResponse,
};
use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};

/// The header naming the chosen endpoints (`ip:port[,ip:port…]`).
pub const DESTINATION_HEADER: &str = "x-gateway-destination-endpoint";
/// The dynamic-metadata namespace of the chosen endpoints and of the endpoint that served.
pub const LB_NAMESPACE: &str = "envoy.lb";
/// The key (in [`LB_NAMESPACE`]) of the endpoint that served the request.
pub const SERVED_KEY: &str = "x-gateway-destination-endpoint-served";
/// The metadata namespace of the subset hint, and its key.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";
/// Endpoints read from a subset hint at most (the gateway sizes it: more are ignored, counted).
pub const MAX_SUBSET: usize = 4096;

/// A request header's value (keys arrive lower-cased; values in `raw_value`, or `value` from
/// older data planes).
pub fn header(headers: Option<&HeaderMap>, name: &str) -> Option<String> {
    let h = headers?.headers.iter().find(|h| h.key.eq_ignore_ascii_case(name))?;
    if h.raw_value.is_empty() {
        Some(h.value.clone())
    } else {
        String::from_utf8(h.raw_value.clone()).ok()
    }
}

/// Whether the data plane streams the request body in full-duplex mode (it then waits for no
/// answer to the headers before sending the body, and takes the body back from the picker).
/// `None` when the message does not say (only the stream's first message carries it).
pub fn full_duplex(req: &ProcessingRequest) -> Option<bool> {
    req.protocol_config.as_ref().map(|p| p.request_body_mode == BodySendMode::FullDuplexStreamed as i32)
}

/// How the data plane sends a response's body to the picker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ResponseBodies {
    /// Not at all (`NONE`), or not said (a data plane that sends no protocol configuration).
    #[default]
    Unsent,
    /// Whole, once it ended (`BUFFERED`, `BUFFERED_PARTIAL`), or as gRPC messages (`GRPC`).
    Whole,
    /// Chunk by chunk as it comes (`STREAMED`); in full-duplex mode each chunk is taken back from
    /// the picker.
    Streamed { full_duplex: bool },
}

impl ResponseBodies {
    /// Whether an answer's chunks come one by one as it streams (its first is its first token).
    pub fn chunked(self) -> bool {
        matches!(self, ResponseBodies::Streamed { .. })
    }
}

/// How the data plane sends response bodies, from the stream's first message (`None` on the
/// others).
pub fn response_bodies(req: &ProcessingRequest) -> Option<ResponseBodies> {
    let mode = req.protocol_config.as_ref()?.response_body_mode;
    Some(match BodySendMode::try_from(mode) {
        Ok(BodySendMode::Streamed) => ResponseBodies::Streamed { full_duplex: false },
        Ok(BodySendMode::FullDuplexStreamed) => ResponseBodies::Streamed { full_duplex: true },
        // gRPC messages, not an answer's events: nothing to time either.
        Ok(BodySendMode::Buffered | BodySendMode::BufferedPartial | BodySendMode::Grpc) => ResponseBodies::Whole,
        Ok(BodySendMode::None) | Err(_) => ResponseBodies::Unsent,
    })
}

fn namespace<'a>(meta: Option<&'a Metadata>, ns: &str) -> Option<&'a Struct> {
    meta?.filter_metadata.get(ns)
}

/// The subset hint: `Some(list)` when the data plane set
/// `envoy.lb.subset_hint/x-gateway-destination-endpoint-subset` (possibly empty: nothing is
/// eligible), `None` when it did not (the whole pool is). The second value: entries dropped
/// past [`MAX_SUBSET`] or not strings.
pub fn subset_hint(req: &ProcessingRequest) -> (Option<Vec<String>>, usize) {
    let Some(v) = namespace(req.metadata_context.as_ref(), SUBSET_NAMESPACE).and_then(|s| s.fields.get(SUBSET_KEY))
    else {
        return (None, 0);
    };
    let mut out = Vec::new();
    let mut dropped = 0usize;
    fn push(s: &str, out: &mut Vec<String>, dropped: &mut usize) {
        for e in s.split(',').map(str::trim).filter(|e| !e.is_empty()) {
            if out.len() < MAX_SUBSET {
                out.push(e.to_owned());
            } else {
                *dropped = dropped.saturating_add(1);
            }
        }
    }
    match &v.kind {
        Some(Kind::ListValue(l)) => {
            for item in &l.values {
                match &item.kind {
                    Some(Kind::StringValue(s)) => push(s, &mut out, &mut dropped),
                    _ => dropped = dropped.saturating_add(1),
                }
            }
        }
        Some(Kind::StringValue(s)) => push(s, &mut out, &mut dropped),
        _ => dropped = dropped.saturating_add(1),
    }
    (Some(out), dropped)
}

/// The endpoint that served the request, as the data plane reports it on the response
/// (`envoy.lb/x-gateway-destination-endpoint-served`).
pub fn served_endpoint(req: &ProcessingRequest) -> Option<String> {
    match &namespace(req.metadata_context.as_ref(), LB_NAMESPACE)?.fields.get(SERVED_KEY)?.kind {
        Some(Kind::StringValue(s)) if !s.is_empty() => Some(s.trim().to_owned()),
        _ => None,
    }
}

fn string_value(s: String) -> Value {
    Value { kind: Some(Kind::StringValue(s)) }
}

fn set_header(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue { key: key.to_owned(), value: String::new(), raw_value: value.as_bytes().to_vec() }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..HeaderValueOption::default()
    }
}

/// Where the request goes: the primary endpoint, then the ordered fallbacks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Destination {
    pub endpoints: Vec<String>,
    /// vLLM's data-parallel rank header, when the chosen engine is one rank of several.
    pub dp_rank: Option<u32>,
}

impl Destination {
    /// The value of both the header and the metadata entry (the protocol forbids them to differ).
    pub fn value(&self) -> String {
        self.endpoints.join(",")
    }
}

/// vLLM's (0.33) request header naming the data-parallel rank that serves a request.
pub const DP_RANK_HEADER: &str = "x-data-parallel-rank";

/// The header mutation of a routed request: the destination header set (any client value
/// overwritten) and the rank header set, or removed when the engine is not data-parallel.
fn route_mutation(dest: &Destination) -> HeaderMutation {
    let mut set_headers = vec![set_header(DESTINATION_HEADER, &dest.value())];
    let mut remove_headers = Vec::new();
    match dest.dp_rank {
        Some(r) => set_headers.push(set_header(DP_RANK_HEADER, &r.to_string())),
        None => remove_headers.push(DP_RANK_HEADER.to_owned()),
    }
    HeaderMutation { set_headers, remove_headers }
}

/// The `envoy.lb` dynamic metadata naming the endpoints.
pub fn route_metadata(dest: &Destination) -> Struct {
    let mut inner = Struct::default();
    inner.fields.insert(DESTINATION_HEADER.to_owned(), string_value(dest.value()));
    let mut outer = Struct::default();
    outer.fields.insert(LB_NAMESPACE.to_owned(), Value { kind: Some(Kind::StructValue(inner)) });
    outer
}

fn common(header_mutation: Option<HeaderMutation>, body_mutation: Option<BodyMutation>) -> CommonResponse {
    CommonResponse {
        header_mutation,
        body_mutation,
        // The destination header changed: the route (and its cluster) is chosen again.
        clear_route_cache: true,
        ..CommonResponse::default()
    }
}

/// The answer to the request headers carrying the route.
pub fn route_headers(dest: &Destination) -> ProcessingResponse {
    ProcessingResponse {
        dynamic_metadata: Some(route_metadata(dest)),
        response: Some(processing_response::Response::RequestHeaders(HeadersResponse {
            response: Some(common(Some(route_mutation(dest)), None)),
        })),
        ..ProcessingResponse::default()
    }
}

/// The answer to a buffered request body carrying the route (the headers were answered before
/// the body came).
pub fn route_body(dest: &Destination) -> ProcessingResponse {
    ProcessingResponse {
        dynamic_metadata: Some(route_metadata(dest)),
        response: Some(processing_response::Response::RequestBody(BodyResponse {
            response: Some(common(Some(route_mutation(dest)), None)),
        })),
        ..ProcessingResponse::default()
    }
}

/// Request headers answered without a change (a buffered body is still to come).
pub fn headers_unchanged(request: bool) -> ProcessingResponse {
    let r = HeadersResponse { response: None };
    let response = if request {
        processing_response::Response::RequestHeaders(r)
    } else {
        processing_response::Response::ResponseHeaders(r)
    };
    ProcessingResponse { response: Some(response), ..ProcessingResponse::default() }
}

/// A body chunk handed back in full-duplex mode (the data plane forwards what it gets back).
pub fn streamed_body(request: bool, body: Vec<u8>, end_of_stream: bool) -> ProcessingResponse {
    let chunk = StreamedBodyResponse { body, end_of_stream, ..StreamedBodyResponse::default() };
    let r = BodyResponse {
        response: Some(CommonResponse {
            body_mutation: Some(BodyMutation { mutation: Some(body_mutation::Mutation::StreamedResponse(chunk)) }),
            ..CommonResponse::default()
        }),
    };
    let response = if request {
        processing_response::Response::RequestBody(r)
    } else {
        processing_response::Response::ResponseBody(r)
    };
    ProcessingResponse { response: Some(response), ..ProcessingResponse::default() }
}

/// A buffered body answered without a change.
pub fn body_unchanged(request: bool) -> ProcessingResponse {
    let r = BodyResponse { response: None };
    let response = if request {
        processing_response::Response::RequestBody(r)
    } else {
        processing_response::Response::ResponseBody(r)
    };
    ProcessingResponse { response: Some(response), ..ProcessingResponse::default() }
}

/// Trailers answered without a change.
pub fn trailers_unchanged(request: bool) -> ProcessingResponse {
    let r = TrailersResponse { header_mutation: None };
    let response = if request {
        processing_response::Response::RequestTrailers(r)
    } else {
        processing_response::Response::ResponseTrailers(r)
    };
    ProcessingResponse { response: Some(response), ..ProcessingResponse::default() }
}

/// An answer sent by the data plane instead of forwarding the request: 503 when no endpoint is
/// eligible, 429 when the request is shed.
pub fn immediate(status: u32, body: Vec<u8>, details: &str) -> ProcessingResponse {
    let headers =
        HeaderMutation { set_headers: vec![set_header("content-type", "application/json")], remove_headers: vec![] };
    ProcessingResponse {
        response: Some(processing_response::Response::ImmediateResponse(ImmediateResponse {
            status: Some(HttpStatus { code: i32::try_from(status).unwrap_or(503) }),
            headers: Some(headers),
            body,
            grpc_status: None,
            details: details.to_owned(),
        })),
        ..ProcessingResponse::default()
    }
}

#[cfg(test)]
mod tests;
