//! The proof: native answers checked against a replica's own `/tokenize`, off the request's
//! path. Every answer among a model's first `verify_first` is checked, then a share of them;
//! the first difference switches the model off (its requests are declined to the replicas
//! from then on), counted, with both token lists logged once.

use super::{NativeModel, NativeTokenizers};
use crate::hub::Hub;
use axum::body::Bytes;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;
use tracing::{error, warn};

/// Whether the `n`th answer (from 0) is checked.
pub fn chosen(n: u64, first: u64, fraction: f64) -> bool {
    if n < first {
        return true;
    }
    if fraction <= 0.0 {
        return false;
    }
    let every = (1.0 / fraction).round().max(1.0) as u64;
    n.saturating_sub(first).is_multiple_of(every)
}

/// Asks a replica serving `model` to tokenize `body` and compares, in the background. Skipped
/// (and counted) when `max_verify_in_flight` checks are already out.
/// `checks` bounds the checks in flight; the replica is one of `hub`'s serving the model.
pub fn spawn_check(
    checks: &Arc<Semaphore>,
    tokenizers: &NativeTokenizers,
    hub: &Hub,
    model: Arc<NativeModel>,
    body: Bytes,
    native: Vec<u32>,
    n: u64,
) {
    let Ok(permit) = checks.clone().try_acquire_owned() else {
        model.counters.verify_skipped.fetch_add(1, Ordering::Relaxed);
        return;
    };
    let names = tokenizers.names_of(&model);
    let address = {
        let hub = hub.state();
        let serving: Vec<String> = hub
            .live()
            .filter(|e| (e.up || e.http_ok) && e.spec.dp_rank == 0)
            .filter(|e| e.spec.models.is_empty() || e.spec.models.iter().any(|m| names.contains(m)))
            .map(|e| e.spec.address.clone())
            .collect();
        usize::try_from(n).unwrap_or(0).checked_rem(serving.len()).and_then(|i| serving.get(i)).cloned()
    };
    let Some(address) = address else {
        model.counters.verify_errors.fetch_add(1, Ordering::Relaxed);
        return;
    };
    let timeout = Duration::from_millis(tokenizers.config.verify_timeout_ms);
    tokio::spawn(async move {
        let _permit = permit;
        let url = format!("http://{address}/tokenize");
        let reply = match crate::http_client::post_json(&url, &body, timeout).await {
            Ok(text) => text,
            Err(e) => {
                model.counters.verify_errors.fetch_add(1, Ordering::Relaxed);
                warn!(model = %model.label, replica = %address, error = %e, "native tokenizer check: the replica's /tokenize failed");
                return;
            }
        };
        let Some(replica) = tokens_of(&reply) else {
            model.counters.verify_errors.fetch_add(1, Ordering::Relaxed);
            return;
        };
        model.counters.verified.fetch_add(1, Ordering::Relaxed);
        if replica == native {
            return;
        }
        model.counters.mismatches.fetch_add(1, Ordering::Relaxed);
        if !model.disabled.swap(true, Ordering::Relaxed) {
            let request = String::from_utf8_lossy(&body);
            error!(
                model = %model.label,
                replica = %address,
                native = ?native,
                replica_tokens = ?replica,
                request = %request,
                "native tokenizer differs from the replica's: switched off for this model (its requests go to the replicas)"
            );
        }
    });
}

fn tokens_of(body: &str) -> Option<Vec<u32>> {
    #[derive(serde::Deserialize)]
    struct Answer {
        tokens: Vec<u32>,
    }
    serde_json::from_str::<Answer>(body).ok().map(|a| a.tokens)
}

#[cfg(test)]
mod tests {
    use super::chosen;

    #[test]
    fn the_first_answers_and_then_a_share_are_checked() {
        assert!((0..10).all(|n| chosen(n, 10, 0.0)));
        assert!(!chosen(10, 10, 0.0));
        let picked = (10..1010).filter(|&n| chosen(n, 10, 0.01)).count();
        assert_eq!(picked, 10);
    }
}
