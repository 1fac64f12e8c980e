//! One request, as glue: strip the client's destination header, buffer the body, hand it to
//! the core's router, act on the step it returns (set the destination header, answer 503, or
//! call the tokenizer and hand its reply back), resume.

use crate::decision_log;
use crate::host::{Buffer, Headers, Host, SharedKind};
use crate::phases::Phases;
use crate::{gateway_state, inflight, Shared};
use llmgw_core::config::{DEFAULT_APPROX_PREFIX_BYTES, DEFAULT_DESTINATION_HEADER};
use llmgw_core::flow::{Background, Body, Holding, Keep, Pending, Rejected, Report, Routed, Step, TokenizerReply};
use llmgw_core::policy::rates::Basis;
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::Action;
use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

mod answer;
mod response;

use answer::FromAnswer;
use llmgw_core::request::AnswerStream;
use response::Chunk;

const EXPLAIN_HEADER: &str = "x-llmgw-decision";
/// vLLM's (0.33) request header naming the data-parallel rank that serves a request.
pub const DP_RANK_HEADER: &str = "x-data-parallel-rank";
/// Leading bytes read of a body too large to buffer (they still give an approximate key).
const HEAD_BYTES: usize = DEFAULT_APPROX_PREFIX_BYTES as usize;

/// Where a request is.
enum Phase {
    /// Before the request headers.
    Headers,
    /// Buffering the body.
    Body,
    /// The tokenizer call `token` is out.
    Tokenizing { token: u32, started_ns: u64, pending: Box<Pending>, target: String },
    /// Routed; the tokenizer call `token`, made after routing, is out (its answer is kept for
    /// the next turn of the conversation).
    Background { token: u32, started_ns: u64, pending: Box<Pending>, target: String },
    /// Decided, answered or passed through: nothing more to do before the response.
    Done,
}

pub struct Request {
    host: Rc<dyn Host>,
    shared: Option<Rc<RefCell<Shared>>>,
    phase: Phase,
    path: String,
    /// Address the request was routed to (its answer is passive health).
    counted: Option<String>,
    /// Whether the in-flight record of `counted` was written for it: only then is it taken
    /// back at the first token and at the end (a failed increment must not decrement another
    /// request's count).
    in_flight_recorded: bool,
    /// Prefill tokens counted for it there until its first token.
    prefilling: u32,
    /// The KV blocks its prompt holds there, counted in the VM's held blocks until its end
    /// (`llmgw_core::flow::HeldBlocks`), and when it was routed (its hold, `crate::hold_times`).
    holding: Option<Holding>,
    routed_ns: u64,
    explain: Option<String>,
    /// Where its time went (`crate::phases`).
    phases: Phases,
    /// Its body's room in the VM's body budget, until it is routed or answered.
    held: Option<crate::body_budget::Held>,
    /// What the prediction for its replica rested on, while its observed time to first token
    /// can still be learned (a streamed 200 answer's first chunk, taught once its prompt's
    /// tokens are known; `crate::rates`).
    learning: Option<Box<Basis>>,
    /// The key it is recorded under from its first token, for the next request extending its
    /// prompt (`crate::returns`); whether that record was written (its end is then recorded).
    ends_as: Option<u64>,
    returns_started: bool,
    /// The size of its body while the filter may still rewrite it (read whole, not yet routed).
    whole_body: Option<usize>,
    /// A routed request whose streamed answer is to carry its prompt's token ids.
    answer: Option<Box<FromAnswer>>,
    /// A response chunk handed on whose lessons are still to be taken (at the next callback).
    unread_chunk: Option<Chunk>,
}

impl Request {
    pub fn new(host: Rc<dyn Host>, shared: Option<Rc<RefCell<Shared>>>) -> Request {
        Request {
            host,
            shared,
            phase: Phase::Headers,
            path: String::new(),
            counted: None,
            in_flight_recorded: false,
            prefilling: 0,
            holding: None,
            routed_ns: 0,
            explain: None,
            phases: Phases::default(),
            held: None,
            learning: None,
            ends_as: None,
            returns_started: false,
            whole_body: None,
            answer: None,
            unread_chunk: None,
        }
    }

    /// The configured body limit (unlimited without a configuration: nothing is parsed then).
    fn body_limit(&self) -> usize {
        self.shared
            .as_ref()
            .and_then(|s| s.try_borrow().ok().map(|s| s.router.config().max_body_bytes))
            .unwrap_or(usize::MAX)
    }

