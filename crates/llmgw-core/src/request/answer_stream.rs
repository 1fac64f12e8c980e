//! A streamed request's prompt token ids read from the replica's own answer, instead of a
//! tokenizer call after routing (`tokens_from_answers`). vLLM (0.33) sends them when a request
//! asks with `return_token_ids`: the prompt's ids in the stream's first chunk
//! (`prompt_token_ids`) and each chunk's generated ids (`token_ids`), and a chat stream then
//! also sends a chunk for generated tokens that add no text yet.
//!
//! [`ask`] adds the field to the request body. [`AnswerStream`] gives the client the stream
//! vLLM would have sent without it: both fields read `null` again, as vLLM writes them when not
//! asked, and a chat chunk with nothing in it but ids (every choice an empty `delta`, no
//! `finish_reason`, no `logprobs`) is dropped. The first `prompt_token_ids` is kept for the
//! router.
//!
//! The fields are cut out of the event's bytes by a small scanner of our own rather than
//! re-serialized through `serde_json`: a value tree printed again would reorder nothing but
//! could print numbers (log-probabilities) otherwise than vLLM did, and the client must get
//! vLLM's bytes. `serde_json` still reads the chunk's shape; the ids, checked to be a flat
//! array of digits, are read directly (`flat_ids`, tested against `serde_json`).

use serde::Deserialize;
use serde_json::value::RawValue;

/// Whether a `content-type` is a server-sent event stream (a streamed answer, whose first chunk
/// is its first token; vLLM sends the headers at once, before it).
pub fn is_event_stream(content_type: &[u8]) -> bool {
    content_type.get(..17).is_some_and(|p| p.eq_ignore_ascii_case(b"text/event-stream"))
}

/// The field that asks vLLM for the ids, as it is added to the request body.
const ASK: &[u8] = br#""return_token_ids":true"#;
/// The largest stream event held while it is incomplete: a first chunk carries the whole
/// prompt's ids (about 7 bytes per token). Past it the stream goes to the client as the
/// replica sent it (the ids left in) and no ids are read.
pub const MAX_EVENT_BYTES: usize = 16 << 20;

/// The request body with the field added after its opening brace (a JSON object is required;
/// a later key of the same name would win, and requests that carry one are not asked).
pub fn ask(body: &[u8]) -> Option<Vec<u8>> {
    let open = body.iter().position(|b| !b.is_ascii_whitespace())?;
    if body.get(open) != Some(&b'{') {
        return None;
    }
    let rest = body.get(open.checked_add(1)?..)?;
    let empty = rest.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'}');
    let mut out = Vec::with_capacity(body.len().saturating_add(ASK.len()).saturating_add(1));
    out.extend_from_slice(body.get(..=open)?);
    out.extend_from_slice(ASK);
    if !empty {
        out.push(b',');
    }
    out.extend_from_slice(rest);
    Some(out)
}

/// What the stream's first data event said about the prompt's ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FirstEvent {
    /// The prompt's token ids.
    Ids(Vec<u32>),
    /// A first event without them (an engine that does not know the field), or a stream that
    /// could not be read: the tokenizer call is made instead.
    Missing,
}

/// Where the stream's first data event is.
#[derive(Debug, Default)]
enum First {
    /// Not seen yet.
    #[default]
    Ahead,
    /// Seen with the prompt's ids array as written (read when taken, after the event went on).
    Ids(Vec<u8>),
    /// Seen without them, or none will come (the stream ended or is passed on as it comes).
    Without,
    /// Seen, and what it said taken.
    Taken,
}

/// One streamed answer being rewritten.
#[derive(Debug, Default)]
pub struct AnswerStream {
    /// Bytes of an event not yet complete.
    carry: Vec<u8>,
    /// How much of `carry` is known to hold no event end (a large first event arrives in many
    /// chunks: each is scanned once, not the whole event again).
    scanned: usize,
    /// The first data event.
    first: First,
    /// The stream is passed on as it comes (an event past [`MAX_EVENT_BYTES`]).
    passing: bool,
    /// Whether the held event went past [`MAX_EVENT_BYTES`] (counted once).
    pub overflowed: bool,
}

