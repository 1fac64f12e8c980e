//! Sequence discipline for one publisher (one engine), with no I/O.
//!
//! vLLM numbers each published batch from 0 upwards per publisher instance, with no epoch: a
//! restart shows up only as the number going back to 0, or, if the agent was disconnected for
//! a while, as a jump. The rules:
//!
//! * `seq == expected`: apply.
//! * first message ever, `seq > 0`: the batches before it were missed → fill `0..seq` by replay.
//! * `seq > expected`: gap → fill `expected..seq` by replay; if that does not cover the range,
//!   reset the mirror.
//! * `seq < expected`: the engine restarted → reset, then fill `0..seq` by replay.
//! * after the publisher's connection dropped and came back ([`SeqTracker::mark_reconnect`]),
//!   any `seq != expected` is treated as a restart: a restarted engine's numbers may already have
//!   passed the old ones, so a jump cannot be told apart from a restart.
//!
//! A fill is checked with [`Fill`]: replayed batches must continue the sequence without a hole
//! and reach `until - 1`.

/// Why a fill is needed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cause {
    /// The first message seen from this publisher does not start at 0.
    Initial,
    /// Sequence numbers were skipped.
    Gap,
    /// The sequence went backwards: the engine restarted.
    Restart,
    /// The publisher reconnected and the sequence did not continue.
    Reconnect,
}

impl Cause {
    pub fn as_str(self) -> &'static str {
        match self {
            Cause::Initial => "initial",
            Cause::Gap => "gap",
            Cause::Restart => "restart",
            Cause::Reconnect => "reconnect",
        }
    }
}

/// What to do with a live message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// It continues the sequence: apply it.
    Apply,
    /// First reset the mirror if `reset`, then fetch batches `from..until` (until = the live
    /// seq), apply them, then apply the live message.
    Fill { from: u64, until: u64, reset: bool, cause: Cause },
}

#[derive(Debug, Clone, Default)]
pub struct SeqTracker {
    expected: Option<u64>,
    reconnected: bool,
}

impl SeqTracker {
    pub fn new() -> Self {
        Self::default()
    }

    /// The next sequence number expected, if any message was seen.
    pub fn expected(&self) -> Option<u64> {
        self.expected
    }

    /// The last applied sequence number.
    pub fn last(&self) -> Option<u64> {
        self.expected.and_then(|e| e.checked_sub(1))
    }

    /// The publisher's connection dropped: the next message may come from a new engine.
    pub fn mark_reconnect(&mut self) {
        self.reconnected = true;
    }

    /// The reconnected publisher was verified to be the same engine (its replay buffer holds
    /// the last batch applied here): the next message is judged as if no reconnect happened.
    pub fn confirm_same_publisher(&mut self) {
        self.reconnected = false;
    }

    /// Forget everything (the mirror was reset from outside, e.g. the replica went down): the
    /// next message is handled like the first one.
    pub fn forget(&mut self) {
        self.expected = None;
        self.reconnected = false;
    }

    /// Judges a live message. The caller then either applies it, or performs the fill and
    /// applies it; either way it calls [`SeqTracker::applied`] with `seq`.
    pub fn observe(&mut self, seq: u64) -> Verdict {
        let reconnected = std::mem::take(&mut self.reconnected);
        match self.expected {
            None if seq == 0 => Verdict::Apply,
            None => Verdict::Fill { from: 0, until: seq, reset: false, cause: Cause::Initial },
            Some(e) if seq == e => Verdict::Apply,
            Some(_) if reconnected => Verdict::Fill { from: 0, until: seq, reset: true, cause: Cause::Reconnect },
            Some(e) if seq > e => Verdict::Fill { from: e, until: seq, reset: false, cause: Cause::Gap },
            Some(_) => Verdict::Fill { from: 0, until: seq, reset: true, cause: Cause::Restart },
        }
    }

    /// Records that the live message `seq` was applied.
    pub fn applied(&mut self, seq: u64) {
        self.expected = Some(seq.saturating_add(1));
    }
}

/// What to do with one replayed batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FillStep {
    /// Before the range (or a duplicate): ignore.
    Skip,
    /// Next in the range: apply it.
    Apply,
    /// At or past the live message: ignore (the live copy is applied after the fill).
    Done,
    /// A hole: the replay does not cover the range. Stop.
    Hole,
}

/// Checks replayed batches against the range `from..until`.
///
/// A replay buffer keeps only the last batches (vLLM's `buffer_steps`): its first batch may
/// come after `from`. That first batch is still taken (the range is then covered from it on,
/// see [`Fill::late_start`]); a hole after it ends the fill.
#[derive(Debug, Clone)]
pub struct Fill {
    next: u64,
    until: u64,
    /// The first batch taken, when it came after the start of the range.
    late_start: Option<u64>,
    /// Whether a batch was taken.
    started: bool,
}

impl Fill {
    pub fn new(from: u64, until: u64) -> Self {
        Self { next: from, until, late_start: None, started: false }
    }

    pub fn step(&mut self, seq: u64) -> FillStep {
        if self.next >= self.until {
            return FillStep::Done;
        }
        if seq < self.next {
            FillStep::Skip
        } else if seq == self.next || !self.started {
            if seq >= self.until {
                return FillStep::Hole;
            }
            if seq != self.next {
                self.late_start = Some(seq);
            }
            self.started = true;
            self.next = seq.saturating_add(1);
            FillStep::Apply
        } else {
            FillStep::Hole
        }
    }

