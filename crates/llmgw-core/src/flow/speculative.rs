//! Speculative index entries: the blocks a gateway just sent to a replica, before any KV event
//! says that replica holds them (the engine publishes a block once it is computed, and the
//! event then crosses the agent and the feed). A burst of requests sharing a new prefix would
//! otherwise be spread as if nobody held it; with these entries the requests after the first go
//! where the first went, unless the predicted time to first token says otherwise.
//!
//! Blocks hash as a chain, so an entry for block `p` stands for the whole run `0..=p`: a
//! request records only its blocks at the checkpoints `0, 1, 3, 7, 15, …` (and its last hashed
//! block), at most [`MAX_BLOCKS`] deep, past the run its replica is already known to hold. A
//! lookup finds the deepest checkpoint a replica was sent. Entries live in the filter's shared
//! data (every worker of the Envoy sees them), bounded in number, and expire after a TTL: by
//! then the events have confirmed them (the index holds the blocks) or the replica did not keep
//! them.

/// Blocks hashed for speculative entries: 1,024 tokens at block size 16, seven checkpoints.
pub const MAX_BLOCKS: usize = 64;

/// How long an entry is credited without an event confirming it (from its first write).
pub const TTL_NS: u64 = 2_000_000_000;

/// A speculative entry found for a request: the index of its key, the engine it was sent to
/// (`fleet::replica_key`) and when it was written. An entry written before this VM learned of its
/// engine's reset (a restart: its cache is empty) is not credited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hit {
    pub key: usize,
    pub engine: u64,
    pub written_ns: u64,
}

/// The checkpoints of a run of `n` hashed blocks: `0, 1, 3, 7, …` below `n`, and `n − 1`.
pub fn checkpoints(n: usize) -> impl Iterator<Item = usize> {
    let mut next = Some(0usize);
    let last = n.checked_sub(1);
    std::iter::from_fn(move || {
        let p = next?;
        if last.is_none_or(|l| p >= l) {
            next = None;
            return last;
        }
        next = p.checked_mul(2).and_then(|x| x.checked_add(1));
        Some(p)
    })
}

/// What a routed request leaves for the next ones: its blocks at the checkpoints past the run
/// its replica held, to be recorded for `replica`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Speculation {
    pub replica: u64,
    pub keys: Vec<u64>,
    /// When this VM learned the engine was reset (0: not within the TTL): entries written
    /// before are stale and are written anew.
    pub reset_ns: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checkpoints_double_and_end_at_the_last_block() {
        assert_eq!(checkpoints(0).collect::<Vec<_>>(), Vec::<usize>::new());
        assert_eq!(checkpoints(1).collect::<Vec<_>>(), vec![0]);
        assert_eq!(checkpoints(2).collect::<Vec<_>>(), vec![0, 1]);
        assert_eq!(checkpoints(8).collect::<Vec<_>>(), vec![0, 1, 3, 7]);
        assert_eq!(checkpoints(50).collect::<Vec<_>>(), vec![0, 1, 3, 7, 15, 31, 49]);
        assert_eq!(checkpoints(MAX_BLOCKS).count(), 7);
    }
}
