//! Development aid: tokenizes each JSON `/tokenize` body read from stdin (one per line) with
//! the model directory given as argument, printing one JSON line of ids (or the error) each.

// A benchmark/development aid, not shipped code.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::arithmetic_side_effects
)]

use llmgw_tokenize::{ModelOptions, ModelTokenizer, TokenizeRequest};
use std::io::BufRead;

fn main() {
    let Some(dir) = std::env::args().nth(1) else {
        eprintln!("usage: tokenize_lines MODEL_DIR < requests.jsonl");
        std::process::exit(2);
    };
    let model = match ModelTokenizer::load(std::path::Path::new(&dir), &ModelOptions::default()) {
        Ok(m) => m,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(1);
        }
    };
    for line in std::io::stdin().lock().lines().map_while(Result::ok) {
        let out = match serde_json::from_str::<TokenizeRequest>(&line) {
            Ok(req) => match model.tokenize(&req) {
                Ok(ids) => serde_json::json!({ "tokens": ids }),
                Err(e) => serde_json::json!({ "error": e.to_string(), "status": e.status() }),
            },
            Err(e) => serde_json::json!({ "error": e.to_string(), "status": 400 }),
        };
        println!("{out}");
    }
}
