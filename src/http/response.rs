//! A routed request's response: its status as passive health, the end of its prefill at the
//! first token, the phases and the replica's rates taken once the first chunk went on (the rates
//! once the prompt's tokens are known, if later), and its end in the shared counts.

use super::Request;
use super::{Phase, EXPLAIN_HEADER};
use crate::host::{Headers, SharedKind};
use crate::{inflight, phases};
use llmgw_core::request::is_event_stream;
use proxy_wasm::types::Action;

/// A response chunk as it went by: when, whether it had data, whether it ended the answer.
#[derive(Clone, Copy)]
pub(super) struct Chunk {
    pub(super) at_ns: u64,
    pub(super) data: bool,
    pub(super) end: bool,
}

impl Request {
    /// The response's headers: the replica's status, and whether its answer is a stream.
    pub(super) fn response_headers(&mut self, end_of_stream: bool) -> Action {
        // The replica's answer, or Envoy's own (counted only when the replica caused it).
        // The clock is read only where a phase is still to be written.
        if self.counted.is_some() && !self.phases.logged {
            let at_ns = self.host.now_ns();
            self.response_phase(Chunk { at_ns, data: false, end: end_of_stream });
        }
        if let Some(addr) = &self.counted {
            let status = self.host.header(Headers::Response, ":status");
            let code: Option<u32> =
                status.as_deref().and_then(|s| std::str::from_utf8(s).ok()).and_then(|s| s.parse().ok());
            if let Some(code) = code {
                if let Err(k) = crate::health::observe_response(self.host.as_ref(), addr, code) {
                    if let Some(s) = self.shared.as_ref().and_then(|s| s.try_borrow().ok()) {
                        s.metrics.shared_update_failed([k]);
                    }
                }
            }
            // A stream's headers come before its first token (vLLM sends them at once); any
            // other answer (a whole completion, an error) comes after the prefill, or without one.
            let streamed = self.host.header(Headers::Response, "content-type").is_some_and(|v| is_event_stream(&v));
            // An error is nobody's turn to follow.
            if code != Some(200) {
                self.ends_as = None;
            }
            if end_of_stream || !streamed || code != Some(200) {
                self.answer_not_streamed();
            } else if self.answer.is_some() {
                // The chunks change length once the ids are taken out.
                self.host.set_header(Headers::Response, "content-length", None);
            }
            if end_of_stream || !streamed {
                self.first_token();
            }
            // Only a stream's first chunk is its first token; an error teaches nothing.
            if end_of_stream || !streamed || code != Some(200) {
                self.learning = None;
            }
        }
        if let Some(e) = self.explain.take() {
            self.host.set_header(Headers::Response, EXPLAIN_HEADER, Some(&e));
        }
        Action::Continue
    }

