//! vLLM's ZMQ publisher from the reading side: the SUB socket, its frames, and the replay
//! DEALER that fetches missed batches (for the agent's engines and for `publish` alike).

use crate::config::{EngineSpec, Mode, ZmqConfig};
use crate::ingest::{FillOutcome, Joined, Replay, SnapshotFetch};
use crate::seq::{Fill, FillStep};
use std::time::{Duration, Instant};
use tracing::warn;

/// Sequence frame of the end-of-replay marker.
const END_SEQ: [u8; 8] = [0xff; 8];

/// A whole replay may take this many reply timeouts (`zmq.replay_timeout_ms`) at most, a probe
/// this many: a replay socket trickling frames that never finish the range (or never name the
/// batch asked about) cannot hold the engine thread for ever.
const REPLAY_DEADLINE_TIMEOUTS: u32 = 30;
const PROBE_DEADLINE_TIMEOUTS: u32 = 2;

/// Whether a replay or probe on a socket with reply timeout `each` that started at `start`
/// has run past `timeouts` of them.
fn past_deadline(start: Instant, each: Duration, timeouts: u32) -> bool {
    start.elapsed() >= each.saturating_mul(timeouts)
}

/// A socket's reply timeout (none, -1: no deadline either).
fn reply_timeout(d: &zmq::Socket) -> Duration {
    d.get_rcvtimeo().ok().and_then(|ms| u64::try_from(ms).ok()).map_or(Duration::MAX, Duration::from_millis)
}

/// A publisher's sequence frame: 8 bytes big-endian (24 when a publisher id follows).
pub fn parse_seq(frame: &[u8]) -> Option<u64> {
    if frame.len() != 8 && frame.len() != 24 {
        return None;
    }
    let b: [u8; 8] = frame.get(..8)?.try_into().ok()?;
    Some(u64::from_be_bytes(b))
}

/// A replay reply: `[b"", topic, seq8, payload]` since vLLM 0.29, `[b"", seq8, payload]` before.
fn replay_item(frames: &[Vec<u8>]) -> Option<(&[u8], &[u8])> {
    match frames {
        [e, _topic, s, p] if e.is_empty() => Some((s, p)),
        [e, s, p] if e.is_empty() => Some((s, p)),
        _ => None,
    }
}

/// A SUB socket for an engine's publisher with the configured limits, subscribed to its topic,
/// not yet bound or connected (a monitor must be set up before: see [`attach`]).
pub fn sub_socket(ctx: &zmq::Context, cfg: &ZmqConfig, spec: &EngineSpec) -> Result<zmq::Socket, zmq::Error> {
    let sub = ctx.socket(zmq::SUB)?;
    sub.set_rcvhwm(cfg.receive_hwm())?;
    sub.set_maxmsgsize(cfg.max_message_bytes)?;
    sub.set_linger(0)?;
    sub.set_reconnect_ivl(100)?;
    sub.set_reconnect_ivl_max(cfg.reconnect_ivl_max_ms)?;
    if spec.endpoint.contains('[') {
        sub.set_ipv6(true)?;
    }
    sub.set_subscribe(spec.topic.as_bytes())?;
    Ok(sub)
}

/// Binds or connects the SUB socket as the engine's mode says.
pub fn attach(sub: &zmq::Socket, spec: &EngineSpec) -> Result<(), zmq::Error> {
    match spec.mode {
        Mode::Bind => sub.bind(&spec.endpoint),
        Mode::Connect => sub.connect(&spec.endpoint),
    }
}

/// A live message `[topic, seq, payload]`: its sequence number and payload, or why it is not
/// one (`bad_frames`, `bad_seq`).
pub fn live_item(frames: &[Vec<u8>]) -> Result<(u64, &[u8]), &'static str> {
    let [_topic, seq_frame, payload] = frames else { return Err("bad_frames") };
    let seq = parse_seq(seq_frame).ok_or("bad_seq")?;
    Ok((seq, payload))
}

