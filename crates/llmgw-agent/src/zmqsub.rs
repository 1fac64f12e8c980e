//! One thread per engine: a libzmq SUB socket (bound or connected), a monitor on it, and
//! replay through a fresh DEALER whenever the sequence discipline asks for a fill.

use crate::config::{EngineSpec, Mode, ZmqConfig};
use crate::hub::{Health, Hub};
use crate::seq::{Cause, Fill, FillStep, SeqTracker, Verdict};
use llmgw_core::event::EventBatch;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::{info, warn};

/// Sequence frame of the end-of-replay marker.
const END_SEQ: [u8; 8] = [0xff; 8];

/// A monitor message: `Some(true)` for a new connection, `Some(false)` for a lost one.
fn monitor_event(frames: &[Vec<u8>]) -> Option<bool> {
    let code = frames.first()?.get(..2).and_then(|b| <[u8; 2]>::try_from(b).ok())?;
    match zmq::SocketEvent::from_raw(u16::from_le_bytes(code)) {
        zmq::SocketEvent::CONNECTED | zmq::SocketEvent::ACCEPTED => Some(true),
        zmq::SocketEvent::DISCONNECTED => Some(false),
        _ => None,
    }
}

/// A replay reply: `[b"", topic, seq8, payload]` since vLLM 0.29, `[b"", seq8, payload]` before.
fn replay_item(frames: &[Vec<u8>]) -> Option<(&[u8], &[u8])> {
    match frames {
        [e, _topic, s, p] if e.is_empty() => Some((s, p)),
        [e, s, p] if e.is_empty() => Some((s, p)),
        _ => None,
    }
}

/// A digest of a payload, to recognise the same batch again.
fn payload_digest(payload: &[u8]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    payload.hash(&mut h);
    h.finish()
}

/// A publisher's sequence frame: 8 bytes big-endian (24 when a publisher id follows).
pub fn parse_seq(frame: &[u8]) -> Option<u64> {
    if frame.len() != 8 && frame.len() != 24 {
        return None;
    }
    let b: [u8; 8] = frame.get(..8)?.try_into().ok()?;
    Some(u64::from_be_bytes(b))
}

