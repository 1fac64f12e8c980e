//! One request: strip the client's destination header, buffer the body, tokenize on a
//! replica, hash, score, set the destination header, resume.

use crate::inflight;
use crate::metrics::{Fallback, TokenizerFailure};
use crate::{now_ns, Shared};
use llmgw_core::config::{FilterConfig, Profile, Weights};
use llmgw_core::hash::BlockHash;
use llmgw_core::hash::RequestExtras;
use llmgw_core::policy::{self, Candidate, Decision, Outcome};
use llmgw_core::request::{parse_request, parse_tokenizer_response, ApiKind, ParsedRequest, Prompt, TokenizerCall};
use llmgw_core::tokcache::{Alias, Tokenized};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::{Action, BufferType, MapType};
use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

const EXPLAIN_HEADER: &str = "x-llmgw-decision";
/// Blocks hashed before the first look at the index (see `Request::exact_scores`).
const FIRST_HASH_BATCH: usize = 8;
/// Leading bytes hashed by the approximate fallback when no profile says otherwise.
const DEFAULT_APPROX_BYTES: usize = 1024;

/// A tokenizer call in flight.
struct Pending {
    token: u32,
    started_ns: u64,
    profile: usize,
    parsed: ParsedRequest,
    /// Leading prompt bytes the approximate key reads.
    approx_bytes: usize,
    /// The tokenization cache's tag for this request, when the cache is on.
    cache_tag: Option<u128>,
    /// The tag of the raw body (see `Request::route_cached`).
    raw_tag: Option<u128>,
}

pub struct Request {
    shared: Option<Rc<RefCell<Shared>>>,
    path: String,
    pending: Option<Pending>,
    /// Address whose in-flight counter this request holds.
    counted: Option<String>,
    explain: Option<String>,
    /// The filter's own time (parse, hash, score), without the tokenizer round trip.
    busy_ns: u64,
    done: bool,
}

/// A request header (bytes, so a non-UTF-8 value cannot trip the SDK's UTF-8 conversion).
fn header(name: &str) -> Option<String> {
    let v = hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, name).ok().flatten()?;
    Some(String::from_utf8_lossy(&v).into_owned())
}

fn elapsed_us(since_ns: u64) -> u64 {
    now_ns().saturating_sub(since_ns) / 1_000
}

/// Replicas that serve `model` (all replicas when the model is unknown), with their loads.
fn candidates<'a>(s: &'a Shared, model: Option<&str>) -> Vec<Candidate<'a>> {
    let in_flight = inflight::Snapshot::read();
    s.feed
        .replicas
        .iter()
        .filter(|r| match model {
            Some(m) => r.models.is_empty() || r.models.iter().any(|x| x == m),
            None => true,
        })
        .filter_map(|r| {
            let id = u16::try_from(r.id).ok()?;
            let load = s.feed.loads.iter().find(|l| l.replica == r.id);
            Some(Candidate {
                id,
                address: r.address.as_str(),
                up: r.up && !r.address.is_empty(),
                in_flight: in_flight.get(&r.address),
                running: load.map_or(0, |l| l.running),
                waiting: load.map_or(0, |l| l.waiting),
                kv_usage: load.map_or(0.0, |l| l.kv_cache_usage),
            })
        })
        .collect()
}

fn profile_index(cfg: &FilterConfig, model: Option<&str>) -> Option<usize> {
    let p = cfg.profile_for(model.unwrap_or_default())?;
    cfg.profiles.iter().position(|x| std::ptr::eq(x, p))
}

fn weights(cfg: &FilterConfig, profile: Option<usize>) -> Weights {
    profile.and_then(|i| cfg.profiles.get(i)).map(|p| p.weights.clone()).unwrap_or_default()
}

fn approx_bytes(p: Option<&Profile>) -> usize {
    p.map_or(DEFAULT_APPROX_BYTES, |p| usize::try_from(p.approx_prefix_bytes).unwrap_or(DEFAULT_APPROX_BYTES))
}

