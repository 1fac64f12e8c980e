//! Replicas found at run time: a DNS name re-resolved periodically (a Kubernetes headless
//! Service), each address one replica, its event endpoints read from vLLM's
//! `GET /kv_event_sources` (or fixed ports). New addresses become engines; vanished ones are
//! removed (their blocks leave, they leave the replica table).

use crate::config::{parse_tcp, Config, DiscoveryConfig, EngineSpec, EventSource, Mode, Sources};
use crate::counters::Refused;
use crate::hub::Hub;
use crate::zmqsub::Engine;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;
use tracing::{info, warn};

/// A `/kv_event_sources` answer (or one endpoint of it) refused: why, and what was wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourcesError {
    pub reason: Refused,
    pub detail: String,
}

impl SourcesError {
    fn unparseable(detail: impl Into<String>) -> SourcesError {
        SourcesError { reason: Refused::Unparseable, detail: detail.into() }
    }

    /// The same refusal, its detail prefixed (`rank 0: ...`).
    fn within(self, prefix: &str) -> SourcesError {
        SourcesError { reason: self.reason, detail: format!("{prefix}{}", self.detail) }
    }
}

impl std::fmt::Display for SourcesError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.detail)
    }
}

/// One rank's publisher settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Source {
    pub rank: u32,
    pub endpoint: String,
    pub replay_endpoint: Option<String>,
    pub topic: String,
}

fn host_of(ip: IpAddr) -> String {
    match ip {
        IpAddr::V4(a) => a.to_string(),
        IpAddr::V6(a) => format!("[{a}]"),
    }
}

fn is_wildcard(host: &str) -> bool {
    matches!(host, "*" | "0.0.0.0" | "[::]" | "::")
}

/// Whether `host` (as written in an endpoint) is the replica's own address `ip`. A replica
/// names only its own sockets: any other host (another replica's, or a loopback address while
/// the replica is not on loopback) would make the agent subscribe where the replica chose.
fn is_own_host(ip: IpAddr, host: &str) -> bool {
    let bare = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
    let named = if bare == "localhost" { Some(IpAddr::from([127, 0, 0, 1])) } else { bare.parse::<IpAddr>().ok() };
    named.is_some_and(|n| n.to_canonical() == ip.to_canonical())
}

/// The address to connect to for a publisher vLLM reports as `published`. vLLM binds its PUB
/// only when the endpoint has `*` or `::`; otherwise it connects somewhere, which discovery
/// cannot serve. A concrete host must be the replica's own.
pub fn publisher_endpoint(ip: IpAddr, published: &str) -> Result<String, SourcesError> {
    if !(published.contains('*') || published.contains("::")) {
        return Err(SourcesError::unparseable(format!(
            "publisher {published:?} connects out; discovery needs it to bind"
        )));
    }
    let (host, port) = parse_tcp(published).map_err(|e| SourcesError::unparseable(e.to_string()))?;
    if port == 0 {
        return Err(SourcesError::unparseable(format!("publisher {published:?} has port 0")));
    }
    endpoint_on(ip, &host, port, published)
}

/// vLLM always binds the replay ROUTER.
pub fn replay_endpoint(ip: IpAddr, published: &str) -> Result<String, SourcesError> {
    let (host, port) = parse_tcp(published).map_err(|e| SourcesError::unparseable(e.to_string()))?;
    endpoint_on(ip, &host, port, published)
}

fn endpoint_on(ip: IpAddr, host: &str, port: u16, published: &str) -> Result<String, SourcesError> {
    if is_wildcard(host) {
        Ok(format!("tcp://{}:{port}", host_of(ip)))
    } else if is_own_host(ip, host) {
        Ok(format!("tcp://{host}:{port}"))
    } else {
        Err(SourcesError {
            reason: Refused::ForeignHost,
            detail: format!("{published:?} names host {host}, not this replica's address {ip}"),
        })
    }
}

/// The most data-parallel ranks one replica may list (each is an engine with its own thread).
pub const MAX_RANKS: usize = 64;