    /// The body is complete (or too large to read): hand it to the router.
    fn on_body(&mut self, bytes: &[u8], too_large: bool) -> Action {
        let Some(shared) = self.shared.clone() else { return self.pass() };
        let Ok(mut s) = shared.try_borrow_mut() else { return self.pass() };
        let t0 = self.host.now_ns();
        self.phases.body(t0);
        let in_flight = gateway_state::Snapshot::read(&self.host);
        let step = s.router.on_body(&Body { path: &self.path, bytes, too_large }, &in_flight, t0);
        self.act(&mut s, step, t0, false)
    }

    /// Continues without routing (no configuration).
    fn pass(&mut self) -> Action {
        self.phase = Phase::Done;
        Action::Continue
    }

    /// The one exit path: carries out a router step. `resuming`: the request is paused on a
    /// callout and must be resumed once routed.
    fn act(&mut self, s: &mut Shared, step: Step, t0: u64, resuming: bool) -> Action {
        s.metrics.report(step.report());
        if let Some(note) = s.router.take_hash_note() {
            log::warn!("{note}");
        }
        if let Some(f) = step.report().tokenizer_failure {
            log::debug!("llmgw: tokenizer call failed: {}", f.as_str());
        }
        let action = match step {
            Step::Route(r) => self.route(s, r, resuming),
            Step::RouteThenTokenize(r, t) => {
                let action = self.route(s, r, resuming);
                if t.from_answer && !resuming && self.ask_for_token_ids() {
                    self.answer = Some(Box::new(FromAnswer { stream: AnswerStream::default(), call: Some(t) }));
                } else {
                    self.call_after_routing(s, *t);
                }
                action
            }
            Step::Reject(r) => {
                let mut headers = vec![("content-type", "application/json")];
                if s.router.config().explain_header {
                    headers.push((EXPLAIN_HEADER, Rejected::EXPLAIN));
                }
                self.phase = Phase::Done;
                let line = decision_log::rejected(&r, self.phases.breakdown().tokenizer_us);
                self.host.set_property(decision_log::PROPERTY, line.as_bytes());
                // Decided before the answer goes out (the access log reads the breakdown).
                self.record_busy(s, t0);
                self.log_phases();
                self.host.send_http_response(r.status, &headers, &r.body);
                return Action::Pause;
            }
            Step::Tokenize(t) => {
                // The decision so far; the call's round trip is not the filter's time.
                self.record_busy(s, t0);
                let cluster = &s.router.config().tokenizer_cluster;
                let timeout = Duration::from_millis(u64::from(t.timeout_ms));
                match self.host.dispatch_http_call(cluster, &call_headers(s, &t.target, t.path), &t.body, timeout) {
                    Ok(token) => {
                        let started_ns = self.host.now_ns();
                        self.phase = Phase::Tokenizing { token, started_ns, pending: t.pending, target: t.target };
                        return Action::Pause;
                    }
                    Err(e) => {
                        log::warn!("llmgw: tokenizer callout to cluster `{cluster}` refused: {e:?}");
                        let t1 = self.host.now_ns();
                        let in_flight = gateway_state::Snapshot::read(&self.host);
                        let step = s.router.on_tokenizer_reply(*t.pending, &TokenizerReply::Refused, &in_flight, t1);
                        // A refused call yields a route or a 503, never another call.
                        return self.act(s, step, t1, resuming);
                    }
                }
            }
        };
        self.record_busy(s, t0);
        if matches!(self.phase, Phase::Done | Phase::Background { .. }) {
            self.held = None;
        }
        action
    }

