//! Exactness against the real vLLM 0.33.0: for every tokenizer family in
//! `tests/fixtures/exactness/` (recorded by `dev/tokenizer_families.py record` from vLLM's own
//! `/tokenize` over a corpus of completions and chats), the native tokenizer answers every case
//! with vLLM's token ids, first from an empty piece cache and again from a warm one, and
//! refuses what vLLM refused. The tokenizer files are fetched by `dev/tokenizer_families.py
//! fetch` (their licences do not let them be copied here); `LLMGW_TOKENIZER_FAMILIES` names the
//! directory holding one model directory per family. Without it the test says so and passes,
//! unless `LLMGW_REQUIRE_TOKENIZER_FAMILIES` is set (as `./build.sh test` sets it).

use llmgw_tokenize::{ModelOptions, ModelTokenizer, TokenizeRequest};
use serde_json::Value;
use std::path::{Path, PathBuf};

fn fixtures() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/exactness");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map(|d| {
            d.filter_map(|e| e.ok().map(|e| e.path())).filter(|p| p.extension().is_some_and(|x| x == "json")).collect()
        })
        .unwrap_or_default();
    files.sort();
    files
}

#[test]
fn every_family_answers_as_vllm_does_cold_and_warm() {
    let Some(models) = std::env::var_os("LLMGW_TOKENIZER_FAMILIES").map(PathBuf::from) else {
        assert!(
            std::env::var_os("LLMGW_REQUIRE_TOKENIZER_FAMILIES").is_none(),
            "LLMGW_TOKENIZER_FAMILIES is not set: run dev/tokenizer_families.py fetch"
        );
        eprintln!("skipped: LLMGW_TOKENIZER_FAMILIES is not set (dev/tokenizer_families.py fetch, then point it at CACHE/models)");
        return;
    };
    let files = fixtures();
    assert!(files.len() >= 5, "expected the recorded families, found {}", files.len());
    let mut failures = Vec::new();
    let mut cases = 0;
    for file in &files {
        let fixture: Value = serde_json::from_slice(&std::fs::read(file).unwrap()).unwrap();
        let family = fixture["family"].as_str().unwrap();
        let dir = models.join(family);
        let model = match ModelTokenizer::load(&dir, &ModelOptions::default()) {
            Ok(m) => m,
            Err(e) => {
                failures.push(format!("{family}: refused at load: {e}"));
                continue;
            }
        };
        for pass in ["cold", "warm"] {
            for case in fixture["cases"].as_array().unwrap() {
                cases += 1;
                let name = case["name"].as_str().unwrap_or("?");
                let got = serde_json::from_value::<TokenizeRequest>(case["request"].clone())
                    .map_err(|e| e.to_string())
                    .and_then(|r| model.tokenize(&r).map_err(|e| e.to_string()));
                match (case.get("tokens"), got) {
                    (Some(want), Ok(ids)) => {
                        let want: Vec<u32> = serde_json::from_value(want.clone()).unwrap();
                        if want != ids {
                            let at =
                                want.iter().zip(&ids).position(|(a, b)| a != b).unwrap_or(want.len().min(ids.len()));
                            failures.push(format!(
                                "{family}/{name} ({pass}): differs at token {at}: vLLM {:?} native {:?}",
                                want.get(at..at + 8),
                                ids.get(at..at + 8)
                            ));
                        }
                    }
                    (Some(_), Err(e)) => failures.push(format!("{family}/{name} ({pass}): vLLM answered, native: {e}")),
                    (None, Ok(_)) => failures.push(format!(
                        "{family}/{name} ({pass}): vLLM refused it ({}), native answered",
                        case["error"]
                    )),
                    (None, Err(_)) => {}
                }
            }
        }
    }
    assert!(failures.is_empty(), "{} of {cases} checks failed:\n{}", failures.len(), failures.join("\n"));
}
