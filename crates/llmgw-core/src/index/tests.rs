//! Tests of `index.rs`.

/// Mean distance of occupied slots from their home slot over every page (probe cost).
fn mean_displacement(ix: &ReplicaIndex) -> f64 {
    let (mut sum, mut n) = (0usize, 0usize);
    for t in &ix.pages {
        let m = t.cap_mask();
        for (i, &s) in t.slots.iter().enumerate() {
            if s != 0 {
                sum += i.wrapping_sub(t.home(slot_fp(s))) & m;
                n += 1;
            }
        }
    }
    sum as f64 / n.max(1) as f64
}

#[test]
fn keys_chosen_to_share_a_home_slot_probe_like_random_keys() {
    const FIB: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut inv = FIB;
    for _ in 0..6 {
        inv = inv.wrapping_mul(2u64.wrapping_sub(FIB.wrapping_mul(inv)));
    }
    // Under the old placement (fingerprint = top 48 bits of key × φ) these keys have
    // distinct fingerprints that all start at slot 0: every lookup walks one long run.
    let n = 20_000u64;
    let hostile: Vec<BlockKey> = (1..=n).map(|i| BlockKey((i << 16).wrapping_mul(inv))).collect();
    assert!(hostile.iter().all(|k| k.0.wrapping_mul(FIB) >> 40 == 0));
    let random: Vec<BlockKey> = (1..=n).map(|i| BlockKey(crate::stable_hash::mix64(i ^ 0x5eed))).collect();
    let (mut a, mut b) = (ReplicaIndex::new(), ReplicaIndex::new());
    for (&h, &r) in hostile.iter().zip(&random) {
        a.insert(ReplicaId(0), h);
        b.insert(ReplicaId(0), r);
    }
    let (da, db) = (mean_displacement(&a), mean_displacement(&b));
    assert!(da <= 10.0 * db.max(1.0), "hostile keys: mean probe distance {da:.1}, random keys {db:.1}");
    assert!(hostile.iter().all(|&k| a.holds(ReplicaId(0), k)));
}
use super::*;

#[test]
fn leading_runs() {
    let mut ix = ReplicaIndex::new();
    for k in [10, 11, 12] {
        ix.insert(ReplicaId(0), BlockKey(k));
    }
    for k in [10, 12, 13] {
        ix.insert(ReplicaId(2), BlockKey(k));
    }
    ix.insert(ReplicaId(70), BlockKey(10)); // second page
    ix.insert(ReplicaId(70), BlockKey(11));
    let s = ix.score(&[BlockKey(10), BlockKey(11), BlockKey(12), BlockKey(13)]);
    assert_eq!(s.total, 4);
    assert_eq!(s.leading[0], 3);
    assert_eq!(s.leading[1], 0);
    assert_eq!(s.leading[2], 1);
    assert_eq!(s.leading[70], 2);
    assert_eq!(s.best(), Some((ReplicaId(0), 3)));
    assert!((s.share(ReplicaId(0)) - 0.75).abs() < 1e-12);
    assert_eq!(ix.score(&[]).best(), None);
}

/// Many pages (more than one group of pages probed together, some pages empty): every
/// replica's leading run equals a naive count, whichever replicas hold the first key.
#[test]
fn leading_runs_across_many_pages() {
    let mut ix = ReplicaIndex::new();
    let replicas = 16 * 19 + 5; // 20 pages, the last partial
    let query: Vec<BlockKey> = (0..40u64).map(|k| BlockKey(k.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)).collect();
    let mut want = vec![0u32; replicas];
    for (r, w) in want.iter_mut().enumerate() {
        // Pages 4..8 hold nothing of the query; elsewhere runs of 0..=40 and some gaps.
        if (4..8).contains(&(r / 16)) {
            ix.insert(ReplicaId(r as u16), BlockKey(u64::MAX - r as u64));
            continue;
        }
        let run = (r * 7) % 41;
        for (i, &k) in query.iter().enumerate() {
            if i < run || (i > run && r % 3 == 0) {
                ix.insert(ReplicaId(r as u16), k);
            }
        }
        *w = run as u32;
    }
    assert_eq!(ix.score(&query).leading, want);
    assert_eq!(ix.score(&query[..1]).leading, want.iter().map(|&w| w.min(1)).collect::<Vec<_>>());
    let empty = ix.score(&[]);
    assert_eq!((empty.total, empty.leading.iter().all(|&l| l == 0)), (0, true));
}

#[test]
fn removal_keeps_probe_runs_intact() {
    let mut ix = ReplicaIndex::new();
    for k in 0..5000u64 {
        ix.insert(ReplicaId(1), BlockKey(k.wrapping_mul(7919)));
    }
    for k in (0..5000u64).step_by(2) {
        ix.remove(ReplicaId(1), BlockKey(k.wrapping_mul(7919)));
    }
    for k in 0..5000u64 {
        assert_eq!(ix.holds(ReplicaId(1), BlockKey(k.wrapping_mul(7919))), k % 2 == 1, "key {k}");
    }
    assert_eq!(ix.replica_blocks(ReplicaId(1)), 2500);
    ix.clear_replica(ReplicaId(1));
    assert_eq!(ix.entries(), 0);
    assert!(!ix.holds(ReplicaId(1), BlockKey(7919)));
}
