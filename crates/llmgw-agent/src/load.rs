//! Load scraping: each replica's vLLM `/metrics` (running, waiting, KV-cache usage) every
//! interval, each scrape published to the feed as it is read; a replica unreachable for
//! `down_after` is marked down and its blocks leave.
//!
//! vLLM's whole page is about 48 KB of Python-rendered text, some 5 ms of its API server's CPU
//! per scrape, taken from the engine on a busy host. Where the metrics URL is vLLM's `/metrics`,
//! the agent asks for the series it reads by name instead (`/metrics/?name[]=…`: vLLM serves
//! that path with `prometheus_client`'s own app, which renders only the named metrics: about
//! 0.5 KB and 0.3 ms on vLLM 0.33). A page that does not answer so (another exporter, a proxy
//! in front) is read whole from then on, until the replica is next unreachable.

use crate::config::{EngineSpec, LoadConfig};
use crate::http_client::HttpError;
use crate::hub::{Health, Hub};
use llmgw_core::feed::ReplicaLoad;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::{info, warn};

/// Load figures parsed from one /metrics page.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Load {
    pub running: f64,
    pub waiting: f64,
    pub kv_cache_usage: f64,
    /// The blocks its KV cache holds (`vllm:cache_config_info`'s `num_gpu_blocks` plus
    /// `num_cpu_blocks`), when the page says.
    pub cache_blocks: Option<u64>,
    /// Of those, the GPU's (`num_gpu_blocks`): what a request's prompt must fit in before the
    /// engine starts it.
    pub gpu_blocks: Option<u64>,
}

/// Parses vLLM's Prometheus text. Series with an `engine` label other than `rank` are left
/// out (one API server can front several data-parallel engines); the rest are summed (usage:
/// the largest).
pub fn parse_load(text: &str, rank: u32) -> Load {
    let mut l = Load::default();
    let rank = rank.to_string();
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        let (name, labels, rest) = match line.split_once('{') {
            Some((name, tail)) => {
                let Some((labels, rest)) = tail.rsplit_once('}') else { continue };
                (name, labels, rest)
            }
            None => match line.split_once(' ') {
                Some((n, r)) => (n, "", r),
                None => continue,
            },
        };
        let Some(value) = rest.split_whitespace().next().and_then(|v| v.parse::<f64>().ok()) else { continue };
        if !value.is_finite() {
            continue;
        }
        if let Some(engine) = label(labels, "engine") {
            if engine != rank {
                continue;
            }
        }
        match name {
            "vllm:num_requests_running" => l.running += value,
            "vllm:num_requests_waiting" => l.waiting += value,
            "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" => l.kv_cache_usage = l.kv_cache_usage.max(value),
            "vllm:cache_config_info" => {
                let blocks = |k| label(labels, k).and_then(|v| v.parse::<u64>().ok());
                if let Some(gpu) = blocks("num_gpu_blocks") {
                    l.gpu_blocks = Some(gpu);
                    l.cache_blocks = Some(gpu.saturating_add(blocks("num_cpu_blocks").unwrap_or(0)));
                }
            }
            _ => {}
        }
    }
    l
}

fn label<'a>(labels: &'a str, key: &str) -> Option<&'a str> {
    labels.split(',').find_map(|kv| {
        let (k, v) = kv.split_once('=')?;
        (k.trim() == key).then(|| v.trim().trim_matches('"'))
    })
}

/// The series [`parse_load`] reads.
const READ: [&str; 5] = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "vllm:cache_config_info",
];

/// The URL of only the series the agent reads, for a metrics URL that is vLLM's `/metrics`
/// (no query); `None` for any other.
pub fn by_name_url(url: &str) -> Option<String> {
    let uri: hyper::Uri = url.parse().ok()?;
    if uri.scheme_str() != Some("http") || uri.path() != "/metrics" || uri.query().is_some() {
        return None;
    }
    let names: Vec<String> = READ.iter().map(|n| format!("name%5B%5D={}", n.replace(':', "%3A"))).collect();
    Some(format!("http://{}/metrics/?{}", uri.authority()?, names.join("&")))
}

