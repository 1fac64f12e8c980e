//! `llmgw-sim`: one simulated vLLM replica (see the crate docs).

use clap::Parser;
use llmgw_core::hash::{defaults, BlockHasher, HashAlgo};
use llmgw_core::wire::{Encoding, HashForm};
use llmgw_sim::pool::BlockPool;
use llmgw_sim::publisher::{self, PublisherConfig};
use llmgw_sim::server::{router, Engine, EngineConfig};
use serde_json::json;
use std::process::ExitCode;

#[derive(Parser, Debug)]
#[command(
    name = "llmgw-sim",
    version,
    about = "A simulated vLLM replica: OpenAI API, /tokenize, prefix cache, KV events"
)]
struct Args {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Replica name (reported in responses).
    #[arg(long, default_value = "sim")]
    name: String,
    /// Served model name.
    #[arg(long, default_value = "sim-model")]
    model: String,
    /// Another name of the model (repeatable; vLLM's `--served-model-name` past the first).
    #[arg(long = "alias")]
    aliases: Vec<String>,
    /// A LoRA adapter served, `NAME=PATH` (repeatable; vLLM's `--lora-modules`).
    #[arg(long = "lora-module", value_parser = lora_module)]
    lora_modules: Vec<(String, String)>,
    /// GPU blocks in the pool.
    #[arg(long, default_value_t = 2048)]
    blocks: usize,
    /// Tokens per KV block.
    #[arg(long, default_value_t = defaults::BLOCK_SIZE)]
    block_size: u32,
    #[arg(long, default_value_t = 32768)]
    max_model_len: usize,
    /// --prefix-caching-hash-algo.
    #[arg(long, default_value = defaults::ALGO.name())]
    hash_algo: String,
    /// PYTHONHASHSEED of this engine (omit for unset).
    #[arg(long)]
    seed: Option<String>,
    /// KV event endpoint; binds when it contains `*` or `::` (like vLLM), else connects.
    #[arg(long)]
    kv_endpoint: Option<String>,
    /// Replay endpoint (always bound).
    #[arg(long)]
    replay_endpoint: Option<String>,
    #[arg(long, default_value = "kv-events")]
    topic: String,
    /// Event encoding: `tagged` (vLLM ≥ 0.24) or `legacy` (positional arrays).
    #[arg(long, default_value = "tagged")]
    encoding: String,
    /// Hash form in events: `int` (default) or `bytes`.
    #[arg(long, default_value = "int")]
    hash_form: String,
    #[arg(long, default_value_t = 10_000)]
    buffer_steps: usize,
    /// Prefill speed, tokens per second.
    #[arg(long, default_value_t = 20_000.0)]
    prefill_tps: f64,
    /// Time per output token with one running request, milliseconds.
    #[arg(long, default_value_t = 10.0)]
    decode_ms: f64,
    /// Extra decode time per additional running request (fraction of decode_ms).
    #[arg(long, default_value_t = 0.1)]
    decode_slowdown: f64,
    #[arg(long, default_value_t = 16)]
    max_batch: usize,
    #[arg(long, default_value_t = 16)]
    default_max_tokens: usize,
}

fn main() -> ExitCode {
    let a = Args::parse();
    match run(a) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("llmgw-sim: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(a: Args) -> Result<(), String> {
    let algo = HashAlgo::parse(&a.hash_algo).map_err(|e| format!("--hash-algo: {e}"))?;
    let hasher = BlockHasher::new(algo, a.seed.as_deref()).map_err(|e| format!("--seed: {e}"))?;
    let block_size = match usize::try_from(a.block_size) {
        Ok(0) | Err(_) => return Err(format!("--block-size: expected at least 1, got {}", a.block_size)),
        Ok(n) => n,
    };
    let encoding = match a.encoding.as_str() {
        "tagged" => Encoding::Tagged,
        "legacy" => Encoding::Positional,
        other => return Err(format!("--encoding: expected tagged or legacy, got {other:?}")),
    };
    let hash_form = match a.hash_form.as_str() {
        "int" => HashForm::Int,
        "bytes" => HashForm::Bytes,
        other => return Err(format!("--hash-form: expected int or bytes, got {other:?}")),
    };
    let (tx, rx) = std::sync::mpsc::channel();
    let sources = match &a.kv_endpoint {
        Some(ep) => {
            publisher::spawn(
                PublisherConfig {
                    endpoint: ep.clone(),
                    replay_endpoint: a.replay_endpoint.clone(),
                    topic: a.topic.clone(),
                    encoding,
                    hash_form,
                    buffer_steps: a.buffer_steps,
                    dp_rank: 0,
                },
                rx,
            )?;
            json!({"0": {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": ep,
                         "replay_endpoint": a.replay_endpoint, "buffer_steps": a.buffer_steps,
                         "hwm": 100000, "max_queue_size": 100000, "topic": a.topic}})
        }
        None => {
            // No events: drain the channel so the engine never blocks.
            std::thread::spawn(move || while rx.recv().is_ok() {});
            json!({})
        }
    };
    let pool = BlockPool::new(a.blocks, block_size, hasher);
    let engine = Engine::new(
        EngineConfig {
            name: a.name.clone(),
            model: a.model.clone(),
            max_model_len: a.max_model_len,
            prefill_tps: a.prefill_tps,
            decode_ms: a.decode_ms,
            decode_slowdown: a.decode_slowdown,
            max_batch: a.max_batch,
            default_max_tokens: a.default_max_tokens,
            kv_event_sources: sources,
            aliases: a.aliases.clone(),
            lora_modules: a.lora_modules.clone(),
            hash_algo: algo.name().to_owned(),
        },
        pool,
        tx,
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    rt.block_on(async move {
        let addr = format!("{}:{}", a.host, a.port);
        let listener = tokio::net::TcpListener::bind(&addr).await.map_err(|e| format!("listen {addr}: {e}"))?;
        eprintln!("llmgw-sim {} serving {} on http://{addr}", a.name, a.model);
        // No Nagle delay on streamed chunks (vLLM's server sets TCP_NODELAY too).
        use axum::serve::ListenerExt;
        let listener = listener.tap_io(|tcp| {
            let _ = tcp.set_nodelay(true);
        });
        axum::serve(listener, router(engine))
            .with_graceful_shutdown(async {
                let _ = tokio::signal::ctrl_c().await;
            })
            .await
            .map_err(|e| e.to_string())
    })
}

/// `NAME=PATH`, as vLLM's `--lora-modules` takes it.
fn lora_module(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((name, path)) if !name.is_empty() && !path.is_empty() => Ok((name.to_owned(), path.to_owned())),
        _ => Err(format!("`{s}`: expected NAME=PATH")),
    }
}
