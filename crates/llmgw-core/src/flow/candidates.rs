//! The candidates of a request: the replicas serving its model that the allowlist permits, with
//! their loads as this gateway and their engines see them.

use super::gateway::GatewayState;
use crate::feed::FeedState;
use crate::policy::{Candidate, Pool};

/// Replicas that serve `model` (all replicas when the model is unknown), with their loads.
/// Replicas the gateway avoids count as down, unless it avoids every one that is up (then none
/// is avoided: a fleet-wide failure is not made worse by refusing every request).
pub fn candidates<'a>(feed: &'a FeedState, model: Option<&str>, gw: &dyn GatewayState) -> Vec<Candidate<'a>> {
    let mut cands = candidates_avoiding(feed, model, gw, true);
    if !cands.iter().any(|c| c.up) {
        cands = candidates_avoiding(feed, model, gw, false);
    }
    cands
}

fn candidates_avoiding<'a>(
    feed: &'a FeedState,
    model: Option<&str>,
    gw: &dyn GatewayState,
    avoid: bool,
) -> Vec<Candidate<'a>> {
    feed.replicas
        .iter()
        .filter(|r| r.serves(model) && feed.allowed(u32::from(r.id)))
        .map(|r| {
            let load = if feed.loads_stale { None } else { feed.load(r.id) };
            // Room in the cache is weighed only where its size is known.
            let blocks = load.map_or(0, |l| u64::from(l.gpu_blocks));
            Candidate {
                id: r.id,
                address: r.address.as_str(),
                up: r.up && !r.address.is_empty() && !(avoid && gw.avoided(&r.address)),
                in_flight: gw.in_flight(&r.address),
                pending_tokens: gw.pending_tokens(&r.address),
                running: load.map_or(0, |l| l.running),
                waiting: load.map_or(0, |l| l.waiting),
                kv_usage: load.map_or(0.0, |l| l.kv_cache_usage),
                dp_rank: r.dp_rank,
                rates: gw.learned_rates(&r.address),
                incomplete: r.incomplete,
                recent: gw.recent_requests(&r.address),
                returning: gw.returning(&r.address),
                pool: match blocks {
                    0 => Pool::default(),
                    _ => {
                        let others = load.map(|l| l.others()).unwrap_or_default();
                        Pool {
                            blocks,
                            held: gw.held_blocks(&r.address),
                            others: others.blocks,
                            others_running: others.requests,
                            hold_us: gw.hold_us(&r.address),
                        }
                    }
                },
            }
        })
        .collect()
}