/// Parses `GET /kv_event_sources`: `{"0": {"endpoint": ..., "replay_endpoint": ..., "topic": ...}}`.
pub fn parse_sources(ip: IpAddr, body: &str) -> Result<Vec<Source>, SourcesError> {
    let v: Value = serde_json::from_str(body).map_err(|e| SourcesError::unparseable(format!("not JSON: {e}")))?;
    let obj = v.as_object().ok_or_else(|| SourcesError::unparseable("not a JSON object"))?;
    if obj.len() > MAX_RANKS {
        return Err(SourcesError {
            reason: Refused::TooManyRanks,
            detail: format!("{} ranks listed; at most {MAX_RANKS} are accepted", obj.len()),
        });
    }
    let mut out = Vec::new();
    for (rank, cfg) in obj {
        let rank: u32 =
            rank.parse().map_err(|_| SourcesError::unparseable(format!("rank {rank:?} is not a number")))?;
        // vLLM numbers a replica's ranks from 0: a rank past the bound is not one of them (and
        // would reach requests as `X-data-parallel-rank`).
        if usize::try_from(rank).map_or(true, |r| r >= MAX_RANKS) {
            return Err(SourcesError::unparseable(format!(
                "rank {rank} is out of range (ranks are below {MAX_RANKS})"
            )));
        }
        if cfg.get("enable_kv_cache_events").and_then(Value::as_bool) == Some(false) {
            continue;
        }
        if cfg.get("publisher").and_then(Value::as_str).is_some_and(|p| p != "zmq") {
            continue;
        }
        let published = cfg
            .get("endpoint")
            .and_then(Value::as_str)
            .ok_or_else(|| SourcesError::unparseable(format!("rank {rank}: no endpoint")))?;
        let endpoint = publisher_endpoint(ip, published).map_err(|e| e.within(&format!("rank {rank}: ")))?;
        let replay = match cfg.get("replay_endpoint").and_then(Value::as_str) {
            Some(r) => Some(replay_endpoint(ip, r).map_err(|e| e.within(&format!("rank {rank}: replay ")))?),
            None => None,
        };
        let topic = cfg.get("topic").and_then(Value::as_str).unwrap_or("").to_owned();
        out.push(Source { rank, endpoint, replay_endpoint: replay, topic });
    }
    out.sort_by_key(|s| s.rank);
    Ok(out)
}

/// Sources from fixed ports.
pub fn static_sources(d: &DiscoveryConfig, ip: IpAddr) -> Vec<Source> {
    let host = host_of(ip);
    (0..d.dp_ranks)
        .filter_map(|rank| {
            let port = u16::try_from(u32::from(d.events_port?).checked_add(rank)?).ok()?;
            let replay = d
                .replay_port
                .and_then(|p| u16::try_from(u32::from(p).checked_add(rank)?).ok())
                .map(|p| format!("tcp://{host}:{p}"));
            Some(Source {
                rank,
                endpoint: format!("tcp://{host}:{port}"),
                replay_endpoint: replay,
                topic: d.topic.clone(),
            })
        })
        .collect()
}

/// Engine specs of one discovered replica (ids are assigned by the hub).
pub fn specs(cfg: &Config, d: &DiscoveryConfig, ip: IpAddr, sources: &[Source]) -> Vec<EngineSpec> {
    let address = SocketAddr::new(ip, d.port).to_string();
    sources
        .iter()
        .map(|s| EngineSpec {
            id: 0,
            replica: format!("{}-{ip}", d.name),
            address: address.clone(),
            models: d.models.clone(),
            dp_rank: s.rank,
            dp_size: u32::try_from(sources.len()).unwrap_or(u32::MAX),
            mode: Mode::Connect,
            endpoint: s.endpoint.clone(),
            replay_endpoint: s.replay_endpoint.clone(),
            topic: s.topic.clone(),
            hash: d.hash.clone().unwrap_or_else(|| cfg.hash.clone()),
            metrics_url: d.scrape.then(|| format!("http://{address}/metrics")),
            source: EventSource::Zmq,
            snapshot_url: d.snapshot_port.map(|p| format!("http://{}", SocketAddr::new(ip, p))),
        })
        .collect()
}

