//! The prompt's leading text for the approximate fallback, read without a full JSON parse: for
//! chats, a walk over the raw messages (already validated by the request parser) that stops once
//! `max` bytes are gathered, so a long message costs nothing past the key's bytes. The result is
//! byte for byte what a full parse would give: each message's role and text, each followed by a
//! newline, capped at `max`.

use super::parsed::{ParsedRequest, Prompt};

impl ParsedRequest {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::{parse_request, ApiKind};
    use serde_json::{json, Value};

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
}
