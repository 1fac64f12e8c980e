//! The feed over real gRPC: the server on 127.0.0.1:0, the client generated from the `.proto`;
//! and the generated messages against llmgw-core's hand-written ones.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::arithmetic_side_effects
)]

use llmgw_agent::config::Config;
use llmgw_agent::feed::generated as pb;
use llmgw_agent::feed::service::feed_client::FeedClient;
use llmgw_agent::hub::Hub;
use llmgw_core::event::EventBatch;
use llmgw_core::feed::{self as core, Body, FeedState};
use llmgw_core::wire::{encode_batch, Encoding, HashForm, WireBatch, WireBlockStored, WireEvent};
use llmgw_core::BlockKey;
use prost::Message;
use std::sync::Arc;
use std::time::Duration;

fn hub() -> Arc<Hub> {
    let cfg = Config::parse(
        r#"
[[replicas]]
name = "a"
address = "127.0.0.1:8000"
models = ["m"]
endpoint = "tcp://127.0.0.1:5557"
[[replicas]]
name = "b"
address = "127.0.0.1:8001"
endpoint = "tcp://127.0.0.1:5558"
dp_ranks = 2
"#,
    )
    .unwrap();
    Hub::new(cfg.engines(), 1024, 1 << 20)
}

fn batch(keys: Vec<u64>) -> EventBatch {
    let w = WireBatch {
        ts: 1.0,
        events: vec![WireEvent::BlockStored(WireBlockStored {
            block_hashes: keys,
            block_size: 16,
            ..Default::default()
        })],
        data_parallel_rank: None,
    };
    EventBatch::decode(&encode_batch(&w, Encoding::Tagged, HashForm::Int)).unwrap()
}

/// Every body variant, generated → core → generated, must be identical.
#[test]
fn generated_and_core_messages_agree_on_field_numbers() {
    use pb::feed_message::Body as G;
    let bodies = vec![
        G::Replicas(pb::ReplicaTable {
            replicas: vec![pb::Replica {
                id: 7,
                name: "r".into(),
                address: "10.0.0.1:8000".into(),
                models: vec!["m1".into(), "m2".into()],
                up: true,
                dp_rank: 3,
                hash: Some(pb::HashSettings {
                    algo: "sha256".into(),
                    seeded: true,
                    seed: "7".into(),
                    block_size: 32,
                    lookahead_tokens: 1,
                }),
                dp_size: 4,
                kv_groups: vec![pb::KvCacheGroup {
                    group_idx: 1,
                    kind: "sliding_window".into(),
                    block_size: 16,
                    sliding_window: 32,
                }],
                lora_adapters: vec![pb::LoraAdapter { name: "sql".into(), path: "/adapters/sql".into() }],
                mirror_incomplete: true,
            }],
        }),
        G::Snapshot(pb::SnapshotChunk { replica: 2, first: true, blocks: vec![1, u64::MAX, 3] }),
        G::SnapshotComplete(pb::SnapshotComplete {}),
        G::Delta(pb::BlockDelta { replica: 4, added: vec![5, 6], removed: vec![7] }),
        G::Load(pb::LoadReport {
            loads: vec![pb::ReplicaLoad { replica: 1, running: 2, waiting: 3, kv_cache_usage: 0.5, gpu_blocks: 0 }],
        }),
        G::Reset(pb::ReplicaReset { replica: 9, reason: "restart".into() }),
        G::Heartbeat(pb::Heartbeat {}),
        G::Deltas(pb::BlockDeltas {
            deltas: vec![
                pb::BlockDelta { replica: 4, added: vec![5], removed: vec![] },
                pb::BlockDelta { replica: 1, added: vec![], removed: vec![u64::MAX] },
            ],
        }),
    ];
    for (i, b) in bodies.into_iter().enumerate() {
        let g = pb::FeedMessage { seq: 100 + i as u64, body: Some(b) };
        let bytes = g.encode_to_vec();
        let c = core::FeedMessage::decode(bytes.as_slice()).unwrap();
        assert_eq!(c.seq, g.seq);
        assert!(c.body.is_some(), "variant {i} lost");
        let back = c.encode_to_vec();
        assert_eq!(pb::FeedMessage::decode(back.as_slice()).unwrap(), g);
        assert_eq!(back, bytes, "variant {i}: byte-for-byte");
    }
    // Check the mapping of a few fields explicitly (not just a round trip).
    let c = core::FeedMessage::decode(
        pb::FeedMessage {
            seq: 1,
            body: Some(G::Delta(pb::BlockDelta { replica: 4, added: vec![5], removed: vec![7] })),
        }
        .encode_to_vec()
        .as_slice(),
    )
    .unwrap();
    assert_eq!(c.body, Some(Body::Delta(core::BlockDelta { replica: 4, added: vec![5], removed: vec![7] })));
    let req = pb::SubscribeRequest { subscriber: "s".into(), token: "t".into(), batches: true };
    let c = core::SubscribeRequest::decode(req.encode_to_vec().as_slice()).unwrap();
    assert_eq!((c.subscriber.as_str(), c.token.as_str(), c.batches), ("s", "t", true));
}

