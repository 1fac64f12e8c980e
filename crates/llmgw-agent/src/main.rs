//! `llmgw-agent`: mirrors vLLM replicas' KV caches and feeds llmgw filters; also carries the
//! parity tools `hash` and `decode`.

mod install_filter;
mod tools;

use clap::{Args, Parser, Subcommand};
use llmgw_agent::config::Config;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// `--version`: the crate's version and the commit it was built from (see `build_commit.rs`).
const VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), " (commit ", env!("LLMGW_GIT_COMMIT"), ")");

#[derive(Parser)]
#[command(name = "llmgw-agent", version = VERSION, about = "llmgw agent: vLLM KV-cache mirror and parity tools")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the agent: subscribe to every replica's KV events and serve the feed.
    Run(RunArgs),
    /// Run the agent and one vLLM replica under it: `launch --config FILE -- vllm serve MODEL ...`.
    /// The matching flags and PYTHONHASHSEED are added; the process is restarted when it exits
    /// (its blocks leave the index) and receives SIGTERM when the agent stops.
    Launch(LaunchArgs),
    /// Print the vLLM flags and environment matching the configuration, for replicas
    /// started elsewhere.
    VllmArgs(VllmArgsArgs),
    /// Check a configuration file and print the engines it describes.
    CheckConfig(ConfigArgs),
    /// Check a configuration against the running fleet, one line per check with the fix: each
    /// replica's /health and /v1/models, discovery (DNS, /kv_event_sources), each native
    /// tokenizer model against each replica's /tokenize, and Envoy's clusters given its admin.
    /// Exits non-zero if any check fails.
    Doctor(DoctorArgs),
    /// Hash token ids (a JSON array on stdin) into vLLM block hashes.
    Hash(tools::HashArgs),
    /// Decode one KVEventBatch payload (msgpack on stdin) into JSON.
    Decode(tools::DecodeArgs),
    /// Replay a captured KV-event stream (JSON lines with payload_hex) through the engine mirror
    /// and the replica index, checking hash parity and scoring requests.
    Replay(tools::ReplayArgs),
    /// Beside one vLLM replica: publish its KV events (read from its ZMQ publisher) to the
    /// configuration's [jetstream] stream, for agents whose replicas have events = "jetstream",
    /// and/or keep its blocks and serve snapshots of them (--snapshot-listen).
    Publish(PublishArgs),
    /// Print a fresh hash seed (a random PYTHONHASHSEED) for a deployment's Secret: the replicas
    /// read it as PYTHONHASHSEED, the agents through [hash] seed_env or seed_file.
    GenSeed,
    /// Copy the filter (`llmgw.wasm`) to where Envoy loads it: what the init container of the
    /// shipped manifests runs, the agent's image having no shell or `cp`.
    InstallFilter(install_filter::InstallFilterArgs),
}

#[derive(Args)]
struct PublishArgs {
    /// TOML configuration file: [jetstream] and the replica (its endpoint, replay_endpoint,
    /// topic, dp_ranks and the address the filter routes to, which names its subject).
    #[arg(long)]
    config: PathBuf,
    /// Which configured replica to publish (default: the only one).
    #[arg(long)]
    replica: Option<String>,
    /// Keep the replica's blocks and serve them as snapshots (`GET /snapshot?dp_rank=R`,
    /// `/metrics`) on this address, for agents that start after the replica
    /// (`replicas[].snapshot_url`). Without [jetstream] the sidecar only does this.
    #[arg(long)]
    snapshot_listen: Option<SocketAddr>,
    /// Log filter level: error, warn, info, debug.
    #[arg(long, default_value = "info")]
    log_level: tracing::Level,
}

#[derive(Args)]
struct DoctorArgs {
    /// TOML configuration file.
    #[arg(long)]
    config: PathBuf,
    /// Envoy's admin address (http://HOST:PORT): checks the clusters the filter needs.
    #[arg(long)]
    envoy_admin: Option<String>,
}

