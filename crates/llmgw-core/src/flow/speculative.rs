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
//! data (every worker of the Envoy sees them), or in the endpoint picker's memory, bounded in
//! number ([`MAX_ENTRIES`]), and expire after a TTL: by then the events have confirmed them (the
//! index holds the blocks) or the replica did not keep them ([`add`], [`hits`]).

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

/// The most entries a gateway keeps: past that, the ones expiring first go.
pub const MAX_ENTRIES: usize = 2048;

/// One entry: a block key sent to an engine (`fleet::replica_key`), credited until `expires`
/// (ns).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    pub key: u64,
    pub engine: u64,
    pub expires: u64,
}

/// `entries` with `spec`'s added at `now` and the expired ones gone; how many unexpired entries
/// the bound dropped. An entry expires [`TTL_NS`] after it was first written (routing the same
/// blocks again does not extend it: only KV events, through the index, keep them credited),
/// unless it predates its engine's reset (then it is written anew).
pub fn add(entries: &mut Vec<Entry>, spec: &Speculation, now: u64) -> usize {
    entries.retain(|r| r.expires > now);
    let expires = now.saturating_add(TTL_NS);
    for &key in &spec.keys {
        match entries.iter_mut().find(|r| r.key == key && r.engine == spec.replica) {
            // Written before the engine's reset (or at the instant it was learned): stale.
            Some(r) if spec.reset_ns > 0 && r.expires.saturating_sub(TTL_NS) <= spec.reset_ns => r.expires = expires,
            Some(_) => {}
            None => entries.push(Entry { key, engine: spec.replica, expires }),
        }
    }
    let dropped = entries.len().saturating_sub(MAX_ENTRIES);
    if dropped > 0 {
        // Stable: among equal expiries the older entries (earlier in the list) go first.
        entries.sort_by_key(|r| r.expires);
        entries.drain(..dropped);
    }
    dropped
}

/// For each of `keys` an entry unexpired at `now` holds, a hit.
pub fn hits(entries: impl IntoIterator<Item = Entry>, keys: &[u64], now: u64, out: &mut Vec<Hit>) {
    for r in entries.into_iter().filter(|r| r.expires > now) {
        if let Some(key) = keys.iter().position(|&k| k == r.key) {
            out.push(Hit { key, engine: r.engine, written_ns: r.expires.saturating_sub(TTL_NS) });
        }
    }
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
