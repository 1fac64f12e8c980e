//! A fake host for native tests of the filter's glue: it holds what Envoy would (headers,
//! bodies, shared data, metrics, the clock) and records what the filter asked of it (callouts,
//! local replies, resumes, gRPC streams), builder style:
//! `FakeHost::new().with_config(json).with_request_header(":path", "/v1/completions")`.
#![allow(clippy::arithmetic_side_effects)]

use crate::host::{Buffer, Headers, Host, SharedWrite};
use proxy_wasm::types::{MetricType, Status};
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::time::Duration;

/// An HTTP callout the filter made.
#[derive(Debug, Clone, PartialEq)]
pub struct Call {
    pub token: u32,
    pub cluster: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    pub timeout: Duration,
}

impl Call {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }
}

/// A local reply the filter sent.
#[derive(Debug, Clone, PartialEq)]
pub struct Reply {
    pub status: u32,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

#[derive(Debug)]
struct Metric {
    kind: MetricType,
    name: String,
    value: i64,
    samples: Vec<u64>,
}

#[derive(Default)]
pub struct FakeHost {
    pub now_ns: Cell<u64>,
    headers: RefCell<HashMap<(u8, String), Vec<u8>>>,
    buffers: RefCell<HashMap<u8, Vec<u8>>>,
    pub calls: RefCell<Vec<Call>>,
    pub refuse_calls: Cell<bool>,
    pub replies: RefCell<Vec<Reply>>,
    pub resumed: Cell<u32>,
    shared: RefCell<HashMap<String, (Vec<u8>, u32)>>,
    /// Compare-and-swap writes to fail before succeeding (another VM racing).
    pub cas_failures: Cell<u32>,
    pub streams: RefCell<Vec<(u32, String)>>,
    pub stream_messages: RefCell<Vec<(u32, Vec<u8>, bool)>>,
    pub cancelled: RefCell<Vec<u32>>,
    metrics: RefCell<Vec<Metric>>,
    /// Filter state the request set (`set_property`), by name, and Envoy's stream attributes
    /// the filter reads, by dotted path (`response.code_details`).
    pub properties: RefCell<HashMap<String, Vec<u8>>>,
    /// How many times Envoy's stream attributes were read (`property`).
    pub property_reads: Cell<u32>,
    pub tick: Cell<Option<Duration>>,
    next_token: Cell<u32>,
}

thread_local! {
    /// Log records of this test thread (see [`capture_logs`]).
    static LOGS: RefCell<Vec<(log::Level, String)>> = const { RefCell::new(Vec::new()) };
}

struct Capture;

impl log::Log for Capture {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }
    fn log(&self, record: &log::Record<'_>) {
        LOGS.with(|l| l.borrow_mut().push((record.level(), record.args().to_string())));
    }
    fn flush(&self) {}
}

static CAPTURE: Capture = Capture;

/// Sends the filter's log lines (the `log` crate's, which Envoy's logger gets in a VM) to a
/// per-thread list that [`logs`] reads; each test runs on its own thread.
pub fn capture_logs() {
    let _ = log::set_logger(&CAPTURE);
    log::set_max_level(log::LevelFilter::Debug);
}

/// This thread's log lines so far.
pub fn logs() -> Vec<(log::Level, String)> {
    LOGS.with(|l| l.borrow().clone())
}

fn map_id(m: Headers) -> u8 {
    match m {
        Headers::Request => 0,
        Headers::Response => 1,
        Headers::CallResponse => 2,
    }
}

fn buf_id(b: Buffer) -> u8 {
    match b {
        Buffer::Request => 0,
        Buffer::CallResponse => 1,
        Buffer::GrpcReceive => 2,
        Buffer::PluginConfiguration => 3,
        Buffer::Response => 4,
    }
}

#[allow(dead_code)]
impl FakeHost {
    pub fn new() -> FakeHost {
        let h = FakeHost::default();
        h.now_ns.set(1_000_000_000);
        h.next_token.set(1);
        h
    }

    pub fn with_config(self, json: &str) -> FakeHost {
        self.set_buffer(Buffer::PluginConfiguration, json.as_bytes());
        self
    }