    /// Sets the destination of a routed request and counts it there.
    fn route(&mut self, s: &mut Shared, mut r: Routed, resuming: bool) -> Action {
        s.metrics.shared_update_failed(keep_shared(self.host.as_ref(), &std::mem::take(&mut r.keep)));
        let cfg = s.router.config();
        self.host.set_header(Headers::Request, &cfg.destination_header, Some(&r.address));
        // The rank the decision credited, so vLLM's own balancer does not pick another;
        // a client's value is removed when the engine is not data-parallel.
        let rank = r.dp_rank.map(|rank| rank.to_string());
        self.host.set_header(Headers::Request, DP_RANK_HEADER, rank.as_deref());
        let tokens = u32::try_from(r.prefill_tokens).unwrap_or(u32::MAX);
        let blocks = r.holding.map_or(0, |h| s.held.borrow_mut().add(&r.address, &h));
        let mut gave_up = inflight::increment(self.host.as_ref(), s.vm, &r.address, tokens, blocks);
        self.in_flight_recorded = !gave_up.contains(&SharedKind::InFlight);
        self.holding = r.holding.filter(|_| self.in_flight_recorded);
        if let (false, Some(h)) = (self.in_flight_recorded, &r.holding) {
            s.held.borrow_mut().remove(&r.address, h);
        }
        self.routed_ns = self.host.now_ns();
        gave_up.extend(crate::recent::routed(self.host.as_ref(), &r.address).err());
        if let Some(key) = r.follows {
            gave_up.extend(crate::returns::followed(self.host.as_ref(), key));
        }
        self.ends_as = r.ends_as;
        s.metrics.shared_update_failed(gave_up);
        self.prefilling = if self.in_flight_recorded { tokens } else { 0 };
        if let Some(spec) = &r.speculation {
            match crate::speculative::record(self.host.as_ref(), spec) {
                Ok(dropped) => s.metrics.speculative_dropped(dropped),
                Err(k) => s.metrics.shared_update_failed([k]),
            }
        }
        if cfg.explain_header {
            self.explain = Some(r.explain(&s.vm_tag));
        }
        let line = decision_log::routed(&r, self.phases.breakdown().tokenizer_us);
        self.host.set_property(decision_log::PROPERTY, line.as_bytes());
        // A prediction with a wait for room in the cache: its observation says nothing of the
        // rates.
        self.learning = r.decision.basis.filter(|b| b.learning.enabled && r.decision.capacity_wait_us.0 == 0);
        self.counted = Some(r.address);
        self.phase = Phase::Done;
        if resuming {
            self.host.resume_http_request();
        }
        Action::Continue
    }