/// The approximate fallback's key: a stable hash of the prompt's leading text, or of the raw
/// body's leading bytes when there is no prompt.
fn approx_key(parsed: Option<&ParsedRequest>, body: &[u8], nbytes: usize) -> Option<u64> {
    let mut lead = Vec::new();
    match parsed {
        Some(p) if !matches!(p.prompt, Prompt::None) => p.leading_text(nbytes, &mut lead),
        _ => lead.extend(body.iter().take(nbytes)),
    }
    (!lead.is_empty()).then(|| policy::stable_hash(&lead))
}

impl Request {
    pub fn new(_context_id: u32, shared: Option<Rc<RefCell<Shared>>>) -> Request {
        Request { shared, path: String::new(), pending: None, counted: None, explain: None, busy_ns: 0, done: false }
    }

    /// Hashes `tokens` for the profile and scores them against the index; `None` when hashing
    /// failed. `known`: hashes of the request's leading blocks computed earlier (a cached
    /// tokenization), used before hashing more. Only the leading run some replica holds
    /// matters, so blocks are hashed in growing batches (8, 16, 32, ...) and hashing stops once
    /// no replica holds the last block hashed: a prompt nobody has cached costs a few sha256s,
    /// not one per block. Each batch is scored on its own and joined to the runs so far, so
    /// every block is looked up once. Afterwards `scratch.hashes` holds every hash computed.
    fn exact_scores(
        s: &mut Shared,
        profile: usize,
        who: (Option<&str>, Option<&str>),
        tokens: &[u32],
        known: &[BlockHash],
    ) -> Option<()> {
        let (cache_salt, model) = who;
        let p = s.config.profiles.get(profile)?;
        let block_size = usize::try_from(p.block_size).ok()?;
        let extras = RequestExtras {
            cache_salt: cache_salt.map(str::to_owned),
            lora: model.and_then(|m| p.lora_adapters.get(m).map(|path| (m.to_owned(), path.clone()))),
            mm: Vec::new(),
        };
        let Shared { hashers, scratch, feed, .. } = s;
        let hasher = hashers.get_mut(profile)?.as_mut()?;
        let full = tokens.len().checked_div(block_size)?;
        scratch.hashes.clear();
        scratch.hashes.extend_from_slice(known.get(..full.min(known.len()))?);
        scratch.keys.clear();
        let mut batch = FIRST_HASH_BATCH;
        loop {
            let from = scratch.keys.len();
            // This round scores `batch` more blocks, or every known one if there are more.
            let want = from.saturating_add(batch).max(scratch.hashes.len()).min(full);
            if let Some(more) = want.checked_sub(scratch.hashes.len()).filter(|&n| n > 0) {
                hasher.hash_request_more(tokens, block_size, &extras, &mut scratch.hashes, more).ok()?;
            }
            scratch.keys.extend(scratch.hashes.iter().skip(from).map(|h| h.key));
            let new_keys = scratch.keys.get(from..).unwrap_or_default();
            if from == 0 {
                feed.index.score_into(new_keys, &mut scratch.scores);
            } else {
                // Leading runs over the concatenation: a replica that held every block so far
                // extends its run by its run in the new batch.
                feed.index.score_into(new_keys, &mut scratch.batch);
                for (l, &more) in scratch.scores.leading.iter_mut().zip(&scratch.batch.leading) {
                    if usize::try_from(*l).ok() == Some(from) {
                        *l = l.saturating_add(more);
                    }
                }
            }
            let hashed = scratch.keys.len();
            let someone_holds_all = scratch.scores.leading.iter().any(|&l| usize::try_from(l).ok() == Some(hashed));
            if hashed == from || hashed >= full || !someone_holds_all {
                break;
            }
            batch = batch.saturating_mul(2);
        }
        // Shares are of the whole request, hashed or not.
        scratch.scores.total = u32::try_from(full).unwrap_or(u32::MAX);
        Some(())
    }

