//! KV events through NATS JetStream, for fleets where every agent subscribing to every
//! publisher costs too much (the manual's "Past one agent's reach", docs/src/benchmarks/scale.md).
//!
//! * **Publishing** (`llmgw-agent publish`, beside each vLLM replica): one thread per
//!   data-parallel rank subscribes to the replica's ZMQ publisher on loopback, fills any gap from
//!   its replay socket, and publishes every batch, unchanged, to the JetStream stream on the
//!   engine's subject ([`subject`]) with vLLM's sequence number in the `Llmgw-Seq` header and a
//!   `Nats-Msg-Id` the broker deduplicates a retried publish by.
//! * **Consuming** (`llmgw-agent run` with replicas whose `events = "jetstream"`): one ordered
//!   consumer per agent over all the stream's subjects: one connection instead of one per
//!   replica, and a restarted agent rebuilds its mirrors from what the stream retains instead of
//!   asking every replica. Messages that arrived together are applied under one hub lock.
//!
//! The broker stores, fans out and replays; nothing here relays. The sequence discipline is the
//! ZMQ path's ([`crate::seq`]): the stream is ordered per subject, so a hole in a subject's
//! sequence is a batch the publisher could not deliver (the mirror is reset, as after a gap that
//! replay could not fill), and a sequence going back is an engine restart.

//!
//! * [`consume`]: the agent's consumer.
//! * [`publish`]: `llmgw-agent publish`.

use crate::config::JetStreamConfig;
use async_nats::jetstream::stream;
use std::time::Duration;

pub mod consume;
pub mod publish;

pub use crate::config::subject;

/// Header carrying vLLM's sequence number of the batch (decimal).
pub const SEQ_HEADER: &str = "Llmgw-Seq";

/// A boxed error of the NATS client (its error types differ per call).
pub type NatsError = Box<dyn std::error::Error + Send + Sync>;

/// Why talking to the broker failed.
#[derive(Debug, thiserror::Error)]
pub enum JetStreamError {
    #[error("jetstream.url {url}: {source}")]
    Connect { url: String, source: async_nats::ConnectError },
    #[error("stream {stream}: {source}")]
    Stream { stream: String, source: NatsError },
    #[error("consumer on {stream}: {source}")]
    Consumer { stream: String, source: NatsError },
    #[error("message stream ended")]
    Ended,
    #[error("stream {stream} {why}; reading the new one from its start")]
    Replaced { stream: String, why: &'static str },
}

impl JetStreamError {
    pub(crate) fn stream(stream: &str, e: impl Into<NatsError>) -> JetStreamError {
        JetStreamError::Stream { stream: stream.to_owned(), source: e.into() }
    }

    pub(crate) fn consumer(stream: &str, e: impl Into<NatsError>) -> JetStreamError {
        JetStreamError::Consumer { stream: stream.to_owned(), source: e.into() }
    }
}

/// The stream both ends create if it is missing (the same settings, so either may be first).
pub fn stream_config(cfg: &JetStreamConfig) -> stream::Config {
    stream::Config {
        name: cfg.stream.clone(),
        subjects: vec![format!("{}.>", cfg.subject_prefix)],
        max_messages_per_subject: cfg.max_messages_per_subject,
        max_bytes: cfg.max_bytes,
        max_age: Duration::from_secs(cfg.max_age_secs),
        storage: if cfg.memory_storage { stream::StorageType::Memory } else { stream::StorageType::File },
        discard: stream::DiscardPolicy::Old,
        // The broker refuses a duplicate window longer than a non-zero max_age.
        duplicate_window: match cfg.max_age_secs {
            0 => Duration::from_secs(120),
            a => Duration::from_secs(a.min(120)),
        },
        ..Default::default()
    }
}

/// Connects to the broker with the configured token and TLS.
pub async fn connect(cfg: &JetStreamConfig, name: &str) -> Result<async_nats::Client, JetStreamError> {
    // Servers the broker announces are not followed: only the configured (validated) address.
    let mut opts = async_nats::ConnectOptions::new()
        .name(name)
        .connection_timeout(Duration::from_secs(5))
        .ignore_discovered_servers();
    if let Some(t) = cfg.token.as_deref().filter(|t| !t.is_empty()) {
        opts = opts.token(t.to_owned());
    }
    if let Some(ca) = &cfg.tls_ca {
        opts = opts.add_root_certificates(ca.clone()).require_tls(true);
    }
    opts.connect(cfg.url.as_str()).await.map_err(|source| JetStreamError::Connect { url: cfg.url.clone(), source })
}