    /// A chunk of the response body, handed on at once.
    pub(super) fn response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        // The chunk before this one is on its way: what it taught is taken now.
        self.after_chunk(false);
        // The first chunk of a stream carries its first token: before it goes on, only what
        // the client must not see is done (the ids taken out of an answer asked for them;
        // nothing is buffered but the part of such an event not yet complete), and the end of
        // its prefill is counted (the next decision on any worker reads it). What else it
        // teaches (the prompt's ids, the replica's rates, the phases) waits for the next
        // callback, the next chunk or the stream's end, off the first token's way.
        self.answer_chunk(body_size, end_of_stream);
        if self.counted.is_some() && (body_size > 0 || end_of_stream) {
            self.first_token();
            // Only the first chunk's moment is used (the phases are written once: later chunks
            // read no clock).
            let at_ns = if self.phases.logged { 0 } else { self.host.now_ns() };
            self.unread_chunk = Some(Chunk { at_ns, data: body_size > 0, end: end_of_stream });
        }
        if end_of_stream {
            self.after_chunk(false);
        }
        Action::Continue
    }

    /// The request's end (Envoy's log callback): its records in shared data closed.
    pub(super) fn ended(&mut self) {
        // A stream cut after a chunk: nothing more comes to take its lessons at (its phases
        // reach Envoy's access log only if the filters' log callbacks run before it).
        self.after_chunk(true);
        let tokens = std::mem::take(&mut self.prefilling);
        if let Some(key) = self.ends_as.take().filter(|_| std::mem::take(&mut self.returns_started)) {
            let failed = crate::returns::ended(self.host.as_ref(), key);
            if let Some(s) = self.shared.as_ref().and_then(|s| s.try_borrow().ok()) {
                s.metrics.shared_update_failed(failed);
            }
        }
        if let Some(addr) = self.counted.take().filter(|_| std::mem::take(&mut self.in_flight_recorded)) {
            if let Some(s) = self.shared.as_ref().and_then(|s| s.try_borrow().ok()) {
                let blocks = self.holding.take().map_or(0, |h| s.held.borrow_mut().remove(&addr, &h));
                s.metrics.shared_update_failed(inflight::decrement(self.host.as_ref(), s.vm, &addr, tokens, blocks));
                let held_us = self.host.now_ns().saturating_sub(self.routed_ns) / 1_000;
                s.metrics.shared_update_failed(crate::hold_times::observe(self.host.as_ref(), &addr, held_us).err());
            }
        }
    }

    /// The replica's first token (or its answer, when not streamed): the request's prefill
    /// tokens stop counting there.
    fn first_token(&mut self) {
        let tokens = std::mem::take(&mut self.prefilling);
        let Some(addr) = &self.counted else { return };
        if let Some(key) = self.ends_as.filter(|_| !self.returns_started) {
            self.returns_started = true;
            let failed = crate::returns::started(self.host.as_ref(), addr, key);
            if let Some(s) = self.shared.as_ref().and_then(|s| s.try_borrow().ok()) {
                s.metrics.shared_update_failed(failed);
            }
        }
        if tokens == 0 {
            return;
        }
        if let Some(s) = self.shared.as_ref().and_then(|s| s.try_borrow().ok()) {
            s.metrics.shared_update_failed(inflight::first_token(self.host.as_ref(), s.vm, addr, tokens));
        }
    }

    /// What a response chunk handed on taught, taken once it went (`unread_chunk`): the
    /// prompt's ids from an answer asked for them, and its phases (with the replica's rates).
    fn after_chunk(&mut self, ending: bool) {
        let Some(c) = self.unread_chunk.take() else { return };
        self.answer_lessons(ending);
        self.response_phase(c);
    }

    /// The response's first byte (`c.data` false: its headers, or an empty last chunk) or first
    /// body chunk (true) of a routed request, taken once that chunk went on; the breakdown goes
    /// to the access log then, or at the headers of an answer without a body.
    fn response_phase(&mut self, c: Chunk) {
        // Nothing more once written.
        if self.counted.is_none() || self.phases.logged {
            return;
        }
        let (chunk, end_of_stream) = (c.data, c.end);
        let first = if chunk { self.phases.first_chunk(c.at_ns) } else { self.phases.first_byte(c.at_ns) };
        if first {
            let b = self.phases.breakdown();
            let taught = self.teach_rates();
            if let Some(s) = self.shared.as_ref().and_then(|s| s.try_borrow().ok()) {
                match (chunk, b.upstream_first_chunk_us, b.upstream_first_byte_us) {
                    (true, Some(us), _) => s.metrics.phase_upstream_first_chunk_us(us),
                    (false, _, Some(us)) => s.metrics.phase_upstream_first_byte_us(us),
                    _ => {}
                }
                s.metrics.shared_update_failed(taught);
            }
        }
        if chunk || end_of_stream {
            self.log_phases();
        }
    }

    /// The replica's observed time to first token (decision to first body chunk) teaches its
    /// rates, once, when both are known: that chunk, and the request's prompt tokens (not an
    /// estimate still awaited from its call or its answer's first event; the estimate is
    /// corrected in `learning` when they come). Called at the first chunk and where the tokens
    /// come; whichever is later teaches. The failure, if the shared record was not updated.
    pub(super) fn teach_rates(&mut self) -> Option<SharedKind> {
        let estimated =
            matches!(self.phase, Phase::Background { .. }) || self.answer.as_ref().is_some_and(|a| a.call.is_some());
        let us = self.phases.breakdown().upstream_first_chunk_us.filter(|_| !estimated)?;
        let (Some(basis), Some(addr)) = (self.learning.take(), &self.counted) else { return None };
        crate::rates::observe(self.host.as_ref(), addr, &basis, us).err()
    }

    /// Writes the breakdown for Envoy's access log, once.
    pub(super) fn log_phases(&mut self) {
        if !std::mem::replace(&mut self.phases.logged, true) {
            self.host.set_property(phases::PROPERTY, self.phases.breakdown().line().as_bytes());
        }
    }
}
