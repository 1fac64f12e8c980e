//! Start-to-exact benchmark (not a test; `./build.sh bench warmstart` runs it): how long a
//! gateway's agent takes from its start to an exact index in a feed client (what a filter VM
//! subscribes to), at ENGINES engines of BLOCKS cached blocks each, end to end: the agent
//! process spawned, its ZMQ subscriptions, each engine's history (from its sidecar's snapshot
//! over HTTP, or from its replay socket), its feed, and the client's index holding every block.
//!
//! Each engine is a vLLM stand-in on loopback: a ZMQ publisher sending a live batch of 16 new
//! blocks every `--live-ms` (a busy replica, so every engine is heard at once), a replay socket
//! (vLLM's protocol) holding its whole history, and beside it the sidecar's snapshot server (the
//! agent's own `snapshot::serve` router over a ledger the live batches keep up to date, as the
//! `publish` sidecar's engine thread does). The same engines serve both runs, alternately:
//! - `replay` (the baseline): replicas without `snapshot_url`; the agent reads every engine's
//!   history as ordinary batches from its replay socket (vLLM's best case: a buffer still
//!   holding batch 0);
//! - `snapshot`: replicas with `snapshot_url`; the agent joins each engine from its snapshot.
//!
//! While snapshots are served, the longest a live batch takes to enter its engine's ledger (the
//! wait for the lock plus the apply) is the stall snapshot serving puts on a sidecar's
//! ingestion; the same in the replay rounds, where no snapshot is served, is its baseline.
//!
//! `cargo run --release -p llmgw-agent --example start_to_exact -- --agent-bin PATH
//!  [--engines 16] [--blocks 100000] [--rounds 3] [--live-ms 10]` prints one line per run and a
//! JSON summary.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::arithmetic_side_effects,
    clippy::print_stdout,
    clippy::cast_possible_truncation
)]

use llmgw_agent::feed::service::feed_client::FeedClient;
use llmgw_agent::snapshot::serve::{router, Ledgers};
use llmgw_core::event::EventBatch;
use llmgw_core::feed::{Body, SubscribeRequest};
use llmgw_core::wire::{encode_batch, Encoding, HashForm, WireBatch, WireBlockStored, WireEvent};
use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const PER_BATCH: u64 = 16;
/// Live blocks carry this bit, history blocks do not; bits 40.. name the engine.
const LIVE: u64 = 1 << 39;
const END_SEQ: [u8; 8] = [0xff; 8];

fn payload(keys: impl Iterator<Item = u64>) -> Vec<u8> {
    let ev =
        WireEvent::BlockStored(WireBlockStored { block_hashes: keys.collect(), block_size: 16, ..Default::default() });
    encode_batch(&WireBatch { ts: 1.0, events: vec![ev], data_parallel_rank: None }, Encoding::Tagged, HashForm::Int)
}

/// Every batch an engine published, by sequence number (what its replay socket answers from).
type History = Arc<Mutex<Vec<Vec<u8>>>>;

/// One vLLM stand-in and its sidecar's snapshot server.
struct Engine {
    tag: u64,
    publisher: String,
    replay: String,
    snapshot: String,
    history: History,
    ledgers: Arc<Ledgers>,
}

