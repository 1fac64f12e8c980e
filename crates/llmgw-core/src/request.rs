//! OpenAI-style request bodies as the router needs them: which API, which model, the prompt
//! (text, token ids or chat messages), the cache salt and LoRA adapter that change block
//! hashes; the body of the tokenizer call that yields the engine's own tokens; and the
//! tokenizer's answer.
//!
//! Tokenizer call forms (vLLM's `/tokenize`): completions send
//! `{model, prompt, add_special_tokens: true}` (the completions endpoint's default); chats send
//! `{model, messages, add_generation_prompt, continue_final_message, chat_template_kwargs,
//! tools, add_special_tokens: false}` (the chat endpoint's default: the template supplies BOS).
//! The render endpoints (`/v1/completions/render`, `/v1/chat/completions/render`) take the
//! generation request's body unchanged.
//!
//! Chat messages, tools and template arguments are kept as the raw JSON the client sent: they
//! are only passed on to the tokenizer, so they are validated but never decoded into a tree and
//! written out again (for a 16 KB chat that copy is most of the parsing cost in wasm).

use crate::config::TokenizerEndpoint;
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::Value;
use std::fmt;

/// Which OpenAI API a request path names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApiKind {
    Completions,
    Chat,
    Other,
}

impl ApiKind {
    /// From the `:path` header (query string ignored).
    pub fn from_path(path: &str) -> ApiKind {
        let p = path.split(['?', '#']).next().unwrap_or_default().trim_end_matches('/');
        match p {
            "/v1/completions" => ApiKind::Completions,
            "/v1/chat/completions" => ApiKind::Chat,
            _ => ApiKind::Other,
        }
    }
}

/// The prompt in the form the request carried it.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    /// A completion prompt as text (needs tokenizing).
    Text(String),
    /// A completion prompt as token ids: the engine caches exactly these.
    Tokens(Vec<u32>),
    /// Chat messages (a non-empty JSON array), as the raw JSON sent, so the tokenizer renders
    /// them as the engine will.
    Chat(RawJson),
    /// Nothing usable (empty, or an API the router does not read).
    None,
}

/// A JSON value kept as the text the client sent (validated JSON).
#[derive(Debug, Clone)]
pub struct RawJson(Box<RawValue>);

impl RawJson {
    pub fn get(&self) -> &str {
        self.0.get()
    }

    /// Parses JSON text into a raw value (whitespace around it trimmed).
    pub fn from_json(s: &str) -> Option<RawJson> {
        serde_json::from_str::<Box<RawValue>>(s).ok().map(RawJson)
    }
}

impl PartialEq for RawJson {
    fn eq(&self, other: &Self) -> bool {
        self.get() == other.get()
    }
}

/// What the router reads from a request body.
#[derive(Debug, Clone, PartialEq)]
pub struct ParsedRequest {
    pub kind: ApiKind,
    pub model: Option<String>,
    pub stream: bool,
    pub cache_salt: Option<String>,
    pub prompt: Prompt,
    /// Chat template inputs forwarded to `/tokenize`.
    pub add_generation_prompt: Option<bool>,
    pub continue_final_message: Option<bool>,
    pub add_special_tokens: Option<bool>,
    pub chat_template: Option<RawJson>,
    pub chat_template_kwargs: Option<RawJson>,
    pub tools: Option<RawJson>,
}

/// Why a body could not be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RequestError {
    /// Not JSON, or JSON of the wrong shape.
    Unparseable(String),
    /// The tokenizer's answer carried no token ids.
    BadTokenizerResponse(String),
}

impl fmt::Display for RequestError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RequestError::Unparseable(m) => write!(f, "unparseable request body: {m}"),
            RequestError::BadTokenizerResponse(m) => write!(f, "unusable tokenizer response: {m}"),
        }
    }
}

impl std::error::Error for RequestError {}

#[derive(Deserialize)]
struct RawRequest {
    #[serde(default)]
    model: Option<Value>,
    #[serde(default)]
    stream: Option<Value>,
    #[serde(default)]
    cache_salt: Option<Value>,
    #[serde(default)]
    prompt: Option<Value>,
    #[serde(default)]
    messages: Option<Box<RawValue>>,
    #[serde(default)]
    add_generation_prompt: Option<Value>,
    #[serde(default)]
    continue_final_message: Option<Value>,
    #[serde(default)]
    add_special_tokens: Option<Value>,
    #[serde(default)]
    chat_template: Option<Box<RawValue>>,
    #[serde(default)]
    chat_template_kwargs: Option<Box<RawValue>>,
    #[serde(default)]
    tools: Option<Box<RawValue>>,
}

fn string(v: Option<Value>) -> Option<String> {
    match v {
        Some(Value::String(s)) => Some(s),
        _ => None,
    }
}

fn boolean(v: &Option<Value>) -> Option<bool> {
    v.as_ref().and_then(Value::as_bool)
}

/// A raw value unless it is JSON `null`.
fn non_null(v: Option<Box<RawValue>>) -> Option<RawJson> {
    v.filter(|v| v.get() != "null").map(RawJson)
}

