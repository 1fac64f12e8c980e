//! llmgw-sim: a vLLM stand-in that behaves like vLLM where routing can see it.
//!
//! * [`tokenizer`]: a deterministic tokenizer and chat template; `/tokenize` and the engine
//!   share it, as in vLLM.
//! * [`pool`]: a GPU block pool with vLLM's prefix-cache behaviour: blocks hashed with
//!   llmgw-core exactly as vLLM hashes them, hits on leading blocks, LRU eviction of free cached
//!   blocks, and the `BlockStored` / `BlockRemoved` / `AllBlocksCleared` events vLLM emits.
//!
//! The pieces here do no I/O and read no clock, so they are tested directly.

pub mod pool;
pub mod publisher;
pub mod server;
pub mod tokenizer;