/// Which page of one replica is read: the series by name while it answers so, else the whole.
struct Page {
    whole: String,
    by_name: Option<String>,
    named_works: bool,
    /// The page by name answered since the last reset (logged once).
    named_seen: bool,
}

impl Page {
    fn new(whole: String) -> Page {
        let by_name = by_name_url(&whole);
        Page { named_works: by_name.is_some(), whole, by_name, named_seen: false }
    }

    /// One scrape: the page by name where it serves the load, else the whole page.
    async fn get(&mut self, label: &str, timeout: Duration) -> Result<String, HttpError> {
        if let (Some(url), true) = (&self.by_name, self.named_works) {
            match crate::http_client::get(url, timeout).await {
                Ok(body) if body.contains("vllm:num_requests_running") => {
                    if !self.named_seen {
                        info!(replica = %label, %url, "reading the load by name");
                        self.named_seen = true;
                    }
                    return Ok(body);
                }
                // Unreachable (refused, timed out): so is the whole page.
                Err(e @ (HttpError::Io(_) | HttpError::TimedOut)) => return Err(e),
                named => {
                    let whole = crate::http_client::get(&self.whole, timeout).await;
                    if whole.is_ok() {
                        // The replica answers, but not by name: read it whole from now on.
                        info!(replica = %label, url = %self.whole, by_name = named.is_ok(),
                              "the metrics page does not serve series by name; reading it whole");
                        self.named_works = false;
                    }
                    return whole;
                }
            }
        }
        crate::http_client::get(&self.whole, timeout).await
    }

    /// The replica was unreachable and answers again (it may have been replaced): try by name
    /// again.
    fn reset(&mut self) {
        self.named_works = self.by_name.is_some();
        self.named_seen = false;
    }
}

/// Scrapes one engine's replica forever.
pub async fn scrape_engine(hub: Arc<Hub>, spec: EngineSpec, cfg: LoadConfig) {
    let Some(url) = spec.metrics_url.clone() else { return };
    let mut page = Page::new(url.clone());
    let label = spec.label();
    let idx = usize::try_from(spec.id).unwrap_or(usize::MAX);
    // Held while this scraper runs: the engine's slot is not reused before it is dropped.
    let Some(stop) = hub.state().engines.get(idx).map(|e| e.stop.clone()) else { return };
    let mut t = tokio::time::interval(Duration::from_millis(cfg.interval_ms));
    t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let down_after = Duration::from_millis(cfg.down_after_ms);
    let mut last_ok = Instant::now();
    // Until its first answer nothing says the replica is up (the agent may have just
    // restarted in front of a dead one): its first failed scrape marks it down at once.
    let mut ever_ok = false;
    let mut failing = false;
    loop {
        t.tick().await;
        if stop.load(std::sync::atomic::Ordering::SeqCst) {
            return;
        }
        let got = page.get(&label, Duration::from_millis(cfg.timeout_ms)).await;
        if stop.load(std::sync::atomic::Ordering::SeqCst) {
            return;
        }
        match got {
            Ok(body) => {
                last_ok = Instant::now();
                ever_ok = true;
                if failing {
                    info!(replica = %spec.label(), %url, "replica reachable again");
                    failing = false;
                }
                let l = parse_load(&body, spec.dp_rank);
                let mut st = hub.state();
                if let Some(blocks) = l.cache_blocks {
                    st.set_engine_blocks(idx, blocks);
                }
                if st.set_health(idx, Health::Http, true, "reachable") {
                    info!(replica = %spec.label(), "replica up; mirror starts clean");
                }
                st.set_load(
                    idx,
                    ReplicaLoad {
                        replica: spec.id,
                        running: to_u32(l.running),
                        waiting: to_u32(l.waiting),
                        kv_cache_usage: l.kv_cache_usage as f32,
                        gpu_blocks: l.gpu_blocks.map_or(0, |b| u32::try_from(b).unwrap_or(u32::MAX)),
                    },
                );
                st.publish_load(idx);
            }
            Err(e) => {
                if !failing {
                    warn!(replica = %spec.label(), %url, error = %e, "load scrape failed");
                    failing = true;
                    page.reset();
                }
                let down = !ever_ok || last_ok.elapsed() >= down_after;
                if down && hub.state().set_health(idx, Health::Http, false, "unreachable") {
                    warn!(replica = %spec.label(), %url, "replica unreachable; marked down, its blocks leave the index");
                }
            }
        }
    }
}

