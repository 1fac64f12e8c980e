//! A vector kept in fixed-size, reference-counted chunks, so that a copy costs one reference
//! per chunk and a change afterwards copies only the chunk it touches.
//!
//! The sidecar's ledger keeps an engine's blocks in one of these: a snapshot takes its copy
//! under the engine's lock in microseconds whatever the ledger's size (about 25 references at
//! 100,000 blocks), and event ingestion pays for copy-on-write only on the chunks it changes
//! while a snapshot still holds them. Kept here rather than taken from a persistent-vector
//! crate because the ledger needs only push, swap-remove and in-place change, and the copy's
//! cost is the point: a few lines over `Arc::make_mut` show it plainly.

use std::sync::Arc;

/// Entries per chunk: 4,096 ledger entries are 64 KiB, a copy-on-write costs microseconds.
pub const CHUNK: usize = 4096;

/// A vector in chunks of [`CHUNK`] (every chunk full but the last).
#[derive(Debug, Clone)]
pub struct ChunkedVec<T: Clone> {
    chunks: Vec<Arc<Vec<T>>>,
    len: usize,
}

impl<T: Clone> Default for ChunkedVec<T> {
    fn default() -> Self {
        ChunkedVec { chunks: Vec::new(), len: 0 }
    }
}

/// The chunk and the place in it of entry `i`.
fn place(i: usize) -> (usize, usize) {
    (i.checked_div(CHUNK).unwrap_or(0), i.checked_rem(CHUNK).unwrap_or(0))
}

impl<T: Clone> ChunkedVec<T> {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn get(&self, i: usize) -> Option<&T> {
        let (c, j) = place(i);
        self.chunks.get(c)?.get(j)
    }

    /// Entry `i`, its chunk copied first if a copy of the vector still shares it.
    pub fn get_mut(&mut self, i: usize) -> Option<&mut T> {
        let (c, j) = place(i);
        Arc::make_mut(self.chunks.get_mut(c)?).get_mut(j)
    }

    pub fn push(&mut self, value: T) {
        if self.chunks.last().is_none_or(|c| c.len() >= CHUNK) {
            self.chunks.push(Arc::new(Vec::with_capacity(CHUNK)));
        }
        if let Some(last) = self.chunks.last_mut() {
            Arc::make_mut(last).push(value);
            self.len = self.len.saturating_add(1);
        }
    }

    pub fn pop(&mut self) -> Option<T> {
        let last = self.chunks.last_mut()?;
        let value = Arc::make_mut(last).pop();
        if last.is_empty() {
            self.chunks.pop();
        }
        if value.is_some() {
            self.len = self.len.saturating_sub(1);
        }
        value
    }

    /// Removes entry `i`, the last entry taking its place (as `Vec::swap_remove`).
    pub fn swap_remove(&mut self, i: usize) -> Option<T> {
        if i >= self.len {
            return None;
        }
        let last = self.pop()?;
        if i == self.len {
            return Some(last);
        }
        self.get_mut(i).map(|slot| std::mem::replace(slot, last))
    }

    pub fn clear(&mut self) {
        self.chunks.clear();
        self.len = 0;
    }

    pub fn iter(&self) -> impl Iterator<Item = &T> {
        self.chunks.iter().flat_map(|c| c.iter())
    }
}

#[cfg(test)]
#[allow(clippy::arithmetic_side_effects)]
mod tests {
    use super::*;

    #[test]
    fn it_behaves_as_a_vector_across_chunk_boundaries() {
        let (mut v, mut model) = (ChunkedVec::default(), Vec::new());
        let mut x: u64 = 11;
        for _ in 0..30_000 {
            x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            if !x.is_multiple_of(3) || model.is_empty() {
                v.push(x);
                model.push(x);
            } else {
                let i = (x >> 20) as usize % model.len();
                assert_eq!(v.swap_remove(i), Some(model.swap_remove(i)));
                if let (Some(a), Some(b)) = (v.get_mut(i / 2), model.get_mut(i / 2)) {
                    *a ^= 1;
                    *b ^= 1;
                }
            }
        }
        assert!(model.len() > 2 * CHUNK, "the run crossed chunks: {}", model.len());
        assert_eq!(v.len(), model.len());
        assert_eq!(v.iter().copied().collect::<Vec<_>>(), model);
        assert_eq!(v.swap_remove(model.len()), None);
        v.clear();
        assert!(v.is_empty() && v.iter().next().is_none());
    }

    #[test]
    fn a_copy_shares_every_chunk_and_keeps_its_entries_when_the_original_changes() {
        let mut v = ChunkedVec::default();
        for i in 0..(3 * CHUNK as u64 + 5) {
            v.push(i);
        }
        let copy = v.clone();
        assert!(v.chunks.iter().zip(&copy.chunks).all(|(a, b)| Arc::ptr_eq(a, b)), "the copy is references");
        if let Some(e) = v.get_mut(1) {
            *e = 999;
        }
        v.swap_remove(CHUNK + 2);
        v.push(7);
        assert_eq!(copy.iter().copied().collect::<Vec<_>>(), (0..(3 * CHUNK as u64 + 5)).collect::<Vec<_>>());
        let shared = v.chunks.iter().zip(&copy.chunks).filter(|(a, b)| Arc::ptr_eq(a, b)).count();
        assert_eq!(shared, 1, "only the untouched third chunk is still shared");
        assert_eq!(v.get(1), Some(&999));
    }
}
