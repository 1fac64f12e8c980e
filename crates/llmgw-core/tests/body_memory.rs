//! A request body of token ids costs memory in proportion to its ids, not to a JSON value tree:
//! the peak heap while parsing an 8 MiB completion body stays within a small multiple of the
//! body (a `serde_json::Value` tree of the same array peaks at about 14× the body).
//! Own test binary: the counting allocator sees only this test.

use llmgw_core::request::{parse_request, ApiKind, Prompt};
use peak_alloc::PeakAlloc;

#[global_allocator]
static ALLOC: PeakAlloc = PeakAlloc;

/// The peak heap above what was in use when `f` started, in bytes.
fn peak_while<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let base = ALLOC.current_usage();
    ALLOC.reset_peak_usage();
    let out = f();
    (out, ALLOC.peak_usage().saturating_sub(base))
}

#[test]
fn a_body_of_token_ids_parses_without_a_value_tree() {
    let mut body = String::from(r#"{"model":"m","prompt":["#);
    let mut n = 0u32;
    while body.len() < 8 << 20 {
        if n > 0 {
            body.push(',');
        }
        body.push_str(&(n % 100_000).to_string());
        n += 1;
    }
    body.push_str("]}");
    let (parsed, peak) = peak_while(|| parse_request(ApiKind::Completions, body.as_bytes()));
    let Prompt::Tokens(ids) = parsed.unwrap().prompt else { panic!("not token ids") };
    assert_eq!(ids.len(), n as usize);
    let ratio = peak as f64 / body.len() as f64;
    println!("peak heap {peak} bytes for a {} byte body: {ratio:.2}x", body.len());
    assert!(ratio < 3.0, "peak heap {ratio:.2}x the body");
    // What a value tree of the same body costs, for comparison.
    let (tree, tree_peak) = peak_while(|| serde_json::from_slice::<serde_json::Value>(body.as_bytes()).map(|_| ()));
    tree.unwrap();
    println!("as a serde_json::Value: {:.2}x", tree_peak as f64 / body.len() as f64);
    assert!(tree_peak > 4 * peak);
}