/// The first byte of JSON text after whitespace.
fn first_byte(s: &[u8]) -> Option<u8> {
    s.iter().copied().find(|b| !b.is_ascii_whitespace())
}

/// Token ids from a JSON array, if every element is a u32.
fn token_ids(items: &[Value]) -> Option<Vec<u32>> {
    items.iter().map(|t| t.as_u64().and_then(|n| u32::try_from(n).ok())).collect()
}

fn completion_prompt(v: Option<Value>) -> Prompt {
    match v {
        Some(Value::String(s)) if !s.is_empty() => Prompt::Text(s),
        Some(Value::Array(items)) => {
            match items.first() {
                // A batch of prompts: each is its own engine request; route by the first.
                Some(Value::String(s)) => Prompt::Text(s.clone()),
                Some(Value::Array(inner)) => token_ids(inner).map_or(Prompt::None, Prompt::Tokens),
                Some(_) => token_ids(&items).map_or(Prompt::None, Prompt::Tokens),
                None => Prompt::None,
            }
        }
        _ => Prompt::None,
    }
}

/// Parses a generation request body for the API its path names.
pub fn parse_request(kind: ApiKind, body: &[u8]) -> Result<ParsedRequest, RequestError> {
    // serde would also read a struct from a JSON array (by position): only objects are requests.
    if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(RequestError::Unparseable("not a JSON object".into()));
    }
    let raw: RawRequest = serde_json::from_slice(body).map_err(|e| RequestError::Unparseable(e.to_string()))?;
    let prompt = match kind {
        ApiKind::Completions => completion_prompt(raw.prompt),
        ApiKind::Chat => match raw.messages {
            None => Prompt::None,
            Some(m) if m.get() == "null" => Prompt::None,
            Some(m) => {
                let text = m.get().as_bytes();
                if first_byte(text) != Some(b'[') {
                    return Err(RequestError::Unparseable("`messages` is not an array".into()));
                }
                // `[` then `]` (whitespace aside) is the empty array.
                if first_byte(text.get(1..).unwrap_or_default()) == Some(b']') {
                    Prompt::None
                } else {
                    Prompt::Chat(RawJson(m))
                }
            }
        },
        ApiKind::Other => Prompt::None,
    };
    Ok(ParsedRequest {
        kind,
        stream: boolean(&raw.stream).unwrap_or(false),
        add_generation_prompt: boolean(&raw.add_generation_prompt),
        continue_final_message: boolean(&raw.continue_final_message),
        add_special_tokens: boolean(&raw.add_special_tokens),
        model: string(raw.model),
        cache_salt: string(raw.cache_salt).filter(|s| !s.is_empty()),
        prompt,
        chat_template: non_null(raw.chat_template),
        chat_template_kwargs: non_null(raw.chat_template_kwargs),
        tools: non_null(raw.tools),
    })
}

/// A tokenizer call to make on a replica.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenizerCall {
    pub path: &'static str,
    pub body: Vec<u8>,
}

impl ParsedRequest {
    /// The call that yields the engine's tokens for this request, or `None` when no call is
    /// needed (token ids given) or possible (no prompt). `raw_body` is the request body, sent
    /// unchanged to the render endpoints.
    pub fn tokenizer_call(&self, endpoint: TokenizerEndpoint, raw_body: &[u8]) -> Option<TokenizerCall> {
        if matches!(self.prompt, Prompt::Tokens(_) | Prompt::None) {
            return None;
        }
        if endpoint == TokenizerEndpoint::Render {
            let path = match self.kind {
                ApiKind::Completions => "/v1/completions/render",
                ApiKind::Chat => "/v1/chat/completions/render",
                ApiKind::Other => return None,
            };
            return Some(TokenizerCall { path, body: raw_body.to_vec() });
        }
        // Written field by field into one buffer: the messages are serialized from the parsed
        // request without being cloned into a new JSON tree first.
        let mut body = Vec::with_capacity(raw_body.len().saturating_add(256));
        let mut first = true;
        body.push(b'{');
        if let Some(model) = &self.model {
            put(&mut body, &mut first, "model", model)?;
        }
        match &self.prompt {
            Prompt::Text(t) => {
                put(&mut body, &mut first, "prompt", t)?;
                put(&mut body, &mut first, "add_special_tokens", &self.add_special_tokens.unwrap_or(true))?;
            }
            Prompt::Chat(msgs) => {
                put_raw(&mut body, &mut first, "messages", msgs);
                let cont = self.continue_final_message.unwrap_or(false);
                // vLLM refuses both at once; continuing the final message implies no prompt.
                let gen = self.add_generation_prompt.unwrap_or(!cont) && !cont;
                put(&mut body, &mut first, "add_generation_prompt", &gen)?;
                put(&mut body, &mut first, "continue_final_message", &cont)?;
                for (k, v) in [
                    ("chat_template", &self.chat_template),
                    ("chat_template_kwargs", &self.chat_template_kwargs),
                    ("tools", &self.tools),
                ] {
                    if let Some(v) = v {
                        put_raw(&mut body, &mut first, k, v);
                    }
                }
                put(&mut body, &mut first, "add_special_tokens", &self.add_special_tokens.unwrap_or(false))?;
            }
            Prompt::Tokens(_) | Prompt::None => return None,
        }
        body.push(b'}');
        Some(TokenizerCall { path: "/tokenize", body })
    }

