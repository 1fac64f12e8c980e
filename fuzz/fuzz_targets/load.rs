//! Fuzzes the load scrape's Prometheus text parser with any text and rank: no panic, and the
//! figures it returns are never NaN (the agent turns them into the feed's load report).
#![no_main]

use libfuzzer_sys::fuzz_target;
use llmgw_agent::load::parse_load;

fuzz_target!(|data: &[u8]| {
    let Some((&rank, text)) = data.split_first() else { return };
    let text = String::from_utf8_lossy(text);
    let l = parse_load(&text, u32::from(rank % 4));
    assert!(!l.running.is_nan() && !l.waiting.is_nan() && !l.kv_cache_usage.is_nan(), "{l:?}");
});
