//! The one seam between the filter and Envoy: every host call goes through [`Host`]. The
//! proxy-wasm implementation ([`ProxyWasm`]) is the only code that names
//! `proxy_wasm::hostcalls`; native tests drive the filter's contexts with a fake host
//! (`fake.rs`), so the glue's own decisions are tested without an Envoy.
//!
//! Host errors are folded into what the glue needs: an absent value, or a refusal with the
//! host's status for the log. Nothing here panics (the SDK's `get_map_value` panics on a
//! non-UTF-8 value, so headers are read as bytes).

use proxy_wasm::types::{MetricType, Status};
use std::time::Duration;

/// Which header map.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Headers {
    Request,
    Response,
    /// The headers of the last HTTP callout's response.
    CallResponse,
}

/// Which body buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Buffer {
    Request,
    Response,
    CallResponse,
    GrpcReceive,
    PluginConfiguration,
}

/// A shared-data write that lost a compare-and-swap race, or another refusal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SharedWrite {
    CasMismatch,
    Refused,
}

/// Compare-and-swap attempts before a shared-data update gives up (other VMs racing).
pub const CAS_RETRIES: u32 = 16;

/// What a shared-data update keeps: the `what` of `llmgw_shared_update_failures_total`, counted
/// when [`update_shared`] gives up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SharedKind {
    /// Per-replica in-flight requests and prefill tokens (`crate::inflight`).
    InFlight,
    /// The VMs' heartbeats (`crate::inflight::heartbeat`).
    Heartbeat,
    /// Replicas avoided after a 5xx (`crate::health`).
    Health,
    /// Tokenizers avoided after failing (`crate::health`).
    TokenizerHealth,
    /// Speculative index entries (`crate::speculative`).
    Speculative,
    /// Rates learned from observed times to first token (`crate::rates`).
    Rates,
    /// Requests routed lately per replica (`crate::recent`).
    Recent,
    /// Requests that ended lately and how soon next ones followed (`crate::returns`).
    Returns,
    /// Tokens kept for conversations' next turns (`crate::earlier_turns`).
    EarlierTurns,
    /// Text prompts handed to the other VMs (`crate::earlier_prompts`).
    EarlierPrompts,
    /// The tokenizer calls' round trips (`crate::tokenizer_times`).
    TokenizerTimes,
    /// How long requests hold their KV blocks per replica (`crate::hold_times`).
    HoldTimes,
}

impl SharedKind {
    pub const ALL: [SharedKind; 12] = [
        SharedKind::InFlight,
        SharedKind::Heartbeat,
        SharedKind::Health,
        SharedKind::TokenizerHealth,
        SharedKind::Speculative,
        SharedKind::Rates,
        SharedKind::Recent,
        SharedKind::Returns,
        SharedKind::EarlierTurns,
        SharedKind::EarlierPrompts,
        SharedKind::TokenizerTimes,
        SharedKind::HoldTimes,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            SharedKind::InFlight => "in_flight",
            SharedKind::Heartbeat => "heartbeat",
            SharedKind::Health => "health",
            SharedKind::TokenizerHealth => "tokenizer_health",
            SharedKind::Speculative => "speculative",
            SharedKind::Rates => "rates",
            SharedKind::Recent => "recent",
            SharedKind::Returns => "returns",
            SharedKind::EarlierTurns => "earlier_turns",
            SharedKind::EarlierPrompts => "earlier_prompts",
            SharedKind::TokenizerTimes => "tokenizer_times",
            SharedKind::HoldTimes => "hold_times",
        }
    }
}

/// Updates shared value `key` with compare-and-swap: `next` gets the current value (empty when
/// absent) and returns the new one, or `None` when nothing needs writing. False when the value
/// could not be read or written (a refused read leaves it alone: a blind write would drop what
/// other VMs put there) or every attempt lost its race.
pub fn update_shared(host: &dyn Host, key: &str, mut next: impl FnMut(&[u8]) -> Option<Vec<u8>>) -> bool {
    for _ in 0..CAS_RETRIES {
        let Some((v, cas)) = host.shared_data(key) else { return false };
        let Some(value) = next(v.as_deref().unwrap_or_default()) else { return true };
        match host.set_shared_data(key, &value, cas) {
            Err(SharedWrite::CasMismatch) => continue,
            Err(SharedWrite::Refused) => return false,
            Ok(()) => return true,
        }
    }
    false
}

pub trait Host {
    /// Nanoseconds since the epoch (0 if the host has no clock).
    fn now_ns(&self) -> u64;
    fn set_tick_period(&self, period: Duration);

    fn header(&self, map: Headers, name: &str) -> Option<Vec<u8>>;
    /// Sets (`Some`) or removes (`None`) a header.
    fn set_header(&self, map: Headers, name: &str, value: Option<&str>);
    /// Up to `max` bytes of a buffer from its start.
    fn buffer(&self, which: Buffer, max: usize) -> Vec<u8>;
    /// Replaces a buffer's first `size` bytes (a body chunk held by the filter) with `bytes`;
    /// false when the host refused.
    fn replace_buffer(&self, which: Buffer, size: usize, bytes: &[u8]) -> bool;
    /// One of Envoy's stream attributes (e.g. `["response", "code_details"]`), serialized as
    /// Envoy gives it (a string as is, an integer as 8 little-endian bytes); `None` when absent.
    fn property(&self, path: &[&str]) -> Option<Vec<u8>>;