    /// Up to `max` leading bytes of the prompt as text, for the approximate fallback: the
    /// completion text, the token ids (little-endian), or each chat message's role and text
    /// parts. Requests sharing a leading prompt share this prefix.
    pub fn leading_text(&self, max: usize, out: &mut Vec<u8>) {
        out.clear();
        match &self.prompt {
            Prompt::Text(t) => push_capped(out, t.as_bytes(), max),
            Prompt::Tokens(ts) => {
                for t in ts {
                    if out.len() >= max {
                        break;
                    }
                    push_capped(out, &t.to_le_bytes(), max);
                }
            }
            Prompt::Chat(msgs) => chat_leading_text(msgs.get(), max, out),
            Prompt::None => {}
        }
    }
}

/// Appends `"key":value` (with a leading comma after the first field) to a JSON object.
fn put<T: serde::Serialize + ?Sized>(out: &mut Vec<u8>, first: &mut bool, key: &str, v: &T) -> Option<()> {
    if !std::mem::take(first) {
        out.push(b',');
    }
    serde_json::to_writer(&mut *out, key).ok()?;
    out.push(b':');
    serde_json::to_writer(&mut *out, v).ok()
}

/// Appends `"key":<raw JSON>` to a JSON object.
fn put_raw(out: &mut Vec<u8>, first: &mut bool, key: &str, v: &RawJson) {
    if !std::mem::take(first) {
        out.push(b',');
    }
    out.push(b'"');
    out.extend_from_slice(key.as_bytes());
    out.extend_from_slice(b"\":");
    out.extend_from_slice(v.get().as_bytes());
}

/// A cursor over JSON text already validated by the request parser: only what the approximate
/// key needs is read, and reading stops once enough text is gathered, so a long message costs
/// nothing past the key's bytes.
struct Walker<'a> {
    b: &'a [u8],
    i: usize,
}

impl Walker<'_> {
    fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }

    fn bump(&mut self, n: usize) {
        self.i = self.i.saturating_add(n);
    }

    fn ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\n' | b'\r' | b'\t')) {
            self.bump(1);
        }
    }

    /// Consumes `c` after whitespace, if it is next.
    fn eat(&mut self, c: u8) -> bool {
        self.ws();
        let hit = self.peek() == Some(c);
        if hit {
            self.bump(1);
        }
        hit
    }

    /// At a string's opening quote: moves past its closing quote and returns the literal's
    /// span (quotes included).
    fn string(&mut self) -> Option<(usize, usize)> {
        let start = self.i;
        self.bump(1);
        loop {
            let rest = self.b.get(self.i..)?;
            let n = rest.iter().position(|&c| c == b'"' || c == b'\\')?;
            self.bump(n);
            if self.peek()? == b'"' {
                self.bump(1);
                return Some((start, self.i));
            }
            self.bump(2);
        }
    }

    /// Moves past one value.
    fn skip(&mut self) -> Option<()> {
        self.ws();
        match self.peek()? {
            b'"' => self.string().map(|_| ()),
            b'{' | b'[' => {
                let mut depth = 0usize;
                loop {
                    match self.peek()? {
                        b'"' => {
                            self.string()?;
                            continue;
                        }
                        b'{' | b'[' => depth = depth.saturating_add(1),
                        b'}' | b']' => {
                            depth = depth.saturating_sub(1);
                            if depth == 0 {
                                self.bump(1);
                                return Some(());
                            }
                        }
                        _ => {}
                    }
                    self.bump(1);
                }
            }
            _ => {
                while !matches!(self.peek(), None | Some(b',' | b']' | b'}' | b' ' | b'\n' | b'\r' | b'\t')) {
                    self.bump(1);
                }
                Some(())
            }
        }
    }

    /// At an object: calls `f(walker, key literal)` at each value; `f` must consume the value.
    /// Stops early when `f` returns `None`.
    fn object(&mut self, mut f: impl FnMut(&mut Self, &[u8]) -> Option<()>) -> Option<()> {
        if !self.eat(b'{') {
            return None;
        }
        if self.eat(b'}') {
            return Some(());
        }
        loop {
            self.ws();
            let key_start = self.i;
            self.string()?;
            let key_end = self.i;
            if !self.eat(b':') {
                return None;
            }
            self.ws();
            let b = self.b;
            f(self, b.get(key_start..key_end)?)?;
            if !self.eat(b',') {
                return self.eat(b'}').then_some(());
            }
        }
    }
}

