//! `llmgw-agent doctor`: checks a configuration against the running fleet before traffic
//! depends on it. Today: every native tokenizer model is loaded as `run` would load it and
//! compared with each configured replica serving the model, over a small corpus of completions
//! and chats sent to both `/tokenize` endpoints.

use crate::config::Config;
use crate::native_tokenizer::NativeTokenizers;
use llmgw_tokenize::TokenizeRequest;
use serde_json::json;
use std::time::Duration;

/// One line of the report, and whether it is a problem.
pub struct Finding {
    pub ok: bool,
    pub line: String,
}

/// The corpus: what a gateway sends a tokenizer most (completions, chats with a system prompt,
/// several turns, text parts, unicode).
fn corpus(model: &str) -> Vec<serde_json::Value> {
    vec![
        json!({"model": model, "prompt": "Hello, world! The quick brown fox jumps over the lazy dog."}),
        json!({"model": model, "prompt": "  leading spaces, tabs\tand\nnew lines; unicode: café, 東京, 🙂"}),
        json!({"model": model, "messages": [{"role": "user", "content": "What is a KV cache?"}]}),
        json!({"model": model, "messages": [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "Name three primes."},
            {"role": "assistant", "content": "2, 3, 5."},
            {"role": "user", "content": "Three more?"}]}),
        json!({"model": model, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "First part."}, {"type": "text", "text": "Second part."}]}]}),
        json!({"model": model, "messages": [{"role": "user", "content": "Finish this: once upon"}],
               "add_generation_prompt": true}),
    ]
}

fn tokens_of(body: &str) -> Option<Vec<u32>> {
    serde_json::from_str::<serde_json::Value>(body)
        .ok()?
        .get("tokens")?
        .as_array()?
        .iter()
        .map(|v| v.as_u64().and_then(|x| u32::try_from(x).ok()))
        .collect()
}

/// Checks every native tokenizer model against the configured replicas serving it.
pub async fn tokenizers(cfg: &Config) -> Vec<Finding> {
    let mut out = Vec::new();
    let Some(tcfg) = &cfg.tokenizer else {
        out.push(Finding { ok: true, line: "tokenizer: no [tokenizer] section, nothing to check".into() });
        return out;
    };
    let native = NativeTokenizers::load(tcfg);
    let engines = cfg.engines();
    for m in &native.models {
        let tok = match &m.tokenizer {
            Ok(t) => t.clone(),
            Err(e) => {
                out.push(Finding { ok: false, line: format!("tokenizer {}: refused at load: {e}", m.label) });
                continue;
            }
        };
        let names = native.names_of(m);
        let replicas: Vec<_> = engines
            .iter()
            .filter(|e| e.dp_rank == 0)
            .filter(|e| e.models.is_empty() || e.models.iter().any(|x| names.contains(x)))
            .collect();
        if replicas.is_empty() {
            out.push(Finding {
                ok: false,
                line: format!(
                    "tokenizer {}: no configured replica serves it (discovered replicas are not checked here)",
                    m.label
                ),
            });
            continue;
        }
        for r in replicas {
            let mut equal = 0usize;
            let mut problems = Vec::new();
            let cases = corpus(&m.label);
            for body in &cases {
                let native_ids = serde_json::from_value::<TokenizeRequest>(body.clone())
                    .map_err(|e| e.to_string())
                    .and_then(|req| tok.tokenize(&req).map_err(|e| e.to_string()));
                let text = body.to_string();
                let url = format!("http://{}/tokenize", r.address);
                let replica_ids = crate::http_client::post_json(&url, text.as_bytes(), Duration::from_secs(10))
                    .await
                    .map_err(|e| e.to_string())
                    .and_then(|b| tokens_of(&b).ok_or_else(|| "no token ids in its answer".to_owned()));
                match (native_ids, replica_ids) {
                    (Ok(a), Ok(b)) if a == b => equal = equal.saturating_add(1),
                    (Ok(a), Ok(b)) => {
                        let at = a.iter().zip(&b).position(|(x, y)| x != y).unwrap_or(a.len().min(b.len()));
                        problems.push(format!(
                            "{text}: differ at token {at} (native {} tokens, replica {})",
                            a.len(),
                            b.len()
                        ));
                    }
                    (Err(e), _) => problems.push(format!("{text}: native: {e}")),
                    (_, Err(e)) => problems.push(format!("{text}: replica: {e}")),
                }
            }
            out.push(Finding {
                ok: problems.is_empty(),
                line: format!(
                    "tokenizer {} vs {} ({}): {equal}/{} equal{}",
                    m.label,
                    r.replica,
                    r.address,
                    cases.len(),
                    problems.iter().map(|p| format!("\n    {p}")).collect::<String>()
                ),
            });
        }
    }
    out
}
