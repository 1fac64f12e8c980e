//! The fleet as routing sees it: identities of the engines behind the replicas the feed
//! announces.

use crate::stable_hash::{mix64, stable_hash};

/// The identity of one engine: its replica's address, and its rank on a data-parallel replica
/// (whose ranks share the address). Speculative entries and resets name engines by it.
pub fn replica_key(address: &str, dp_rank: Option<u32>) -> u64 {
    let a = stable_hash(address.as_bytes());
    match dp_rank {
        Some(rank) => mix64(a ^ u64::from(rank).wrapping_add(1)),
        None => a,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_of_one_address_are_different_engines() {
        assert_ne!(replica_key("a:1", None), replica_key("a:1", Some(0)));
        assert_ne!(replica_key("a:1", Some(0)), replica_key("a:1", Some(1)));
    }
}