async fn start(hub: Arc<Hub>, token: Option<String>) -> (String, tokio::sync::oneshot::Sender<()>) {
    start_gathering(hub, token, Duration::ZERO).await
}

async fn start_gathering(
    hub: Arc<Hub>,
    token: Option<String>,
    gather: Duration,
) -> (String, tokio::sync::oneshot::Sender<()>) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(llmgw_agent::feed::serve(l, hub, token, None, gather, async {
        let _ = rx.await;
    }));
    (format!("http://{addr}"), tx)
}

async fn next(s: &mut tonic::Streaming<core::FeedMessage>) -> core::FeedMessage {
    tokio::time::timeout(Duration::from_secs(10), s.message()).await.unwrap().unwrap().unwrap()
}

#[tokio::test]
async fn subscribe_over_grpc_gets_table_snapshot_then_deltas() {
    let h = hub();
    h.state().apply(0, 0, &batch(vec![1, 2, 3]));
    h.state().apply(2, 0, &batch(vec![9]));
    let (url, stop) = start(h.clone(), Some("sesame".into())).await;

    let mut client = FeedClient::connect(url.clone()).await.unwrap();
    let denied = client
        .subscribe(core::SubscribeRequest { subscriber: "x".into(), token: "wrong".into(), batches: false })
        .await
        .unwrap_err();
    assert_eq!(denied.code(), tonic::Code::Unauthenticated);
    assert_eq!(h.state().feed.rejected_token, 1);

    // Token in metadata works too.
    let mut req = tonic::Request::new(core::SubscribeRequest {
        subscriber: "filter-0".into(),
        token: String::new(),
        batches: false,
    });
    req.metadata_mut().insert("x-llmgw-token", "sesame".parse().unwrap());
    let mut stream = client.subscribe(req).await.unwrap().into_inner();
    let mut st = FeedState::default();
    let mut seqs = Vec::new();
    loop {
        let m = next(&mut stream).await;
        seqs.push(m.seq);
        st.apply(&m).unwrap();
        if st.synced {
            break;
        }
    }
    // Table + one chunk per engine (3) + complete.
    assert_eq!(seqs, vec![0, 1, 2, 3, 4]);
    assert_eq!(st.replicas.len(), 3);
    assert_eq!(st.replicas[2].rank, 1);
    assert_eq!(st.index.score(&[BlockKey(1), BlockKey(2), BlockKey(3)]).leading, vec![3, 0, 0]);
    assert_eq!(st.index.score(&[BlockKey(9)]).leading, vec![0, 0, 1]);

    // Live changes follow with seq + 1 each.
    h.state().apply(1, 0, &batch(vec![1, 2]));
    h.state().reset(0, "restart");
    let m = next(&mut stream).await;
    assert_eq!(m.seq, 5);
    assert_eq!(m.body, Some(Body::Delta(core::BlockDelta { replica: 1, added: vec![1, 2], removed: vec![] })));
    st.apply(&m).unwrap();
    let m = next(&mut stream).await;
    assert_eq!(m.seq, 6);
    st.apply(&m).unwrap();
    assert_eq!(st.index.score(&[BlockKey(1), BlockKey(2), BlockKey(3)]).leading, vec![0, 2, 0]);
    assert_eq!(h.state().live_subscribers(), 1);

    // A subscriber that goes away is dropped from the hub.
    drop(stream);
    drop(client);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        h.state().publish(Body::Heartbeat(core::Heartbeat {}));
        if h.state().live_subscribers() == 0 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "subscriber never released");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _ = stop.send(());
}

/// Subscribes over gRPC and reads until the snapshot is complete.
async fn synced(url: &str, batches: bool) -> (tonic::Streaming<core::FeedMessage>, FeedState) {
    let mut client = FeedClient::connect(url.to_owned()).await.unwrap();
    let req = core::SubscribeRequest { subscriber: format!("batches-{batches}"), token: String::new(), batches };
    let mut stream = client.subscribe(req).await.unwrap().into_inner();
    let mut st = FeedState::default();
    while !st.synced {
        st.apply(&next(&mut stream).await).unwrap();
    }
    (stream, st)
}

