//! The configuration file's default values: what serde fills a field left out of the file
//! with. Kept apart from the sections' definitions (the parent file), which say what each
//! field is; the values need nothing from them.

use llmgw_core::hash::{defaults, HashAlgo};
use std::net::SocketAddr;

pub(super) fn default_refresh() -> u64 {
    10_000
}

pub(super) fn default_js_stream() -> String {
    "LLMGW_KV".to_owned()
}
pub(super) fn default_js_prefix() -> String {
    "llmgw.kv".to_owned()
}
pub(super) fn default_js_per_subject() -> i64 {
    10_000
}
pub(super) fn default_js_max_bytes() -> i64 {
    -1
}
pub(in crate::config) fn default_feed_listen() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 7070))
}
pub(super) fn default_http_listen() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 9464))
}
pub(super) fn default_queue() -> usize {
    4096
}
pub(super) fn default_max_subscribers() -> usize {
    1024
}
pub(super) fn default_backlog_bytes() -> usize {
    64 << 20
}
pub(super) fn default_heartbeat() -> f64 {
    5.0
}
/// An engine step is rarely under 10 ms, and the filter records where it sent each request
/// itself: a change seen up to 10 ms later costs routing nothing it would notice, and a VM
/// takes at most about a hundred change messages a second, whatever the fleet's size (each
/// costs Envoy about a hundred microseconds of CPU, however few blocks it carries).
pub(super) fn default_gather_ms() -> u64 {
    10
}
pub(super) fn default_algo() -> HashAlgo {
    defaults::ALGO
}
pub(super) fn default_block_size() -> u32 {
    defaults::BLOCK_SIZE
}
pub(super) fn default_rcvhwm() -> i32 {
    100_000
}
pub(super) fn default_reconnect_max() -> i32 {
    1000
}
pub(super) fn default_replay_timeout() -> u64 {
    2000
}
pub(super) fn default_publisher_down() -> u64 {
    30_000
}
pub(super) fn default_max_blocks() -> usize {
    16 << 20
}
pub(super) fn default_max_message_bytes() -> i64 {
    4 << 20
}
pub(super) fn default_queued_bytes() -> i64 {
    1 << 30
}
pub(super) fn default_true() -> bool {
    true
}
pub(super) fn default_interval() -> u64 {
    500
}
pub(super) fn default_down_after() -> u64 {
    10_000
}
pub(super) fn default_scrape_timeout() -> u64 {
    1000
}
pub(super) fn default_models_interval() -> u64 {
    30_000
}
pub(super) fn default_parity_threshold() -> f64 {
    0.01
}
pub(super) fn default_parity_min() -> u64 {
    16
}
pub(super) fn default_dp() -> u32 {
    1
}