    pub fn with_request_header(self, name: &str, value: &str) -> FakeHost {
        self.set_header(Headers::Request, name, Some(value));
        self
    }

    pub fn set_buffer(&self, which: Buffer, bytes: &[u8]) {
        self.buffers.borrow_mut().insert(buf_id(which), bytes.to_vec());
    }

    /// Clears the request's state for the next one (headers, bodies); metrics, shared data and
    /// records stay.
    pub fn next_request(&self) {
        self.headers.borrow_mut().clear();
        self.properties.borrow_mut().clear();
        self.buffers.borrow_mut().retain(|b, _| *b == 3);
        self.properties.borrow_mut().clear();
    }

    /// The request's filter state `name` as text.
    pub fn property(&self, name: &str) -> Option<String> {
        self.properties.borrow().get(name).map(|v| String::from_utf8_lossy(v).into_owned())
    }

    /// A request header as the filter left it.
    pub fn request_header(&self, name: &str) -> Option<String> {
        self.header(Headers::Request, name).map(|v| String::from_utf8_lossy(&v).into_owned())
    }

    pub fn response_header(&self, name: &str) -> Option<String> {
        self.header(Headers::Response, name).map(|v| String::from_utf8_lossy(&v).into_owned())
    }

    /// A counter's value (`None` if never defined).
    pub fn counter(&self, name: &str) -> Option<i64> {
        self.metrics.borrow().iter().find(|m| m.name == name && m.kind == MetricType::Counter).map(|m| m.value)
    }

    /// Every counter with a non-zero value, by name.
    pub fn counters(&self) -> Vec<(String, i64)> {
        let mut v: Vec<_> = self
            .metrics
            .borrow()
            .iter()
            .filter(|m| m.kind == MetricType::Counter && m.value != 0)
            .map(|m| (m.name.clone(), m.value))
            .collect();
        v.sort();
        v
    }

    /// Every metric defined so far, by name.
    pub fn metric_names(&self) -> Vec<String> {
        self.metrics.borrow().iter().map(|m| m.name.clone()).collect()
    }

    pub fn samples(&self, name: &str) -> Vec<u64> {
        self.metrics.borrow().iter().find(|m| m.name == name).map(|m| m.samples.clone()).unwrap_or_default()
    }

    pub fn gauge(&self, name_prefix: &str) -> Option<i64> {
        self.metrics
            .borrow()
            .iter()
            .find(|m| m.kind == MetricType::Gauge && m.name.starts_with(name_prefix))
            .map(|m| m.value)
    }

    pub fn shared_value(&self, key: &str) -> Option<Vec<u8>> {
        self.shared.borrow().get(key).map(|(v, _)| v.clone())
    }

    /// How Envoy marks the response: `details` is `response.code_details` ("via_upstream" for a
    /// replica's own answer), `flags` `response.flags`.
    pub fn set_response_info(&self, details: &str, flags: u64) {
        let mut p = self.properties.borrow_mut();
        p.insert("response.code_details".to_owned(), details.as_bytes().to_vec());
        p.insert("response.flags".to_owned(), flags.to_le_bytes().to_vec());
    }

    pub fn last_call(&self) -> Option<Call> {
        self.calls.borrow().last().cloned()
    }
}

impl Host for FakeHost {
    fn now_ns(&self) -> u64 {
        self.now_ns.get()
    }

    fn set_tick_period(&self, period: Duration) {
        self.tick.set(Some(period));
    }

    fn header(&self, map: Headers, name: &str) -> Option<Vec<u8>> {
        self.headers.borrow().get(&(map_id(map), name.to_owned())).cloned()
    }

    fn set_header(&self, map: Headers, name: &str, value: Option<&str>) {
        let key = (map_id(map), name.to_owned());
        match value {
            Some(v) => self.headers.borrow_mut().insert(key, v.as_bytes().to_vec()),
            None => self.headers.borrow_mut().remove(&key),
        };
    }