#[tokio::test]
async fn changes_published_while_a_batching_subscriber_waits_arrive_as_one_message() {
    let h = hub();
    // Long against the spacing below, so that the test does not depend on the machine's speed.
    let (url, stop) = start_gathering(h.clone(), None, Duration::from_secs(2)).await;
    let (mut batching, mut sb) = synced(&url, true).await;
    let (mut plain, mut sp) = synced(&url, false).await;
    // Changes spaced out: each finds the subscriber's stream task idle.
    for (engine, key) in [(0, 1), (1, 2), (2, 3), (0, 4), (1, 5)] {
        h.state().apply(engine, key, &batch(vec![key]));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let m = next(&mut batching).await;
    assert!(matches!(&m.body, Some(Body::Deltas(d)) if d.deltas.len() == 5), "{m:?}");
    sb.apply(&m).unwrap();
    for _ in 0..5 {
        sp.apply(&next(&mut plain).await).unwrap();
    }
    let keys: Vec<BlockKey> = (1..=5).map(BlockKey).collect();
    assert_eq!(sb.index.score(&keys[..1]).leading, vec![1, 0, 0]);
    for k in &keys {
        assert_eq!(sb.index.score(std::slice::from_ref(k)).leading, sp.index.score(std::slice::from_ref(k)).leading);
    }
    assert_eq!(h.state().feed.gathered, 4);
    let _ = stop.send(());
}

/// PEM: a CA, a server certificate for `localhost` / 127.0.0.1 and a client certificate, both
/// issued by it.
struct Pki {
    ca: String,
    server: (String, String),
    client: (String, String),
}

fn pki() -> Pki {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let leaf = |names: Vec<String>| {
        let key = KeyPair::generate().unwrap();
        let cert = CertificateParams::new(names).unwrap().signed_by(&key, &ca, &ca_key).unwrap();
        (cert.pem(), key.serialize_pem())
    };
    Pki {
        ca: ca.pem(),
        server: leaf(vec!["localhost".into(), "127.0.0.1".into()]),
        client: leaf(vec!["llmgw-filter".into()]),
    }
}

async fn start_tls(hub: Arc<Hub>, pki: &Pki, mutual: bool) -> (String, tokio::sync::oneshot::Sender<()>) {
    let dir = std::env::temp_dir().join(format!("llmgw-feed-tls-{}-{mutual}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let write = |name: &str, text: &str| {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    };
    let mut cfg = Config::parse(
        "[[replicas]]\nname = \"a\"\naddress = \"127.0.0.1:8000\"\nendpoint = \"tcp://127.0.0.1:5557\"\n",
    )
    .unwrap()
    .feed;
    cfg.tls_cert = Some(write("cert.pem", &pki.server.0));
    cfg.tls_key = Some(write("key.pem", &pki.server.1));
    cfg.client_ca = mutual.then(|| write("ca.pem", &pki.ca));
    let tls = llmgw_agent::feed::tls_config(&cfg).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(llmgw_agent::feed::serve(l, hub, None, tls, Duration::ZERO, async {
        let _ = rx.await;
    }));
    (format!("https://localhost:{port}"), tx)
}

async fn tls_subscribe(url: &str, pki: &Pki, client_cert: bool) -> Result<core::FeedMessage, String> {
    use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};
    let mut tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(&pki.ca)).domain_name("localhost");
    if client_cert {
        tls = tls.identity(Identity::from_pem(&pki.client.0, &pki.client.1));
    }
    let url = url.replace("localhost", "127.0.0.1");
    let channel = Channel::from_shared(url).unwrap().tls_config(tls).map_err(|e| e.to_string())?;
    let channel = channel.connect().await.map_err(|e| format!("connect: {e:?}"))?;
    let mut client = FeedClient::new(channel);
    let req = core::SubscribeRequest { subscriber: "tls".into(), token: String::new(), batches: false };
    let mut stream = client.subscribe(req).await.map_err(|e| format!("subscribe: {e}"))?.into_inner();
    Ok(next(&mut stream).await)
}

#[tokio::test]
async fn the_feed_over_tls_and_mutual_tls() {
    let pki = pki();
    // TLS: a client trusting the CA gets the table; a cleartext client gets nothing.
    let (url, stop) = start_tls(hub(), &pki, false).await;
    let first = tls_subscribe(&url, &pki, false).await.unwrap();
    assert!(matches!(first.body, Some(Body::Replicas(_))), "{first:?}");
    let plain = url.replace("https://localhost", "http://127.0.0.1");
    let cleartext = async {
        let mut c = FeedClient::connect(plain).await.map_err(|e| e.to_string())?;
        let req = core::SubscribeRequest { subscriber: "plain".into(), token: String::new(), batches: false };
        c.subscribe(req).await.map(|_| ()).map_err(|e| e.to_string())
    };
    assert!(tokio::time::timeout(Duration::from_secs(10), cleartext).await.unwrap().is_err());
    let _ = stop.send(());
    // Mutual TLS: without a client certificate refused, with one issued by the CA served.
    let (url, stop) = start_tls(hub(), &pki, true).await;
    assert!(tls_subscribe(&url, &pki, false).await.is_err());
    let first = tls_subscribe(&url, &pki, true).await.unwrap();
    assert!(matches!(first.body, Some(Body::Replicas(_))));
    let _ = stop.send(());
}
