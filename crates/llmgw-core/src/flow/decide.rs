//! The decision stage: the candidates serving the model, the profile's policy over them, and
//! the [`Step`] that follows (route, or 503 when no replica is healthy), with what the
//! speculative entries of the chosen engine should record.

use super::candidates::candidates;
use super::exact::Scored;
use super::gateway::GatewayState;
use super::prefix::Scratch;
use super::reasons::Fallback;
use super::speculative::{checkpoints, Speculation, MAX_BLOCKS};
use super::step::{no_replica_body, Holding, Keep, Rejected, Report, Routed, Step, MAX_EXPLAINED_INCOMPLETE};
use crate::feed::FeedState;
use crate::fleet::replica_key;
use crate::policy::{self, Decision, Outcome, Weights};

/// What a decision reads.
pub struct Deciding<'a> {
    pub feed: &'a FeedState,
    pub weights: &'a Weights,
    pub gw: &'a dyn GatewayState,
    /// Engines reset recently, with when this VM learned it.
    pub resets: &'a [(u64, u64)],
    pub model: Option<&'a str>,
}

/// Decides with whatever is known. `exact`: the request scored from exact data, its hashes and
/// leading runs in `scratch`.
pub fn decide(
    ctx: &Deciding<'_>,
    exact: Option<(&Scored, &Scratch)>,
    approx: &dyn Fn() -> Option<u64>,
    why: Option<Fallback>,
    mut report: Report,
) -> Step {
    let cands = candidates(ctx.feed, ctx.model, ctx.gw);
    let block_size = exact.map_or(0, |(s, _)| u64::try_from(s.block_size).unwrap_or(u64::MAX));
    let work = exact.map(|(s, sc)| policy::Work {
        tokens: s.tokens,
        block_size,
        prompt_key: sc.hashes.last().map_or(0, |h| h.key.0),
    });
    let d: Decision = policy::decide_lazy(&cands, exact.map(|(_, sc)| &sc.scores), work, approx, ctx.weights);
    let prefill_tokens =
        exact.map_or(0, |(s, _)| s.tokens.saturating_sub(u64::from(d.matched).saturating_mul(block_size)));
    let runner_up = d.runner_up.and_then(|(i, _)| cands.get(i)).map(|c| c.address.to_owned());
    // With exact data: the winner and the leading blocks the index alone shows it holding.
    let exact_winner = d
        .winner
        .and_then(|i| cands.get(i))
        .and_then(|c| exact.map(|(_, sc)| (c, sc.index_leading.get(usize::from(c.id)).copied().unwrap_or(0), sc)));
    let speculative_blocks = exact_winner.map_or(0, |(_, held, _)| d.matched.saturating_sub(held));
    let speculation = exact_winner.and_then(|(c, held, sc)| {
        let held = usize::try_from(held).unwrap_or(usize::MAX);
        let n = sc.hashes.len().min(MAX_BLOCKS);
        let keys: Vec<u64> =
            checkpoints(n).filter(|&p| p >= held).filter_map(|p| sc.hashes.get(p).map(|h| h.key.0)).collect();
        let replica = replica_key(c.address, c.dp_rank);
        let reset_ns = ctx.resets.iter().find(|&&(e, _)| e == replica).map_or(0, |&(_, at)| at);
        (!keys.is_empty()).then_some(Speculation { replica, keys, reset_ns })
    });
    // The deepest block that ended a request lately, short of this one's last (the same prompt
    // again is no next turn): this request is its next one.
    let follows =
        exact.and_then(|(_, sc)| sc.hashes.iter().rev().skip(1).map(|h| h.key.0).find(|&k| ctx.gw.ended_request(k)));
    let holding = exact.map(|(s, sc)| {
        let run_blocks = u64::from(d.matched);
        let run = usize::try_from(run_blocks)
            .ok()
            .and_then(|m| m.checked_sub(1))
            .and_then(|last| sc.hashes.get(last))
            .map_or(0, |h| h.key.0);
        let run_blocks = if run == 0 { 0 } else { run_blocks };
        let own_blocks = policy::capacity::blocks_of(s.tokens, block_size).saturating_sub(run_blocks);
        Holding { run, run_blocks, own_blocks }
    });
    let incomplete_count = cands.iter().filter(|c| c.incomplete).count();
    let incomplete: Vec<String> = cands
        .iter()
        .filter(|c| c.incomplete)
        .take(MAX_EXPLAINED_INCOMPLETE)
        .map(|c| match c.dp_rank {
            Some(rank) => format!("{}#{rank}", c.address),
            None => c.address.to_owned(),
        })
        .collect();
    report.saw_incomplete = incomplete_count > 0;
    report.outcome = Some(d.outcome);
    report.hybrid_unsupported |= exact.is_some_and(|(s, _)| s.hybrid_unsupported);
    report.fallback = why.or((exact.is_some() && d.outcome == Outcome::Approx).then_some(Fallback::NoMatch));
    if exact.is_some() {
        report.matched_blocks = Some(d.matched);
    }
    match d.winner.and_then(|i| cands.get(i)) {
        Some(c) => Step::Route(Routed {
            address: c.address.to_owned(),
            dp_rank: c.dp_rank,
            model: ctx.model.map(str::to_owned),
            decision: d,
            report,
            prefill_tokens,
            runner_up,
            speculation,
            speculative_blocks,
            incomplete,
            incomplete_count,
            keep: Keep::default(),
            ends_as: work.map(|w| w.prompt_key).filter(|&k| k != 0),
            follows,
            holding,
        }),
        None => Step::Reject(Rejected { status: 503, body: no_replica_body(ctx.model), report }),
    }
}