fn to_u32(v: f64) -> u32 {
    if v.is_finite() && v > 0.0 {
        v.round().min(f64::from(u32::MAX)) as u32
    } else {
        0
    }
}

#[cfg(test)]
#[allow(clippy::arithmetic_side_effects)]
mod tests {
    use super::*;

    const PAGE: &str = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 5.0
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
vllm:num_requests_running_other 99
"#;

    #[test]
    fn parses_per_rank() {
        let load = |running, waiting, kv_cache_usage| Load {
            running,
            waiting,
            kv_cache_usage,
            cache_blocks: None,
            gpu_blocks: None,
        };
        assert_eq!(parse_load(PAGE, 0), load(3.0, 2.0, 0.25));
        assert_eq!(parse_load(PAGE, 1), load(5.0, 0.0, 0.5));
        let unlabelled = "vllm:num_requests_running 4\nvllm:num_requests_waiting 1\nvllm:kv_cache_usage_perc 0.1\n";
        assert_eq!(parse_load(unlabelled, 0), load(4.0, 1.0, 0.1));
        assert_eq!(parse_load("garbage{\n{}\nvllm:num_requests_running{x=\"1\"} NaN\n", 0), Load::default());
    }

    /// vLLM 0.33's `vllm:cache_config_info` (every CacheConfig field as a label, `str()` of its
    /// value, one series per engine) gives each rank's KV-cache size.
    #[test]
    fn the_kv_cache_size_comes_from_cache_config_info_per_rank() {
        let page = concat!(
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n",
            "# TYPE vllm:cache_config_info gauge\n",
            "vllm:cache_config_info{block_size=\"16\",cache_dtype=\"auto\",engine=\"0\",",
            "num_cpu_blocks=\"None\",num_gpu_blocks=\"27834\",prefix_caching_hash_algo=\"sha256_cbor\"} 1.0\n",
            "vllm:cache_config_info{block_size=\"16\",engine=\"1\",num_cpu_blocks=\"1000\",num_gpu_blocks=\"500\"} 1.0\n",
        );
        assert_eq!(parse_load(page, 0).cache_blocks, Some(27834));
        assert_eq!(parse_load(page, 1).cache_blocks, Some(1500));
        // The GPU's alone: the pool a prompt must fit in before the engine starts it.
        assert_eq!((parse_load(page, 0).gpu_blocks, parse_load(page, 1).gpu_blocks), (Some(27834), Some(500)));
        assert_eq!(parse_load(PAGE, 0).cache_blocks, None);
        assert_eq!(parse_load("vllm:cache_config_info{num_gpu_blocks=\"None\"} 1.0\n", 0).cache_blocks, None);
    }

    /// A hub of one replica at `addr` (its publisher never connects).
    fn one_replica(addr: &str) -> Arc<Hub> {
        let cfg = crate::config::Config::parse(&format!(
            "[[replicas]]\nname = \"r\"\naddress = \"{addr}\"\nendpoint = \"tcp://127.0.0.1:1\"\n"
        ))
        .unwrap();
        Hub::new(cfg.engines(), 64, 10)
    }

    /// Scrapes `hub`'s one replica every `interval_ms` until the task is aborted.
    fn start_scraper(
        hub: &Arc<Hub>,
        interval_ms: u64,
        down_after_ms: u64,
        timeout_ms: u64,
    ) -> tokio::task::JoinHandle<()> {
        let spec = hub.state().engines[0].spec.clone();
        let load = LoadConfig { enabled: true, interval_ms, down_after_ms, timeout_ms, models_interval_ms: 0 };
        tokio::spawn(scrape_engine(hub.clone(), spec, load))
    }