    /// `f` over the reply to a tokenizer call (its body read only if `f` asks): a reset or
    /// overflowed callout has no headers at all.
    fn with_call_reply<R>(&self, num_headers: usize, body_size: usize, f: impl FnOnce(&TokenizerReply<'_>) -> R) -> R {
        let host = self.host.clone();
        let read_body = move || host.buffer(Buffer::CallResponse, body_size);
        if num_headers == 0 {
            return f(&TokenizerReply::Reset);
        }
        let status = self.host.header(Headers::CallResponse, ":status");
        f(&TokenizerReply::Answered { status: status.as_deref(), body: &read_body })
    }

    /// Makes the tokenizer call of a routed request (its answer is for the next turn).
    fn call_after_routing(&mut self, s: &Shared, t: llmgw_core::flow::Tokenize) {
        let cluster = &s.router.config().tokenizer_cluster;
        let timeout = Duration::from_millis(u64::from(t.timeout_ms));
        match self.host.dispatch_http_call(cluster, &call_headers(s, &t.target, t.path), &t.body, timeout) {
            Ok(token) => {
                let started_ns = self.host.now_ns();
                self.phase = Phase::Background { token, started_ns, pending: t.pending, target: t.target };
            }
            Err(e) => {
                log::debug!("llmgw: tokenizer callout after routing refused: {e:?}");
                // Its prompt tokens stay an estimate: its first token teaches no rates.
                self.learning = None;
            }
        }
    }

    /// The answer to the tokenizer call made after routing: cached for the next turn; the
    /// tokenizer's health and latency are counted; the prompt tokens the decision estimated
    /// are corrected in what the replica's first token teaches its rates (now, if it came).
    fn background_reply(
        &mut self,
        started_ns: u64,
        pending: Pending,
        target: &str,
        num_headers: usize,
        body_size: usize,
    ) {
        // Unread, the prompt's tokens stay an estimate: its first token teaches no rates.
        let Some(shared) = self.shared.clone() else {
            self.learning = None;
            return;
        };
        let Ok(mut s) = shared.try_borrow_mut() else {
            self.learning = None;
            return;
        };
        let now = self.host.now_ns();
        let round_trip_us = now.saturating_sub(started_ns) / 1_000;
        self.call_timed(&mut s, round_trip_us);
        let b = self
            .with_call_reply(num_headers, body_size, |reply| self.tokens_after_routing(&mut s, pending, reply, now));
        if let Some(f) = b.failure {
            log::debug!("llmgw: tokenizer call after routing failed: {}", f.as_str());
        }
        if b.failure.is_none_or(|f| f.strikes()) {
            if let Err(k) = crate::health::observe_tokenizer(self.host.as_ref(), target, b.failure.is_some()) {
                s.metrics.shared_update_failed([k]);
            }
        }
        if let Some(t) = b.retry {
            return self.call_after_routing(&s, *t);
        }
        self.correct_learning(b.tokens, b.estimated_tokens);
        s.metrics.shared_update_failed(self.teach_rates());
    }

    /// A tokenizer call answered or failed after `round_trip_us`: the histogram and the round
    /// trips every worker shares (`crate::tokenizer_times`), which the router weighs waits by.
    fn call_timed(&self, s: &mut Shared, round_trip_us: u64) {
        s.metrics.tokenizer_latency_us(round_trip_us);
        if let Err(k) = crate::tokenizer_times::observe(self.host.as_ref(), round_trip_us) {
            s.metrics.shared_update_failed([k]);
        }
    }

    /// A routed request's prompt tokens, from its tokenizer call or its answer, to the router
    /// (kept for the next turn); what it keeps for the other VMs written.
    fn tokens_after_routing(
        &self,
        s: &mut Shared,
        pending: Pending,
        reply: &TokenizerReply<'_>,
        now: u64,
    ) -> Background {
        let in_flight = gateway_state::Snapshot::read(&self.host);
        let b = s.router.on_background_reply(pending, reply, &in_flight, now);
        s.metrics.report(&Report { tokenizer_failure: b.failure, ..Report::default() });
        s.metrics.shared_update_failed(keep_shared(self.host.as_ref(), &b.keep));
        b
    }

    /// The prompt tokens the decision estimated, corrected to `tokens` in what the replica's
    /// first token teaches its rates (nothing is taught when they stay unknown).
    fn correct_learning(&mut self, tokens: Option<u64>, estimated: Option<u64>) {
        self.learning = match (self.learning.take(), tokens, estimated) {
            (Some(basis), Some(tokens), Some(estimated)) => Some(Box::new((*basis).corrected(tokens, estimated))),
            _ => None,
        };
    }

    /// The filter worked since `since_ns`; once decided, the phases up to the decision are
    /// recorded.
    fn record_busy(&mut self, s: &Shared, since_ns: u64) {
        let now = self.host.now_ns();
        self.phases.busy(since_ns, now);
        if matches!(self.phase, Phase::Done | Phase::Background { .. }) {
            self.phases.decided(now);
            let b = self.phases.breakdown();
            s.metrics.decision_us(b.decision_us.unwrap_or(0));
            s.metrics.phases_decided(&b);
        }
    }
}

/// The headers of a tokenizer call to `target`.
fn call_headers<'a>(s: &'a Shared, target: &'a str, path: &'a str) -> [(&'a str, &'a str); 5] {
    [
        (":method", "POST"),
        (":path", path),
        (":authority", target),
        ("content-type", "application/json"),
        (s.router.config().destination_header.as_str(), target),
    ]
}

impl Context for Request {
    fn on_http_call_response(&mut self, token_id: u32, num_headers: usize, body_size: usize, _trailers: usize) {
        let (started_ns, pending, target) = match std::mem::replace(&mut self.phase, Phase::Done) {
            Phase::Tokenizing { token, started_ns, pending, target } if token == token_id => {
                (started_ns, pending, target)
            }
            Phase::Background { token, started_ns, pending, target } if token == token_id => {
                return self.background_reply(started_ns, *pending, &target, num_headers, body_size);
            }
            other => {
                self.phase = other;
                return;
            }
        };
        let Some(shared) = self.shared.clone() else {
            self.host.resume_http_request();
            return;
        };
        let Ok(mut s) = shared.try_borrow_mut() else {
            self.host.resume_http_request();
            return;
        };
        let t0 = self.host.now_ns();
        let round_trip_us = t0.saturating_sub(started_ns) / 1_000;
        self.call_timed(&mut s, round_trip_us);
        self.phases.tokenizer(started_ns, t0);
        let in_flight = gateway_state::Snapshot::read(&self.host);
        let step = self.with_call_reply(num_headers, body_size, |reply| {
            s.router.on_tokenizer_reply(*pending, reply, &in_flight, t0)
        });
        // The tokenizer's circuit breaker: a timeout, reset, 5xx or garbage leaves it alone for
        // a while; a good answer clears it.
        let failure = step.report().tokenizer_failure;
        let request_caused = step.report().tokenizer_failure_request_caused;
        if failure.is_none_or(|f| f.strikes() && !request_caused) {
            if let Err(k) = crate::health::observe_tokenizer(self.host.as_ref(), &target, failure.is_some()) {
                s.metrics.shared_update_failed([k]);
            }
        }
        self.act(&mut s, step, t0, true);
    }
}

