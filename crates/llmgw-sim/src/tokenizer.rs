//! A deterministic word-level tokenizer with a chat template. Any scheme works for routing as
//! long as `/tokenize` and the engine agree, which they do by sharing this code.

/// Beginning of sequence.
pub const BOS: u32 = 1;
/// End of a chat turn.
pub const EOT: u32 = 2;
const ROLE_SYSTEM: u32 = 3;
const ROLE_USER: u32 = 4;
const ROLE_ASSISTANT: u32 = 5;
const ROLE_TOOL: u32 = 6;
/// Ids below this are special; words map to `FIRST_WORD..FIRST_WORD + WORDS`.
const FIRST_WORD: u32 = 100;
const WORDS: u32 = 32_000;

/// One chat message (text content only; structured parts are joined by the caller).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

fn fnv1a(s: &str) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for b in s.bytes() {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    h
}

/// The token id of one word.
fn word_id(w: &str) -> u32 {
    FIRST_WORD.saturating_add(fnv1a(w) % WORDS)
}

/// Splits text into words and punctuation marks and maps each to an id.
pub fn encode(text: &str, add_bos: bool) -> Vec<u32> {
    let mut out = Vec::with_capacity((text.len() / 4).saturating_add(2));
    if add_bos {
        out.push(BOS);
    }
    let mut start: Option<usize> = None;
    for (i, c) in text.char_indices() {
        let is_word = c.is_alphanumeric() || c == '_' || c == '\'';
        match (is_word, start) {
            (true, None) => start = Some(i),
            (true, Some(_)) => {}
            (false, s) => {
                if let Some(s) = s {
                    out.push(word_id(text.get(s..i).unwrap_or_default()));
                    start = None;
                }
                if !c.is_whitespace() {
                    let mut buf = [0u8; 4];
                    out.push(word_id(c.encode_utf8(&mut buf)));
                }
            }
        }
    }
    if let Some(s) = start {
        out.push(word_id(text.get(s..).unwrap_or_default()));
    }
    out
}

fn role_id(role: &str) -> u32 {
    match role {
        "system" | "developer" => ROLE_SYSTEM,
        "assistant" => ROLE_ASSISTANT,
        "tool" => ROLE_TOOL,
        _ => ROLE_USER,
    }
}

/// The chat template: `BOS`, then per message `<role> content EOT`, then `<assistant>` when a
/// generation prompt is asked for. Like vLLM's chat path, BOS comes from the template only.
pub fn apply_chat_template(messages: &[ChatMessage], add_generation_prompt: bool) -> Vec<u32> {
    let mut out = vec![BOS];
    for m in messages {
        out.push(role_id(&m.role));
        out.extend(encode(&m.content, false));
        out.push(EOT);
    }
    if add_generation_prompt {
        out.push(ROLE_ASSISTANT);
    }
    out
}

/// A reply's text for `n` generated tokens (deterministic, from the prompt's last token).
pub fn generated_tokens(prompt: &[u32], n: usize) -> Vec<u32> {
    let mut x = prompt.last().copied().unwrap_or(7);
    (0..n)
        .map(|_| {
            x = x.wrapping_mul(1_103_515_245).wrapping_add(12_345);
            FIRST_WORD.saturating_add((x >> 8) % WORDS)
        })
        .collect()
}

/// Text for token ids (ids are not invertible; each becomes `w<id>`).
pub fn decode(tokens: &[u32]) -> String {
    let words: Vec<String> = tokens.iter().map(|t| format!("w{t}")).collect();
    words.join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_and_prefix_stable() {
        let a = encode("You are a helpful assistant. Answer briefly.", true);
        let b = encode("You are a helpful assistant. Answer briefly. What is 2+2?", true);
        assert_eq!(a.first(), Some(&BOS));
        assert_eq!(a.len(), 10);
        assert_eq!(b.get(..a.len()), Some(a.as_slice()));
        assert_ne!(encode("cat", false), encode("dog", false));
    }

    #[test]
    fn chat_turns_extend_the_previous_prompt() {
        let sys = ChatMessage { role: "system".into(), content: "Be terse.".into() };
        let u1 = ChatMessage { role: "user".into(), content: "Hi there".into() };
        let a1 = ChatMessage { role: "assistant".into(), content: "Hello".into() };
        let u2 = ChatMessage { role: "user".into(), content: "More".into() };
        let t1 = apply_chat_template(&[sys.clone(), u1.clone()], true);
        let t2 = apply_chat_template(&[sys, u1, a1, u2], true);
        // The second turn starts with the first turn's prompt (its generation prompt included).
        assert_eq!(t2.get(..t1.len()), Some(t1.as_slice()));
    }
}
