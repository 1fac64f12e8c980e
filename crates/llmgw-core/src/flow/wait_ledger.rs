//! Whether waiting for a request's own tokens pays, learned per family of requests that share a
//! prefix: a chat request's siblings (the same messages but the last, [`super::shared_prefix`])
//! or text prompts that begin with the same text ([`super::earlier_prompts`]).
//!
//! A request routed on a prefix it shares with earlier ones waits for its own tokens where two
//! or more replicas hold that prefix whole: only its tokens tell which of them holds more of it.
//! Where the family's recent waits found those holders holding no more of the request than one
//! another (each sibling asks a new question), waiting costs a tokenizer round trip and gains
//! nothing. So a
//! wait that found nothing lets the next member go at once; each further such wait doubles how
//! many go at once before the next one waits to check (1, 3, 7, … up to 63 of 64), and a wait
//! that found a replica holding more (a question asked before) makes every member wait again.
//! A family that has not waited yet starts from the same count taken over every family's waits
//! in a row, so that each new system prompt's first members do not each wait to learn what the
//! others already showed.

use super::recent::Recent;

/// Families kept per VM (a few dozen bytes each), the least recently used dropped first.
pub const MAX_FAMILIES: usize = 1024;

/// The most waits in a row that found nothing past the prefix counted: afterwards one member
/// in 2^6 still waits, so a family whose questions start to repeat is noticed.
const MAX_UNPAID: u8 = 6;

/// A request that waited for its tokens to learn for its family (`family`, a tag) whether they
/// show more than the `prefix` tokens it could have been routed on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WaitedOn {
    pub family: u128,
    pub prefix: usize,
}

#[derive(Debug, Default, Clone, Copy)]
struct Waits {
    /// Members in a row that waited and found no replica holding past the prefix (up to
    /// [`MAX_UNPAID`]).
    unpaid: u8,
    /// Members that may still go at once before the next one waits to check.
    at_once: u8,
}

/// Each family's recent waits, and every family's.
#[derive(Debug)]
pub struct WaitLedger {
    families: Recent<Waits>,
    /// Waits in a row, of any family, that found nothing past the prefix (up to
    /// [`MAX_UNPAID`]): a family not seen yet starts from this.
    streak: u8,
}

impl Default for WaitLedger {
    fn default() -> Self {
        WaitLedger { families: Recent::new(MAX_FAMILIES, |_| false), streak: 0 }
    }
}

impl WaitLedger {
    /// A member of `family` that waited for its own tokens found a replica holding blocks past
    /// the prefix (`paid`), or none did.
    pub fn waited(&mut self, family: u128, paid: bool) {
        let unpaid = unpaid_after(self.families.peek(family).map_or(0, |w| w.unpaid), paid);
        self.families.insert(family, Waits { unpaid, at_once: at_once_after(unpaid) });
        self.streak = unpaid_after(self.streak, paid);
    }

    /// Whether a member of `family` may skip waiting for its tokens (and counts it). A family
    /// seen first here goes by every family's waits in a row; its own count starts from its
    /// own first wait.
    pub fn skips_waiting(&mut self, family: u128) -> bool {
        // Only a family given members to send at once takes a slot before its first wait.
        if !self.families.contains(family) {
            let at_once = at_once_after(self.streak);
            if at_once == 0 {
                return false;
            }
            self.families.insert(family, Waits { unpaid: 0, at_once });
        }
        let Some(w) = self.families.get(family) else { return false };
        if w.at_once == 0 {
            return false;
        }
        w.at_once = w.at_once.saturating_sub(1);
        true
    }

    /// Families dropped for room since the last call.
    pub fn take_evicted(&mut self) -> u64 {
        self.families.take_evicted()
    }

    pub fn clear(&mut self) {
        self.families.clear();
        self.streak = 0;
    }
}

/// The waits in a row that found nothing past the prefix, after one that did (`paid`) or not.
fn unpaid_after(unpaid: u8, paid: bool) -> u8 {
    if paid {
        0
    } else {
        unpaid.saturating_add(1).min(MAX_UNPAID)
    }
}

/// Members that go at once after `unpaid` such waits in a row: 2^unpaid − 1.
fn at_once_after(unpaid: u8) -> u8 {
    1u8.checked_shl(u32::from(unpaid)).unwrap_or(u8::MAX).saturating_sub(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at_once(l: &mut WaitLedger, family: u128) -> usize {
        (0..100).take_while(|_| l.skips_waiting(family)).count()
    }

    #[test]
    fn each_wait_that_found_nothing_past_the_prefix_lets_twice_as_many_members_go_at_once() {
        let mut l = WaitLedger::default();
        assert_eq!(at_once(&mut l, 1), 0);
        let mut seen = Vec::new();
        for _ in 0..8 {
            l.waited(1, false);
            seen.push(at_once(&mut l, 1));
        }
        assert_eq!(seen, [1, 3, 7, 15, 31, 63, 63, 63]);
        // A wait that paid: every member waits again.
        l.waited(1, false);
        l.waited(1, true);
        assert_eq!(at_once(&mut l, 1), 0);
        l.waited(1, false);
        assert_eq!(at_once(&mut l, 1), 1);
    }

    #[test]
    fn a_family_that_has_not_waited_starts_from_the_recent_waits_of_every_family() {
        let mut l = WaitLedger::default();
        l.waited(1, false);
        l.waited(1, false);
        // Two waits in a row found nothing past family 1's prefix: family 2's first 3 members
        // go at once, then one waits; what it finds is family 2's own from then on.
        assert_eq!(at_once(&mut l, 2), 3);
        l.waited(2, false);
        assert_eq!(at_once(&mut l, 2), 1);
        // A family whose first wait comes before any skip counts from that wait.
        l.waited(4, false);
        assert_eq!(at_once(&mut l, 4), 1);
        // A wait that paid (any family's): a new family waits from its first member again,
        // and the families already seen keep their own count.
        l.waited(1, true);
        assert_eq!(at_once(&mut l, 3), 0);
        // Checked without a budget, it takes no slot (only its first wait does).
        assert!(!l.families.contains(3));
        l.waited(2, false);
        assert_eq!(at_once(&mut l, 2), 3);
    }

    #[test]
    fn families_are_bounded_and_the_least_recently_used_go_first() {
        let mut l = WaitLedger::default();
        l.waited(0, false);
        for f in 1..(MAX_FAMILIES as u128 + 5) {
            l.waited(f, false);
            // Family 0 is used now and then: it stays.
            if f % 100 == 0 {
                l.skips_waiting(0);
            }
        }
        assert!(l.families.contains(0) && !l.families.contains(1));
        assert_eq!((l.take_evicted(), l.take_evicted()), (5, 0));
    }
}
