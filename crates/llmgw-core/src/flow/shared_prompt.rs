//! A tokenized text prompt, as a VM keeps it for the text prompts after it and hands it to the
//! other VMs of its gateway (see [`super::earlier_prompts`]), with the bounds every VM keeps it
//! within.

use std::sync::Arc;

/// Tokens kept of each prompt.
pub const MAX_TOKENS: usize = 2048;
/// A prompt's marks: the tags (64 bits of them) of its leading `MARK`, `2 × MARK`, … bytes, up
/// to `MAX_MARKS` of them; how far two prompts' texts agree is read from them, to `MARK` bytes.
pub const MARK: usize = 64;
pub const MAX_MARKS: usize = 512;
/// The shortest leading text a prompt is kept and looked up under (a few blocks' worth of
/// tokens).
pub const FIRST_BOUNDARY: usize = 128;

/// The most tags a prompt is kept under (its leading 128, 256, … bytes, to `MARK × MAX_MARKS`).
pub const MAX_PROMPT_TAGS: usize = 9;

/// A tokenized text prompt.
#[derive(Debug, Clone, PartialEq)]
pub struct EarlierPrompt {
    /// Its length in bytes, and the tag of its whole text.
    pub bytes: usize,
    pub whole: u128,
    /// Its first [`MAX_TOKENS`] tokens, and how many it had.
    pub tokens: Vec<u32>,
    pub count: usize,
    /// The tags of its leading `64 × (i + 1)` bytes, at most [`MAX_MARKS`].
    pub marks: Vec<u64>,
}

/// A prompt one VM learned, for the other VMs of the gateway: the tags it is kept under, and
/// the prompt.
#[derive(Debug, Clone, PartialEq)]
pub struct SharedPrompt {
    pub tags: Vec<u128>,
    pub prompt: Arc<EarlierPrompt>,
}

impl SharedPrompt {
    /// Within the bounds a VM keeps a prompt under (a prompt read back from shared data is
    /// taken up only if it is).
    pub fn is_bounded(&self) -> bool {
        let p = &self.prompt;
        (1..=MAX_PROMPT_TAGS).contains(&self.tags.len())
            && !p.tokens.is_empty()
            && p.tokens.len() <= MAX_TOKENS
            && p.count >= p.tokens.len()
            && p.marks.len() <= MAX_MARKS
            && p.bytes >= FIRST_BOUNDARY
    }
}