    fn buffer(&self, which: Buffer, max: usize) -> Vec<u8> {
        let b = self.buffers.borrow();
        let v = b.get(&buf_id(which)).map(Vec::as_slice).unwrap_or_default();
        v.get(..max.min(v.len())).unwrap_or_default().to_vec()
    }

    fn replace_buffer(&self, which: Buffer, size: usize, bytes: &[u8]) -> bool {
        let mut b = self.buffers.borrow_mut();
        let v = b.entry(buf_id(which)).or_default();
        let size = size.min(v.len());
        v.splice(..size, bytes.iter().copied());
        true
    }

    fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        self.property_reads.set(self.property_reads.get().saturating_add(1));
        self.properties.borrow().get(&path.join(".")).cloned()
    }

    fn dispatch_http_call(
        &self,
        cluster: &str,
        headers: &[(&str, &str)],
        body: &[u8],
        timeout: Duration,
    ) -> Result<u32, Status> {
        if self.refuse_calls.get() {
            return Err(Status::BadArgument);
        }
        let token = self.next_token.get();
        self.next_token.set(token + 1);
        self.calls.borrow_mut().push(Call {
            token,
            cluster: cluster.to_owned(),
            headers: headers.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect(),
            body: body.to_vec(),
            timeout,
        });
        Ok(token)
    }

    fn send_http_response(&self, status: u32, headers: &[(&str, &str)], body: &[u8]) {
        self.replies.borrow_mut().push(Reply {
            status,
            headers: headers.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect(),
            body: body.to_vec(),
        });
    }

    fn resume_http_request(&self) {
        self.resumed.set(self.resumed.get() + 1);
    }

    fn shared_data(&self, key: &str) -> Option<(Option<Vec<u8>>, Option<u32>)> {
        Some(match self.shared.borrow().get(key) {
            Some((v, cas)) => (Some(v.clone()), Some(*cas)),
            None => (None, None),
        })
    }

    fn set_shared_data(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SharedWrite> {
        if self.cas_failures.get() > 0 {
            self.cas_failures.set(self.cas_failures.get() - 1);
            return Err(SharedWrite::CasMismatch);
        }
        let mut shared = self.shared.borrow_mut();
        let current = shared.get(key).map(|(_, c)| *c);
        if cas.is_some() && cas != current {
            return Err(SharedWrite::CasMismatch);
        }
        shared.insert(key.to_owned(), (value.to_vec(), current.unwrap_or(0) + 1));
        Ok(())
    }

    fn open_grpc_stream(&self, cluster: &str, _service: &str, _method: &str) -> Result<u32, Status> {
        let token = self.next_token.get();
        self.next_token.set(token + 1);
        self.streams.borrow_mut().push((token, cluster.to_owned()));
        Ok(token)
    }

    fn send_grpc_stream_message(&self, token: u32, message: &[u8], end_stream: bool) -> Result<(), Status> {
        self.stream_messages.borrow_mut().push((token, message.to_vec(), end_stream));
        Ok(())
    }

    fn cancel_grpc_stream(&self, token: u32) {
        self.cancelled.borrow_mut().push(token);
    }

    fn set_property(&self, name: &str, value: &[u8]) {
        self.properties.borrow_mut().insert(name.to_owned(), value.to_vec());
    }

    fn define_metric(&self, kind: MetricType, name: &str) -> Option<u32> {
        let mut m = self.metrics.borrow_mut();
        if let Some(i) = m.iter().position(|x| x.name == name) {
            return u32::try_from(i).ok();
        }
        m.push(Metric { kind, name: name.to_owned(), value: 0, samples: Vec::new() });
        u32::try_from(m.len() - 1).ok()
    }

    fn increment_metric(&self, id: u32, by: i64) {
        if let Some(m) = self.metrics.borrow_mut().get_mut(id as usize) {
            m.value += by;
        }
    }

    fn record_metric(&self, id: u32, value: u64) {
        if let Some(m) = self.metrics.borrow_mut().get_mut(id as usize) {
            m.samples.push(value);
            m.value = i64::try_from(value).unwrap_or(i64::MAX);
        }
    }
}
