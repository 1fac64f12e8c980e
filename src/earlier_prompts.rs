//! Text prompts this Envoy's VMs tokenized, handed by the VM that learned one to the others
//! through proxy-wasm shared data (`llmgw_core::flow::SharedPrompt`), so that a conversation
//! written out as text goes at once whichever worker its next turn reaches.
//!
//! A ring of [`RING`] values, `llmgw.prompt.N`, and a counter, `llmgw.prompt.seq` (u64), of the
//! prompts handed on so far. A VM bumps the counter (compare-and-swap) to `seq` and writes its
//! prompt in slot `seq % RING`, `seq` at the record's head. A reader takes the counter and the
//! slots written since its last position, at most [`MAX_READ`] of the newest, and skips a slot
//! whose head names another position (written over, or not written yet). A record, in
//! little-endian: `seq` u64; the tag count u32 and the tags (u128 each); the prompt's bytes u32,
//! whole-text tag u128, token count u32; the mark count u32 and the marks (u64 each); then its
//! kept tokens (u32 each). At most `RING × 12.5 KiB`, 1.6 MiB, however many prompts there are.

use crate::host::{update_shared, Host};
use crate::shared_records::FieldReader;
use llmgw_core::flow::{EarlierPrompt, SharedPrompt, MAX_PROMPT_MARKS, MAX_PROMPT_TAGS, MAX_PROMPT_TOKENS};
use std::sync::Arc;

/// Slots of the ring.
pub const RING: u64 = 128;
/// The most records one lookup reads (a VM that fell further behind skips the oldest).
pub const MAX_READ: u64 = 16;
const SEQ_KEY: &str = "llmgw.prompt.seq";

fn slot(seq: u64) -> String {
    format!("llmgw.prompt.{}", seq % RING)
}

fn seq_of(v: &[u8]) -> u64 {
    v.first_chunk::<8>().map_or(0, |b| u64::from_le_bytes(*b))
}

fn push_u128(out: &mut Vec<u8>, v: u128) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn push_count(out: &mut Vec<u8>, n: usize) {
    out.extend_from_slice(&u32::try_from(n).unwrap_or(u32::MAX).to_le_bytes());
}

/// The record of `shared` at position `seq`; `None` for a prompt past the bounds.
fn encode(seq: u64, shared: &SharedPrompt) -> Option<Vec<u8>> {
    if !shared.is_bounded() {
        return None;
    }
    let p = &shared.prompt;
    let size = 56usize
        .saturating_add(shared.tags.len().saturating_mul(16))
        .saturating_add(p.marks.len().saturating_mul(8))
        .saturating_add(p.tokens.len().saturating_mul(4));
    let mut out = Vec::with_capacity(size);
    out.extend_from_slice(&seq.to_le_bytes());
    push_count(&mut out, shared.tags.len());
    for &t in &shared.tags {
        push_u128(&mut out, t);
    }
    push_count(&mut out, p.bytes);
    push_u128(&mut out, p.whole);
    push_count(&mut out, p.count);
    push_count(&mut out, p.marks.len());
    for m in &p.marks {
        out.extend_from_slice(&m.to_le_bytes());
    }
    for t in &p.tokens {
        out.extend_from_slice(&t.to_le_bytes());
    }
    Some(out)
}

fn read_count(f: &mut FieldReader<'_>, max: usize) -> Option<usize> {
    usize::try_from(f.u32()?).ok().filter(|&n| n <= max)
}

/// The prompt in a record written at position `seq`; `None` for another position or a record
/// that does not read back within the bounds.
fn decode(seq: u64, v: &[u8]) -> Option<SharedPrompt> {
    let mut f = FieldReader::new(v);
    if f.u64()? != seq {
        return None;
    }
    let n = read_count(&mut f, MAX_PROMPT_TAGS)?;
    let tags = (0..n).map(|_| f.u128()).collect::<Option<Vec<_>>>()?;
    let bytes = usize::try_from(f.u32()?).ok()?;
    let whole = f.u128()?;
    let count = usize::try_from(f.u32()?).ok()?;
    let n = read_count(&mut f, MAX_PROMPT_MARKS)?;
    let marks = (0..n).map(|_| f.u64()).collect::<Option<Vec<_>>>()?;
    let rest = f.rest().len();
    if !rest.is_multiple_of(4) || rest / 4 > MAX_PROMPT_TOKENS {
        return None;
    }
    let tokens = f.rest_u32s();
    let shared = SharedPrompt { tags, prompt: Arc::new(EarlierPrompt { bytes, whole, tokens, count, marks }) };
    shared.is_bounded().then_some(shared)
}