/// A fresh DEALER on a publisher's replay socket, with the configured size cap and timeout.
pub fn replay_dealer(ctx: &zmq::Context, cfg: &ZmqConfig, endpoint: &str) -> Result<zmq::Socket, zmq::Error> {
    let d = ctx.socket(zmq::DEALER)?;
    d.set_maxmsgsize(cfg.max_message_bytes)?;
    d.set_linger(0)?;
    d.set_rcvtimeo(i32::try_from(cfg.replay_timeout_ms).unwrap_or(i32::MAX))?;
    if endpoint.contains('[') {
        d.set_ipv6(true)?;
    }
    d.connect(endpoint)?;
    Ok(d)
}

/// Asks a replay socket for the batches from `from` and hands those in `from..until` to
/// `batch` in order (it returns false to stop); `bad` hears of frames it cannot read
/// (`bad_replay_frames`, `bad_seq`) and of a `timeout`. Returns whether the whole range came,
/// how many batches were handed on, and the first batch when the buffer no longer held the
/// start of the range but covered it from that batch to its end.
fn replay_range(
    d: &zmq::Socket,
    from: u64,
    until: u64,
    batch: &mut dyn FnMut(u64, &[u8]) -> bool,
    bad: &mut dyn FnMut(&'static str),
) -> Result<(bool, u64, Option<u64>), zmq::Error> {
    d.send_multipart([&[][..], &from.to_be_bytes()[..]], 0)?;
    let mut fill = Fill::new(from, until);
    let mut handed: u64 = 0;
    let (start, each) = (Instant::now(), reply_timeout(d));
    while !fill.reached_end() {
        if past_deadline(start, each, REPLAY_DEADLINE_TIMEOUTS) {
            bad("timeout");
            break;
        }
        let frames = match d.recv_multipart(0) {
            Ok(f) => f,
            Err(zmq::Error::EAGAIN) => {
                bad("timeout");
                break;
            }
            Err(e) => return Err(e),
        };
        let Some((seq_frame, payload)) = replay_item(&frames) else {
            bad("bad_replay_frames");
            continue;
        };
        if seq_frame == END_SEQ {
            break;
        }
        let Some(seq) = parse_seq(seq_frame) else {
            bad("bad_seq");
            continue;
        };
        match fill.step(seq) {
            FillStep::Skip => continue,
            FillStep::Apply => {
                handed = handed.saturating_add(1);
                if !batch(seq, payload) {
                    break;
                }
            }
            FillStep::Done | FillStep::Hole => break,
        }
    }
    let tail_from = fill.late_start().filter(|_| fill.reached_end());
    Ok((fill.complete(), handed, tail_from))
}

/// Asks a replay socket whether it holds batch `seq` with this digest: `Some(same)` once it
/// answered about `seq`, `None` on timeout.
pub fn probe(d: &zmq::Socket, seq: u64, same: impl Fn(&[u8]) -> bool) -> Result<Option<bool>, zmq::Error> {
    d.send_multipart([&[][..], &seq.to_be_bytes()[..]], 0)?;
    let (start, each) = (Instant::now(), reply_timeout(d));
    loop {
        if past_deadline(start, each, PROBE_DEADLINE_TIMEOUTS) {
            return Ok(None);
        }
        let frames = match d.recv_multipart(0) {
            Ok(f) => f,
            Err(zmq::Error::EAGAIN) => return Ok(None),
            Err(e) => return Err(e),
        };
        let Some((seq_frame, payload)) = replay_item(&frames) else { continue };
        if seq_frame == END_SEQ {
            return Ok(Some(false));
        }
        match parse_seq(seq_frame) {
            Some(s) if s == seq => return Ok(Some(same(payload))),
            Some(s) if s > seq => return Ok(Some(false)),
            _ => continue,
        }
    }
}

/// An engine's replay socket as the [`Replay`] of the ingest loop: a fresh DEALER per fill.
pub struct ZmqReplay {
    pub ctx: zmq::Context,
    pub cfg: ZmqConfig,
    /// `None`: the publisher has no replay socket.
    pub endpoint: Option<String>,
    /// For logs.
    pub label: String,
    /// Where a snapshot of the engine is fetched when it is first heard after its start.
    pub snapshot_url: Option<String>,
}

/// How long a snapshot fetch may take.
const SNAPSHOT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

impl ZmqReplay {
    pub fn new(ctx: zmq::Context, cfg: ZmqConfig, spec: &EngineSpec) -> ZmqReplay {
        ZmqReplay { ctx, cfg, endpoint: spec.replay_endpoint.clone(), label: spec.label(), snapshot_url: None }
    }

    /// Joins from the engine's snapshot (its `snapshot_url`, this rank's) when it is first heard.
    pub fn with_snapshot(mut self, spec: &EngineSpec) -> ZmqReplay {
        self.snapshot_url =
            spec.snapshot_url.as_deref().map(|base| crate::snapshot::fetch::rank_url(base, spec.dp_rank));
        self
    }
}

impl Replay<[u8]> for ZmqReplay {
    fn replay(&mut self, from: u64, until: u64, apply: &mut dyn FnMut(u64, &[u8]) -> bool) -> FillOutcome {
        let Some(endpoint) = self.endpoint.as_deref() else { return FillOutcome::NoReplay };
        let mut skipped = Vec::new();
        let label = &self.label;
        let mut bad = |reason: &'static str| {
            if reason == "timeout" {
                warn!(replica = %label, endpoint, "replay timed out");
            } else {
                skipped.push(reason);
            }
        };
        let r =
            replay_dealer(&self.ctx, &self.cfg, endpoint).and_then(|d| replay_range(&d, from, until, apply, &mut bad));
        let (complete, batches, tail_from) = r.unwrap_or_else(|e| {
            warn!(replica = %self.label, error = %e, "replay socket failed");
            (false, 0, None)
        });
        FillOutcome::Replayed { complete, batches, skipped, tail_from }
    }

    fn snapshot(&mut self) -> SnapshotFetch<Box<[u8]>> {
        let Some(url) = self.snapshot_url.as_deref() else { return SnapshotFetch::NoSource };
        match crate::snapshot::fetch::fetch(url, SNAPSHOT_TIMEOUT) {
            Ok(s) => SnapshotFetch::Got(Joined {
                seq: s.seq,
                incomplete_from: s.incomplete_from,
                batch: s.payload.into_boxed_slice(),
            }),
            Err(e) => {
                warn!(replica = %self.label, url, error = %e, "snapshot not fetched; starting from the replay buffer");
                SnapshotFetch::Failed(e.reason())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seq_frames() {
        assert_eq!(parse_seq(&7u64.to_be_bytes()), Some(7));
        let mut long = 9u64.to_be_bytes().to_vec();
        long.extend_from_slice(&[1u8; 16]);
        assert_eq!(parse_seq(&long), Some(9));
        assert_eq!(parse_seq(&[0u8; 4]), None);
        assert_eq!(parse_seq(&[]), None);
    }

    /// A replay socket answering with frames that never finish a range nor name the batch
    /// probed (here: batch 0 again and again, faster than the reply timeout) is given up on.
    #[test]
    fn a_replay_socket_that_never_finishes_is_given_up_on() {
        let ctx = zmq::Context::new();
        let router = ctx.socket(zmq::ROUTER).unwrap();
        router.bind("inproc://llmgw-trickle").unwrap();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stop2 = stop.clone();
        let server = std::thread::spawn(move || {
            router.set_rcvtimeo(20).unwrap();
            let mut peers: Vec<Vec<u8>> = Vec::new();
            while !stop2.load(std::sync::atomic::Ordering::SeqCst) {
                if let Ok(frames) = router.recv_multipart(0) {
                    peers.extend(frames.first().cloned());
                }
                for p in &peers {
                    let _ = router.send_multipart([&p[..], &[][..], &0u64.to_be_bytes()[..], b"x"], 0);
                }
            }
        });
        let cfg = ZmqConfig { replay_timeout_ms: 50, ..ZmqConfig::default() };
        let d = replay_dealer(&ctx, &cfg, "inproc://llmgw-trickle").unwrap();
        // Without the deadlines both would wait for ever: the watchdog turns that into a failure.
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let probed = probe(&d, 5, |_| true).unwrap();
            let mut timeouts = 0;
            let r =
                replay_range(&d, 1, 10, &mut |_, _| true, &mut |why| timeouts += u32::from(why == "timeout")).unwrap();
            let _ = tx.send((probed, r.0, r.1, timeouts));
        });
        let got = rx.recv_timeout(Duration::from_secs(60)).expect("probe and replay still waiting after 60 s");
        assert_eq!(got, (None, false, 0, 1));
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
        server.join().unwrap();
    }
}
