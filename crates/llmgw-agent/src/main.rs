//! `llmgw-agent`: mirrors vLLM replicas' KV caches and feeds llmgw filters; also carries the
//! parity tools `hash` and `decode`.

mod tools;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "llmgw-agent", version, about = "llmgw agent: vLLM KV-cache mirror and parity tools")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Hash token ids (a JSON array on stdin) into vLLM block hashes.
    Hash(tools::HashArgs),
    /// Decode one KVEventBatch payload (msgpack on stdin) into JSON.
    Decode(tools::DecodeArgs),
    /// Replay a captured KV-event stream (JSON lines with payload_hex) through the engine mirror
    /// and the replica index, checking hash parity and scoring requests.
    Replay(tools::ReplayArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Hash(a) => tools::hash(&a),
        Command::Decode(a) => tools::decode(&a),
        Command::Replay(a) => tools::replay(&a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(msg) => {
            eprintln!("llmgw-agent: {msg}");
            ExitCode::FAILURE
        }
    }
}
