//! The bytes of request bodies one VM holds at once. A body is copied into the VM to be parsed,
//! and a request waiting for its tokenizer call keeps its parsed prompt and the call's body; each
//! is counted as twice the body's size from the copy until the request is routed or answered.
//! A body that would take the VM past `body_budget_bytes` is not copied whole: it is routed by
//! its leading bytes, as one past `max_body_bytes` is (`llmgw_body_budget_exhausted_total`). A
//! VM's linear memory never shrinks, so this bounds how far a burst of large bodies grows it.

use crate::Shared;
use std::cell::{Cell, RefCell};
use std::rc::Rc;

thread_local! {
    /// Bytes held by this VM's requests (a VM runs on one thread).
    static HELD: Cell<usize> = const { Cell::new(0) };
}

/// Room reserved for one request's body, given back when dropped.
#[derive(Debug)]
pub struct Held(usize);

impl Drop for Held {
    fn drop(&mut self) {
        HELD.with(|h| h.set(h.get().saturating_sub(self.0)));
    }
}

/// Reserves room for a body of `body_bytes` within `budget`; `None` when it would not fit.
pub fn reserve(body_bytes: usize, budget: usize) -> Option<Held> {
    let want = body_bytes.saturating_mul(2);
    HELD.with(|h| {
        let next = h.get().checked_add(want).filter(|n| *n <= budget)?;
        h.set(next);
        Some(Held(want))
    })
}

/// Bytes this VM's requests hold now.
#[cfg(test)]
pub fn held() -> usize {
    HELD.with(Cell::get)
}

/// Reserves room for a request's body within its configuration's budget; `None` (counted) when
/// the budget is spent. Without a configuration nothing is parsed: nothing is reserved.
pub(crate) fn admit(shared: Option<&Rc<RefCell<Shared>>>, body_bytes: usize) -> Option<Held> {
    let Some(s) = shared.and_then(|s| s.try_borrow().ok()) else { return Some(Held(0)) };
    let held = reserve(body_bytes, s.router.config().body_budget_bytes);
    if held.is_none() {
        s.metrics.body_budget_exhausted();
    }
    held
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_are_held_within_the_budget_and_given_back_when_dropped() {
        let a = reserve(10, 50).unwrap();
        let b = reserve(15, 50).unwrap();
        assert_eq!(held(), 50);
        assert!(reserve(1, 50).is_none(), "past the budget");
        drop(a);
        assert_eq!(held(), 30);
        assert!(reserve(11, 50).is_none() && reserve(10, 50).is_some());
        drop(b);
        assert_eq!(held(), 0);
        let c = reserve(1, usize::MAX).unwrap();
        assert!(reserve(usize::MAX, usize::MAX).is_none(), "no overflow");
        drop(c);
    }
}