impl AnswerStream {
    /// The bytes to hand on for `chunk` (the events it completes, rewritten); `end`: the last
    /// chunk, after which nothing is held.
    pub fn feed(&mut self, chunk: &[u8], end: bool) -> Vec<u8> {
        if self.passing {
            return chunk.to_vec();
        }
        let mut data = std::mem::take(&mut self.carry);
        data.extend_from_slice(chunk);
        let mut out = Vec::new();
        let mut at = 0;
        // An event end found from here on may begin up to two bytes before the new chunk.
        let mut from = self.scanned.saturating_sub(2);
        while let Some(end_at) = event_end(&data, at.max(from)) {
            if let Some(event) = data.get(at..end_at) {
                self.rewrite(event, &mut out);
            }
            at = end_at;
            from = at;
        }
        let held = data.len().saturating_sub(at);
        if end || held > MAX_EVENT_BYTES {
            // A last event without its blank line, or one past the limit, goes on as it is.
            out.extend_from_slice(data.get(at..).unwrap_or_default());
            if !end {
                self.passing = true;
                self.overflowed = true;
            }
            self.no_first_event();
            self.scanned = 0;
        } else {
            data.drain(..at);
            self.scanned = data.len();
            self.carry = data;
        }
        out
    }

    /// What the first data event said, once (None before it, and after it was taken). The ids
    /// are read here rather than as the event goes by, so that the first token is handed on
    /// without waiting for them.
    pub fn take_first(&mut self) -> Option<FirstEvent> {
        match &self.first {
            First::Ahead | First::Taken => None,
            First::Without => {
                self.first = First::Taken;
                Some(FirstEvent::Missing)
            }
            First::Ids(array) => {
                let said = flat_ids(array).map_or(FirstEvent::Missing, FirstEvent::Ids);
                self.first = First::Taken;
                Some(said)
            }
        }
    }

    fn no_first_event(&mut self) {
        if matches!(self.first, First::Ahead) {
            self.first = First::Without;
        }
    }

    /// One whole event (its blank line included) onto `out`, rewritten.
    fn rewrite(&mut self, event: &[u8], out: &mut Vec<u8>) {
        let Some(json) = event.strip_prefix(b"data: ").filter(|j| j.first() == Some(&b'{')) else {
            out.extend_from_slice(event);
            return;
        };
        let fields = id_fields(json);
        if matches!(self.first, First::Ahead) {
            let array = fields.iter().find(|f| f.prompt).and_then(|f| json.get(f.start..f.end));
            self.first = array.map_or(First::Without, |a| First::Ids(a.to_vec()));
        }
        if fields.is_empty() {
            out.extend_from_slice(event);
            return;
        }
        // Written in place; taken back if it turns out to be a chunk sent only for its ids.
        let mark = out.len();
        out.extend_from_slice(b"data: ");
        let mut from = 0;
        for f in &fields {
            out.extend_from_slice(json.get(from..f.start).unwrap_or_default());
            out.extend_from_slice(b"null");
            from = f.end;
        }
        out.extend_from_slice(json.get(from..).unwrap_or_default());
        if only_ids(out.get(mark.saturating_add(6)..).unwrap_or_default()) {
            out.truncate(mark);
        }
    }
}

/// The end of the first whole event in `data` (through its blank line: `\n\n` or `\n\r\n`)
/// whose line break is at `from` or after, if there is one.
fn event_end(data: &[u8], from: usize) -> Option<usize> {
    let mut i = from;
    while let Some(nl) = data.get(i..)?.iter().position(|b| *b == b'\n') {
        let at = i.checked_add(nl)?;
        match (data.get(at.saturating_add(1)), data.get(at.saturating_add(2))) {
            (Some(b'\n'), _) => return at.checked_add(2),
            (Some(b'\r'), Some(b'\n')) => return at.checked_add(3),
            _ => i = at.checked_add(1)?,
        }
    }
    None
}

/// Where an id array sits in an event's JSON.
#[derive(Debug)]
struct Field {
    start: usize,
    end: usize,
    /// `prompt_token_ids` (else `token_ids`).
    prompt: bool,
}

/// The array values of the keys `prompt_token_ids` and `token_ids` in `json`, in order
/// (strings are skipped whole, so text that looks like such a key is never taken).
fn id_fields(json: &[u8]) -> Vec<Field> {
    let mut fields = Vec::new();
    let mut i = 0;
    while let Some(&b) = json.get(i) {
        if b != b'"' {
            i = i.saturating_add(1);
            continue;
        }
        let Some(close) = string_end(json, i) else { break };
        let key = json.get(i.saturating_add(1)..close).unwrap_or_default();
        i = close.saturating_add(1);
        let prompt = match key {
            b"prompt_token_ids" => true,
            b"token_ids" => false,
            _ => continue,
        };
        let after = skip_ws(json, i);
        if json.get(after) != Some(&b':') {
            continue;
        }
        let start = skip_ws(json, after.saturating_add(1));
        if json.get(start) != Some(&b'[') {
            continue;
        }
        // vLLM's are flat arrays of integers: the first `]` closes one. Anything else (a
        // nested array) is left as it is.
        let Some(len) = json.get(start..).and_then(|v| v.iter().position(|b| *b == b']')) else { break };
        let end = start.saturating_add(len).saturating_add(1);
        let inner = json.get(start.saturating_add(1)..end.saturating_sub(1)).unwrap_or_default();
        if inner.iter().all(|b| b.is_ascii_digit() || *b == b',' || b.is_ascii_whitespace()) {
            fields.push(Field { start, end, prompt });
        }
        i = end;
    }
    fields
}