    /// The cache tag of a request: profile, tokenizer call, and what else enters its hashes.
    fn cache_tag(s: &Shared, profile: usize, parsed: &ParsedRequest, call: &TokenizerCall) -> Option<u128> {
        if !s.tokcache.enabled() {
            return None;
        }
        let profile = u64::try_from(profile).unwrap_or(u64::MAX).to_le_bytes();
        Some(s.tokcache.tag(&[
            &profile,
            call.path.as_bytes(),
            &call.body,
            parsed.cache_salt.as_deref().unwrap_or_default().as_bytes(),
            parsed.model.as_deref().unwrap_or_default().as_bytes(),
        ]))
    }

    /// Routes with whatever is known. `exact`: the scores in the scratch space are valid.
    /// Returns false when the request was answered locally (no healthy replica).
    fn finish(
        &mut self,
        s: &Shared,
        model: Option<&str>,
        profile: Option<usize>,
        exact: bool,
        approx_key: &dyn Fn() -> Option<u64>,
        why: Option<Fallback>,
    ) -> bool {
        let w = weights(&s.config, profile);
        let cands = candidates(s, model);
        let scores = if exact { Some(&s.scratch.scores) } else { None };
        let d: Decision = policy::decide_lazy(&cands, scores, approx_key, &w);
        let winner = d.winner.and_then(|i| cands.get(i)).map(|c| c.address.to_owned());
        drop(cands);
        s.metrics.outcome(d.outcome);
        if let Some(why) = why {
            s.metrics.fallback(why);
        } else if exact && d.outcome == Outcome::Approx {
            s.metrics.fallback(Fallback::NoMatch);
        }
        if exact {
            s.metrics.matched_blocks(d.matched);
        }
        let Some(addr) = winner else {
            let model = model.unwrap_or("(none)");
            let body = serde_json::json!({
                "error": {
                    "message": format!("no healthy replica for model `{model}`"),
                    "type": "llmgw_no_replica",
                    "code": 503
                }
            });
            let body = serde_json::to_vec(&body).unwrap_or_default();
            let mut headers = vec![("content-type", "application/json")];
            if s.config.explain_header {
                headers.push((EXPLAIN_HEADER, "outcome=no_replica"));
            }
            let _ = hostcalls::send_http_response(503, headers, Some(&body));
            self.done = true;
            return false;
        };
        let dest = s.config.destination_header.clone();
        let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, &dest, Some(&addr));
        inflight::increment(&addr);
        if s.config.explain_header {
            self.explain = Some(format!(
                "outcome={}; replica={addr}; matched={}/{}; vm={}",
                d.outcome.as_str(),
                d.matched,
                d.total,
                s.vm_tag
            ));
        }
        self.counted = Some(addr);
        self.done = true;
        true
    }

    /// Routes from the cached tokenization `alias.tag`: `None` (nothing done) when it is no
    /// longer cached.
    fn route_cached(
        &mut self,
        s: &mut Shared,
        alias: &Alias,
        approx: &dyn Fn() -> Option<u64>,
        t0: u64,
    ) -> Option<Action> {
        let mut t = s.tokcache.take(alias.tag, t0)?;
        s.metrics.tokenizer_cache(true);
        let who = (alias.cache_salt.as_deref(), alias.model.as_deref());
        let exact = Self::exact_scores(s, alias.profile, who, &t.tokens, &t.hashes).is_some();
        if exact && s.scratch.hashes.len() > t.hashes.len() {
            t.hashes.clone_from(&s.scratch.hashes);
        }
        s.tokcache.put_back(alias.tag, t);
        let why = if exact { None } else { Some(Fallback::Hash) };
        let routed = self.finish(s, alias.model.as_deref(), Some(alias.profile), exact, approx, why);
        self.record_busy(s, t0);
        Some(if routed { Action::Continue } else { Action::Pause })
    }

    /// The body is complete (or too large to read): decide or start the tokenizer call.
    /// Returns the action for the current callback.
    fn on_body(&mut self, body: &[u8], too_large: bool) -> Action {
        let Some(shared) = self.shared.clone() else { return Action::Continue };
        let Ok(mut s) = shared.try_borrow_mut() else { return Action::Continue };
        let t0 = now_ns();
        let kind = ApiKind::from_path(&self.path);
        // A byte-identical body seen recently resolves to its cached tokenization unparsed
        // (retries, several samples of one prompt).
        let raw_tag = (s.tokcache.enabled() && !too_large && !body.is_empty() && kind != ApiKind::Other)
            .then(|| s.tokcache.tag(&[b"body", self.path.as_bytes(), body]));
        if let Some(alias) = raw_tag.and_then(|t| s.tokcache.alias(t).cloned()) {
            let usable = s.index_usable() && s.config.profiles.get(alias.profile).is_some_and(|p| p.kv_events);
            let nbytes = approx_bytes(s.config.profiles.get(alias.profile));
            let approx = || approx_key(parse_request(kind, body).ok().as_ref(), body, nbytes);
            if usable {
                if let Some(action) = self.route_cached(&mut s, &alias, &approx, t0) {
                    return action;
                }
            }
        }
        let parsed = if too_large { None } else { parse_request(kind, body).ok() };
        let model = parsed.as_ref().and_then(|p| p.model.clone());
        let profile = profile_index(&s.config, model.as_deref());
        let nbytes = approx_bytes(profile.and_then(|i| s.config.profiles.get(i)));
        let why = match (&parsed, profile) {
            _ if too_large => Some(Fallback::BodyTooLarge),
            (None, _) if body.is_empty() => Some(Fallback::NoPrompt),
            (None, _) => Some(Fallback::Unparseable),
            (Some(p), _) if matches!(p.prompt, Prompt::None) => Some(Fallback::NoPrompt),
            (Some(_), None) => Some(Fallback::NoProfile),
            (Some(_), Some(i)) if !s.config.profiles.get(i).is_some_and(|p| p.kv_events) => Some(Fallback::NoKvEvents),
            (Some(_), Some(_)) if !s.index_usable() => Some(Fallback::NotSynced),
            _ => None,
        };
        if why.is_some() || profile.is_none() || parsed.is_none() {
            let approx = || approx_key(parsed.as_ref(), body, nbytes);
            let routed = self.finish(&s, model.as_deref(), profile, false, &approx, why);
            self.record_busy(&s, t0);
            return if routed { Action::Continue } else { Action::Pause };
        }
        let (Some(parsed), Some(pi)) = (parsed, profile) else { return Action::Continue };
        // The approximate key, computed only if the decision needs it.
        let approx = || approx_key(Some(&parsed), body, nbytes);
        if let Prompt::Tokens(tokens) = &parsed.prompt {
            let exact =
                Self::exact_scores(&mut s, pi, (parsed.cache_salt.as_deref(), parsed.model.as_deref()), tokens, &[])
                    .is_some();
            let why = if exact { None } else { Some(Fallback::Hash) };
            let routed = self.finish(&s, model.as_deref(), profile, exact, &approx, why);
            self.record_busy(&s, t0);
            return if routed { Action::Continue } else { Action::Pause };
        }
        let Some(p) = s.config.profiles.get(pi) else { return Action::Continue };
        let call = parsed.tokenizer_call(p.tokenizer, body);
        let timeout = Duration::from_millis(u64::from(p.tokenizer_timeout_ms));
        let w = p.weights.clone();
        let why = if call.is_none() { Some(Fallback::NoPrompt) } else { None };
        // The same prompt seen recently: its tokens (and leading hashes) are known.
        let cache_tag = call.as_ref().and_then(|c| Self::cache_tag(&s, pi, &parsed, c));
        if let Some(tag) = cache_tag {
            let alias = Alias { tag, profile: pi, model: parsed.model.clone(), cache_salt: parsed.cache_salt.clone() };
            if let Some(action) = self.route_cached(&mut s, &alias, &approx, t0) {
                if let Some(raw) = raw_tag {
                    s.tokcache.add_alias(raw, alias);
                }
                return action;
            }
            s.metrics.tokenizer_cache(false);
        }
        // Tokenize on the least-loaded healthy replica of the model.
        let target = call.as_ref().and_then(|_| {
            let cands = candidates(&s, model.as_deref());
            policy::least_loaded(&cands, &w).and_then(|i| cands.get(i)).map(|c| c.address.to_owned())
        });
        let (Some(call), Some(target)) = (call, target) else {
            // No call possible; without a replica `finish` answers 503.
            let routed = self.finish(&s, model.as_deref(), profile, false, &approx, why);
            self.record_busy(&s, t0);
            return if routed { Action::Continue } else { Action::Pause };
        };
        let dest = s.config.destination_header.clone();
        let cluster = s.config.tokenizer_cluster.clone();
        let headers = vec![
            (":method", "POST"),
            (":path", call.path),
            (":authority", target.as_str()),
            ("content-type", "application/json"),
            (dest.as_str(), target.as_str()),
        ];
        self.record_busy(&s, t0);
        match hostcalls::dispatch_http_call(&cluster, headers, Some(&call.body), Vec::new(), timeout) {
            Ok(token) => {
                self.pending = Some(Pending {
                    token,
                    started_ns: now_ns(),
                    profile: pi,
                    parsed,
                    approx_bytes: nbytes,
                    cache_tag,
                    raw_tag,
                });
                Action::Pause
            }
            Err(e) => {
                log::warn!("llmgw: tokenizer callout to cluster `{cluster}` refused: {e:?}");
                s.metrics.tokenizer_failure(TokenizerFailure::Dispatch);
                let t1 = now_ns();
                let routed = self.finish(&s, model.as_deref(), profile, false, &approx, Some(Fallback::Tokenizer));
                self.record_busy(&s, t1);
                if routed {
                    Action::Continue
                } else {
                    Action::Pause
                }
            }
        }
    }

    fn record_busy(&mut self, s: &Shared, since_ns: u64) {
        self.busy_ns = self.busy_ns.saturating_add(now_ns().saturating_sub(since_ns));
        if self.done {
            s.metrics.decision_us(self.busy_ns / 1_000);
        }
    }
}