/// Each message's role and text (string content, or its text parts), each followed by a
/// newline, up to `max` bytes.
fn chat_leading_text(messages: &str, max: usize, out: &mut Vec<u8>) {
    let mut w = Walker { b: messages.as_bytes(), i: 0 };
    if !w.eat(b'[') {
        return;
    }
    while out.len() < max {
        w.ws();
        match w.peek() {
            Some(b'{') => {}
            Some(b']') | None => return,
            Some(_) => {
                // Not an object: an empty role and no text.
                push_capped(out, b"\n\n", max);
                if w.skip().is_none() || !w.eat(b',') {
                    return;
                }
                continue;
            }
        }
        // Role first; a content seen before its role is read once the role is known.
        let bytes = w.b;
        let role_text = |r: Option<(usize, usize)>| unescape(r.and_then(|(a, b)| bytes.get(a..b)).unwrap_or_default());
        let mut role: Option<(usize, usize)> = None;
        let mut content_at: Option<usize> = None;
        let mut wrote_content = false;
        let done = w.object(|w, key| {
            match key {
                b"\"role\"" if w.peek() == Some(b'"') => role = Some(w.string()?),
                b"\"content\"" if role.is_some() && !wrote_content => {
                    push_capped(out, &role_text(role), max);
                    push_capped(out, b"\n", max);
                    wrote_content = true;
                    content_text(w, out, max)?;
                }
                b"\"content\"" => {
                    content_at = Some(w.i);
                    w.skip()?;
                }
                _ => w.skip()?,
            }
            Some(())
        });
        if !wrote_content {
            push_capped(out, &role_text(role), max);
            push_capped(out, b"\n", max);
            if let Some(at) = content_at {
                let mut c = Walker { b: w.b, i: at };
                let _ = content_text(&mut c, out, max);
            }
        }
        if out.len() >= max {
            return;
        }
        push_capped(out, b"\n", max);
        if done.is_none() || !w.eat(b',') {
            return;
        }
    }
}

/// Appends a message content's text (a string, or the `text` of each part) and consumes the
/// value; `None` once `max` is reached (the walk stops there).
fn content_text(w: &mut Walker<'_>, out: &mut Vec<u8>, max: usize) -> Option<()> {
    match w.peek()? {
        b'"' => {
            let end = unescape_into(w.b.get(w.i.saturating_add(1)..)?, out, max)?;
            w.bump(end.saturating_add(1));
            Some(())
        }
        b'[' => {
            w.bump(1);
            if w.eat(b']') {
                return Some(());
            }
            loop {
                w.ws();
                if w.peek() == Some(b'{') {
                    w.object(|w, key| {
                        if key == b"\"text\"" && w.peek() == Some(b'"') {
                            let end = unescape_into(w.b.get(w.i.saturating_add(1)..)?, out, max)?;
                            w.bump(end.saturating_add(1));
                            Some(())
                        } else {
                            w.skip()
                        }
                    })?;
                } else {
                    w.skip()?;
                }
                if !w.eat(b',') {
                    return w.eat(b']').then_some(());
                }
            }
        }
        _ => w.skip(),
    }
}

/// The decoded text of a JSON string literal (quotes included), in full (roles are short).
fn unescape(lit: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    let _ = unescape_into(lit.get(1..).unwrap_or_default(), &mut out, usize::MAX);
    out
}

/// Decodes a JSON string's text from just after its opening quote into `out`, up to `max`
/// bytes of output: the offset just past the closing quote, or `None` when `max` was reached
/// first (or the text is cut short).
fn unescape_into(b: &[u8], out: &mut Vec<u8>, max: usize) -> Option<usize> {
    let mut i = 0usize;
    loop {
        if out.len() >= max {
            return None;
        }
        // Look no further than the room left: a long string is not scanned past the key's bytes.
        let room = max.saturating_sub(out.len());
        let run = b.get(i..)?;
        let window = run.get(..room.min(run.len())).unwrap_or_default();
        let Some(n) = window.iter().position(|&x| x == b'"' || x == b'\\') else {
            // `max` reached (or the text ends unterminated): the walk stops here.
            push_capped(out, window, max);
            return None;
        };
        push_capped(out, run.get(..n).unwrap_or_default(), max);
        i = i.saturating_add(n);
        if b.get(i)? == &b'"' {
            return Some(i.saturating_add(1));
        }
        if out.len() >= max {
            return None;
        }
        let esc = *b.get(i.saturating_add(1))?;
        i = i.saturating_add(2);
        let ch: char = match esc {
            b'n' => '\n',
            b't' => '\t',
            b'r' => '\r',
            b'b' => '\u{8}',
            b'f' => '\u{c}',
            b'u' => {
                let hex = |at: usize| {
                    b.get(at..at.saturating_add(4))
                        .and_then(|h| std::str::from_utf8(h).ok())
                        .and_then(|h| u16::from_str_radix(h, 16).ok())
                };
                let hi = hex(i)?;
                i = i.saturating_add(4);
                let lo = if (0xd800..0xdc00).contains(&hi) && b.get(i..i.saturating_add(2)) == Some(b"\\u") {
                    hex(i.saturating_add(2))
                } else {
                    None
                };
                match lo.filter(|l| (0xdc00..0xe000).contains(l)) {
                    Some(l) => {
                        i = i.saturating_add(6);
                        char::decode_utf16([hi, l]).next().and_then(Result::ok).unwrap_or('\u{fffd}')
                    }
                    None => char::from_u32(u32::from(hi)).unwrap_or('\u{fffd}'),
                }
            }
            other => char::from(other),
        };
        let mut buf = [0u8; 4];
        push_capped(out, ch.encode_utf8(&mut buf).as_bytes(), max);
    }
}