    /// Starts an HTTP callout; the token identifies its response.
    fn dispatch_http_call(
        &self,
        cluster: &str,
        headers: &[(&str, &str)],
        body: &[u8],
        timeout: Duration,
    ) -> Result<u32, Status>;
    fn send_http_response(&self, status: u32, headers: &[(&str, &str)], body: &[u8]);
    fn resume_http_request(&self);

    /// A value and its compare-and-swap version (`None` when the host refused the read).
    fn shared_data(&self, key: &str) -> Option<(Option<Vec<u8>>, Option<u32>)>;
    fn set_shared_data(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SharedWrite>;

    fn open_grpc_stream(&self, cluster: &str, service: &str, method: &str) -> Result<u32, Status>;
    fn send_grpc_stream_message(&self, token: u32, message: &[u8], end_stream: bool) -> Result<(), Status>;
    fn cancel_grpc_stream(&self, token: u32);

    /// Writes the request's filter state `wasm.<name>` (Envoy's access log prints it with
    /// `%FILTER_STATE(wasm.<name>:PLAIN)%`). Only from a request's context, once per name: the
    /// SDK panics when Envoy refuses the write (no request, or a state it will not overwrite).
    fn set_property(&self, name: &str, value: &[u8]);

    fn define_metric(&self, kind: MetricType, name: &str) -> Option<u32>;
    fn increment_metric(&self, id: u32, by: i64);
    fn record_metric(&self, id: u32, value: u64);
}

/// The host Envoy gives a proxy-wasm module.
pub struct ProxyWasm;

mod proxy {
    use super::{Buffer, Headers, Host, ProxyWasm, SharedWrite};
    use proxy_wasm::hostcalls;
    use proxy_wasm::types::{BufferType, MapType, MetricType, Status};
    use std::time::{Duration, UNIX_EPOCH};

    fn buffer_type(which: Buffer) -> BufferType {
        match which {
            Buffer::Request => BufferType::HttpRequestBody,
            Buffer::Response => BufferType::HttpResponseBody,
            Buffer::CallResponse => BufferType::HttpCallResponseBody,
            Buffer::GrpcReceive => BufferType::GrpcReceiveBuffer,
            Buffer::PluginConfiguration => BufferType::PluginConfiguration,
        }
    }

    fn map(m: Headers) -> MapType {
        match m {
            Headers::Request => MapType::HttpRequestHeaders,
            Headers::Response => MapType::HttpResponseHeaders,
            Headers::CallResponse => MapType::HttpCallResponseHeaders,
        }
    }

    impl Host for ProxyWasm {
        fn now_ns(&self) -> u64 {
            hostcalls::get_current_time()
                .ok()
                .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
                .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
        }

        fn set_tick_period(&self, period: Duration) {
            let _ = hostcalls::set_tick_period(period);
        }

        fn header(&self, m: Headers, name: &str) -> Option<Vec<u8>> {
            hostcalls::get_map_value_bytes(map(m), name).ok().flatten()
        }

        fn set_header(&self, m: Headers, name: &str, value: Option<&str>) {
            let _ = hostcalls::set_map_value(map(m), name, value);
        }

        fn buffer(&self, which: Buffer, max: usize) -> Vec<u8> {
            hostcalls::get_buffer(buffer_type(which), 0, max).ok().flatten().unwrap_or_default()
        }

        fn replace_buffer(&self, which: Buffer, size: usize, bytes: &[u8]) -> bool {
            hostcalls::set_buffer(buffer_type(which), 0, size, bytes).is_ok()
        }

        fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
            hostcalls::get_property(path.to_vec()).ok().flatten()
        }

        fn dispatch_http_call(
            &self,
            cluster: &str,
            headers: &[(&str, &str)],
            body: &[u8],
            timeout: Duration,
        ) -> Result<u32, Status> {
            hostcalls::dispatch_http_call(cluster, headers.to_vec(), Some(body), Vec::new(), timeout)
        }

        fn send_http_response(&self, status: u32, headers: &[(&str, &str)], body: &[u8]) {
            let _ = hostcalls::send_http_response(status, headers.to_vec(), Some(body));
        }

        fn resume_http_request(&self) {
            let _ = hostcalls::resume_http_request();
        }

        fn shared_data(&self, key: &str) -> Option<(Option<Vec<u8>>, Option<u32>)> {
            hostcalls::get_shared_data(key).ok()
        }

        fn set_shared_data(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SharedWrite> {
            match hostcalls::set_shared_data(key, Some(value), cas) {
                Ok(()) => Ok(()),
                Err(Status::CasMismatch) => Err(SharedWrite::CasMismatch),
                Err(_) => Err(SharedWrite::Refused),
            }
        }

        fn open_grpc_stream(&self, cluster: &str, service: &str, method: &str) -> Result<u32, Status> {
            hostcalls::open_grpc_stream(cluster, service, method, Vec::new())
        }

        fn send_grpc_stream_message(&self, token: u32, message: &[u8], end_stream: bool) -> Result<(), Status> {
            hostcalls::send_grpc_stream_message(token, Some(message), end_stream)
        }

        fn cancel_grpc_stream(&self, token: u32) {
            let _ = hostcalls::cancel_grpc_stream(token);
        }

        fn set_property(&self, name: &str, value: &[u8]) {
            let _ = hostcalls::set_property(vec![name], Some(value));
        }

        fn define_metric(&self, kind: MetricType, name: &str) -> Option<u32> {
            hostcalls::define_metric(kind, name).ok()
        }

        fn increment_metric(&self, id: u32, by: i64) {
            let _ = hostcalls::increment_metric(id, by);
        }

        fn record_metric(&self, id: u32, value: u64) {
            let _ = hostcalls::record_metric(id, value);
        }
    }
}