#[derive(Args)]
struct VllmArgsArgs {
    /// TOML configuration file.
    #[arg(long)]
    config: PathBuf,
    /// The filter's `tokenizer` is `render` (multimodal chats): adds `--enable-scale-out`, without
    /// which `vllm serve` answers the render endpoints 403.
    #[arg(long)]
    render: bool,
    /// Batches each replica's replay socket keeps (`buffer_steps` in `--kv-events-config`): an
    /// agent away for longer than that many batches resets the replica's mirror instead of
    /// replaying. vLLM's default.
    #[arg(long, default_value_t = llmgw_agent::vllm::DEFAULT_BUFFER_STEPS, value_parser = clap::value_parser!(u32).range(1..))]
    buffer_steps: u32,
}

#[derive(Args)]
struct ConfigArgs {
    /// TOML configuration file.
    #[arg(long)]
    config: PathBuf,
}

#[derive(Args)]
struct RunArgs {
    /// TOML configuration file.
    #[arg(long)]
    config: PathBuf,
    /// gRPC feed listener (overrides feed.listen).
    #[arg(long)]
    feed_listen: Option<SocketAddr>,
    /// HTTP listener for /metrics, /healthz, /debug/replicas (overrides http.listen).
    #[arg(long)]
    http_listen: Option<SocketAddr>,
    /// Allow the feed to listen on a non-loopback address (needs a token).
    #[arg(long)]
    feed_allow_non_loopback: bool,
    /// Shared token feed subscribers must present (overrides feed.token).
    #[arg(long)]
    feed_token: Option<String>,
    /// Log filter level: error, warn, info, debug.
    #[arg(long, default_value = "info")]
    log_level: tracing::Level,
}

#[derive(Args)]
struct LaunchArgs {
    #[command(flatten)]
    run: RunArgs,
    /// Which configured replica the process is (default: the only one).
    #[arg(long)]
    replica: Option<String>,
    /// Seconds to wait for vLLM after forwarding SIGTERM before killing it.
    #[arg(long, default_value_t = 30)]
    stop_timeout_secs: u64,
    /// The vLLM command line, after `--`.
    #[arg(last = true, required = true)]
    command: Vec<String>,
}

fn load(path: &Path) -> Result<Config, String> {
    Config::load(path).map_err(|e| format!("{}: {e}", path.display()))
}

/// Loads a configuration without reading its hash seed's variable or file (commands that print
/// a reference to it, or never hash).
fn load_deferring_seed(path: &Path) -> Result<Config, String> {
    Config::load_with(path, llmgw_agent::config::seed::SeedLookup::Defer)
        .map_err(|e| format!("{}: {e}", path.display()))
}

fn prepare(a: RunArgs) -> Result<Config, String> {
    tracing_subscriber::fmt().with_max_level(a.log_level).with_writer(std::io::stderr).with_ansi(false).init();
    let mut cfg = load(&a.config)?;
    if let Some(l) = a.feed_listen {
        cfg.feed.listen = l;
    }
    if let Some(l) = a.http_listen {
        cfg.http.listen = l;
    }
    if a.feed_allow_non_loopback {
        cfg.feed.allow_non_loopback = true;
    }
    if a.feed_token.is_some() {
        cfg.feed.token = a.feed_token;
    }
    cfg.validate().map_err(|e| e.to_string())?;
    Ok(cfg)
}

fn publish(a: PublishArgs) -> Result<(), String> {
    tracing_subscriber::fmt().with_max_level(a.log_level).with_writer(std::io::stderr).with_ansi(false).init();
    // The sidecar never hashes: it needs no seed.
    let cfg = load_deferring_seed(&a.config)?;
    llmgw_agent::jetstream::publish::run(cfg, a.replica.as_deref(), a.snapshot_listen).map_err(|e| e.to_string())
}