fn bound(s: &zmq::Socket) -> String {
    s.bind("tcp://127.0.0.1:*").unwrap();
    s.get_last_endpoint().unwrap().unwrap()
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn arg(args: &[String], name: &str, d: &str) -> String {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned().unwrap_or_else(|| d.to_owned())
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let engines: u64 = arg(&args, "--engines", "16").parse().unwrap();
    let blocks: u64 = arg(&args, "--blocks", "100000").parse().unwrap();
    let rounds: usize = arg(&args, "--rounds", "3").parse().unwrap();
    let live_ms: u64 = arg(&args, "--live-ms", "10").parse().unwrap();
    let agent_bin = arg(&args, "--agent-bin", "target/release/llmgw-agent");
    assert!(blocks.is_multiple_of(PER_BATCH) && blocks < LIVE, "--blocks: a multiple of {PER_BATCH}");
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let zctx = zmq::Context::new();

    // The engines: history batches, a ledger holding them, a snapshot server, sockets.
    let mut fleet = Vec::new();
    let (mut pubs, mut routers) = (Vec::new(), Vec::new());
    for e in 0..engines {
        let tag = (e + 1) << 40;
        let history: Vec<Vec<u8>> =
            (0..blocks / PER_BATCH).map(|s| payload((0..PER_BATCH).map(|i| tag | (s * PER_BATCH + i)))).collect();
        let ledgers = Arc::new(Ledgers::new([0], usize::MAX));
        {
            let mut l = ledgers.lock(0).unwrap();
            for (seq, p) in history.iter().enumerate() {
                l.apply(seq as u64, &EventBatch::decode(p).unwrap());
            }
        }
        let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
        let snapshot = format!("http://{}", listener.local_addr().unwrap());
        let app = router(ledgers.clone());
        rt.spawn(async move { axum::serve(listener, app).await });
        let p = zctx.socket(zmq::PUB).unwrap();
        let r = zctx.socket(zmq::ROUTER).unwrap();
        // vLLM's replay answers a whole range at once: no reply is dropped at a high-water mark.
        r.set_sndhwm(0).unwrap();
        let (publisher, replay) = (bound(&p), bound(&r));
        pubs.push(p);
        routers.push(r);
        fleet.push(Engine { tag, publisher, replay, snapshot, history: Arc::new(Mutex::new(history)), ledgers });
    }
    println!("{engines} engines x {blocks} blocks ({PER_BATCH} per batch), a live batch every {live_ms} ms per engine");

    let stop = Arc::new(AtomicBool::new(false));
    let stall_us = Arc::new(AtomicU64::new(0));
    let histories: Vec<_> = fleet.iter().map(|e| e.history.clone()).collect();
    let replay = {
        let stop = stop.clone();
        std::thread::spawn(move || serve_replay(&routers, &histories, &stop))
    };
    let live = {
        let (stop, stall_us) = (stop.clone(), stall_us.clone());
        let feeds: Vec<_> = fleet.iter().map(|e| (e.tag, e.history.clone(), e.ledgers.clone())).collect();
        std::thread::spawn(move || publish_live(&pubs, &feeds, live_ms, &stop, &stall_us))
    };

    let mut results: HashMap<&str, Vec<f64>> = HashMap::new();
    let (mut stall_max_us, mut baseline_max_us) = (0, 0);
    for round in 0..rounds {
        for mode in ["replay", "snapshot"] {
            stall_us.store(0, Ordering::SeqCst);
            let took = run_once(&rt, &fleet, mode == "snapshot", &agent_bin, blocks, round);
            if mode == "snapshot" {
                stall_max_us = stall_max_us.max(stall_us.load(Ordering::SeqCst));
            } else {
                baseline_max_us = baseline_max_us.max(stall_us.load(Ordering::SeqCst));
            }
            let ms = took.map(|d| d.as_secs_f64() * 1e3);
            match ms {
                Some(ms) => println!("round {round} {mode:>8}: exact after {ms:>8.1} ms"),
                None => println!("round {round} {mode:>8}: not exact within 120 s"),
            }
            results.entry(mode).or_default().push(ms.unwrap_or(f64::NAN));
        }
    }
    stop.store(true, Ordering::SeqCst);
    replay.join().unwrap();
    live.join().unwrap();
    // The sidecars' own account: the longest any held its engine's lock to copy the ledger.
    let copy_max_ms = fleet.iter().map(|e| copy_max_seconds(&e.snapshot) * 1e3).fold(0.0, f64::max);

    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (r, s) = (median(&results["replay"]), median(&results["snapshot"]));
    println!("median start to exact: replay (baseline) {r:.1} ms, snapshot {s:.1} ms, snapshot / replay {:.3}", s / r);
    println!(
        "longest a live batch took to enter its ledger (lock wait + apply) while snapshots were served: {:.3} ms \
         (baseline, no snapshot served: {:.3} ms)",
        stall_max_us as f64 / 1e3,
        baseline_max_us as f64 / 1e3
    );
    println!("longest a sidecar held its ledger's lock to copy it (its /metrics): {copy_max_ms:.3} ms");
    let list = |v: &[f64]| v.iter().map(|x| format!("{x:.1}")).collect::<Vec<_>>().join(",");
    println!(
        "{{\"engines\":{engines},\"blocks_per_engine\":{blocks},\"live_ms\":{live_ms},\"replay_ms\":[{}],\"snapshot_ms\":[{}],\"replay_median_ms\":{r:.1},\"snapshot_median_ms\":{s:.1},\"ratio\":{:.3},\"ingest_stall_max_ms\":{:.3},\"ingest_baseline_max_ms\":{:.3},\"copy_max_ms\":{copy_max_ms:.3}}}",
        list(&results["replay"]),
        list(&results["snapshot"]),
        s / r,
        stall_max_us as f64 / 1e3,
        baseline_max_us as f64 / 1e3
    );
}

/// `llmgw_publish_snapshot_copy_max_seconds` from a sidecar's `/metrics`.
fn copy_max_seconds(base: &str) -> f64 {
    use std::io::{Read, Write};
    let addr = base.trim_start_matches("http://");
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.write_all(format!("GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes()).unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix("llmgw_publish_snapshot_copy_max_seconds "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap()
}

/// Answers replay requests (`[id, "", seq8]`) from every engine's history, as vLLM does: each
/// batch from the one asked for, then the end marker.
fn serve_replay(routers: &[zmq::Socket], histories: &[History], stop: &AtomicBool) {
    while !stop.load(Ordering::SeqCst) {
        let mut items: Vec<_> = routers.iter().map(|r| r.as_poll_item(zmq::POLLIN)).collect();
        if zmq::poll(&mut items, 50).unwrap() == 0 {
            continue;
        }
        let ready: Vec<bool> = items.iter().map(zmq::PollItem::is_readable).collect();
        for (i, r) in routers.iter().enumerate().filter(|(i, _)| ready[*i]) {
            while let Ok(frames) = r.recv_multipart(zmq::DONTWAIT) {
                let [id, _, seq] = &frames[..] else { continue };
                let from = u64::from_be_bytes(seq[..8].try_into().unwrap()) as usize;
                let batches: Vec<Vec<u8>> = histories[i].lock().unwrap().get(from..).unwrap_or_default().to_vec();
                for (k, p) in batches.iter().enumerate() {
                    let s = ((from + k) as u64).to_be_bytes();
                    r.send_multipart([&id[..], &[][..], &s[..], &p[..]], 0).unwrap();
                }
                r.send_multipart([&id[..], &[][..], &END_SEQ[..], &[][..]], 0).unwrap();
            }
        }
    }
}

/// Every `live_ms`, one batch of 16 new blocks per engine: into its ledger (the wait for the
/// lock plus the apply, which copies a chunk a snapshot still shares, is the sidecar's
/// ingestion stall), its history, then its publisher.
fn publish_live(
    pubs: &[zmq::Socket],
    feeds: &[(u64, History, Arc<Ledgers>)],
    live_ms: u64,
    stop: &AtomicBool,
    stall_us: &AtomicU64,
) {
    let mut next = 0u64;
    while !stop.load(Ordering::SeqCst) {
        let t = Instant::now();
        for (p, (tag, history, ledgers)) in pubs.iter().zip(feeds) {
            let body = payload((0..PER_BATCH).map(|i| tag | LIVE | (next * PER_BATCH + i)));
            let batch = EventBatch::decode(&body).unwrap();
            let mut h = history.lock().unwrap();
            let seq = h.len() as u64;
            let waited = Instant::now();
            let mut ledger = ledgers.lock(0).unwrap();
            ledger.apply(seq, &batch);
            drop(ledger);
            stall_us.fetch_max(waited.elapsed().as_micros() as u64, Ordering::SeqCst);
            h.push(body.clone());
            drop(h);
            p.send_multipart([&b""[..], &seq.to_be_bytes()[..], &body[..]], 0).unwrap();
        }
        next += 1;
        std::thread::sleep(Duration::from_millis(live_ms).saturating_sub(t.elapsed()));
    }
}

/// Starts an agent over the fleet and returns how long after its spawn a feed client's index
/// held every engine's history exactly (`None`: not within 120 s).
fn run_once(
    rt: &tokio::runtime::Runtime,
    fleet: &[Engine],
    snapshots: bool,
    agent_bin: &str,
    blocks: u64,
    round: usize,
) -> Option<Duration> {
    let (feed, http) = (free_port(), free_port());
    let mut cfg = format!(
        "[feed]\nlisten = \"127.0.0.1:{feed}\"\n[http]\nlisten = \"127.0.0.1:{http}\"\n[load]\nenabled = false\n\
         [hash]\nalgo = \"sha256_cbor\"\nseed = \"0\"\nblock_size = 16\n"
    );
    for (i, e) in fleet.iter().enumerate() {
        let _ = write!(
            cfg,
            "[[replicas]]\nname = \"e{i}\"\naddress = \"127.0.0.1:{}\"\nmodels = [\"m\"]\nendpoint = \"{}\"\n\
             replay_endpoint = \"{}\"\nmetrics_url = \"\"\n",
            20000 + i,
            e.publisher,
            e.replay
        );
        if snapshots {
            let _ = writeln!(cfg, "snapshot_url = \"{}\"", e.snapshot);
        }
    }
    let dir = std::env::temp_dir().join(format!("llmgw-start-to-exact-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("agent-{round}-{snapshots}.toml"));
    std::fs::write(&path, cfg).unwrap();
    let log = std::fs::File::create(dir.join(format!("agent-{round}-{snapshots}.log"))).unwrap();
    let t0 = Instant::now();
    let mut child = Command::new(agent_bin)
        .args(["run", "--config"])
        .arg(&path)
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("the agent binary (--agent-bin)");
    let tags: Vec<u64> = fleet.iter().map(|e| e.tag).collect();
    let took = rt.block_on(exact_after(feed, &tags, blocks, t0, Duration::from_secs(120)));
    let _ = child.kill();
    let _ = child.wait();
    took
}

/// A feed client's index, per replica id: its blocks, how many of them are its engine's history,
/// and how many belong to another engine.
#[derive(Default)]
struct Index {
    tags: HashMap<u32, u64>,
    held: HashMap<u32, HashSet<u64>>,
    history: u64,
    foreign: u64,
    synced: bool,
}

impl Index {
    fn class(&self, replica: u32, k: u64, blocks: u64) -> (u64, u64) {
        let tag = self.tags.get(&replica).copied().unwrap_or(0);
        if k >> 40 != tag >> 40 {
            (0, 1)
        } else if k & LIVE == 0 && k & (LIVE - 1) < blocks {
            (1, 0)
        } else {
            (0, 0)
        }
    }

    fn add(&mut self, replica: u32, keys: &[u64], blocks: u64) {
        for &k in keys {
            if self.held.entry(replica).or_default().insert(k) {
                let (h, f) = self.class(replica, k, blocks);
                self.history += h;
                self.foreign += f;
            }
        }
    }

    fn remove(&mut self, replica: u32, keys: &[u64], blocks: u64) {
        for &k in keys {
            if self.held.entry(replica).or_default().remove(&k) {
                let (h, f) = self.class(replica, k, blocks);
                self.history -= h;
                self.foreign -= f;
            }
        }
    }

    fn clear(&mut self, replica: u32, blocks: u64) {
        let keys: Vec<u64> = self.held.get(&replica).map(|h| h.iter().copied().collect()).unwrap_or_default();
        self.remove(replica, &keys, blocks);
    }
}

async fn exact_after(feed: u16, tags: &[u64], blocks: u64, t0: Instant, limit: Duration) -> Option<Duration> {
    let url = format!("http://127.0.0.1:{feed}");
    let mut stream = loop {
        if t0.elapsed() > limit {
            return None;
        }
        if let Ok(mut c) = FeedClient::connect(url.clone()).await {
            let req =
                SubscribeRequest { subscriber: "start-to-exact".to_owned(), token: String::new(), batches: false };
            if let Ok(s) = c.subscribe(req).await {
                break s.into_inner();
            }
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    };
    let want = tags.len() as u64 * blocks;
    let mut ix = Index::default();
    loop {
        let left = limit.checked_sub(t0.elapsed())?;
        let m = tokio::time::timeout(left, stream.message()).await.ok()?.ok()??;
        match m.body {
            Some(Body::Replicas(t)) => {
                for r in t.replicas {
                    let i: usize = r.name.trim_start_matches('e').parse().unwrap();
                    ix.tags.insert(r.id, tags[i]);
                }
            }
            Some(Body::Snapshot(s)) => {
                if s.first {
                    ix.clear(s.replica, blocks);
                }
                ix.add(s.replica, &s.blocks, blocks);
            }
            Some(Body::SnapshotComplete(_)) => ix.synced = true,
            Some(Body::Delta(d)) => {
                ix.add(d.replica, &d.added, blocks);
                ix.remove(d.replica, &d.removed, blocks);
            }
            Some(Body::Reset(r)) => ix.clear(r.replica, blocks),
            _ => {}
        }
        if ix.synced && ix.history == want {
            assert_eq!(ix.foreign, 0, "blocks under the wrong replica");
            return Some(t0.elapsed());
        }
    }
}
