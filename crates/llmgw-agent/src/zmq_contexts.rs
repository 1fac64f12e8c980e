//! ZMQ contexts shared by the engine threads, a new one every [`ENGINES_PER_CONTEXT`] engines:
//! one context's I/O thread and socket table serve a bounded number of subscriptions, whether
//! the engines were configured or discovered (a single context for hundreds of discovered
//! engines runs out of sockets, and their threads retry for ever).

use std::sync::Mutex;

/// Engines (each a SUB socket and a replay DEALER) per context.
pub const ENGINES_PER_CONTEXT: usize = 200;

pub struct ContextPool {
    inner: Mutex<(zmq::Context, usize, usize)>,
    per: usize,
}

impl ContextPool {
    pub fn new(per: usize) -> ContextPool {
        ContextPool { inner: Mutex::new((zmq::Context::new(), 0, 1)), per: per.max(1) }
    }

    /// The context for the next engine.
    pub fn next(&self) -> zmq::Context {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let (ctx, handed, created) = &mut *g;
        if *handed > 0 && handed.is_multiple_of(self.per) {
            *ctx = zmq::Context::new();
            *created = created.saturating_add(1);
        }
        *handed = handed.saturating_add(1);
        ctx.clone()
    }

    /// Contexts created so far.
    pub fn created(&self) -> usize {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).2
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_context_every_n_engines_wherever_they_come_from() {
        let pool = ContextPool::new(3);
        for _ in 0..3 {
            pool.next();
        }
        assert_eq!(pool.created(), 1);
        pool.next();
        assert_eq!(pool.created(), 2);
        for _ in 0..5 {
            pool.next();
        }
        assert_eq!(pool.created(), 3);
    }
}