fn launch(a: LaunchArgs) -> Result<(), String> {
    let cfg = prepare(a.run)?;
    let replica = match &a.replica {
        Some(name) => cfg
            .replicas
            .iter()
            .position(|r| &r.name == name)
            .ok_or_else(|| format!("--replica {name:?} is not in the configuration"))?,
        None if cfg.replicas.len() == 1 => 0,
        None => return Err("the configuration has several replicas: choose one with --replica".into()),
    };
    let spec = llmgw_agent::launch::LaunchSpec {
        replica,
        command: a.command,
        stop_timeout: std::time::Duration::from_secs(a.stop_timeout_secs),
    };
    llmgw_agent::run_with(cfg, Some(spec)).map_err(|e| e.to_string())
}

/// Loads every native tokenizer model as `run` would: one line each, an error if any is refused.
fn check_tokenizers(cfg: &llmgw_agent::config::Config) -> Result<(), String> {
    let Some(t) = &cfg.tokenizer else { return Ok(()) };
    let native = llmgw_agent::native_tokenizer::NativeTokenizers::load(t);
    let mut refused = 0usize;
    for m in &native.models {
        match &m.tokenizer {
            Ok(tok) => println!(
                "tokenizer {}: loaded ({} bytes of tokenizer.json, chat template: {})",
                m.label,
                tok.file_bytes,
                if tok.has_chat_template() { "yes" } else { "none" }
            ),
            Err(e) => {
                refused = refused.saturating_add(1);
                println!("tokenizer {}: refused: {e}", m.label);
            }
        }
    }
    if refused > 0 {
        return Err(format!("{refused} native tokenizer model(s) refused"));
    }
    Ok(())
}

fn doctor(cfg: &llmgw_agent::config::Config, envoy_admin: Option<&str>) -> Result<(), String> {
    use llmgw_agent::{doctor, doctor_live};
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| e.to_string())?;
    let findings = rt.block_on(async {
        let mut all = doctor::replicas(cfg).await;
        all.extend(doctor::discovery(cfg).await);
        all.extend(doctor_live::flags(cfg).await);
        all.extend(doctor_live::events(cfg).await);
        all.extend(doctor::tokenizers(cfg).await);
        if let Some(admin) = envoy_admin {
            all.extend(doctor::envoy(admin).await);
            all.extend(doctor_live::feed(admin).await);
        }
        all
    });
    let bad = findings.iter().filter(|f| !f.ok).count();
    for f in &findings {
        println!("{} {}", if f.ok { "ok  " } else { "FAIL" }, f.line);
    }
    if bad > 0 {
        return Err(format!("{bad} check(s) failed"));
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(a) => prepare(a).and_then(|cfg| llmgw_agent::run(cfg).map_err(|e| e.to_string())),
        Command::Launch(a) => launch(a),
        Command::VllmArgs(a) => load_deferring_seed(&a.config).map(|cfg| {
            let opts = llmgw_agent::vllm::Options { render: a.render, buffer_steps: a.buffer_steps };
            print!("{}", llmgw_agent::vllm::render(&cfg, &opts))
        }),
        Command::CheckConfig(a) => load(&a.config).and_then(|cfg| {
            for e in cfg.engines() {
                println!("{} id={} {} {}", e.label(), e.id, e.address, e.source_summary());
            }
            check_tokenizers(&cfg)
        }),
        Command::Doctor(a) => load(&a.config).and_then(|cfg| doctor(&cfg, a.envoy_admin.as_deref())),
        Command::Hash(a) => tools::hash(&a).map_err(|e| e.to_string()),
        Command::Decode(a) => tools::decode(&a).map_err(|e| e.to_string()),
        Command::Replay(a) => tools::replay(&a).map_err(|e| e.to_string()),
        Command::Publish(a) => publish(a),
        Command::InstallFilter(a) => install_filter::install(&a),
        Command::GenSeed => llmgw_agent::config::seed::generate()
            .map(|seed| println!("{seed}"))
            .map_err(|e| format!("cannot read the system's randomness: {e}")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(msg) => {
            eprintln!("llmgw-agent: {msg}");
            ExitCode::FAILURE
        }
    }
}