fn push_capped(out: &mut Vec<u8>, b: &[u8], max: usize) {
    let room = max.saturating_sub(out.len());
    out.extend(b.iter().take(room));
}

#[derive(Deserialize)]
struct TokenizeResponse {
    #[serde(default)]
    tokens: Option<Vec<u32>>,
    #[serde(default)]
    token_ids: Option<Vec<u32>>,
}

/// Token ids from a `/tokenize` answer (`tokens`) or a render answer (`token_ids`, possibly one
/// object per prompt in an array: the first is used, as for routing).
pub fn parse_tokenizer_response(body: &[u8]) -> Result<Vec<u32>, RequestError> {
    if let Some(tokens) = fast_tokens(body) {
        return Ok(tokens);
    }
    let bad = |m: String| RequestError::BadTokenizerResponse(m);
    let first = body.iter().find(|b| !b.is_ascii_whitespace());
    let r: TokenizeResponse = if first == Some(&b'[') {
        let mut items: Vec<TokenizeResponse> = serde_json::from_slice(body).map_err(|e| bad(e.to_string()))?;
        if items.is_empty() {
            return Err(bad("empty array".into()));
        }
        items.swap_remove(0)
    } else {
        // Straight into the struct: no intermediate `Value` for thousands of token ids.
        serde_json::from_slice(body).map_err(|e| bad(e.to_string()))?
    };
    r.tokens.or(r.token_ids).ok_or_else(|| bad("no `tokens` or `token_ids`".into()))
}

/// Fast path for `/tokenize` answers (`{"count":..,"max_model_len":..,"tokens":[..],..}`): the
/// first `"tokens":` key followed by an array of plain unsigned integers. A JSON string cannot
/// contain an unescaped quote, so the key cannot be matched inside a string value. Anything
/// unexpected returns `None` and the caller parses the body fully.
fn fast_tokens(body: &[u8]) -> Option<Vec<u32>> {
    const KEY: &[u8] = b"\"tokens\":";
    let at = body.windows(KEY.len()).position(|w| w == KEY)?;
    // The character before the key must be one that can precede an object key.
    let before = body.get(..at)?.iter().rev().find(|b| !b.is_ascii_whitespace())?;
    if *before != b'{' && *before != b',' {
        return None;
    }
    let ws = |b: u8| matches!(b, b' ' | b'\t' | b'\n' | b'\r');
    let mut i = at.checked_add(KEY.len())?;
    while body.get(i).copied().is_some_and(ws) {
        i = i.wrapping_add(1);
    }
    if body.get(i) != Some(&b'[') {
        return None;
    }
    i = i.wrapping_add(1);
    // About one id per 6 bytes of a typical answer.
    let mut out = Vec::with_capacity(body.len().saturating_sub(i) / 6);
    while body.get(i).copied().is_some_and(ws) {
        i = i.wrapping_add(1);
    }
    if body.get(i) == Some(&b']') {
        return Some(out);
    }
    loop {
        // Fast path: an id of 1 to 7 digits directly followed by `,` or `]`, read 8 bytes at a
        // time; anything else (whitespace, longer numbers, the last bytes) takes the byte path.
        if let Some((v, n, sep)) = body.get(i..i.wrapping_add(8)).and_then(eight_digits) {
            out.push(v);
            i = i.wrapping_add(n).wrapping_add(1);
            if sep == b']' {
                return Some(out);
            }
            continue;
        }
        while body.get(i).copied().is_some_and(ws) {
            i = i.wrapping_add(1);
        }
        // One unsigned integer; `v` stays below 2³² × 10 + 10, far from u64's limit.
        let mut v: u64 = 0;
        let start = i;
        while let Some(d) = body.get(i).filter(|b| b.is_ascii_digit()) {
            v = v.wrapping_mul(10).wrapping_add(u64::from(d.wrapping_sub(b'0')));
            if v > u64::from(u32::MAX) {
                return None;
            }
            i = i.wrapping_add(1);
        }
        if i == start {
            return None;
        }
        out.push(u32::try_from(v).ok()?);
        while body.get(i).copied().is_some_and(ws) {
            i = i.wrapping_add(1);
        }
        match body.get(i) {
            Some(b',') => i = i.wrapping_add(1),
            Some(b']') => return Some(out),
            _ => return None,
        }
    }
}

