//! The engines a configuration describes: one per replica and data-parallel rank, with dense
//! ids, and the `tcp://host:port` endpoint rules (vLLM offsets both ports by the rank).

use super::file::{Config, Events, HashConfig, Mode};
use llmgw_core::hash::BlockHasher;
use std::net::IpAddr;

/// One engine: a replica's data-parallel rank, with its endpoints already offset.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineSpec {
    /// Dense id used on the feed.
    pub id: u32,
    pub replica: String,
    pub address: String,
    pub models: Vec<String>,
    pub dp_rank: u32,
    /// Data-parallel ranks of the replica (1: not data-parallel).
    pub dp_size: u32,
    pub mode: Mode,
    pub endpoint: String,
    pub replay_endpoint: Option<String>,
    pub topic: String,
    pub hash: HashConfig,
    pub metrics_url: Option<String>,
    /// Where its events come from.
    pub source: EventSource,
    /// Its `publish` sidecar's base URL, to join from a snapshot.
    pub snapshot_url: Option<String>,
}

/// Where an engine's KV events come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EventSource {
    /// Its ZMQ publisher (`endpoint`, `replay_endpoint`, `topic`, `mode`).
    Zmq,
    /// The `[jetstream]` stream, on this subject.
    JetStream { subject: String },
}

impl EventSource {
    /// The JetStream subject, for an engine fed from the stream.
    pub fn subject(&self) -> Option<&str> {
        match self {
            EventSource::Zmq => None,
            EventSource::JetStream { subject } => Some(subject),
        }
    }
}

/// The subject an engine's batches are published on: `{prefix}.{address}.{rank}`, the address
/// with every character other than a letter or digit replaced by `_` (subject tokens cannot hold
/// `.` or `:`). Both ends derive it from the address the filter routes to.
pub fn subject(prefix: &str, address: &str, rank: u32) -> String {
    let token: String = address.chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '_' }).collect();
    format!("{prefix}.{token}.{rank}")
}

impl EngineSpec {
    /// The hasher parity checks use (validated at load).
    pub fn hasher(&self) -> Option<BlockHasher> {
        BlockHasher::new(self.hash.algo, self.hash.seed.as_deref()).ok()
    }

    /// Where its events come from, as `check-config` prints it.
    pub fn source_summary(&self) -> String {
        match &self.source {
            EventSource::JetStream { subject } => format!("jetstream {subject}"),
            EventSource::Zmq => {
                format!("{:?} {} replay={}", self.mode, self.endpoint, self.replay_endpoint.as_deref().unwrap_or("-"))
            }
        }
    }

    /// Display name: the replica, with `#rank` when it has several ranks.
    pub fn label(&self) -> String {
        format!("{}#{}", self.replica, self.dp_rank)
    }
}

impl Config {
    /// Every engine (replica x rank), with dense ids in configuration order.
    pub fn engines(&self) -> Vec<EngineSpec> {
        let mut out = Vec::new();
        let mut id: u32 = 0;
        for r in &self.replicas {
            for rank in 0..r.dp_ranks {
                let metrics_url = match &r.metrics_url {
                    Some(u) if u.is_empty() => None,
                    Some(u) => Some(u.clone()),
                    None => Some(format!("http://{}/metrics", r.address)),
                };
                out.push(EngineSpec {
                    id,
                    replica: r.name.clone(),
                    address: r.address.clone(),
                    models: r.models.clone(),
                    dp_rank: rank,
                    dp_size: r.dp_ranks,
                    mode: r.mode,
                    endpoint: offset_port(&r.endpoint, rank).unwrap_or_else(|| r.endpoint.clone()),
                    replay_endpoint: r
                        .replay_endpoint
                        .as_ref()
                        .map(|e| offset_port(e, rank).unwrap_or_else(|| e.clone())),
                    topic: r.topic.clone(),
                    hash: r.hash.clone().unwrap_or_else(|| self.hash.clone()),
                    metrics_url,
                    source: match (r.events, &self.jetstream) {
                        (Events::Jetstream, Some(js)) => {
                            EventSource::JetStream { subject: subject(&js.subject_prefix, &r.address, rank) }
                        }
                        _ => EventSource::Zmq,
                    },
                    snapshot_url: r.snapshot_url.clone(),
                });
                id = id.saturating_add(1);
            }
        }
        out
    }
}

