"""Fault suite: the whole product on loopback (simulated replicas, the agent, Envoy with the
filter) under steady load through Envoy while one thing breaks. A client loop at modest
concurrency counts every request: sent, failed (non-2xx or connection error), and which replica
the filter sent it to (its x-llmgw-decision header). Each test prints one line
`FAULT <name>: sent N, failed F, recovery …` and asserts the issue's target for its fault:

- 200 partial HTTP/2 streams on one connection: at most 100 held (the rest refused, or the
  connection closed); a request beside them answered as quickly as before them
- 1,100 slow requests in flight (past Envoy's default cap of 1,024 for all replicas): none
  refused by Envoy, and a follow-up whose prompt one replica holds goes there
- agent SIGKILL and restart: 0 failed; every VM's index equal to the agent's within 1 s of its return
- replica SIGKILL: nothing sent to it 1 s after the kill; the only failures are requests to it
- engine restart (sequence back to 0): 0 failed; the agent's mirror equals the engine's cache after
- publisher gap, replayable and not: 0 failed; filled by replay, or the engine's mirror reset
  (never a block the engine does not hold)
- a replica's /metrics down then up (its mirror dropped, then rebuilt by replay while live
  batches arrive, with evictions after): 0 failed; the mirror equals the engine's cache after
- tokenizer slower than its timeout: every request answered, p99 within the timeout + a margin
- Envoy listener reload (file-based LDS, atomic rename) under load: >= 99.99 % success
- a wasm VM crash (the test-only fault-injection build): no failure beyond the requests in
  flight on the crashed worker (Envoy fails those; see test_vm_crash_is_reloaded for why the
  99.99 % target is stated per crash rather than asserted over the test's own run)

The figures of a run are in README.md ("Fault suite")."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import yaml

import llmgw_testkit as kit
from llmgw_testkit import wait_until
from llmgw_testkit.fleet import pct
from llmgw_testkit.load_faults import CHAT, MODEL, ClientLoad, Rec, SimFleet, failed

N_SIMS = 3
CONCURRENCY = 6
# The filter's tokenizer timeout in these tests (the shipped default is 500 ms; shorter keeps
# the slow-tokenizer phase short).
TOKENIZER_TIMEOUT_MS = 150


# ---------------------------------------------------------------------------------------------
# The load (llmgw_testkit.load_faults): CONCURRENCY client threads, each request on a fresh
# connection (as many clients behind a proxy do), every one recorded.


SYSTEMS = [" ".join(f"family{f} rule{j}" for j in range(24)) for f in range(8)]


class Load(ClientLoad):
    """Chat requests to 127.0.0.1:port until stop(). Prompts share system prompts in 8 families;
    with `unique` every request's question is new (so every one is tokenized), else a request
    repeats one of 64 questions and one in `churn` (or one per `churn_every_s`) is new: the
    replicas keep storing blocks, so events flow, and with churn_every_s the index changes slowly
    enough to be compared with the agent's (each VM's gauge is sampled every 200 ms)."""

    def __init__(self, port: int, concurrency: int = CONCURRENCY, unique: bool = False, churn: int = 4,
                 churn_every_s: float | None = None, max_tokens: int = 2, timeout: float = 30.0):
        self.unique, self.churn, self.max_tokens = unique, churn, max_tokens
        # With churn_every_s, a new question once per that many seconds instead of one in `churn`.
        self.churn_every_s, self.last_new = churn_every_s, 0.0
        self.n = 0
        super().__init__(port, concurrency, timeout=timeout)

    def _new(self, k: int) -> bool:
        if self.unique:
            return True
        if self.churn_every_s is None:
            return k % self.churn == 0
        with self.lock:
            now = time.monotonic()
            if now - self.last_new >= self.churn_every_s:
                self.last_new = now
                return True
            return False

    def body(self, k: int) -> bytes:
        if self._new(k):
            # Long enough to fill blocks of its own: the replica stores (and publishes) them.
            question = f"new question {k} {time.monotonic_ns()} " + " ".join(f"detail{k}x{j}" for j in range(24))
        else:
            question = f"question {k % 64}"
        msgs = [{"role": "system", "content": SYSTEMS[k % len(SYSTEMS)]}, {"role": "user", "content": question}]
        return json.dumps({"model": MODEL, "messages": msgs, "max_tokens": self.max_tokens}).encode()

    def request(self, i: int) -> tuple[str, bytes]:
        with self.lock:
            k = self.n
            self.n += 1
        return CHAT, self.body(k)


def report(name: str, recs: list[Rec], recovery: str) -> str:
    f = failed(recs)
    line = (f"FAULT {name}: sent {len(recs)}, failed {len(f)} ({100 * (1 - len(f) / max(1, len(recs))):.3f} % ok), "
            f"recovery {recovery}")
    print(line)
    return line


# ---------------------------------------------------------------------------------------------
# The fleet (llmgw_testkit.load_faults.SimFleet): N_SIMS simulated replicas publishing to one
# agent, Envoy with two workers.


def new_fleet(procs, tmp_path: Path, agent_bin, sim_bin, envoy_bin) -> SimFleet:
    # A replay buffer that covers a whole test: a restarted agent refills from batch 0.
    return SimFleet(procs, tmp_path, agent_bin, sim_bin, envoy_bin, N_SIMS, blocks=65536, decode_ms=1,
                    buffer_steps=2_000_000, profile={"tokenizer_timeout_ms": TOKENIZER_TIMEOUT_MS})


@pytest.fixture
def fleet(procs, tmp_path, agent_bin, sim_bin, envoy_bin, wasm_path):
    return new_fleet(procs, tmp_path, agent_bin, sim_bin, envoy_bin).start_envoy(wasm_path)


def warm(load: Load, n: int = 150) -> None:
    """Steady state first: n requests answered through Envoy."""
    load.wait_answered(n, after=0.0, what="before the fault")


# ---------------------------------------------------------------------------------------------
# 1. agent SIGKILL and restart


# How long the killed agent stays away: long enough for the VMs' reconnect backoff to grow.
AGENT_OUTAGE_S = 3.0


def test_agent_sigkill_and_restart(fleet):
    fl = fleet
    load = Load(fl.listen, churn_every_s=0.5)
    try:
        warm(load)
        wait_until(fl.indexes_equal_agent, 10, "every VM's index equal to the agent's before the fault")
        connects = fl.envoy.metric("llmgw_feed_connects_total")
        vms = len(fl.envoy.index_blocks())
        fl.kill_agent()
        t_kill = time.monotonic()
        wait_until(lambda: not any(v for v in fl.envoy.stats("llmgw_feed_connected").values()), 10,
                   "every VM noticed the agent is gone")
        # The agent stays away AGENT_OUTAGE_S (as long as a restart by a supervisor takes); the
        # requests sent meanwhile are routed from the index the VMs hold.
        wait_until(lambda: load.since(t_kill + AGENT_OUTAGE_S), AGENT_OUTAGE_S + 10, "the outage under load")
        fl.restart_agent()
        t_back = time.monotonic()
        wait_until(lambda: fl.envoy.metric("llmgw_feed_connects_total") >= connects + vms, 10,
                   "every VM subscribed to the restarted agent")
        t_sub = time.monotonic()
        wait_until(fl.indexes_equal_agent, 10, "every VM's index equal to the restarted agent's", interval=0.01)
        t_equal = time.monotonic()
        load.wait_answered(150, what="after the agent's return")
    finally:
        recs = load.stop()
    report("agent SIGKILL + restart", recs,
           f"outage {t_back - t_kill:.2f} s; every VM resubscribed {t_sub - t_back:.2f} s and its index equal to the "
           f"agent's {t_equal - t_back:.2f} s after the agent's return")
    assert not failed(recs), failed(recs)[:5]
    assert t_equal - t_back <= 1.0, f"indexes equal {t_equal - t_back:.2f} s after the agent's return"


# ---------------------------------------------------------------------------------------------
# 2. replica SIGKILL


def test_replica_sigkill(fleet):
    fl = fleet
    victim = fl.sims[0]
    addr = fl.addr(victim)
    load = Load(fl.listen)
    try:
        warm(load)
        wait_until(lambda: any(r.replica == addr for r in load.since(0.0)), 10, "requests routed to the victim")
        fl.kill_sim(victim)
        t_kill = time.monotonic()
        wait_until(lambda: not fl.agent.replica(victim["name"])["up"], 10, "the agent marking the victim down")
        t_down = time.monotonic()
        # Steady load well past the one-second mark.
        load.wait_answered(300, after=t_kill + 1.0, what="after the kill")
    finally:
        recs = load.stop()
    to_victim = [r for r in recs if r.replica == addr]
    after = [r for r in recs if r.t0 >= t_kill]
    late = [r for r in to_victim if r.t0 >= t_kill + 1.0]
    bad = failed(recs)
    last = max((r.t0 for r in to_victim if r.t0 >= t_kill), default=t_kill)
    report("replica SIGKILL", recs,
           f"last request sent to it {last - t_kill:.3f} s after the kill; agent marked it down after "
           f"{t_down - t_kill:.2f} s; {len([r for r in bad if r.t0 < t_kill])} failed were in flight at the kill")
    assert not late, f"{len(late)} requests sent to the killed replica >= 1 s after the kill"
    # The only failures: requests to the killed replica, in flight at the kill or routed to it
    # before the first failed connect marked it avoided (at most one per client each).
    assert all(r.replica == addr for r in bad), [r for r in bad if r.replica != addr][:5]
    assert len(bad) <= 2 * CONCURRENCY, len(bad)
    assert len(after) >= 300


# ---------------------------------------------------------------------------------------------
# 3. engine restart (the publisher's sequence back to 0)


def quiet_and_equal(fl: SimFleet, sims: list[dict], timeout: float = 20.0) -> None:
    """After the load stopped: the agent's mirror of each of `sims` holds exactly the blocks
    the engine caches, and every VM's index equals the agent's."""
    for s in sims:
        try:
            wait_until(lambda s=s: fl.agent.keys(s["name"]) == fl.sim_keys(s), timeout,
                       f"the agent's mirror of {s['name']} equal to its cache")
        except TimeoutError as e:
            a, b = fl.agent.keys(s["name"]), fl.sim_keys(s)
            raise AssertionError(f"{e}: the agent holds {len(a)}, {len(a - b)} of them not in the cache; the "
                                 f"cache {len(b)}, {len(b - a)} of them unknown to the agent; agent's view: "
                                 f"{ {k: v for k, v in fl.agent.replica(s['name']).items() if k != 'block_keys'} }")
    wait_until(fl.indexes_equal_agent, timeout, "every VM's index equal to the agent's")


def test_engine_restart(fleet):
    fl = fleet
    load = Load(fl.listen)
    try:
        warm(load)
        sim = fl.busiest()
        assert fl.agent.replica(sim["name"])["blocks"] > 0
        resets = fl.resets(sim)
        kit.post_json(f"http://127.0.0.1:{sim['port']}/sim/restart")
        t_restart = time.monotonic()
        wait_until(lambda: fl.resets(sim) > resets, 10,
                   "the agent resetting the restarted engine's mirror")
        t_reset = time.monotonic()
        load.wait_answered(300, what="after the restart")
    finally:
        recs = load.stop()
    # The restarted engine's first batches can be lost to its publisher's reconnect (a ZMQ PUB
    # drops what it sends before the connection is up, as vLLM's does); the agent repairs them by
    # replay at the engine's next batch. If the load gave it none, one more request served by
    # the engine does.
    try:
        wait_until(lambda: fl.agent.keys(sim["name"]) == fl.sim_keys(sim), 3, "the restarted engine's mirror")
        nudged = "not needed"
    except TimeoutError:
        direct = [{"role": "user", "content": "after the restart " + " ".join(f"a{j}" for j in range(40))}]
        kit.post_json(f"http://127.0.0.1:{sim['port']}/v1/chat/completions",
                      {"model": MODEL, "messages": direct, "max_tokens": 1})
        nudged = "needed"
    quiet_and_equal(fl, fl.sims)
    report("engine restart (seq back to 0)", recs,
           f"engine's mirror reset {t_reset - t_restart:.3f} s after the restart; after the load the agent's "
           f"mirrors equal the engines' caches and every VM's index the agent's (one more batch of the "
           f"restarted engine's: {nudged})")
    assert not failed(recs), failed(recs)[:5]


# ---------------------------------------------------------------------------------------------
# 4. publisher gap, with and without replay


@pytest.mark.parametrize("replayable", [True, False], ids=["replay", "no-replay"])
def test_publisher_gap(fleet, replayable):
    fl = fleet
    load = Load(fl.listen)
    try:
        warm(load)
        sim = fl.busiest()
        before = fl.agent.replica(sim["name"])
        resets = fl.resets(sim)
        fl.fault(sim, drop_batches=5, replayable=replayable)
        t_gap = time.monotonic()
        wait_until(lambda: fl.agent.replica(sim["name"])["gaps"] > before["gaps"], 10,
                   f"the agent seeing the gap (received before: {before['received']}, now: "
                   f"{fl.agent.replica(sim['name'])['received']})")
        t_seen = time.monotonic()
        load.wait_answered(300, what="after the gap")
    finally:
        recs = load.stop()
    after = fl.agent.replica(sim["name"])
    name = f"publisher gap, {'replayable' if replayable else 'not replayable'}"
    if replayable:
        quiet_and_equal(fl, fl.sims)
        assert after["replays"]["complete"] > before["replays"]["complete"], after["replays"]
        assert fl.resets(sim) == resets, "a replayable gap must not reset the mirror"
        outcome = "filled by replay; mirrors equal the engines' caches"
    else:
        assert after["replays"]["incomplete"] > before["replays"]["incomplete"], after["replays"]
        assert fl.resets(sim) > resets, "an unfillable gap must reset the engine's mirror"
        # What the agent knows of the engine after the reset is what the engine holds: never a
        # block it does not (the batches lost may have removed some).
        wait_until(lambda: fl.agent.keys(sim["name"]) <= fl.sim_keys(sim), 20, "no phantom block in the mirror")
        quiet_and_equal(fl, [s for s in fl.sims if s is not sim])
        wait_until(fl.indexes_equal_agent, 20, "every VM's index equal to the agent's")
        outcome = (f"mirror reset; holds {len(fl.agent.keys(sim['name']))} of the engine's "
                   f"{len(fl.sim_keys(sim))} blocks, none it does not")
    report(name, recs, f"seen {t_seen - t_gap:.3f} s after the first dropped batch; {outcome}")
    assert not failed(recs), failed(recs)[:5]


# ---------------------------------------------------------------------------------------------
# 0. one client holding many partial HTTP/2 streams


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload


def _literal(name: str, value: str) -> bytes:
    """An HPACK literal header field without indexing, new name, no Huffman (short strings)."""
    n, v = name.encode(), value.encode()
    assert len(n) < 127 and len(v) < 127
    return b"\x00" + bytes([len(n)]) + n + bytes([len(v)]) + v


def _read_frames(sock, until: float) -> tuple[list[tuple[int, int, int, bytes]], bool]:
    """The frames the server sends until `until` (monotonic) or it closes, (type, flags, stream,
    payload) each, and whether it closed the connection."""
    import socket as socketlib
    buf, frames, closed = b"", [], False
    while time.monotonic() < until:
        sock.settimeout(max(0.01, until - time.monotonic()))
        try:
            chunk = sock.recv(65536)
        except (socketlib.timeout, TimeoutError):
            break
        except ConnectionResetError:
            closed = True
            break
        if not chunk:
            closed = True
            break
        buf += chunk
        while len(buf) >= 9 and len(buf) >= 9 + int.from_bytes(buf[:3], "big"):
            n = int.from_bytes(buf[:3], "big")
            frames.append((buf[3], buf[4], int.from_bytes(buf[5:9], "big") & 0x7FFFFFFF, buf[9:9 + n]))
            buf = buf[9 + n:]
    return frames, closed


PARTIAL_STREAMS = 200


def test_partial_http2_streams_are_capped_per_connection_and_others_are_served(fleet):
    """One h2c connection opens 200 request streams, each with a part of its body and never the
    end: Envoy holds at most the configured 100 (it refuses the rest), and a request from
    another client beside them is answered as quickly as before them."""
    import socket as socketlib
    fl = fleet
    control = {"model": MODEL, "messages": [{"role": "user", "content": "control request"}], "max_tokens": 1}

    def timed() -> float:
        t = time.monotonic()
        kit.post_json(f"http://127.0.0.1:{fl.listen}/v1/chat/completions", control)
        return time.monotonic() - t

    timed()
    before = sorted(timed() for _ in range(5))[2]
    h2_streams = "http.llmgw.downstream_rq_http2_total"
    opened_before = fl.envoy.stats(h2_streams).get(h2_streams, 0)
    sock = socketlib.create_connection(("127.0.0.1", fl.listen), timeout=5)
    try:
        sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _frame(4, 0, 0))
        # Envoy's SETTINGS (max concurrent streams) and its connection window come first.
        frames, _ = _read_frames(sock, time.monotonic() + 2)
        settings = [p for t, f, s, p in frames if t == 4 and not f & 1]
        advertised = {int.from_bytes(p[i:i + 2], "big"): int.from_bytes(p[i + 2:i + 6], "big")
                      for p in settings for i in range(0, len(p), 6)}
        sock.sendall(_frame(4, 1, 0))  # SETTINGS ACK
        block = b"".join(_literal(k, v) for k, v in [
            (":method", "POST"), (":scheme", "http"), (":path", "/v1/chat/completions"),
            (":authority", f"127.0.0.1:{fl.listen}"), ("content-type", "application/json")])
        part = b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", "content": "' + b"x" * 200
        out = b""
        for i in range(PARTIAL_STREAMS):
            stream = 2 * i + 1
            out += _frame(1, 0x4, stream, block) + _frame(0, 0, stream, part)
        sock.sendall(out)
        frames, closed = _read_frames(sock, time.monotonic() + 2)
        refused = {s for t, f, s, p in frames if t == 3}
        goaway = [p for t, f, s, p in frames if t == 7]
        opened = fl.envoy.stats(h2_streams).get(h2_streams, 0) - opened_before
        # Beside the held streams, another client's request.
        during = sorted(timed() for _ in range(5))[2]
    finally:
        sock.close()
    print(f"FAULT {PARTIAL_STREAMS} partial h2 streams: max_concurrent_streams advertised "
          f"{advertised.get(3)}; Envoy opened {opened} streams, refused {len(refused)}, goaway {bool(goaway)}, "
          f"connection closed {closed}; control request median {before * 1000:.1f} ms before, "
          f"{during * 1000:.1f} ms beside them")
    assert advertised.get(3) == 100, advertised
    # Envoy never held more than the 100 it advertised: past them it refuses the streams or
    # closes the connection (with every stream on it).
    assert opened <= 100, opened
    assert closed or goaway or len(refused) >= PARTIAL_STREAMS - 100, (closed, goaway, len(refused))
    assert during <= before + 0.5, (before, during)


def _h2_requests(port: int, path: str, bodies: list[bytes]):
    """One h2c connection sending each body as a whole request (END_STREAM), answers left
    unread: the requests stay in flight while the socket is open. Returns the socket."""
    import socket as socketlib
    sock = socketlib.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _frame(4, 0, 0))
    _read_frames(sock, time.monotonic() + 1)
    sock.sendall(_frame(4, 1, 0))
    block = b"".join(_literal(k, v) for k, v in [
        (":method", "POST"), (":scheme", "http"), (":path", path), (":authority", f"127.0.0.1:{port}"),
        ("content-type", "application/json")])
    sock.sendall(b"".join(_frame(1, 0x4, 2 * i + 1, block) + _frame(0, 0x1, 2 * i + 1, b)
                          for i, b in enumerate(bodies)))
    return sock


SLOW_STREAMS = 1100


def test_more_slow_streams_than_envoys_default_cap_leave_the_holder_chosen(procs, tmp_path, agent_bin, sim_bin,
                                                                           envoy_bin, wasm_path):
    """1,100 slow requests in flight through Envoy (past the 1,024 Envoy allows all replicas
    together by default): none is refused by Envoy's circuit breakers, and a follow-up whose
    prompt one replica holds still goes there."""
    # Every request runs at once (no queue at the replicas): the slow ones generate for minutes,
    # the follow-up's first token comes at once.
    fl = SimFleet(procs, tmp_path, agent_bin, sim_bin, envoy_bin, N_SIMS, blocks=65536, decode_ms=1,
                  buffer_steps=2_000_000, profile={"tokenizer_timeout_ms": TOKENIZER_TIMEOUT_MS},
                  sim_flags={"max_batch": 2 * SLOW_STREAMS})
    fl.start_envoy(wasm_path)
    held = list(range(1000, 1000 + 2048))
    first = {"model": MODEL, "prompt": held, "max_tokens": 1}
    status, hdrs, _ = kit.request("POST", f"http://127.0.0.1:{fl.listen}/v1/completions",
                                  json.dumps(first).encode(), {"content-type": "application/json"})
    assert status == 200, status
    holder = kit.parse_decision(hdrs.get("x-llmgw-decision")).replica
    holder_sim = next(s for s in fl.sims if fl.addr(s) == holder)
    wait_until(lambda: fl.agent.replica(holder_sim["name"])["blocks"] >= len(held) // 16, 10, "the holder's blocks")
    # 11 connections of 100 streams each (the listener's limit per connection), every request
    # a new prompt generating for seconds.
    socks = []
    try:
        for c in range(SLOW_STREAMS // 100):
            bodies = [json.dumps({"model": MODEL, "prompt": [7, c, i] + list(range(40)), "max_tokens": 4000}).encode()
                      for i in range(100)]
            socks.append(_h2_requests(fl.listen, "/v1/completions", bodies))
        # Envoy's default breakers would hold this at 1,024 (the rest pending, then refused).
        active = "cluster.llmgw_replicas.upstream_rq_active"
        wait_until(lambda: fl.envoy.stats(active).get(active, 0) >= SLOW_STREAMS, 60,
                   "every slow request in flight to the replicas")
        status, hdrs, _ = kit.request("POST", f"http://127.0.0.1:{fl.listen}/v1/completions",
                                      json.dumps({**first, "prompt": held + [5, 6, 7]}).encode(),
                                      {"content-type": "application/json"})
        overflow = fl.envoy.stats("cluster.llmgw_replicas.upstream_rq_pending_overflow")
    finally:
        for sock in socks:
            sock.close()
    decision = kit.parse_decision(hdrs.get("x-llmgw-decision"))
    print(f"FAULT {SLOW_STREAMS} slow streams: follow-up {status} {decision}; overflow {overflow}")
    assert status == 200, status
    assert not any(overflow.values()), overflow
    assert decision.outcome == "exact" and decision.replica == holder, (decision, holder)


# ---------------------------------------------------------------------------------------------
# 4b. a replica's /metrics down then up again: the mirror rebuilt by replay under live batches

# Small caches: under new prompts every engine evicts (BlockRemoved) all along, so a batch
# applied twice around the rebuild would leave a block the engine no longer holds.
SMALL_POOL_BLOCKS = 512
DOWN_UP_CYCLES = 4


def test_replica_down_then_up_is_rebuilt_without_phantom_blocks(procs, tmp_path, agent_bin, sim_bin, envoy_bin,
                                                                 wasm_path):
    fl = SimFleet(procs, tmp_path, agent_bin, sim_bin, envoy_bin, N_SIMS, blocks=SMALL_POOL_BLOCKS, decode_ms=1,
                  buffer_steps=2_000_000, profile={"tokenizer_timeout_ms": TOKENIZER_TIMEOUT_MS})
    fl.start_envoy(wasm_path)
    load = Load(fl.listen, unique=True)
    try:
        warm(load)
        sim = fl.busiest()
        assert fl.agent.replica(sim["name"])["blocks"] > 0
        # Each time up again while the load goes on: live batches reach the clean mirror around
        # the rebuild (a window of the engine thread's loop: several times to meet it).
        for _ in range(DOWN_UP_CYCLES):
            fl.fault(sim, metrics_down=True)
            wait_until(lambda: not fl.agent.replica(sim["name"])["up"], 10, "the agent marking it down")
            assert fl.agent.replica(sim["name"])["blocks"] == 0, "a replica down keeps no blocks"
            fl.fault(sim, metrics_down=False)
            wait_until(lambda: fl.agent.replica(sim["name"])["up"], 10, "the agent marking it up")
        t_up = time.monotonic()
        # Long enough after the rebuild for the engine to evict blocks stored before and after it.
        load.wait_answered(300, after=t_up, what="after it came back")
    finally:
        recs = load.stop()
    # Removals after the replay: the mirror holds exactly what the engine caches, nothing more.
    quiet_and_equal(fl, fl.sims)
    report("replica down, up and rebuilt", recs, "after the load the agent's mirrors equal the engines' caches")
    assert not failed(recs), failed(recs)[:5]


# ---------------------------------------------------------------------------------------------
# 5. tokenizer slower than its timeout

# How long a slow /tokenize takes: well past the filter's timeout.
SLOW_TOKENIZER_MS = 1000
# What p99 may add to the timeout beyond the baseline p99 (a request without the fault): the
# callout's timer fires on the worker's event loop and the fallback decision runs after it, on
# two CPUs shared by Envoy, three replicas, the agent and the clients (and other builds).
P99_MARGIN_MS = 100


def test_tokenizer_slower_than_its_timeout(fleet):
    fl = fleet
    # Every question new: every request needs the tokenizer (no tokenization cache hit).
    load = Load(fl.listen, unique=True)
    try:
        load.wait_answered(300, after=0.0, what="before the fault")
        t_fault = time.monotonic()
        base = [r for r in load.since(0.0) if r.t0 < t_fault]
        timeouts = fl.envoy.metric("llmgw_tokenizer_failures_total", 'reason="timeout"')
        for s in fl.sims:
            fl.fault(s, tokenize_delay_ms=SLOW_TOKENIZER_MS)
        t_slow = time.monotonic()
        load.wait_answered(200, after=t_slow, what="with the tokenizer slow")
    finally:
        recs = load.stop()
        for s in fl.sims:
            fl.fault(s, tokenize_delay_ms=0)
    slow = [r for r in recs if r.t0 >= t_slow]
    lat = lambda rs: [(r.t1 - r.t0) * 1000 for r in rs]  # noqa: E731
    p99_base, p99_slow = pct(lat(base), 99), pct(lat(slow), 99)
    timed_out = fl.envoy.metric("llmgw_tokenizer_failures_total", 'reason="timeout"') - timeouts
    bound = TOKENIZER_TIMEOUT_MS + p99_base + P99_MARGIN_MS
    report("tokenizer slower than its timeout", recs,
           f"none needed: p99 {p99_base:.0f} ms before, {p99_slow:.0f} ms with /tokenize taking "
           f"{SLOW_TOKENIZER_MS} ms (timeout {TOKENIZER_TIMEOUT_MS} ms, bound {bound:.0f} ms, max "
           f"{max(lat(slow)):.0f} ms); {timed_out:.0f} callouts timed out and fell back")
    assert not failed(recs), failed(recs)[:5]
    assert timed_out > 0, "the tokenizer was never slow enough to time out"
    assert p99_slow <= bound, (p99_slow, bound)


# ---------------------------------------------------------------------------------------------
# 6. Envoy listener reload under load (file-based LDS, changed on disk by atomic rename)


def hcm_of(listener: dict) -> dict:
    """The HTTP connection manager of a listener's (one) filter chain: the connection limit
    comes before it."""
    (hcm,) = [f["typed_config"] for f in listener["filter_chains"][0]["filters"]
              if f["name"] == "envoy.filters.network.http_connection_manager"]
    return hcm


def lds_bootstrap(shipped: str, lds_dir: Path) -> tuple[str, dict]:
    """The shipped bootstrap with its listener moved into a file-based LDS source in lds_dir;
    returns (bootstrap YAML, the listener)."""
    doc = yaml.safe_load(shipped)
    (listener,) = doc["static_resources"].pop("listeners")
    doc["node"] = {"id": "llmgw-faults", "cluster": "llmgw-faults"}  # required with xDS
    doc["dynamic_resources"] = {"lds_config": {"resource_api_version": "V3", "path_config_source": {
        "path": str(lds_dir / "lds.yaml"), "watched_directory": {"path": str(lds_dir)}}}}
    return yaml.safe_dump(doc, sort_keys=False), listener


def write_lds(lds_dir: Path, listener: dict, version: int, filter_change: bool = False) -> None:
    """The listener at `version` (it adds x-fault-listener-version to every response; with
    `filter_change` the filter's configuration differs too), written next to lds.yaml and
    renamed over it: Envoy sees one complete file or the other."""
    listener = json.loads(json.dumps(listener))
    hcm = hcm_of(listener)
    hcm["route_config"]["response_headers_to_add"] = [
        {"header": {"key": "x-fault-listener-version", "value": str(version)},
         "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}]
    if filter_change:
        # The filter's own configuration changes too (a new plugin: new root contexts in the VMs).
        for f in hcm["http_filters"]:
            if f["name"] == "envoy.filters.http.wasm":
                value = f["typed_config"]["config"]["configuration"]
                cfg = json.loads(value["value"])
                cfg["tokenizer_cache_ttl_ms"] = 60_000 + version
                value["value"] = json.dumps(cfg)
    doc = {"version_info": str(version),
           "resources": [{"@type": "type.googleapis.com/envoy.config.listener.v3.Listener", **listener}]}
    tmp = lds_dir / f".lds.{version}.yaml"
    tmp.write_text(yaml.safe_dump(doc, sort_keys=False))
    os.rename(tmp, lds_dir / "lds.yaml")


# Reloads of the listener: odd versions change its routes, even ones the filter's configuration too.
RELOADS = 6


def test_listener_reload_under_load(procs, tmp_path, agent_bin, sim_bin, envoy_bin, wasm_path):
    fl = new_fleet(procs, tmp_path, agent_bin, sim_bin, envoy_bin)
    lds_dir = tmp_path / "lds"
    lds_dir.mkdir()
    bootstrap, listener = lds_bootstrap(
        fl.shipped(wasm_path), lds_dir)
    write_lds(lds_dir, listener, 0)
    fl.start_envoy(wasm_path, config=bootstrap)
    load = Load(fl.listen)
    recoveries = []
    try:
        warm(load)
        # The shipped build has no trap: the test-only header is an ordinary one.
        assert load.send(CHAT, load.body(1), {"x-llmgw-fault": "trap"}).status == 200
        for v in range(1, RELOADS + 1):
            ok = fl.envoy.stats("listener_manager.lds.update_success").get("listener_manager.lds.update_success", 0)
            write_lds(lds_dir, listener, v, filter_change=v % 2 == 0)
            t = time.monotonic()
            wait_until(lambda: fl.envoy.stats("listener_manager.lds.update_success")
                       .get("listener_manager.lds.update_success", 0) > ok, 10, f"Envoy taking listener version {v}")
            first = wait_until(lambda: next((r for r in load.since(t) if r.version == str(v)), None), 10,
                               f"a response from listener version {v}")
            recoveries.append(first.t1 - t)
            load.wait_answered(200, what=f"on listener version {v}")
    finally:
        recs = load.stop()
    bad = failed(recs)
    share = 1 - len(bad) / len(recs)
    report(f"listener reload x{RELOADS} (LDS file, atomic rename)", recs,
           f"first response from the new listener {max(recoveries) * 1000:.0f} ms after the rename at most")
    assert share >= 0.9999, (share, bad[:5])


# ---------------------------------------------------------------------------------------------
# 7. a wasm VM crash (the test-only fault-injection build traps on `x-llmgw-fault: trap`)


def fault_wasm() -> Path:
    """The test-only filter (cargo feature fault-injection, profile fault-injection), never
    dist/llmgw.wasm: ./build.sh e2e and test build it."""
    return kit.built("llmgw.wasm", f"{kit.WASM_TARGET}/fault-injection")


def with_reload_backoff(config: str, base_interval: str | None) -> str:
    """The bootstrap with the wasm filter's reload_config backoff at `base_interval` (the shipped
    configuration sets 0.01s; None: no reload_config, Envoy's default of 1 s)."""
    doc = yaml.safe_load(config)
    hcm = hcm_of(doc["static_resources"]["listeners"][0])
    (wasm,) = [f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.wasm"]
    cfg = wasm["typed_config"]["config"]
    if base_interval is None:
        cfg.pop("reload_config", None)
    else:
        cfg["reload_config"] = {"backoff": {"base_interval": base_interval}}
    return yaml.safe_dump(doc, sort_keys=False)


def reload_stats(envoy) -> dict[str, float]:
    return {k: v for k, v in envoy.stats("wasm").items() if "reload" in k}


# A client gives up on a request after this long in the VM-crash test (a request paused in the
# crashed VM is never resumed by Envoy: see the test).
CRASH_CLIENT_TIMEOUT_S = 5.0


@pytest.mark.parametrize("backoff", ["0.01s", None], ids=["reload-10ms", "reload-default"])
def test_vm_crash_is_reloaded(procs, tmp_path, agent_bin, sim_bin, envoy_bin, backoff):
    """One VM (one worker's) traps. Measured with Envoy 1.40 and FAIL_RELOAD:
    - requests in flight on that worker fail (0-5 of them per crash with 6 clients over 2
      workers): 503 or a reset, and in about 1 crash of 3 one or two are never answered at
      all (they end at the client's timeout here, else at the route's or the stream idle
      timeout; most likely streams paused in the filter, which Envoy does not resume once
      their VM is dead);
    - with Envoy's default reload backoff (1 s base interval) that worker also answers 503 to
      every new request until the VM is reloaded (counted in `vm_reload_backoff`, 0.2-0.4 s of
      its traffic here); with a 10 ms base interval the reload comes with the next request;
    - the reloaded VM routes from its first request (the replica table kept in shared data).
    So the best configuration is FAIL_RELOAD with `reload_config.backoff.base_interval` ~10 ms
    (what the shipped configurations set):
    a crash then costs exactly the requests in flight on the crashed worker. The >= 99.99 %
    target holds only if crashes are rarer than one per 10,000 x (requests in flight per
    worker); this test's own run (a few thousand requests at most) does not reach it, so it
    asserts the cost instead: no failure beyond the requests in flight at the crash."""
    wasm = fault_wasm()
    fl = new_fleet(procs, tmp_path, agent_bin, sim_bin, envoy_bin)
    fl.start_envoy(wasm, config=with_reload_backoff(
        fl.shipped(wasm), backoff))
    load = Load(fl.listen, timeout=CRASH_CLIENT_TIMEOUT_S)
    try:
        warm(load)
        before = reload_stats(fl.envoy)
        t_trap = time.monotonic()
        trap = load.send(CHAT, load.body(1), {"x-llmgw-fault": "trap"})
        reloads = before["wasm.llmgw.vm_reload_success"]
        wait_until(lambda: reload_stats(fl.envoy)["wasm.llmgw.vm_reload_success"] > reloads, 20,
                   "Envoy reloading the crashed VM")
        t_reload = time.monotonic()
        load.wait_answered(600, what="after the crash")
        # Every request in flight at the crash is answered or given up on.
        wait_until(lambda: load.settled(trap.t1), CRASH_CLIENT_TIMEOUT_S + 30,
                   "the requests in flight at the crash to end")
    finally:
        recs = load.stop()
    after = reload_stats(fl.envoy)
    bad = failed(recs)
    # Under Envoy's default backoff the crashed worker also refuses requests sent while the trap
    # was being answered (503 from Envoy, no decision): those count with the refused, not as in
    # flight at the crash.
    backed_off = [r for r in bad if backoff is None and r.t0 >= trap.t0 and r.status == 503 and not r.outcome]
    in_flight = [r for r in bad if r.t0 < trap.t1 and r not in backed_off]
    later = [r for r in bad if r.t0 >= trap.t1 or r in backed_off]
    hung = [r for r in in_flight if r.status == 0 and r.t1 - r.t0 >= CRASH_CLIENT_TIMEOUT_S - 0.1]
    refused = after["wasm.llmgw.vm_reload_backoff"] - before["wasm.llmgw.vm_reload_backoff"]
    report(f"wasm VM crash, FAIL_RELOAD, reload backoff {backoff or 'default (1 s)'}", recs,
           f"VM reloaded {t_reload - t_trap:.2f} s after the trap; {len(in_flight)} failed were in flight in the "
           f"crashed VM ({len(hung)} of them never answered), {len(later)} sent after the crash failed "
           f"({refused:.0f} refused while the reload backed off)")
    assert trap.status != 200, "the test-only build did not trap"
    assert len(in_flight) <= CONCURRENCY, in_flight
    # Nothing routed by the filter fails after the crash: no 503 of its own (outcome no_replica).
    assert not [r for r in later if r.outcome], later[:5]
    if backoff is None:
        # Envoy's default: the worker refuses requests (503 without a decision) while it waits.
        # A request sent between the trap and its answer that was in flight on the crashed VM
        # gets the same 503 and counts with them, but not in `vm_reload_backoff`: at most one
        # per client (CI once saw 241 against 240).
        assert refused > 0 and len(later) <= refused + CONCURRENCY, (len(later), refused)
    else:
        assert not later, later[:5]


@pytest.mark.parametrize("policy", ["FAIL_RELOAD", "FAIL_OPEN"])
def test_a_worker_whose_filter_failed_never_sends_a_client_where_it_asks(procs, tmp_path, agent_bin, sim_bin,
                                                                        envoy_bin, policy):
    """Fail closed when the filter fails on a worker: one worker's VM traps on a request that
    names a canary server in the destination header, then requests naming it keep coming on
    fresh connections (both workers). With FAIL_RELOAD and Envoy's default 1 s reload backoff
    that worker answers without a filter until the reload; with FAIL_OPEN it skips the filter
    from then on. Either way Envoy's own header_mutation has removed the client's header before
    the filter's place in the chain, so the canary is never reached."""
    from test_deploy import DEST, Canary

    canary = Canary()
    try:
        wasm = fault_wasm()
        fl = new_fleet(procs, tmp_path, agent_bin, sim_bin, envoy_bin)
        doc = yaml.safe_load(with_reload_backoff(
            fl.shipped(wasm), None))
        hcm = hcm_of(doc["static_resources"]["listeners"][0])
        (wasm_filter,) = [f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.wasm"]
        wasm_filter["typed_config"]["config"]["failure_policy"] = policy
        fl.start_envoy(wasm, config=yaml.safe_dump(doc, sort_keys=False))
        url = f"http://127.0.0.1:{fl.listen}/v1/chat/completions"
        body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 1}).encode()
        headers = {"content-type": "application/json", DEST: f"127.0.0.1:{canary.port}"}
        trap, _, _ = kit.request("POST", url, body, {**headers, "x-llmgw-fault": "trap"}, timeout=10)
        statuses, unfiltered = [], 0
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            status, h, _ = kit.request("POST", url, body, headers, timeout=10)
            statuses.append(status)
            # Answered by a worker whose filter did not run (no decision header).
            unfiltered += kit.DECISION_HEADER not in {k.lower() for k in h}
    finally:
        canary.stop()
    summary = {s: statuses.count(s) for s in set(statuses)}
    print(f"{policy}: trap answered {trap}; then {len(statuses)} requests naming the canary: {summary}, "
          f"{unfiltered} answered by a worker without the filter; canary reached {len(canary.hits)} times")
    assert trap != 200, "the test-only build did not trap"
    # The failing worker was exercised, and nothing reached the address the client named.
    assert unfiltered > 0, summary
    assert canary.hits == [], canary.hits
