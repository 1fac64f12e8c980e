//! The models each replica serves, read from its `/v1/models` and refreshed: vLLM lists its base
//! model under every `--served-model-name`, and each LoRA adapter (with `parent`, the base model
//! it applies to, and `root`, the adapter's path). An engine whose configuration names no model
//! is shown in the feed's table as serving exactly these ids, so a request naming an alias or an
//! adapter finds its replicas without the configuration listing it; a configured `models` list
//! overrides them. The adapters go into the table with their paths whatever the configuration
//! says: vLLM mixes `("lora", name, path)` into every block hash of an adapter's requests, and
//! the filter hashes them the same way.

use crate::config::{EngineSpec, LoadConfig};
use crate::hub::Hub;
use llmgw_core::feed::LoraAdapter;
use serde::Deserialize;
use std::sync::Arc;
use std::time::Duration;
use tracing::{info, warn};

/// Ids kept per replica at most (a model list is the replica's to size).
pub const MAX_MODEL_IDS: usize = 1024;
/// Bytes of one id at most.
const MAX_ID_BYTES: usize = 512;

/// One `/v1/models` entry, as vLLM writes it (`ModelCard`).
#[derive(Debug, Deserialize)]
struct Card {
    id: String,
    /// The base model an adapter applies to (absent for a base model).
    #[serde(default)]
    parent: Option<String>,
    /// An adapter's path (vLLM's `lora_path`); a base model's path otherwise.
    #[serde(default)]
    root: Option<String>,
}

#[derive(Debug, Deserialize)]
struct ModelList {
    data: Vec<Card>,
}

/// What a `/v1/models` answer lists.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Served {
    /// Every id a request may name: base models, aliases, adapters.
    pub ids: Vec<String>,
    /// The LoRA adapters among them, with their paths.
    pub adapters: Vec<LoraAdapter>,
}

/// Parses a `/v1/models` answer; an error names what is wrong. Ids past [`MAX_MODEL_IDS`] or
/// longer than 512 bytes are refused as a whole (nothing half-read is used).
pub fn parse(body: &str) -> Result<Served, String> {
    let list: ModelList = serde_json::from_str(body).map_err(|e| format!("not a model list (data[].id): {e}"))?;
    if list.data.len() > MAX_MODEL_IDS {
        return Err(format!("{} models listed, more than {MAX_MODEL_IDS}", list.data.len()));
    }
    let mut out = Served::default();
    for c in list.data {
        if c.id.is_empty() || c.id.len() > MAX_ID_BYTES {
            return Err(format!("a model id of {} bytes", c.id.len()));
        }
        if c.parent.is_some_and(|p| !p.is_empty()) {
            let path = c.root.filter(|r| !r.is_empty()).ok_or_else(|| format!("adapter {} without a root", c.id))?;
            if path.len() > MAX_ID_BYTES {
                return Err(format!("adapter {}: a root of {} bytes", c.id, path.len()));
            }
            out.adapters.push(LoraAdapter { name: c.id.clone(), path });
        }
        out.ids.push(c.id);
    }
    Ok(out)
}

/// Starts [`refresh_engine`] for `spec` unless `models_interval_ms` is 0.
pub fn spawn(hub: &Arc<Hub>, spec: &EngineSpec, load: &LoadConfig) -> Option<tokio::task::JoinHandle<()>> {
    if load.models_interval_ms == 0 {
        return None;
    }
    let (every, timeout) = (Duration::from_millis(load.models_interval_ms), Duration::from_millis(load.timeout_ms));
    Some(tokio::spawn(refresh_engine(hub.clone(), spec.clone(), every, timeout)))
}

