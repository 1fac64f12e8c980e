//! vLLM's ZMQ KV-event publisher, reproduced: a PUB socket sending `[topic, seq (8 bytes,
//! big-endian), msgpack KVEventBatch]` and an optional ROUTER replay socket answering
//! `[id, "", start_seq]` with every buffered batch from `start_seq` on, then an end marker.
//! The PUB binds when the endpoint contains `*` or `::` (as vLLM decides), else it connects.

use llmgw_core::wire::{encode_batch, Encoding, HashForm, WireBatch, WireEvent};
use std::collections::VecDeque;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

#[derive(Debug, Clone)]
pub struct PublisherConfig {
    pub endpoint: String,
    pub replay_endpoint: Option<String>,
    pub topic: String,
    pub encoding: Encoding,
    pub hash_form: HashForm,
    pub buffer_steps: usize,
    pub dp_rank: i64,
}

/// What the engine asks the publisher to do.
pub enum PubCmd {
    /// One engine step's events.
    Batch(Vec<WireEvent>),
    /// The engine restarted: a new publisher whose sequence starts again at 0.
    Restart,
    /// Fault injection: the next `count` batches are numbered but not published (a gap a
    /// subscriber sees); with `replayable` they stay in the replay buffer, else they are
    /// missing from it too, so a replay cannot fill the gap.
    Drop { count: usize, replayable: bool },
}

/// vLLM's rule: bind only for wildcard or IPv6-literal endpoints (and ipc/inproc).
pub fn binds(endpoint: &str) -> bool {
    endpoint.contains('*')
        || endpoint.contains("::")
        || endpoint.starts_with("ipc://")
        || endpoint.starts_with("inproc://")
}

fn now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

/// Opens the sockets (errors are returned before the thread starts) and runs the publisher
/// on its own thread until the command channel closes.
pub fn spawn(cfg: PublisherConfig, rx: Receiver<PubCmd>) -> Result<std::thread::JoinHandle<()>, String> {
    let ctx = zmq::Context::new();
    let pub_sock = open_pub(&ctx, &cfg.endpoint)?;
    let router = match &cfg.replay_endpoint {
        Some(ep) => {
            let r = ctx.socket(zmq::ROUTER).map_err(|e| format!("ROUTER socket: {e}"))?;
            r.set_sndhwm(i32::try_from(cfg.buffer_steps.saturating_add(1).saturating_mul(2)).unwrap_or(i32::MAX))
                .map_err(|e| e.to_string())?;
            r.set_linger(0).map_err(|e| e.to_string())?;
            if ep.contains('[') {
                r.set_ipv6(true).map_err(|e| e.to_string())?;
            }
            r.bind(ep).map_err(|e| format!("bind replay {ep}: {e}"))?;
            Some(r)
        }
        None => None,
    };
    std::thread::Builder::new()
        .name("kv-publisher".into())
        .spawn(move || run(ctx, cfg, pub_sock, router, rx))
        .map_err(|e| e.to_string())
}

fn open_pub(ctx: &zmq::Context, endpoint: &str) -> Result<zmq::Socket, String> {
    let s = ctx.socket(zmq::PUB).map_err(|e| format!("PUB socket: {e}"))?;
    s.set_sndhwm(100_000).map_err(|e| e.to_string())?;
    s.set_linger(0).map_err(|e| e.to_string())?;
    if endpoint.contains('[') {
        s.set_ipv6(true).map_err(|e| e.to_string())?;
    }
    if binds(endpoint) {
        s.bind(endpoint).map_err(|e| format!("bind {endpoint}: {e}"))?;
    } else {
        s.connect(endpoint).map_err(|e| format!("connect {endpoint}: {e}"))?;
    }
    Ok(s)
}

fn run(
    ctx: zmq::Context,
    cfg: PublisherConfig,
    pub_sock: zmq::Socket,
    router: Option<zmq::Socket>,
    rx: Receiver<PubCmd>,
) {
    let mut pub_sock = pub_sock;
    let mut seq: u64 = 0;
    let mut buffer: VecDeque<(u64, Vec<u8>)> = VecDeque::new();
    // Fault injection: batches still to drop, and whether they stay replayable.
    let mut dropping: (usize, bool) = (0, true);
    let topic = cfg.topic.as_bytes().to_vec();
    loop {
        match rx.recv_timeout(Duration::from_millis(10)) {
            Ok(PubCmd::Batch(events)) => {
                let batch = WireBatch { ts: now(), events, data_parallel_rank: Some(cfg.dp_rank) };
                let payload = encode_batch(&batch, cfg.encoding, cfg.hash_form);
                let (left, replayable) = dropping;
                if left == 0 {
                    let frames: [&[u8]; 3] = [&topic, &seq.to_be_bytes(), &payload];
                    // A PUB never blocks: with no subscriber the message is dropped, as in vLLM.
                    let _ = pub_sock.send_multipart(frames, zmq::DONTWAIT);
                } else {
                    dropping.0 = left.saturating_sub(1);
                }
                if left == 0 || replayable {
                    buffer.push_back((seq, payload));
                }
                while buffer.len() > cfg.buffer_steps {
                    buffer.pop_front();
                }
                seq = seq.saturating_add(1);
            }
            Ok(PubCmd::Drop { count, replayable }) => dropping = (count, replayable),
            Ok(PubCmd::Restart) => {
                // A restarted engine is a new process: its connection drops and a new
                // publisher starts from sequence 0.
                seq = 0;
                buffer.clear();
                drop(std::mem::replace(
                    &mut pub_sock,
                    match ctx.socket(zmq::PUB) {
                        Ok(s) => s,
                        Err(_) => return,
                    },
                ));
                let reopening = std::time::Instant::now();
                loop {
                    match open_pub(&ctx, &cfg.endpoint) {
                        Ok(s) => {
                            pub_sock = s;
                            break;
                        }
                        Err(e) if reopening.elapsed() > Duration::from_secs(5) => {
                            eprintln!("llmgw-sim: cannot reopen the event publisher: {e}");
                            return;
                        }
                        Err(_) => std::thread::sleep(Duration::from_millis(20)),
                    }
                }
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => return,
        }
        if let Some(r) = &router {
            serve_replays(r, &topic, &buffer);
        }
    }
}

fn serve_replays(r: &zmq::Socket, topic: &[u8], buffer: &VecDeque<(u64, Vec<u8>)>) {
    while let Ok(frames) = r.recv_multipart(zmq::DONTWAIT) {
        // [client id, "", start seq]
        let [id, empty, start] = frames.as_slice() else { continue };
        let Ok(start) = <[u8; 8]>::try_from(start.as_slice()) else { continue };
        if !empty.is_empty() {
            continue;
        }
        let start = u64::from_be_bytes(start);
        for (s, payload) in buffer.iter().filter(|(s, _)| *s >= start) {
            let frames: [&[u8]; 5] = [id, b"", topic, &s.to_be_bytes(), payload];
            let _ = r.send_multipart(frames, 0);
        }
        let end: [&[u8]; 5] = [id, b"", b"", &[0xff; 8], b""];
        let _ = r.send_multipart(end, 0);
    }
}