/// Reads `digits` followed by `,` or `]` from the start of an 8-byte window, 1 to 7 digits:
/// (value, number of digits, separator). SWAR: one 64-bit load finds the first non-digit and
/// converts the digits (little-endian: the first character is the lowest byte).
fn eight_digits(w: &[u8]) -> Option<(u32, usize, u8)> {
    let x = u64::from_le_bytes(<[u8; 8]>::try_from(w).ok()?);
    // A byte's high bit is set in `flags` iff it is not an ASCII digit, for every byte up to
    // and including the first non-digit (borrows and carries only come from earlier bytes,
    // which are digits there).
    let flags =
        (x.wrapping_sub(0x3030_3030_3030_3030) | x.wrapping_add(0x4646_4646_4646_4646) | x) & 0x8080_8080_8080_8080;
    let n = flags.trailing_zeros() / 8;
    if !(1..8).contains(&n) {
        return None;
    }
    let sep = *w.get(usize::try_from(n).ok()?)?;
    if sep != b',' && sep != b']' {
        return None;
    }
    // Left-pad to eight digits with '0', then the standard eight-digit conversion.
    let y = x.wrapping_shl(8u32.wrapping_mul(8u32.wrapping_sub(n)))
        | 0x3030_3030_3030_3030u64.wrapping_shr(n.wrapping_mul(8));
    let mut d = y.wrapping_sub(0x3030_3030_3030_3030);
    d = d.wrapping_mul(10).wrapping_add(d.wrapping_shr(8));
    d = (d & 0x0000_00FF_0000_00FF)
        .wrapping_mul(100 + (1_000_000 << 32))
        .wrapping_add((d.wrapping_shr(16) & 0x0000_00FF_0000_00FF).wrapping_mul(1 + (10_000 << 32)))
        .wrapping_shr(32);
    Some((u32::try_from(d).ok()?, usize::try_from(n).ok()?, sep))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn body(v: Value) -> Vec<u8> {
        serde_json::to_vec(&v).unwrap()
    }

    #[test]
    fn paths() {
        assert_eq!(ApiKind::from_path("/v1/completions"), ApiKind::Completions);
        assert_eq!(ApiKind::from_path("/v1/chat/completions?x=1"), ApiKind::Chat);
        assert_eq!(ApiKind::from_path("/v1/chat/completions/"), ApiKind::Chat);
        assert_eq!(ApiKind::from_path("/v1/models"), ApiKind::Other);
    }

    #[test]
    fn completion_text_and_tokens() {
        let r = parse_request(
            ApiKind::Completions,
            &body(json!({"model":"m","prompt":"hello","stream":true,"cache_salt":"s1","max_tokens":3})),
        )
        .unwrap();
        assert_eq!(r.model.as_deref(), Some("m"));
        assert!(r.stream);
        assert_eq!(r.cache_salt.as_deref(), Some("s1"));
        assert_eq!(r.prompt, Prompt::Text("hello".into()));
        let call = r.tokenizer_call(TokenizerEndpoint::Tokenize, b"").unwrap();
        assert_eq!(call.path, "/tokenize");
        let sent: Value = serde_json::from_slice(&call.body).unwrap();
        assert_eq!(sent, json!({"model":"m","prompt":"hello","add_special_tokens":true}));

        let r = parse_request(ApiKind::Completions, &body(json!({"model":"m","prompt":[1,2,3]}))).unwrap();
        assert_eq!(r.prompt, Prompt::Tokens(vec![1, 2, 3]));
        assert!(!r.stream);
        assert_eq!(r.tokenizer_call(TokenizerEndpoint::Tokenize, b""), None);
        let r = parse_request(ApiKind::Completions, &body(json!({"prompt":[[7,8],[9]]}))).unwrap();
        assert_eq!(r.prompt, Prompt::Tokens(vec![7, 8]));
        let r = parse_request(ApiKind::Completions, &body(json!({"prompt":["a","b"]}))).unwrap();
        assert_eq!(r.prompt, Prompt::Text("a".into()));
        let r = parse_request(ApiKind::Completions, &body(json!({"prompt":[1,-2]}))).unwrap();
        assert_eq!(r.prompt, Prompt::None);
        let r = parse_request(ApiKind::Completions, &body(json!({"prompt":"x","add_special_tokens":false}))).unwrap();
        let sent: Value =
            serde_json::from_slice(&r.tokenizer_call(TokenizerEndpoint::Tokenize, b"").unwrap().body).unwrap();
        assert_eq!(sent["add_special_tokens"], json!(false));
    }

    #[test]
    fn chat_tokenize_form() {
        let req = json!({
            "model": "m",
            "messages": [
                {"role":"system","content":"be brief"},
                {"role":"user","content":[{"type":"text","text":"hi "},{"type":"text","text":"there"}]}
            ],
            "tools": [{"type":"function","function":{"name":"f"}}],
            "chat_template_kwargs": {"enable_thinking": false},
            "temperature": 0.1
        });
        let r = parse_request(ApiKind::Chat, &body(req.clone())).unwrap();
        let call = r.tokenizer_call(TokenizerEndpoint::Tokenize, b"").unwrap();
        assert_eq!(call.path, "/tokenize");
        let sent: Value = serde_json::from_slice(&call.body).unwrap();
        assert_eq!(
            sent,
            json!({
                "model": "m",
                "messages": req["messages"],
                "add_generation_prompt": true,
                "continue_final_message": false,
                "chat_template_kwargs": {"enable_thinking": false},
                "tools": req["tools"],
                "add_special_tokens": false
            })
        );
        let mut lead = Vec::new();
        r.leading_text(1000, &mut lead);
        assert_eq!(lead, b"system\nbe brief\nuser\nhi there\n");
        r.leading_text(9, &mut lead);
        assert_eq!(lead, b"system\nbe");

        let r = parse_request(
            ApiKind::Chat,
            &body(json!({"messages":[{"role":"assistant","content":"x"}],"continue_final_message":true})),
        )
        .unwrap();
        let sent: Value =
            serde_json::from_slice(&r.tokenizer_call(TokenizerEndpoint::Tokenize, b"").unwrap().body).unwrap();
        assert_eq!(sent["add_generation_prompt"], json!(false));
        assert_eq!(sent["continue_final_message"], json!(true));
        assert!(sent.get("model").is_none());
    }

    /// The leading text as a full JSON parse reads it (the reference for the raw reader).
    fn reference_lead(messages: &Value, max: usize) -> Vec<u8> {
        let mut out = Vec::new();
        for msg in messages.as_array().unwrap() {
            if out.len() >= max {
                break;
            }
            let role = msg.get("role").and_then(Value::as_str).unwrap_or_default();
            push_capped(&mut out, role.as_bytes(), max);
            push_capped(&mut out, b"\n", max);
            match msg.get("content") {
                Some(Value::String(s)) => push_capped(&mut out, s.as_bytes(), max),
                Some(Value::Array(parts)) => {
                    for p in parts {
                        if let Some(t) = p.get("text").and_then(Value::as_str) {
                            push_capped(&mut out, t.as_bytes(), max);
                        }
                    }
                }
                _ => {}
            }
            push_capped(&mut out, b"\n", max);
        }
        out
    }

    #[test]
    fn raw_chat_leading_text_matches_a_full_parse() {
        let pieces =
            ["a", "é", "\"", "\\", "\n", "\t", "\u{1}", "\u{7f}", "日本", "😀", "/", " ", "\u{2028}", "x\u{8}y"];
        let x = std::cell::Cell::new(7u64);
        let next = |n: u64| {
            x.set(x.get().wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407));
            (x.get() >> 33) % n
        };
        for case in 0..300 {
            let text = || (0..next(40)).map(|_| pieces[next(pieces.len() as u64) as usize]).collect::<String>();
            let mut msgs = Vec::new();
            for _ in 0..1 + next(4) {
                let m = match next(5) {
                    0 => {
                        json!({"role": text(), "content": [{"type": "text", "text": text()}, {"type": "image_url"}, {"text": text()}]})
                    }
                    1 => json!({"content": text()}),
                    2 => json!("not an object"),
                    3 => json!({"role": "user", "content": null, "name": text()}),
                    _ => json!({"role": text(), "content": text()}),
                };
                msgs.push(m);
            }
            let msgs = Value::Array(msgs);
            // serde_json writes non-ASCII as is; also check \uXXXX escapes (surrogate pairs for 😀).
            let ascii: String = serde_json::to_string(&msgs)
                .unwrap()
                .chars()
                .map(|c| {
                    if c.is_ascii() {
                        c.to_string()
                    } else {
                        c.encode_utf16(&mut [0; 2]).iter().map(|u| format!("\\u{u:04x}")).collect()
                    }
                })
                .collect();
            // Clients usually send `role` before `content` (serde_json sorts keys: content first).
            let role_first = format!(
                "[{}]",
                msgs.as_array()
                    .unwrap()
                    .iter()
                    .map(|m| match m.as_object() {
                        Some(o) => {
                            let mut keys: Vec<&String> = o.keys().collect();
                            keys.sort_by_key(|k| (k.as_str() != "role", k.as_str() == "content"));
                            let fields: Vec<String> =
                                keys.iter().map(|k| format!("{}: {}", json!(k), o[k.as_str()])).collect();
                            format!("{{ {} }}", fields.join(" , "))
                        }
                        None => m.to_string(),
                    })
                    .collect::<Vec<_>>()
                    .join(",\n")
            );
            for raw in [serde_json::to_string_pretty(&msgs).unwrap(), ascii, role_first] {
                let body = format!(r#"{{"model":"m","messages":{raw}}}"#);
                let r = parse_request(ApiKind::Chat, body.as_bytes()).unwrap();
                for max in [0, 1, 5, 17, 64, 10_000] {
                    let mut lead = Vec::new();
                    r.leading_text(max, &mut lead);
                    assert_eq!(lead, reference_lead(&msgs, max), "case {case} max {max}: {raw}");
                }
            }
        }
    }

    #[test]
    fn render_sends_the_body_unchanged() {
        let raw = body(json!({"model":"m","messages":[{"role":"user","content":"x"}]}));
        let r = parse_request(ApiKind::Chat, &raw).unwrap();
        let call = r.tokenizer_call(TokenizerEndpoint::Render, &raw).unwrap();
        assert_eq!(call.path, "/v1/chat/completions/render");
        assert_eq!(call.body, raw);
        let raw = body(json!({"model":"m","prompt":"x"}));
        let r = parse_request(ApiKind::Completions, &raw).unwrap();
        assert_eq!(r.tokenizer_call(TokenizerEndpoint::Render, &raw).unwrap().path, "/v1/completions/render");
    }

    #[test]
    fn bad_bodies() {
        assert!(matches!(parse_request(ApiKind::Chat, b"not json"), Err(RequestError::Unparseable(_))));
        assert!(matches!(parse_request(ApiKind::Chat, br#"{"messages":"x"}"#), Err(RequestError::Unparseable(_))));
        assert!(matches!(parse_request(ApiKind::Chat, b"[1,2]"), Err(RequestError::Unparseable(_))));
        let r = parse_request(ApiKind::Chat, br#"{"model":3,"messages":[]}"#).unwrap();
        assert_eq!(r.model, None);
        assert_eq!(r.prompt, Prompt::None);
        assert_eq!(r.tokenizer_call(TokenizerEndpoint::Tokenize, b""), None);
    }

    #[test]
    fn tokenizer_responses() {
        assert_eq!(
            parse_tokenizer_response(br#"{"count":3,"max_model_len":9,"tokens":[1,2,3],"token_strs":null}"#).unwrap(),
            vec![1, 2, 3]
        );
        assert_eq!(parse_tokenizer_response(br#"{"request_id":"x","token_ids":[4,5]}"#).unwrap(), vec![4, 5]);
        assert_eq!(parse_tokenizer_response(br#"[{"token_ids":[6]},{"token_ids":[7]}]"#).unwrap(), vec![6]);
        assert!(parse_tokenizer_response(br#"{"error":{"code":404}}"#).is_err());
        assert!(parse_tokenizer_response(b"<html>").is_err());
        assert!(parse_tokenizer_response(br#"{"tokens":[-1]}"#).is_err());
        assert!(parse_tokenizer_response(b"[]").is_err());
        // The fast path agrees with the full parse, and defers to it on anything unusual.
        assert_eq!(parse_tokenizer_response(br#"{"tokens" : [ 1 , 22,333 ] }"#).unwrap(), vec![1, 22, 333]);
        assert_eq!(parse_tokenizer_response(br#"{"tokens":[]}"#).unwrap(), Vec::<u32>::new());
        assert_eq!(fast_tokens(br#"{"tokens":[1.5]}"#), None);
        assert!(parse_tokenizer_response(br#"{"tokens":[1.5]}"#).is_err());
        assert_eq!(fast_tokens(br#"{"tokens":[4294967296]}"#), None);
        assert!(parse_tokenizer_response(br#"{"tokens":[4294967296]}"#).is_err());
        assert_eq!(fast_tokens(br#"{"a":"x\"tokens\":[9]","tokens":[1]}"#), Some(vec![1]));
        assert_eq!(parse_tokenizer_response(br#"{"a":"x\"tokens\":[9]","tokens":[1]}"#).unwrap(), vec![1]);
        assert_eq!(fast_tokens(br#"{"tokens":[1,2"#), None);
        assert_eq!(fast_tokens(br#"{"tokens":[1,]}"#), None);
        let big: Vec<u32> = (0..5000).map(|i| i * 7919 % 150_000).collect();
        let body =
            serde_json::to_vec(&json!({"count": 5000, "max_model_len": 8192, "tokens": big, "token_strs": null}))
                .unwrap();
        assert_eq!(fast_tokens(&body).as_ref(), Some(&big));
        assert!(parse_tokenizer_response(b"[1,2]").is_err());
        // Every length of id, with and without spaces, at every alignment.
        let mut x: u64 = 1;
        for case in 0..400 {
            let ids: Vec<u32> = (0..(case % 23))
                .map(|_| {
                    x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    let digits = (x >> 60) % 10 + 1;
                    ((x >> 16) % 10u64.pow(digits as u32)).min(u64::from(u32::MAX)) as u32
                })
                .collect();
            let sep = if case % 3 == 0 { ", " } else { "," };
            let list = ids.iter().map(u32::to_string).collect::<Vec<_>>().join(sep);
            let pad = " ".repeat(case % 5);
            let body = format!(r#"{{{pad}"tokens":[{list}],"token_strs":null}}"#);
            assert_eq!(fast_tokens(body.as_bytes()), Some(ids.clone()), "{body}");
            let body = format!(r#"{{"tokens":[{list}]}}"#);
            assert_eq!(fast_tokens(body.as_bytes()), Some(ids), "{body}");
        }
        assert_eq!(fast_tokens(br#"{"tokens":[4294967295,0,7]}"#), Some(vec![u32::MAX, 0, 7]));
        assert_eq!(fast_tokens(br#"{"tokens":[12a,3]}"#), None);
        assert_eq!(fast_tokens(br#"{"tokens":[1,2,3,4,5,6,7,8,9,10"#), None);
    }
}