/// A fresh DEALER on a publisher's replay socket, with the configured size cap and timeout.
pub(crate) fn replay_dealer(ctx: &zmq::Context, cfg: &ZmqConfig, endpoint: &str) -> Result<zmq::Socket, zmq::Error> {
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
/// and how many batches were handed on. The agent's engines and `publish` both fill gaps so.
pub(crate) fn replay_range(
    ctx: &zmq::Context,
    cfg: &ZmqConfig,
    endpoint: &str,
    from: u64,
    until: u64,
    mut batch: impl FnMut(u64, &[u8]) -> bool,
    mut bad: impl FnMut(&'static str),
) -> Result<(bool, u64), zmq::Error> {
    let d = replay_dealer(ctx, cfg, endpoint)?;
    d.send_multipart([&[][..], &from.to_be_bytes()[..]], 0)?;
    let mut fill = Fill::new(from, until);
    let mut handed: u64 = 0;
    while !fill.complete() {
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
    Ok((fill.complete(), handed))
}

pub struct Engine {
    idx: usize,
    spec: EngineSpec,
    hub: Arc<Hub>,
    cfg: ZmqConfig,
    ctx: zmq::Context,
    stop: Arc<AtomicBool>,
    /// Set when discovery removed this engine.
    own_stop: Arc<AtomicBool>,
    rebuild: Arc<AtomicBool>,
    tracker: SeqTracker,
    /// Since when no publisher is connected (`None` while one is).
    disconnected_since: Option<Instant>,
    /// Publisher connections currently open.
    connections: u32,
    /// A connection was lost since the last one opened.
    reconnect_pending: bool,
    /// Sequence number and digest of the last batch applied (kept for reconnect checks).
    last_payload: Option<(u64, u64)>,
}

impl Engine {
    pub fn spawn(
        spec: EngineSpec,
        hub: Arc<Hub>,
        cfg: ZmqConfig,
        ctx: zmq::Context,
        stop: Arc<AtomicBool>,
    ) -> std::io::Result<std::thread::JoinHandle<()>> {
        let idx = usize::try_from(spec.id).unwrap_or(usize::MAX);
        let rebuild = hub.rebuild_flag(idx).unwrap_or_default();
        let own_stop = hub.state().engines.get(idx).map(|e| e.stop.clone()).unwrap_or_default();
        let name = format!("zmq-{}", spec.label());
        let mut e = Engine {
            idx,
            spec,
            hub,
            cfg,
            ctx,
            stop,
            own_stop,
            rebuild,
            tracker: SeqTracker::new(),
            disconnected_since: Some(Instant::now()),
            connections: 0,
            reconnect_pending: false,
            last_payload: None,
        };
        std::thread::Builder::new().name(name).spawn(move || e.run())
    }

    fn run(&mut self) {
        let mut attempt: u64 = 0;
        while !self.stopped() {
            match self.session(attempt) {
                Ok(()) => return,
                Err(e) => {
                    warn!(replica = %self.spec.label(), endpoint = %self.spec.endpoint, error = %e, "zmq socket failed; retrying in 1 s");
                    std::thread::sleep(Duration::from_secs(1));
                }
            }
            attempt = attempt.saturating_add(1);
        }
    }

    fn stopped(&self) -> bool {
        self.stop.load(Ordering::SeqCst) || self.own_stop.load(Ordering::SeqCst)
    }

    fn session(&mut self, attempt: u64) -> Result<(), zmq::Error> {
        let sub = self.ctx.socket(zmq::SUB)?;
        sub.set_rcvhwm(self.cfg.rcvhwm)?;
        sub.set_maxmsgsize(self.cfg.max_message_bytes)?;
        sub.set_linger(0)?;
        sub.set_reconnect_ivl(100)?;
        sub.set_reconnect_ivl_max(self.cfg.reconnect_ivl_max_ms)?;
        if self.spec.endpoint.contains('[') {
            sub.set_ipv6(true)?;
        }
        sub.set_subscribe(self.spec.topic.as_bytes())?;
        let mon_ep = format!("inproc://llmgw-monitor-{}-{attempt}", self.idx);
        let events = zmq::SocketEvent::CONNECTED as i32
            | zmq::SocketEvent::ACCEPTED as i32
            | zmq::SocketEvent::DISCONNECTED as i32;
        sub.monitor(&mon_ep, events)?;
        let mon = self.ctx.socket(zmq::PAIR)?;
        mon.set_linger(0)?;
        mon.connect(&mon_ep)?;
        match self.spec.mode {
            Mode::Bind => sub.bind(&self.spec.endpoint)?,
            Mode::Connect => sub.connect(&self.spec.endpoint)?,
        }
        info!(replica = %self.spec.label(), endpoint = %self.spec.endpoint, mode = ?self.spec.mode, topic = %self.spec.topic, "subscribed to KV events");
        self.connections = 0;
        let mut was_connected = false;
        // libzmq does not reconnect a connecting socket whose peer broke the protocol (e.g. a
        // message past max_message_bytes): past this, a lost connection gets a new socket.
        let stuck_after = Duration::from_millis(u64::try_from(self.cfg.reconnect_ivl_max_ms).unwrap_or(0))
            .saturating_add(Duration::from_secs(2));
        loop {
            if self.stopped() {
                return Ok(());
            }
            was_connected |= self.connections > 0;
            if self.spec.mode == Mode::Connect
                && was_connected
                && self.connections == 0
                && self.disconnected_since.is_some_and(|t| t.elapsed() >= stuck_after)
            {
                warn!(replica = %self.spec.label(), "publisher connection lost and not re-established (a message past zmq.max_message_bytes?); opening a new socket");
                return Err(zmq::Error::ENOTCONN);
            }
            let (sub_ready, mon_ready) = {
                let mut items = [sub.as_poll_item(zmq::POLLIN), mon.as_poll_item(zmq::POLLIN)];
                zmq::poll(&mut items, 200)?;
                let [a, b] = &items;
                (a.is_readable(), b.is_readable())
            };
            let mut events = Vec::new();
            if mon_ready {
                loop {
                    match mon.recv_multipart(zmq::DONTWAIT) {
                        Ok(frames) => events.extend(monitor_event(&frames)),
                        Err(zmq::Error::EAGAIN) => break,
                        Err(e) => return Err(e),
                    }
                }
            }
            // New connections first (a replica coming back up starts clean before its data),
            // then data, then disconnects: messages of a dropped connection are handled before
            // the disconnect marks an epoch boundary.
            for _ in events.iter().filter(|c| **c) {
                self.on_connected();
            }
            if self.rebuild.swap(false, Ordering::SeqCst) {
                self.tracker.forget();
            }
            if sub_ready {
                for _ in 0..4096 {
                    match sub.recv_multipart(zmq::DONTWAIT) {
                        Ok(frames) => self.live(frames),
                        Err(zmq::Error::EAGAIN) => break,
                        Err(e) => return Err(e),
                    }
                }
            }
            for _ in events.iter().filter(|c| !**c) {
                self.on_disconnected();
            }
            // A restart seen within one poll (the old connection's drop and the new one's
            // arrival together): the new connection is already up, verify it now.
            if self.connections > 0 && self.reconnect_pending && self.cfg.verify_on_reconnect {
                self.reconnect_pending = false;
                self.verify_reconnect();
            }
            self.check_publisher_down();
        }
    }

    fn on_connected(&mut self) {
        info!(replica = %self.spec.label(), "publisher connected");
        self.connections = self.connections.saturating_add(1);
        self.disconnected_since = None;
        let mut st = self.hub.state();
        st.connection(self.idx, true);
        if st.set_health(self.idx, Health::Publisher, true, "publisher_connected") {
            info!(replica = %self.spec.label(), "replica up; mirror starts clean");
        }
        drop(st);
        if std::mem::take(&mut self.reconnect_pending) && self.cfg.verify_on_reconnect {
            self.verify_reconnect();
        }
    }

    /// Asks the reconnected publisher's replay socket for the last batch applied here.
    fn verify_reconnect(&mut self) {
        let (Some((seq, digest)), Some(ep)) = (self.last_payload, self.spec.replay_endpoint.clone()) else {
            return;
        };
        let reason = match self.probe(&ep, seq, digest) {
            Ok(Some(true)) => {
                info!(replica = %self.spec.label(), seq, "reconnected publisher is the same engine");
                self.tracker.confirm_same_publisher();
                return;
            }
            Ok(Some(false)) => "restart_on_reconnect",
            Ok(None) | Err(_) => "reconnect_unverified",
        };
        warn!(replica = %self.spec.label(), reason, "reconnected publisher does not hold the last batch seen: engine restarted; mirror reset");
        self.hub.state().reset(self.idx, reason);
        self.tracker.forget();
        self.last_payload = None;
    }

    /// `Some(same)` once the replay answered about `seq`; `None` on timeout.
    fn probe(&self, endpoint: &str, seq: u64, digest: u64) -> Result<Option<bool>, zmq::Error> {
        let d = self.dealer(endpoint)?;
        d.send_multipart([&[][..], &seq.to_be_bytes()[..]], 0)?;
        loop {
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
                Some(s) if s == seq => return Ok(Some(payload_digest(payload) == digest)),
                Some(s) if s > seq => return Ok(Some(false)),
                _ => continue,
            }
        }
    }

    fn dealer(&self, endpoint: &str) -> Result<zmq::Socket, zmq::Error> {
        replay_dealer(&self.ctx, &self.cfg, endpoint)
    }

    fn on_disconnected(&mut self) {
        // A new connection may be a restarted engine: the next message decides.
        warn!(replica = %self.spec.label(), "publisher disconnected (possible engine restart)");
        self.tracker.mark_reconnect();
        self.reconnect_pending = true;
        self.connections = self.connections.saturating_sub(1);
        if self.connections == 0 {
            self.disconnected_since = Some(Instant::now());
        }
        self.hub.state().connection(self.idx, self.connections > 0);
    }

    fn check_publisher_down(&mut self) {
        let limit = self.cfg.down_after_disconnect_ms;
        let Some(since) = self.disconnected_since else { return };
        if limit == 0 || since.elapsed() < Duration::from_millis(limit) {
            return;
        }
        if self.hub.state().set_health(self.idx, Health::Publisher, false, "publisher_gone") {
            warn!(replica = %self.spec.label(), "no publisher connection; replica marked down, its blocks leave the index");
        }
    }

    fn live(&mut self, frames: Vec<Vec<u8>>) {
        self.hub.state().received(self.idx);
        let [_topic, seq_frame, payload] = frames.as_slice() else {
            self.hub.state().skipped(self.idx, "bad_frames");
            return;
        };
        let Some(seq) = parse_seq(seq_frame) else {
            self.hub.state().skipped(self.idx, "bad_seq");
            return;
        };
        if let Verdict::Fill { from, until, reset, cause } = self.tracker.observe(seq) {
            self.fill(from, until, reset, cause);
        }
        self.apply_payload(seq, payload);
        self.tracker.applied(seq);
    }

    fn apply_payload(&mut self, seq: u64, payload: &[u8]) {
        if self.cfg.verify_on_reconnect {
            self.last_payload = Some((seq, payload_digest(payload)));
        }
        match EventBatch::decode(payload) {
            Ok(batch) => self.hub.state().apply(self.idx, seq, &batch),
            Err(e) => {
                warn!(replica = %self.spec.label(), seq, error = %e, "malformed event batch skipped");
                self.hub.state().skipped(self.idx, "malformed");
            }
        }
    }

    fn fill(&mut self, from: u64, until: u64, reset: bool, cause: Cause) {
        {
            let mut st = self.hub.state();
            if cause == Cause::Gap {
                st.count_gap(self.idx);
            }
            if reset {
                st.reset(self.idx, cause.as_str());
            }
        }
        if from >= until {
            info!(replica = %self.spec.label(), cause = cause.as_str(), "sequence restarted at 0");
            return;
        }
        let complete = match self.spec.replay_endpoint.clone() {
            None => false,
            Some(ep) => {
                let (complete, n) = match self.replay(&ep, from, until) {
                    Ok(r) => r,
                    Err(e) => {
                        warn!(replica = %self.spec.label(), error = %e, "replay socket failed");
                        (false, 0)
                    }
                };
                self.hub.state().count_replay(self.idx, complete, n);
                complete
            }
        };
        if complete {
            info!(replica = %self.spec.label(), cause = cause.as_str(), from, until, "missing batches replayed");
        } else {
            warn!(replica = %self.spec.label(), cause = cause.as_str(), from, until, "missing batches could not be replayed; mirror reset");
            self.hub.state().reset(self.idx, &format!("{}_unrepaired", cause.as_str()));
        }
    }

    /// Requests batches from `from` on a fresh DEALER and applies those in `from..until`.
    /// Returns whether the whole range was applied, and how many batches were.
    fn replay(&mut self, endpoint: &str, from: u64, until: u64) -> Result<(bool, u64), zmq::Error> {
        let (ctx, cfg, idx, hub) = (self.ctx.clone(), self.cfg.clone(), self.idx, self.hub.clone());
        let label = self.spec.label();
        replay_range(
            &ctx,
            &cfg,
            endpoint,
            from,
            until,
            |seq, payload| {
                self.apply_payload(seq, payload);
                true
            },
            |reason| {
                if reason == "timeout" {
                    warn!(replica = %label, endpoint, "replay timed out");
                } else {
                    hub.state().skipped(idx, reason);
                }
            },
        )
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
}