    /// After an agent (re)start a replica that never answers is down at its first failed
    /// scrape, not after `down_after_ms` of being shown up.
    #[tokio::test]
    async fn a_replica_never_seen_up_is_down_at_its_first_failed_scrape() {
        // A loopback port nobody listens on (bound, then closed).
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let hub = one_replica(&format!("127.0.0.1:{port}"));
        assert!(hub.state().engines[0].up, "shown up until something says otherwise");
        let task = start_scraper(&hub, 50, 3_600_000, 500);
        // Readiness: the table change. Bounded: one scrape's timeout and then some.
        let deadline = Instant::now() + Duration::from_secs(5);
        while hub.state().engines[0].up {
            assert!(Instant::now() < deadline, "still up: the hour of down_after_ms was waited for");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        task.abort();
    }

    #[test]
    fn vllms_metrics_page_is_asked_for_the_series_read_by_name() {
        let named = by_name_url("http://127.0.0.1:8000/metrics").unwrap();
        assert!(named.starts_with("http://127.0.0.1:8000/metrics/?name%5B%5D=vllm%3Anum_requests_running&"), "{named}");
        assert_eq!(named.matches("name%5B%5D=").count(), READ.len());
        assert_eq!(
            by_name_url("http://[::1]:8000/metrics").unwrap().split('?').next(),
            Some("http://[::1]:8000/metrics/")
        );
        for other in
            ["http://h:1/metrics?x=1", "http://h:1/custom", "http://h:1/metrics/", "https://h:1/metrics", "nonsense"]
        {
            assert_eq!(by_name_url(other), None, "{other}");
        }
    }

    use crate::http_client::test_server::{serve, Heads};

    /// The path a request head asks for.
    fn path(head: &str) -> &str {
        head.split_whitespace().nth(1).unwrap_or("")
    }

    /// A replica's metrics server: its address, and the request heads it read. With `by_name`,
    /// it answers `/metrics/?…` with the running series alone (as vLLM does); without, 404.
    async fn metrics_server(by_name: bool) -> (String, Heads) {
        let answer = move |head: &str| {
            let p = path(head);
            let body = if p == "/metrics" {
                Some(PAGE)
            } else if by_name && p.starts_with("/metrics/?") {
                Some("vllm:num_requests_running{engine=\"0\"} 3.0\n")
            } else {
                None
            };
            match body {
                Some(b) => format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{b}", b.len()).into_bytes(),
                None => b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n".to_vec(),
            }
        };
        let (url, heads) = serve(answer, Duration::ZERO).await;
        (url.trim_start_matches("http://").to_owned(), heads)
    }

    /// Scrapes the server at `addr` until it was asked `n` times; the paths asked.
    async fn scrape_until(addr: &str, heads: &Heads, n: usize) -> (Vec<String>, Option<ReplicaLoad>) {
        let hub = one_replica(addr);
        let task = start_scraper(&hub, 10, 60_000, 2_000);
        let deadline = Instant::now() + Duration::from_secs(10);
        while heads.lock().unwrap().len() < n {
            assert!(Instant::now() < deadline, "asked {:?}", heads.lock().unwrap());
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        task.abort();
        let got = heads.lock().unwrap().iter().map(|h| path(h).to_owned()).collect();
        let load = hub.state().engines[0].load.clone();
        (got, load)
    }

    #[tokio::test]
    async fn the_load_is_read_by_name_where_the_page_serves_it_else_whole() {
        // vLLM: only the series by name, every time.
        let (addr, paths) = metrics_server(true).await;
        let (asked, load) = scrape_until(&addr, &paths, 4).await;
        assert!(asked.iter().all(|p| p.starts_with("/metrics/?name%5B%5D=")), "{asked:?}");
        assert_eq!(load.map(|l| l.running), Some(3));
        // Another exporter: asked by name once, then whole; the load is read all the same.
        let (addr, paths) = metrics_server(false).await;
        let (asked, load) = scrape_until(&addr, &paths, 4).await;
        assert!(asked[0].starts_with("/metrics/?"), "{asked:?}");
        assert!(asked[1..].iter().all(|p| p == "/metrics"), "{asked:?}");
        assert_eq!(load.map(|l| (l.running, l.waiting)), Some((3, 2)));
    }

    #[test]
    fn rounding() {
        assert_eq!(to_u32(2.6), 3);
        assert_eq!(to_u32(-1.0), 0);
        assert_eq!(to_u32(f64::NAN), 0);
        assert_eq!(to_u32(1e20), u32::MAX);
    }
}