impl Context for Request {
    fn on_http_call_response(&mut self, token_id: u32, num_headers: usize, body_size: usize, _trailers: usize) {
        let Some(pending) = self.pending.take_if(|p| p.token == token_id) else { return };
        let Some(shared) = self.shared.clone() else {
            let _ = hostcalls::resume_http_request();
            return;
        };
        let Ok(mut s) = shared.try_borrow_mut() else {
            let _ = hostcalls::resume_http_request();
            return;
        };
        s.metrics.tokenizer_latency_us(elapsed_us(pending.started_ns));
        let t0 = now_ns();
        // A reset or overflowed callout has no headers at all; the SDK panics when asked for one.
        let status = if num_headers == 0 {
            None
        } else {
            hostcalls::get_map_value_bytes(MapType::HttpCallResponseHeaders, ":status").ok().flatten()
        };
        let tokens = match status.as_deref() {
            _ if num_headers == 0 => Err(TokenizerFailure::Reset),
            Some(b"200") => {
                let body = hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, body_size)
                    .ok()
                    .flatten()
                    .unwrap_or_default();
                parse_tokenizer_response(&body).map_err(|_| TokenizerFailure::BadResponse)
            }
            Some(b"504") => Err(TokenizerFailure::Timeout),
            Some(b"503") => Err(TokenizerFailure::Unavailable),
            _ => Err(TokenizerFailure::Status),
        };
        let model = pending.parsed.model.clone();
        let (exact, why) = match tokens {
            Ok(tokens) => {
                // The index may have lost its sync while the call was out.
                if !s.index_usable() {
                    (false, Some(Fallback::NotSynced))
                } else if Self::exact_scores(
                    &mut s,
                    pending.profile,
                    (pending.parsed.cache_salt.as_deref(), pending.parsed.model.as_deref()),
                    &tokens,
                    &[],
                )
                .is_some()
                {
                    if let Some(tag) = pending.cache_tag {
                        let hashes = s.scratch.hashes.clone();
                        s.tokcache.insert(tag, Tokenized { tokens, hashes }, t0);
                        if let Some(raw) = pending.raw_tag {
                            let p = &pending.parsed;
                            let alias = Alias {
                                tag,
                                profile: pending.profile,
                                model: p.model.clone(),
                                cache_salt: p.cache_salt.clone(),
                            };
                            s.tokcache.add_alias(raw, alias);
                        }
                    }
                    (true, None)
                } else {
                    (false, Some(Fallback::Hash))
                }
            }
            Err(f) => {
                log::debug!("llmgw: tokenizer call failed: {}", f.as_str());
                s.metrics.tokenizer_failure(f);
                (false, Some(Fallback::Tokenizer))
            }
        };
        let approx = || approx_key(Some(&pending.parsed), &[], pending.approx_bytes);
        let routed = self.finish(&s, model.as_deref(), Some(pending.profile), exact, &approx, why);
        self.record_busy(&s, t0);
        if routed {
            let _ = hostcalls::resume_http_request();
        }
    }
}