/// The integers of a flat array `[…]` that [`id_fields`] found (digits, commas and whitespace
/// inside), read directly: a prompt's ids are read on its first token's way to the client, and
/// `serde_json` took several times as long over the same bytes. `None` where JSON would not
/// read an array of `u32` (an empty element, a leading zero, a value past `u32::MAX`).
fn flat_ids(array: &[u8]) -> Option<Vec<u32>> {
    let inner = array.strip_prefix(b"[")?.strip_suffix(b"]")?;
    // About one id per 4 bytes or more ("12, ").
    let mut ids = Vec::with_capacity((inner.len() / 4).saturating_add(1));
    // The number being read, its digit count, and whether whitespace followed its digits.
    let (mut id, mut digits, mut spaced) = (0u32, 0u32, false);
    for &b in inner {
        match b {
            b'0'..=b'9' => {
                // A digit after "0" (a leading zero), or after whitespace (two numbers).
                if spaced || (digits == 1 && id == 0) {
                    return None;
                }
                id = id.checked_mul(10)?.checked_add(u32::from(b.wrapping_sub(b'0')))?;
                digits = digits.saturating_add(1);
            }
            b',' => {
                if digits == 0 {
                    return None;
                }
                ids.push(id);
                (id, digits, spaced) = (0, 0, false);
            }
            b' ' | b'\n' | b'\r' | b'\t' => spaced = digits > 0,
            _ => return None,
        }
    }
    match digits {
        0 if ids.is_empty() => {}
        0 => return None,
        _ => ids.push(id),
    }
    Some(ids)
}

/// The index of the quote closing the string opened at `open`.
fn string_end(json: &[u8], open: usize) -> Option<usize> {
    let mut i = open.checked_add(1)?;
    loop {
        match json.get(i)? {
            b'\\' => i = i.checked_add(2)?,
            b'"' => return Some(i),
            _ => i = i.checked_add(1)?,
        }
    }
}

fn skip_ws(json: &[u8], mut i: usize) -> usize {
    while json.get(i).is_some_and(|b| b.is_ascii_whitespace()) {
        i = i.saturating_add(1);
    }
    i
}

#[derive(Deserialize)]
struct Chunk<'a> {
    #[serde(default, borrow)]
    object: Option<&'a RawValue>,
    #[serde(default, borrow)]
    choices: Vec<Choice<'a>>,
}

#[derive(Deserialize)]
struct Choice<'a> {
    #[serde(default, borrow)]
    delta: Option<&'a RawValue>,
    #[serde(default, borrow)]
    finish_reason: Option<&'a RawValue>,
    #[serde(default, borrow)]
    logprobs: Option<&'a RawValue>,
}

