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

/// One native answer to check.
pub struct Check {
    pub model: Arc<NativeModel>,
    /// The request's body, sent to the replica unchanged.
    pub body: Bytes,
    pub native: Vec<u32>,
    /// Which answer of the model it was (spreads the checks over the replicas).
    pub n: u64,
    /// The endpoint it came to, asked of the replica too.
    pub path: &'static str,
}

/// Asks a replica serving the model to answer the same request and compares, in the
/// background. Skipped (and counted) when `max_verify_in_flight` checks are already out.
pub fn spawn_check(tokenizers: &NativeTokenizers, hub: &Hub, checks: &Arc<Semaphore>, check: Check) {
    let Check { model, body, native, n, path } = check;
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
        serving.get(usize::try_from(n).unwrap_or(0).checked_rem(serving.len()).unwrap_or(0)).cloned()
    };
    let Some(address) = address else {
        model.counters.verify_errors.fetch_add(1, Ordering::Relaxed);
        return;
    };
    let timeout = Duration::from_millis(tokenizers.config.verify_timeout_ms);
    tokio::spawn(async move {
        let _permit = permit;
        let url = format!("http://{address}{path}");
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

/// The token ids of a replica's answer: `/tokenize`'s `tokens`, a render answer's `token_ids`
/// (a completion render's first entry).
pub fn tokens_of(body: &str) -> Option<Vec<u32>> {
    let v: serde_json::Value = serde_json::from_str(body).ok()?;
    let v = if let serde_json::Value::Array(items) = v { items.into_iter().next()? } else { v };
    let ids = v.get("tokens").or_else(|| v.get("token_ids"))?.as_array()?;
    ids.iter().map(|x| x.as_u64().and_then(|i| u32::try_from(i).ok())).collect()
}

#[cfg(test)]
mod tests {
    use super::chosen;

    #[test]
    fn a_replicas_ids_are_read_from_tokenize_and_render_answers() {
        assert_eq!(super::tokens_of(r#"{"count":2,"tokens":[5,6]}"#), Some(vec![5, 6]));
        assert_eq!(super::tokens_of(r#"{"request_id":"x","token_ids":[7]}"#), Some(vec![7]));
        assert_eq!(super::tokens_of(r#"[{"request_id":"x","token_ids":[8,9]}]"#), Some(vec![8, 9]));
        assert_eq!(super::tokens_of(r#"{"error":"no"}"#), None);
    }

    #[test]
    fn the_first_answers_and_then_a_share_are_checked() {
        assert!((0..10).all(|n| chosen(n, 10, 0.0)));
        assert!(!chosen(10, 10, 0.0));
        let picked = (10..1010).filter(|&n| chosen(n, 10, 0.01)).count();
        assert_eq!(picked, 10);
    }
}