pub(super) fn is_loopback_host(host: &str) -> bool {
    let h = host.trim_start_matches('[').trim_end_matches(']');
    match h.parse::<IpAddr>() {
        Ok(IpAddr::V4(a)) => a.is_loopback(),
        Ok(IpAddr::V6(a)) => a.is_loopback() || a.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback()),
        Err(_) => h == "localhost",
    }
}

/// Why an endpoint is not `tcp://host:port`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EndpointError {
    #[error("{0:?}: only tcp://host:port endpoints are supported")]
    NotTcp(String),
    #[error("{0:?}: missing :port")]
    MissingPort(String),
    #[error("{0:?}: missing host")]
    MissingHost(String),
    #[error("{endpoint:?}: bad port {port:?}")]
    BadPort { endpoint: String, port: String },
}

/// Splits `tcp://host:port`.
pub fn parse_tcp(endpoint: &str) -> Result<(String, u16), EndpointError> {
    let rest = endpoint.strip_prefix("tcp://").ok_or_else(|| EndpointError::NotTcp(endpoint.to_owned()))?;
    let (host, port) = rest.rsplit_once(':').ok_or_else(|| EndpointError::MissingPort(endpoint.to_owned()))?;
    if host.is_empty() {
        return Err(EndpointError::MissingHost(endpoint.to_owned()));
    }
    let port = port
        .parse::<u16>()
        .map_err(|_| EndpointError::BadPort { endpoint: endpoint.to_owned(), port: port.to_owned() })?;
    Ok((host.to_owned(), port))
}

/// vLLM's rule for data-parallel ranks: a tcp endpoint's port grows by the rank.
pub fn offset_port(endpoint: &str, rank: u32) -> Option<String> {
    let (host, port) = parse_tcp(endpoint).ok()?;
    if rank == 0 || port == 0 {
        return Some(endpoint.to_owned());
    }
    let p = u16::try_from(u32::from(port).checked_add(rank)?).ok()?;
    Some(format!("tcp://{host}:{p}"))
}

#[cfg(test)]
mod tests {
    use super::super::file::field_defaults::default_feed_listen;
    use super::super::file::tests::OK;
    use super::*;

    #[test]
    fn valid_config_expands_ranks_and_offsets_both_ports() {
        let cfg = Config::parse(OK).unwrap();
        let e = cfg.engines();
        assert_eq!(e.len(), 3);
        assert_eq!((e[0].id, e[0].dp_rank, e[0].endpoint.as_str()), (0, 0, "tcp://127.0.0.1:5557"));
        assert_eq!((e[1].id, e[1].dp_rank, e[1].endpoint.as_str()), (1, 1, "tcp://127.0.0.1:5558"));
        assert_eq!(e[1].replay_endpoint.as_deref(), Some("tcp://127.0.0.1:5559"));
        assert_eq!(e[2].mode, Mode::Bind);
        assert_eq!(e[2].metrics_url, None);
        assert_eq!(e[0].metrics_url.as_deref(), Some("http://127.0.0.1:8000/metrics"));
        assert_eq!(e[0].hash.seed.as_deref(), Some("0"));
        assert!(e[0].hasher().is_some());
        assert_eq!(cfg.feed.listen, default_feed_listen());
    }

    #[test]
    fn loopback_forms() {
        assert!(is_loopback_host("127.0.0.1"));
        assert!(is_loopback_host("[::ffff:127.0.0.1]"));
        assert!(is_loopback_host("[::1]"));
        assert!(is_loopback_host("localhost"));
        assert!(!is_loopback_host("*"));
        assert!(!is_loopback_host("10.0.0.1"));
        assert_eq!(offset_port("tcp://h:5557", 3).as_deref(), Some("tcp://h:5560"));
        assert_eq!(offset_port("tcp://[::ffff:127.0.0.1]:5557", 1).as_deref(), Some("tcp://[::ffff:127.0.0.1]:5558"));
    }
}