impl HttpContext for Request {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        // TEST ONLY (feature `fault-injection`, never in the shipped build): a VM crash on demand.
        #[cfg(feature = "fault-injection")]
        if self.host.header(Headers::Request, "x-llmgw-fault").as_deref() == Some(b"trap".as_slice()) {
            std::process::abort();
        }
        // Never trust a client-supplied destination: ORIGINAL_DST forwards to any address.
        // Removed before anything else, on every path (no configuration included).
        self.host.set_header(Headers::Request, DEFAULT_DESTINATION_HEADER, None);
        let configured = self.shared.as_ref().and_then(|s| s.try_borrow().ok()).map(|s| {
            let dest = &s.router.config().destination_header;
            if dest != DEFAULT_DESTINATION_HEADER {
                self.host.set_header(Headers::Request, dest, None);
            }
        });
        if configured.is_none() {
            return self.pass();
        }
        self.path = self
            .host
            .header(Headers::Request, ":path")
            .map(|v| String::from_utf8_lossy(&v).into_owned())
            .unwrap_or_default();
        self.phases.headers(self.host.now_ns());
        if end_of_stream {
            return self.on_body(&[], false);
        }
        self.phase = Phase::Body;
        Action::Pause
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        match self.phase {
            Phase::Tokenizing { .. } => return Action::Pause,
            Phase::Done | Phase::Background { .. } | Phase::Headers => return Action::Continue,
            Phase::Body => {}
        }
        if body_size > self.body_limit() {
            // Route without reading the whole body (its leading bytes still give a key).
            let head = self.host.buffer(Buffer::Request, HEAD_BYTES);
            return self.on_body(&head, true);
        }
        if !end_of_stream {
            return Action::Pause;
        }
        // Past the VM's body budget: routed by its leading bytes, without the copy.
        self.held = crate::body_budget::admit(self.shared.as_ref(), body_size);
        let read = if self.held.is_some() { body_size } else { HEAD_BYTES };
        let body = self.host.buffer(Buffer::Request, read);
        self.whole_body = self.held.is_some().then_some(body.len());
        let action = self.on_body(&body, self.held.is_none());
        self.whole_body = None;
        action
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        // A body followed by trailers never reports its end: it is complete now.
        match self.phase {
            Phase::Tokenizing { .. } => return Action::Pause,
            Phase::Done | Phase::Background { .. } | Phase::Headers => return Action::Continue,
            Phase::Body => {}
        }
        let body = self.host.buffer(Buffer::Request, self.body_limit());
        self.held = crate::body_budget::admit(self.shared.as_ref(), body.len());
        let read = if self.held.is_some() { body.len() } else { HEAD_BYTES.min(body.len()) };
        self.on_body(body.get(..read).unwrap_or_default(), self.held.is_none())
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        self.response_headers(end_of_stream)
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        self.response_body(body_size, end_of_stream)
    }

    fn on_log(&mut self) {
        self.ended();
    }
}

/// Writes what the router keeps for the other VMs into shared data: the kinds the host refused.
fn keep_shared(host: &dyn Host, keep: &Keep) -> Vec<SharedKind> {
    let mut failed = Vec::new();
    for (tag, tokens) in &keep.tokens {
        if !crate::earlier_turns::keep(host, *tag, tokens) {
            failed.push(SharedKind::EarlierTurns);
        }
    }
    if keep.prompt.as_ref().is_some_and(|p| !crate::earlier_prompts::share(host, p)) {
        failed.push(SharedKind::EarlierPrompts);
    }
    failed
}
