//! What a request adds to its block hashes besides tokens: the extra keys vLLM mixes in.

/// One extra key as vLLM hashes it (tagged tuples since vLLM 0.32).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExtraKey {
    /// `("lora", name, path)` on every block of a LoRA request.
    Lora { name: String, path: String },
    /// `("mm", identifier, offset - block_start)` for a multimodal item overlapping the block.
    Mm { identifier: String, offset: i64 },
    /// `("cache_salt", salt)` on block 0 only.
    CacheSalt(String),
    /// `("prompt_embeds", sha256 of the block's embedding tensor bytes)`.
    PromptEmbeds(Vec<u8>),
    /// Lookahead hashing (EAGLE-family speculative decoding, vLLM 0.33): the `L` tokens after
    /// the block. Always the last key; the block's extra keys are then `(E, *tokens)`, where `E`
    /// is the tuple of the keys before it (or `None` when there are none).
    Lookahead(Vec<u32>),
}

/// A multimodal item's placeholder range in the prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MmFeature {
    pub identifier: String,
    pub offset: u64,
    pub length: u64,
}

/// What a request adds to its block hashes besides tokens.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestExtras {
    pub cache_salt: Option<String>,
    /// (adapter name, adapter path) as the engine loaded it.
    pub lora: Option<(String, String)>,
    /// Sorted by offset, as vLLM keeps them.
    pub mm: Vec<MmFeature>,
    /// vLLM's `num_hash_lookahead_tokens` (EAGLE-family speculative decoding with prefix
    /// caching): each block's hash also covers the next this many tokens, so a block is hashed
    /// only once they exist. 0: plain hashing.
    pub lookahead: usize,
}

impl RequestExtras {
    /// Full blocks of `n_tokens` the engine hashes (those followed by `lookahead` more tokens);
    /// `None` for a zero block size.
    pub fn hashed_blocks(&self, n_tokens: usize, block_size: usize) -> Option<usize> {
        n_tokens.saturating_sub(self.lookahead).checked_div(block_size)
    }
}