    /// Whether the range was covered up to its end (from its start, or from a late start).
    pub fn reached_end(&self) -> bool {
        self.next >= self.until
    }

    /// Whether every batch of the range was applied.
    pub fn complete(&self) -> bool {
        self.reached_end() && self.late_start.is_none()
    }

    /// The first batch taken when the source no longer held the start of the range.
    pub fn late_start(&self) -> Option<u64> {
        self.late_start
    }

    /// Batches still missing.
    pub fn missing(&self) -> u64 {
        self.until.saturating_sub(self.next)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(t: &mut SeqTracker, seqs: &[u64]) -> Vec<Verdict> {
        seqs.iter()
            .map(|&s| {
                let v = t.observe(s);
                t.applied(s);
                v
            })
            .collect()
    }

    #[test]
    fn in_order_applies() {
        let mut t = SeqTracker::new();
        assert!(run(&mut t, &[0, 1, 2, 3]).iter().all(|v| *v == Verdict::Apply));
        assert_eq!(t.expected(), Some(4));
        assert_eq!(t.last(), Some(3));
    }

    #[test]
    fn late_start_fills_from_zero() {
        let mut t = SeqTracker::new();
        assert_eq!(t.observe(7), Verdict::Fill { from: 0, until: 7, reset: false, cause: Cause::Initial });
    }

    #[test]
    fn gap_fills_missing_range_without_reset() {
        let mut t = SeqTracker::new();
        run(&mut t, &[0, 1, 2]);
        assert_eq!(t.observe(6), Verdict::Fill { from: 3, until: 6, reset: false, cause: Cause::Gap });
        t.applied(6);
        assert_eq!(t.observe(7), Verdict::Apply);
    }

    #[test]
    fn backwards_is_a_restart() {
        let mut t = SeqTracker::new();
        run(&mut t, &[0, 1, 2, 3, 4]);
        assert_eq!(t.observe(0), Verdict::Fill { from: 0, until: 0, reset: true, cause: Cause::Restart });
        t.applied(0);
        assert_eq!(t.observe(1), Verdict::Apply);
        run(&mut t, &[1, 2, 3]);
        assert_eq!(t.observe(2), Verdict::Fill { from: 0, until: 2, reset: true, cause: Cause::Restart });
    }

    #[test]
    fn reconnect_jump_is_a_restart_but_continuation_is_not() {
        let mut t = SeqTracker::new();
        run(&mut t, &[0, 1, 2]);
        t.mark_reconnect();
        assert_eq!(t.observe(3), Verdict::Apply);
        t.applied(3);
        t.mark_reconnect();
        assert_eq!(t.observe(900), Verdict::Fill { from: 0, until: 900, reset: true, cause: Cause::Reconnect });
        t.applied(900);
        // The flag is consumed by one message.
        assert_eq!(t.observe(905), Verdict::Fill { from: 901, until: 905, reset: false, cause: Cause::Gap });
    }

    #[test]
    fn confirmed_reconnect_treats_a_jump_as_a_gap() {
        let mut t = SeqTracker::new();
        run(&mut t, &[0, 1, 2]);
        t.mark_reconnect();
        t.confirm_same_publisher();
        assert_eq!(t.observe(6), Verdict::Fill { from: 3, until: 6, reset: false, cause: Cause::Gap });
    }

    #[test]
    fn forget_starts_over() {
        let mut t = SeqTracker::new();
        run(&mut t, &[0, 1, 2]);
        t.forget();
        assert_eq!(t.expected(), None);
        assert_eq!(t.observe(3).clone(), Verdict::Fill { from: 0, until: 3, reset: false, cause: Cause::Initial });
    }

    #[test]
    fn fill_covers_exact_range() {
        let mut f = Fill::new(3, 6);
        let steps: Vec<FillStep> = [1, 2, 3, 4, 5, 6, 7].iter().map(|&s| f.step(s)).collect();
        use FillStep::*;
        assert_eq!(steps, vec![Skip, Skip, Apply, Apply, Apply, Done, Done]);
        assert!(f.complete());
    }

    #[test]
    fn fill_detects_hole_and_short_replay() {
        let mut f = Fill::new(3, 6);
        assert_eq!(f.step(3), FillStep::Apply);
        assert_eq!(f.step(5), FillStep::Hole);
        assert!(!f.complete());
        assert_eq!(f.missing(), 2);
        // The replay buffer no longer holds the start of the range: its batches are taken,
        // the range is covered from the first one on.
        let mut f = Fill::new(0, 10);
        assert_eq!(f.step(4), FillStep::Apply);
        assert_eq!(f.late_start(), Some(4));
        assert_eq!((5..10).map(|s| f.step(s)).filter(|s| *s == FillStep::Apply).count(), 5);
        assert!(f.reached_end() && !f.complete());
        // A hole after a late start still ends the fill; a first batch past the range is none of it.
        let mut f = Fill::new(0, 10);
        assert_eq!(f.step(4), FillStep::Apply);
        assert_eq!(f.step(6), FillStep::Hole);
        assert!(!f.reached_end());
        assert_eq!(Fill::new(0, 10).step(10), FillStep::Hole);
        // The replay ended early.
        let mut f = Fill::new(0, 3);
        f.step(0);
        f.step(1);
        assert!(!f.complete());
        // An empty range is complete at once.
        assert!(Fill::new(0, 0).complete());
    }
}