/// A chat chunk (ids already nulled) that vLLM sends only because ids were asked for: every
/// choice an empty delta, without a finish reason or log-probabilities.
fn only_ids(json: &[u8]) -> bool {
    let Ok(c) = serde_json::from_slice::<Chunk>(json) else { return false };
    let null = |v: Option<&RawValue>| v.is_none_or(|v| v.get() == "null");
    c.object.is_some_and(|o| o.get() == r#""chat.completion.chunk""#)
        && !c.choices.is_empty()
        && c.choices.iter().all(|ch| {
            ch.delta.is_some_and(|d| d.get().bytes().filter(|b| !b.is_ascii_whitespace()).eq(*b"{}"))
                && null(ch.finish_reason)
                && null(ch.logprobs)
        })
}

#[cfg(test)]
#[allow(clippy::arithmetic_side_effects)]
mod tests {
    use super::*;

    // Chunks as vLLM 0.33.0 streams them, with and without `return_token_ids` (recorded from a
    // `vllm serve` replica with the conformance suite's no-model executor).
    const COMPLETION_ASKED: &str = r#"data: {"id":"cmpl-a","object":"text_completion","created":1,"model":"tiny","choices":[{"index":0,"text":"useruser","logprobs":null,"finish_reason":"length","stop_reason":null,"prompt_token_ids":[0,281,341],"token_ids":[300,300],"weight_versions":null}],"system_fingerprint":"vllm-0.33.0-4eff9bf1","kv_transfer_params":null}

"#;
    const COMPLETION_PLAIN: &str = r#"data: {"id":"cmpl-a","object":"text_completion","created":1,"model":"tiny","choices":[{"index":0,"text":"useruser","logprobs":null,"finish_reason":"length","stop_reason":null,"prompt_token_ids":null,"token_ids":null,"weight_versions":null}],"system_fingerprint":"vllm-0.33.0-4eff9bf1","kv_transfer_params":null}

"#;
    const CHAT_FIRST_ASKED: &str = r#"data: {"id":"chatcmpl-b","object":"chat.completion.chunk","created":1,"model":"tiny","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],"prompt_token_ids":[0,4,205],"prompt_text":null}

"#;
    const CHAT_FIRST_PLAIN: &str = r#"data: {"id":"chatcmpl-b","object":"chat.completion.chunk","created":1,"model":"tiny","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],"prompt_token_ids":null,"prompt_text":null}

"#;
    const CHAT_IDS_ONLY: &str = r#"data: {"id":"chatcmpl-b","object":"chat.completion.chunk","created":1,"model":"tiny","choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":null,"token_ids":[300],"weight_versions":null}]}

"#;
    const CHAT_LAST_ASKED: &str = r#"data: {"id":"chatcmpl-b","object":"chat.completion.chunk","created":1,"model":"tiny","choices":[{"index":0,"delta":{"content":"user"},"logprobs":null,"finish_reason":"length","stop_reason":null,"token_ids":[300,300],"weight_versions":null}]}

"#;
    const CHAT_LAST_PLAIN: &str = r#"data: {"id":"chatcmpl-b","object":"chat.completion.chunk","created":1,"model":"tiny","choices":[{"index":0,"delta":{"content":"user"},"logprobs":null,"finish_reason":"length","stop_reason":null,"token_ids":null,"weight_versions":null}]}

"#;
    const DONE: &str = "data: [DONE]\n\n";

    fn whole(s: &mut AnswerStream, chunks: &[&[u8]]) -> Vec<u8> {
        let mut out = Vec::new();
        for (i, c) in chunks.iter().enumerate() {
            out.extend(s.feed(c, i + 1 == chunks.len()));
        }
        out
    }

    #[test]
    fn a_completion_stream_reaches_the_client_as_vllm_sends_it_unasked_and_its_prompt_ids_are_read() {
        let mut s = AnswerStream::default();
        let out = whole(&mut s, &[COMPLETION_ASKED.as_bytes(), DONE.as_bytes()]);
        assert_eq!(String::from_utf8(out).unwrap(), format!("{COMPLETION_PLAIN}{DONE}"));
        assert_eq!(s.take_first(), Some(FirstEvent::Ids(vec![0, 281, 341])));
        assert_eq!(s.take_first(), None);
    }

    #[test]
    fn a_chat_stream_loses_the_chunks_sent_only_for_ids_and_keeps_every_other_byte() {
        let asked = format!("{CHAT_FIRST_ASKED}{CHAT_IDS_ONLY}{CHAT_LAST_ASKED}{DONE}");
        // Split everywhere: events held across chunks come out whole.
        for cut in [1, 7, 100, 250, asked.len() - 3] {
            let (a, b) = asked.as_bytes().split_at(cut);
            let mut s = AnswerStream::default();
            let out = whole(&mut s, &[a, b]);
            assert_eq!(
                String::from_utf8(out).unwrap(),
                format!("{CHAT_FIRST_PLAIN}{CHAT_LAST_PLAIN}{DONE}"),
                "cut {cut}"
            );
            assert_eq!(s.take_first(), Some(FirstEvent::Ids(vec![0, 4, 205])));
        }
    }

    #[test]
    fn an_answer_fed_a_byte_at_a_time_comes_out_as_fed_whole() {
        // `\n\r\n` ends an event too; each byte is scanned once, so the split must not matter.
        let asked = format!("{CHAT_FIRST_ASKED}{}{CHAT_LAST_ASKED}{DONE}", CHAT_IDS_ONLY.replace("\n\n", "\n\r\n"));
        let mut s = AnswerStream::default();
        let mut out = Vec::new();
        for (i, b) in asked.as_bytes().iter().enumerate() {
            out.extend(s.feed(&[*b], i + 1 == asked.len()));
        }
        assert_eq!(String::from_utf8(out).unwrap(), format!("{CHAT_FIRST_PLAIN}{CHAT_LAST_PLAIN}{DONE}"));
        assert_eq!(s.take_first(), Some(FirstEvent::Ids(vec![0, 4, 205])));
    }

    #[test]
    fn ids_are_read_as_json_reads_them() {
        for text in [
            "[]",
            "[ ]",
            "[0]",
            "[7, 12 ,300]",
            "[\n1,\r\n2\t]",
            "[4294967295]",
            "[4294967296]",
            "[01]",
            "[1,,2]",
            "[1,]",
            "[,1]",
            "[1 2]",
            "[00]",
            "[99999999999999999999]",
        ] {
            let ours = flat_ids(text.as_bytes());
            let json = serde_json::from_str::<Vec<u32>>(text).ok();
            assert_eq!(ours, json, "{text}");
        }
    }

    proptest::proptest! {
        #[test]
        fn any_flat_array_is_read_as_json_reads_it(
            parts in proptest::collection::vec(("[ \n]{0,2}", "[0-9]{0,11}", "[ \t]{0,2}"), 0..12),
        ) {
            let items: Vec<String> = parts.iter().map(|(a, d, b)| format!("{a}{d}{b}")).collect();
            let text = format!("[{}]", items.join(","));
            proptest::prop_assert_eq!(flat_ids(text.as_bytes()), serde_json::from_str::<Vec<u32>>(&text).ok(), "{}", text);
        }
    }

    #[test]
    fn text_that_looks_like_an_id_field_is_left_alone() {
        let tricky = r#"data: {"object":"chat.completion.chunk","choices":[{"delta":{"content":"say \"token_ids\":[1] and \\"},"finish_reason":null,"token_ids":[9]}],"prompt_token_ids":[3]}

"#;
        let mut s = AnswerStream::default();
        let out = String::from_utf8(s.feed(tricky.as_bytes(), false)).unwrap();
        assert_eq!(
            out,
            r#"data: {"object":"chat.completion.chunk","choices":[{"delta":{"content":"say \"token_ids\":[1] and \\"},"finish_reason":null,"token_ids":null}],"prompt_token_ids":null}

"#
        );
        assert_eq!(s.take_first(), Some(FirstEvent::Ids(vec![3])));
    }

    #[test]
    fn an_id_field_that_is_not_a_flat_array_of_integers_is_left_as_it_came() {
        let odd = "data: {\"choices\":[{\"token_ids\":[[1],[2]],\"text\":\"a\"}],\"prompt_token_ids\":[1,-2]}\n\n";
        let mut s = AnswerStream::default();
        assert_eq!(String::from_utf8(s.feed(odd.as_bytes(), false)).unwrap(), odd);
        assert_eq!(s.take_first(), Some(FirstEvent::Missing));
    }

    #[test]
    fn a_stream_without_ids_passes_unchanged_and_says_they_are_missing() {
        let mut s = AnswerStream::default();
        let out = whole(&mut s, &[COMPLETION_PLAIN.as_bytes(), DONE.as_bytes()]);
        assert_eq!(String::from_utf8(out).unwrap(), format!("{COMPLETION_PLAIN}{DONE}"));
        assert_eq!(s.take_first(), Some(FirstEvent::Missing));
        let mut empty = AnswerStream::default();
        assert!(empty.feed(b"", true).is_empty());
        assert_eq!(empty.take_first(), Some(FirstEvent::Missing));
    }

    #[test]
    fn an_event_past_the_limit_goes_on_as_it_came_and_nothing_more_is_held() {
        let mut s = AnswerStream::default();
        let big = vec![b'x'; MAX_EVENT_BYTES + 1];
        assert_eq!(s.feed(b"data: {", false), b"");
        let out = s.feed(&big, false);
        assert_eq!(out.len(), big.len() + 7);
        assert!(s.overflowed);
        assert_eq!(s.take_first(), Some(FirstEvent::Missing));
        assert_eq!(s.feed(COMPLETION_ASKED.as_bytes(), false), COMPLETION_ASKED.as_bytes());
    }

    #[test]
    fn the_field_is_added_to_an_object_body_only() {
        assert_eq!(ask(br#" {"a":1}"#).unwrap(), br#" {"return_token_ids":true,"a":1}"#.to_vec());
        assert_eq!(ask(b"{ }").unwrap(), br#"{"return_token_ids":true }"#.to_vec());
        assert_eq!(ask(b"[1]"), None);
        assert_eq!(ask(b""), None);
        let v: serde_json::Value = serde_json::from_slice(&ask(br#"{"stream":true}"#).unwrap()).unwrap();
        assert_eq!(v["return_token_ids"], true);
    }
}