impl HttpContext for Request {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let Some(shared) = self.shared.clone() else { return Action::Continue };
        let dest = match shared.try_borrow() {
            Ok(s) => s.config.destination_header.clone(),
            Err(_) => return Action::Continue,
        };
        // Never trust a client-supplied destination: ORIGINAL_DST forwards to any address.
        let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, &dest, None);
        self.path = header(":path").unwrap_or_default();
        if end_of_stream {
            return self.on_body(&[], false);
        }
        Action::Pause
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if self.done || self.pending.is_some() {
            return if self.pending.is_some() { Action::Pause } else { Action::Continue };
        }
        let limit = self
            .shared
            .as_ref()
            .and_then(|s| s.try_borrow().ok().map(|s| s.config.max_body_bytes))
            .map_or(usize::MAX, |l| usize::try_from(l).unwrap_or(usize::MAX));
        if body_size > limit {
            // Route without reading the whole body (its leading bytes still give a key).
            let head = hostcalls::get_buffer(BufferType::HttpRequestBody, 0, DEFAULT_APPROX_BYTES)
                .ok()
                .flatten()
                .unwrap_or_default();
            return self.on_body(&head, true);
        }
        if !end_of_stream {
            return Action::Pause;
        }
        let body = hostcalls::get_buffer(BufferType::HttpRequestBody, 0, body_size).ok().flatten().unwrap_or_default();
        self.on_body(&body, false)
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        // A body followed by trailers never reports its end: it is complete now.
        if self.pending.is_some() {
            return Action::Pause;
        }
        if self.done {
            return Action::Continue;
        }
        let limit = self
            .shared
            .as_ref()
            .and_then(|s| s.try_borrow().ok().map(|s| s.config.max_body_bytes))
            .map_or(usize::MAX, |l| usize::try_from(l).unwrap_or(usize::MAX));
        let body = hostcalls::get_buffer(BufferType::HttpRequestBody, 0, limit).ok().flatten().unwrap_or_default();
        self.on_body(&body, false)
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        if let Some(e) = self.explain.take() {
            let _ = hostcalls::set_map_value(MapType::HttpResponseHeaders, EXPLAIN_HEADER, Some(&e));
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        if let Some(addr) = self.counted.take() {
            inflight::decrement(&addr);
        }
    }
}
