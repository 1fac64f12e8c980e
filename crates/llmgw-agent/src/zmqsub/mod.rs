//! One thread per engine: a libzmq SUB socket (bound or connected) and a monitor on it, whose
//! messages and connection events go through the ingest loop ([`crate::ingest`]); gaps are
//! filled through a fresh replay DEALER ([`socket::ZmqReplay`]).

pub mod socket;

use crate::config::{EngineSpec, Mode, ZmqConfig};
use crate::hub::Hub;
use crate::ingest::to_hub::{payload_digest, HubSink};
use crate::ingest::{Ingest, SourceEvent};
use socket::{attach, live_item, probe, replay_dealer, sub_socket, ZmqReplay};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::{info, warn};

/// A monitor message: `Some(true)` for a new connection, `Some(false)` for a lost one.
pub(crate) fn monitor_event(frames: &[Vec<u8>]) -> Option<bool> {
    let code = frames.first()?.get(..2).and_then(|b| <[u8; 2]>::try_from(b).ok())?;
    match zmq::SocketEvent::from_raw(u16::from_le_bytes(code)) {
        zmq::SocketEvent::CONNECTED | zmq::SocketEvent::ACCEPTED => Some(true),
        zmq::SocketEvent::DISCONNECTED => Some(false),
        _ => None,
    }
}

pub struct Engine {
    idx: usize,
    spec: EngineSpec,
    cfg: ZmqConfig,
    ctx: zmq::Context,
    stop: Arc<AtomicBool>,
    /// Set when discovery removed this engine.
    own_stop: Arc<AtomicBool>,
    rebuild: Arc<AtomicBool>,
    ingest: Ingest,
    sink: HubSink<Arc<Hub>>,
    replay: ZmqReplay,
    /// Since when no publisher is connected (`None` while one is).
    disconnected_since: Option<Instant>,
    /// Publisher connections currently open.
    connections: u32,
    /// A connection was lost since the last one opened.
    reconnect_pending: bool,
    /// Join from the engine's snapshot once subscribed (a new connection, or the mirror rebuilt).
    join_pending: bool,
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
        let sink = HubSink::new(hub, "publisher_connected", "publisher_gone").keeping_last(cfg.verify_on_reconnect);
        let replay = ZmqReplay::new(ctx.clone(), cfg.clone(), &spec).with_snapshot(&spec);
        let mut e = Engine {
            idx,
            spec,
            cfg,
            ctx,
            stop,
            own_stop,
            rebuild,
            ingest: Ingest::new(),
            sink,
            replay,
            disconnected_since: Some(Instant::now()),
            connections: 0,
            reconnect_pending: false,
            join_pending: false,
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

    /// Hands one event to the ingest loop.
    fn handle(&mut self, event: SourceEvent<'_, [u8]>) {
        self.ingest.handle(event, &mut self.replay, &mut self.sink);
    }

    fn session(&mut self, attempt: u64) -> Result<(), zmq::Error> {
        let sub = sub_socket(&self.ctx, &self.cfg, &self.spec)?;
        let mon_ep = format!("inproc://llmgw-monitor-{}-{attempt}", self.idx);
        let events = zmq::SocketEvent::CONNECTED as i32
            | zmq::SocketEvent::ACCEPTED as i32
            | zmq::SocketEvent::DISCONNECTED as i32;
        sub.monitor(&mon_ep, events)?;
        let mon = self.ctx.socket(zmq::PAIR)?;
        mon.set_linger(0)?;
        mon.connect(&mon_ep)?;
        attach(&sub, &self.spec)?;
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
                // Batches may have reached the clean mirror before the flag was seen: clear it
                // now, so the replay from the start applies each batch once (a batch applied
                // twice leaves a block its one removal never takes away).
                self.sink.reset(self.idx, "rebuild");
                self.ingest.forget(self.idx);
                self.join_pending = true;
            }
            // Subscribed: the snapshot comes now (before the next live batch, not at it), so a
            // quiet engine's cache is known too; live batches wait in the socket meanwhile.
            if self.connections > 0 && std::mem::take(&mut self.join_pending) {
                self.ingest.join(self.idx, &mut self.replay, &mut self.sink);
            }
            if sub_ready {
                for _ in 0..4096 {
                    match sub.recv_multipart(zmq::DONTWAIT) {
                        Ok(frames) => self.live(&frames),
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
        self.handle(SourceEvent::Connected { engine: self.idx });
        self.join_pending = true;
        if std::mem::take(&mut self.reconnect_pending) && self.cfg.verify_on_reconnect {
            self.verify_reconnect();
        }
    }

    /// Asks the reconnected publisher's replay socket for the last batch applied here.
    fn verify_reconnect(&mut self) {
        let (Some((seq, digest)), Some(ep)) = (self.sink.last_payload, self.spec.replay_endpoint.as_deref()) else {
            return;
        };
        let answer = replay_dealer(&self.ctx, &self.cfg, ep)
            .and_then(|d| probe(&d, seq, |payload| payload_digest(payload) == digest));
        let reason = match answer {
            Ok(Some(true)) => {
                info!(replica = %self.spec.label(), seq, "reconnected publisher is the same engine");
                self.ingest.confirm_same_publisher(self.idx);
                return;
            }
            Ok(Some(false)) => "restart_on_reconnect",
            Ok(None) | Err(_) => "reconnect_unverified",
        };
        warn!(replica = %self.spec.label(), reason, "reconnected publisher does not hold the last batch seen: engine restarted; mirror reset");
        self.sink.reset(self.idx, reason);
        self.ingest.forget(self.idx);
        self.sink.last_payload = None;
    }

    fn on_disconnected(&mut self) {
        // A new connection may be a restarted engine: the next message decides.
        warn!(replica = %self.spec.label(), "publisher disconnected (possible engine restart)");
        self.reconnect_pending = true;
        self.connections = self.connections.saturating_sub(1);
        if self.connections == 0 {
            self.disconnected_since = Some(Instant::now());
        }
        self.handle(SourceEvent::Disconnected { engine: self.idx, still_connected: self.connections > 0 });
    }

    fn check_publisher_down(&mut self) {
        let limit = self.cfg.down_after_disconnect_ms;
        let Some(since) = self.disconnected_since else { return };
        if limit == 0 || since.elapsed() < Duration::from_millis(limit) {
            return;
        }
        if self.sink.link(self.idx, None, Some(false)) {
            warn!(replica = %self.spec.label(), "no publisher connection; replica marked down, its blocks leave the index");
        }
    }

    fn live(&mut self, frames: &[Vec<u8>]) {
        let idx = self.idx;
        self.sink.with(|st| st.received(idx));
        match live_item(frames) {
            Ok((seq, payload)) => self.handle(SourceEvent::Batch { engine: idx, seq, payload }),
            Err(reason) => self.sink.skipped(idx, reason),
        }
    }
}