/// Reads one engine's `/v1/models` every `interval` until the engine is removed.
pub async fn refresh_engine(hub: Arc<Hub>, spec: EngineSpec, interval: Duration, timeout: Duration) {
    let idx = usize::try_from(spec.id).unwrap_or(usize::MAX);
    let Some(stop) = hub.state().engines.get(idx).map(|e| e.stop.clone()) else { return };
    let url = format!("http://{}/v1/models", spec.address);
    let mut t = tokio::time::interval(interval);
    t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing = false;
    loop {
        t.tick().await;
        if stop.load(std::sync::atomic::Ordering::SeqCst) {
            return;
        }
        let got = match crate::http_client::get(&url, timeout).await {
            Ok(body) => parse(&body).inspect_err(|_| {
                hub.state().discovery_refused.count(crate::counters::Refused::ModelList);
            }),
            Err(e) => Err(e.to_string()),
        };
        if stop.load(std::sync::atomic::Ordering::SeqCst) {
            return;
        }
        match got {
            Ok(served) => {
                failing = false;
                let ids = served.ids.clone();
                let adapters = served.adapters.len();
                if hub.state().set_served(idx, served.ids, served.adapters) {
                    info!(replica = %spec.label(), models = ?ids, adapters, "served models");
                }
            }
            Err(e) => {
                // The last list read stays: a replica that stops answering is judged by its
                // health, not by its model list.
                if !failing {
                    warn!(replica = %spec.label(), %url, error = %e, "cannot read the served models");
                    failing = true;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_aliases_and_adapters_are_listed() {
        let body = r#"{"object":"list","data":[
            {"id":"llama","object":"model","root":"/models/llama","parent":null},
            {"id":"chat","object":"model","root":"/models/llama","parent":null},
            {"id":"sql-lora","object":"model","root":"/adapters/sql","parent":"llama"}]}"#;
        let s = parse(body).unwrap();
        assert_eq!(s.ids, vec!["llama", "chat", "sql-lora"]);
        assert_eq!(s.adapters, vec![LoraAdapter { name: "sql-lora".into(), path: "/adapters/sql".into() }]);
        assert!(parse(r#"{"data":[{"id":"a","parent":"m"}]}"#).unwrap_err().contains("without a root"));
    }

    #[test]
    fn a_list_past_its_limits_is_refused_whole() {
        assert!(parse("{}").unwrap_err().contains("not a model list"));
        let many: Vec<String> = (0..=MAX_MODEL_IDS).map(|i| format!(r#"{{"id":"m{i}"}}"#)).collect();
        assert!(parse(&format!(r#"{{"data":[{}]}}"#, many.join(","))).unwrap_err().contains("more than"));
        let long = "x".repeat(600);
        assert!(parse(&format!(r#"{{"data":[{{"id":"{long}"}}]}}"#)).unwrap_err().contains("600 bytes"));
    }

    #[test]
    fn the_table_shows_what_a_replica_serves_unless_the_configuration_names_its_models() {
        let cfg = crate::config::Config::parse(
            "[[replicas]]\nname = \"a\"\naddress = \"127.0.0.1:8000\"\nendpoint = \"tcp://127.0.0.1:1\"\n\
             [[replicas]]\nname = \"b\"\naddress = \"127.0.0.1:8001\"\nendpoint = \"tcp://127.0.0.1:2\"\n\
             models = [\"m\"]\n",
        )
        .unwrap();
        let hub = Hub::new(cfg.engines(), 64, 10);
        let models =
            |hub: &Hub| -> Vec<Vec<String>> { hub.state().table().replicas.into_iter().map(|r| r.models).collect() };
        assert_eq!(models(&hub), vec![Vec::<String>::new(), vec!["m".to_owned()]], "any model until read");
        let served =
            parse(r#"{"data":[{"id":"llama"},{"id":"sql-lora","parent":"llama","root":"/a/sql"},{"id":"chat"}]}"#)
                .unwrap();
        assert!(hub.state().set_served(0, served.ids.clone(), served.adapters.clone()));
        assert!(
            !hub.state().set_served(0, served.ids.clone(), served.adapters.clone()),
            "unchanged: nothing published"
        );
        // The configured list overrides what the replica lists; its adapters still count.
        assert!(!hub.state().set_served(1, vec!["other".into()], vec![]));
        assert!(hub.state().set_served(1, vec!["other".into()], served.adapters.clone()));
        assert_eq!(
            models(&hub),
            vec![vec!["chat".to_owned(), "llama".into(), "sql-lora".into()], vec!["m".to_owned()]]
        );
        let table = hub.state().table();
        assert!(table.replicas.iter().all(|r| r.lora_adapters == served.adapters));
    }
}