/// Hands `shared` to the other VMs. `false`: the host refused, or the prompt is past the bounds.
pub fn share(host: &dyn Host, shared: &SharedPrompt) -> bool {
    // Checked before the counter moves: a position with no record would cost every reader a read.
    if !shared.is_bounded() {
        return false;
    }
    let mut seq = 0;
    let bumped = update_shared(host, SEQ_KEY, |v| {
        seq = seq_of(v).wrapping_add(1);
        Some(seq.to_le_bytes().to_vec())
    });
    let Some(record) = encode(seq, shared).filter(|_| bumped) else { return false };
    host.set_shared_data(&slot(seq), &record, None).is_ok()
}

/// The prompts handed on since position `seen` (at most [`MAX_READ`] of the newest) pushed onto
/// `out`, and the position now.
pub fn since(host: &dyn Host, seen: u64, out: &mut Vec<SharedPrompt>) -> u64 {
    let Some((Some(v), _)) = host.shared_data(SEQ_KEY) else { return seen };
    let now = seq_of(&v);
    // A counter behind ours (the shared data was cleared): carry on from it.
    let from = seen.min(now).max(now.saturating_sub(MAX_READ));
    for seq in from.saturating_add(1)..=now {
        if let Some((Some(record), _)) = host.shared_data(&slot(seq)) {
            out.extend(decode(seq, &record));
        }
    }
    now
}

#[cfg(test)]
#[allow(clippy::arithmetic_side_effects)]
mod tests {
    use super::*;
    use crate::fake::FakeHost;

    fn prompt(whole: u128, tokens: usize) -> SharedPrompt {
        let p = EarlierPrompt {
            bytes: 300,
            whole,
            tokens: (0..tokens as u32).collect(),
            count: tokens + 1,
            marks: vec![7, 8, 9, 10],
        };
        SharedPrompt { tags: vec![whole, whole + 1], prompt: Arc::new(p) }
    }

    #[test]
    fn prompts_read_back_in_order_from_where_a_reader_left_off() {
        let host = FakeHost::default();
        let mut out = Vec::new();
        assert_eq!(since(&host, 0, &mut out), 0);
        assert!(share(&host, &prompt(1, 10)) && share(&host, &prompt(2, 20)));
        assert_eq!(since(&host, 0, &mut out), 2);
        assert_eq!(out, vec![prompt(1, 10), prompt(2, 20)]);
        out.clear();
        assert!(share(&host, &prompt(3, 30)));
        assert_eq!(since(&host, 2, &mut out), 3);
        assert_eq!(out, vec![prompt(3, 30)]);
        // Past the bounds: not handed on.
        assert!(!share(&host, &prompt(4, MAX_PROMPT_TOKENS + 1)));
        // ... and the counter did not move for it.
        assert_eq!(since(&host, 3, &mut out), 3);
    }

    #[test]
    fn a_reader_far_behind_takes_the_newest_and_a_slot_written_over_is_skipped() {
        let host = FakeHost::default();
        for i in 0..(RING + 5) as u128 {
            assert!(share(&host, &prompt(i * 10, 4)));
        }
        let mut out = Vec::new();
        assert_eq!(since(&host, 0, &mut out), RING + 5);
        let wholes: Vec<u128> = out.iter().map(|p| p.prompt.whole).collect();
        let newest: Vec<u128> = ((RING + 5 - MAX_READ) as u128..(RING + 5) as u128).map(|i| i * 10).collect();
        assert_eq!(wholes, newest);
        // A counter behind the reader's position: nothing read, the position follows it.
        assert_eq!(since(&host, 10 * RING, &mut out), RING + 5);
        assert_eq!(out.len(), MAX_READ as usize);
        // Position 3's slot now holds position RING + 3: nothing for 3.
        assert_eq!(decode(3, &host.shared_data(&slot(3)).unwrap().0.unwrap()), None);
    }

    #[test]
    fn a_record_cut_short_or_past_the_bounds_reads_as_nothing() {
        let record = encode(9, &prompt(1, 10)).unwrap();
        assert_eq!(decode(9, &record), Some(prompt(1, 10)));
        assert_eq!(decode(9, &record[..record.len() - 2]), None);
        assert_eq!(decode(9, &record[..30]), None);
        let mut many_tags = record.clone();
        many_tags[8..12].copy_from_slice(&(MAX_PROMPT_TAGS as u32 + 1).to_le_bytes());
        assert_eq!(decode(9, &many_tags), None);
    }
}