struct Found {
    engines: Vec<usize>,
    scrapers: Vec<tokio::task::JoinHandle<()>>,
}

/// Keeps one discovery entry's replicas in step with DNS until the task is dropped.
pub async fn run(
    cfg: Config,
    idx: usize,
    hub: Arc<Hub>,
    contexts: Arc<crate::zmq_contexts::ContextPool>,
    stop: Arc<AtomicBool>,
) {
    let Some(d) = cfg.discovery.get(idx).cloned() else { return };
    let mut found: BTreeMap<IpAddr, Found> = BTreeMap::new();
    let mut t = tokio::time::interval(Duration::from_millis(d.refresh_ms));
    t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        t.tick().await;
        let resolved: BTreeSet<IpAddr> = match tokio::net::lookup_host((d.dns.as_str(), d.port)).await {
            Ok(addrs) => addrs.map(|a| a.ip()).collect(),
            Err(e) => {
                // A failed lookup keeps what is known: it is no proof that replicas left.
                warn!(dns = %d.dns, error = %e, "discovery lookup failed");
                continue;
            }
        };
        let gone: Vec<IpAddr> = found.keys().filter(|ip| !resolved.contains(ip)).copied().collect();
        for ip in gone {
            if let Some(f) = found.remove(&ip) {
                info!(discovery = %d.name, %ip, "replica left DNS; removing it");
                let mut st = hub.state();
                for e in f.engines {
                    st.remove_engine(e);
                }
                for s in f.scrapers {
                    s.abort();
                }
            }
        }
        for ip in resolved {
            if found.contains_key(&ip) {
                continue;
            }
            let sources = match d.sources {
                Sources::Static => static_sources(&d, ip),
                Sources::KvEventSources => {
                    let url = format!("http://{}/kv_event_sources", SocketAddr::new(ip, d.port));
                    match crate::http_client::get(&url, Duration::from_millis(cfg.load.timeout_ms)).await {
                        Ok(body) => match parse_sources(ip, &body) {
                            Ok(s) => s,
                            Err(e) => {
                                warn!(discovery = %d.name, %url, reason = e.reason.label(), error = %e, "unusable /kv_event_sources");
                                hub.state().discovery_refused.count(e.reason);
                                continue;
                            }
                        },
                        Err(e) => {
                            warn!(discovery = %d.name, %url, error = %e, "cannot read /kv_event_sources; will retry");
                            continue;
                        }
                    }
                }
            };
            if sources.is_empty() {
                warn!(discovery = %d.name, %ip, "replica publishes no KV events; will retry");
                continue;
            }
            let mut f = Found { engines: Vec::new(), scrapers: Vec::new() };
            for spec in specs(&cfg, &d, ip, &sources) {
                let Some(e) = hub.state().add_engine(spec) else {
                    warn!(discovery = %d.name, %ip, "every replica id is in use; engine not added");
                    continue;
                };
                let Some(spec) = hub.state().engines.get(e).map(|x| x.spec.clone()) else { continue };
                info!(replica = %spec.label(), endpoint = %spec.endpoint, "discovered engine");
                if let Err(err) =
                    Engine::spawn(spec.clone(), hub.clone(), cfg.zmq.clone(), contexts.next(), stop.clone())
                {
                    warn!(error = %err, "cannot start engine thread");
                }
                f.scrapers.extend(crate::served_models::spawn(&hub, &spec, &cfg.load));
                if cfg.load.enabled && spec.metrics_url.is_some() {
                    f.scrapers.push(tokio::spawn(crate::load::scrape_engine(hub.clone(), spec, cfg.load.clone())));
                }
                f.engines.push(e);
            }
            found.insert(ip, f);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const IP: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 5));

    #[test]
    fn endpoints_follow_vllm_bind_rule() {
        assert_eq!(publisher_endpoint(IP, "tcp://*:5557").as_deref(), Ok("tcp://10.0.0.5:5557"));
        assert_eq!(publisher_endpoint(IP, "tcp://[::]:5557").as_deref(), Ok("tcp://10.0.0.5:5557"));
        // A concrete address means vLLM connects out.
        assert!(publisher_endpoint(IP, "tcp://10.0.0.9:5557").is_err());
        assert_eq!(replay_endpoint(IP, "tcp://*:5558").as_deref(), Ok("tcp://10.0.0.5:5558"));
        assert_eq!(replay_endpoint(IP, "tcp://10.0.0.5:5558").as_deref(), Ok("tcp://10.0.0.5:5558"));
        let v6: IpAddr = "fd00::1".parse().unwrap();
        assert_eq!(publisher_endpoint(v6, "tcp://*:5557").as_deref(), Ok("tcp://[fd00::1]:5557"));
        // A replica on loopback may name loopback in any form.
        let lo = IpAddr::from([127, 0, 0, 1]);
        assert_eq!(
            publisher_endpoint(lo, "tcp://[::ffff:127.0.0.1]:5557").as_deref(),
            Ok("tcp://[::ffff:127.0.0.1]:5557")
        );
        assert_eq!(replay_endpoint(lo, "tcp://127.0.0.1:5558").as_deref(), Ok("tcp://127.0.0.1:5558"));
        assert_eq!(replay_endpoint(lo, "tcp://localhost:5558").as_deref(), Ok("tcp://localhost:5558"));
    }

    #[test]
    fn a_replica_cannot_name_another_hosts_sockets() {
        // Another replica's publisher, or the agent's own loopback, named by 10.0.0.5.
        for e in ["tcp://[::ffff:10.0.0.9]:5557", "tcp://[::ffff:127.0.0.1]:5557"] {
            let err = publisher_endpoint(IP, e).unwrap_err();
            assert!(err.detail.contains("not this replica's address"), "{err}");
            assert_eq!(err.reason, Refused::ForeignHost);
        }
        assert_eq!(replay_endpoint(IP, "tcp://127.0.0.1:5558").unwrap_err().reason, Refused::ForeignHost);
        let body = r#"{"0":{"endpoint":"tcp://*:5557","replay_endpoint":"tcp://10.0.0.9:5558"}}"#;
        let err = parse_sources(IP, body).unwrap_err();
        assert!(err.detail.contains("replay"), "{err}");
        assert_eq!(err.reason, Refused::ForeignHost);
        // Ranks are bounded.
        let many: String = (0..=MAX_RANKS)
            .map(|r| format!(r#""{r}":{{"endpoint":"tcp://*:{}"}}"#, 6000 + r))
            .collect::<Vec<_>>()
            .join(",");
        let err = parse_sources(IP, &format!("{{{many}}}")).unwrap_err();
        assert!(err.detail.contains("ranks"), "{err}");
        assert_eq!(err.reason, Refused::TooManyRanks);
        // So are their numbers: one rank numbered past the bound is refused.
        let far = r#"{"4000000000":{"endpoint":"tcp://*:5557"}}"#;
        let err = parse_sources(IP, far).unwrap_err();
        assert!(err.detail.contains("out of range"), "{err}");
        assert_eq!(err.reason, Refused::Unparseable);
        let last = format!(r#"{{"{}":{{"endpoint":"tcp://*:5557"}}}}"#, MAX_RANKS - 1);
        assert_eq!(parse_sources(IP, &last).unwrap().len(), 1);
    }

    #[test]
    fn each_refusal_has_its_reason() {
        let reason = |body: &str| parse_sources(IP, body).map(|_| ()).map_err(|e| e.reason);
        for body in [
            "not json",
            "[]",
            r#"{"x":{"endpoint":"tcp://*:5557"}}"#,
            r#"{"0":{}}"#,
            r#"{"0":{"endpoint":"tcp://*:0"}}"#,
            r#"{"0":{"endpoint":"tcp://10.0.0.5:5557"}}"#,
            r#"{"0":{"endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:notaport"}}"#,
        ] {
            assert_eq!(reason(body), Err(Refused::Unparseable), "{body}");
        }
        assert_eq!(
            reason(r#"{"0":{"endpoint":"tcp://*:5557","replay_endpoint":"tcp://10.0.0.6:1"}}"#),
            Err(Refused::ForeignHost)
        );
        let many: Vec<String> = (0..=MAX_RANKS).map(|r| format!(r#""{r}":{{"endpoint":"tcp://*:1"}}"#)).collect();
        assert_eq!(reason(&format!("{{{}}}", many.join(","))), Err(Refused::TooManyRanks));
        // Counted apart, each under its own label.
        let mut counts = crate::counters::RefusedCounts::default();
        counts.count(Refused::ForeignHost);
        counts.count(Refused::ForeignHost);
        counts.count(Refused::TooManyRanks);
        let got: Vec<(&str, u64)> = Refused::ALL.iter().map(|r| (r.label(), counts.get(*r))).collect();
        assert_eq!(
            got,
            vec![
                ("unparseable", 0),
                ("foreign_host", 2),
                ("too_many_ranks", 1),
                ("ids_exhausted", 0),
                ("model_list", 0)
            ]
        );
    }

    #[test]
    fn parses_kv_event_sources() {
        let body = r#"{"1":{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5558","replay_endpoint":"tcp://*:5601","topic":"kv-events"},
                       "0":{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557","replay_endpoint":null,"buffer_steps":10000,"topic":"kv-events"}}"#;
        let s = parse_sources(IP, body).unwrap();
        assert_eq!(
            s,
            vec![
                Source {
                    rank: 0,
                    endpoint: "tcp://10.0.0.5:5557".into(),
                    replay_endpoint: None,
                    topic: "kv-events".into()
                },
                Source {
                    rank: 1,
                    endpoint: "tcp://10.0.0.5:5558".into(),
                    replay_endpoint: Some("tcp://10.0.0.5:5601".into()),
                    topic: "kv-events".into()
                },
            ]
        );
        assert_eq!(parse_sources(IP, "{}").unwrap(), vec![]);
        assert!(parse_sources(IP, "[]").is_err());
        assert!(parse_sources(IP, r#"{"0":{"endpoint":"tcp://10.0.0.9:1"}}"#).is_err());
        let off = r#"{"0":{"enable_kv_cache_events":false,"publisher":"null","endpoint":"tcp://*:5557"}}"#;
        assert_eq!(parse_sources(IP, off).unwrap(), vec![]);
    }

    #[test]
    fn static_sources_and_specs() {
        let cfg = Config::parse(
            "[[discovery]]\nname = \"pool\"\ndns = \"vllm.ns.svc\"\nport = 8000\nsources = \"static\"\nevents_port = 5557\nreplay_port = 5600\ndp_ranks = 2\ntopic = \"t\"\n",
        )
        .unwrap();
        let d = &cfg.discovery[0];
        let s = static_sources(d, IP);
        assert_eq!(s[1].endpoint, "tcp://10.0.0.5:5558");
        assert_eq!(s[1].replay_endpoint.as_deref(), Some("tcp://10.0.0.5:5601"));
        let specs = specs(&cfg, d, IP, &s);
        assert_eq!(specs.len(), 2);
        assert_eq!(specs[0].replica, "pool-10.0.0.5");
        assert_eq!(specs[0].address, "10.0.0.5:8000");
        assert_eq!(specs[0].metrics_url.as_deref(), Some("http://10.0.0.5:8000/metrics"));
        assert_eq!(specs[1].dp_rank, 1);
        let bad = Config::parse("[[discovery]]\nname = \"pool\"\ndns = \"x\"\nport = 8000\nsources = \"static\"\n");
        assert_eq!(bad.unwrap_err().field, "discovery[0].events_port");
        let bad = Config::parse("[[discovery]]\nname = \"pool\"\ndns = \"x\"\nport = 8000\nsources = \"mdns\"\n");
        assert_eq!(bad.unwrap_err().field, "discovery[0].sources");
    }
}
