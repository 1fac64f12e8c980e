"""The load-and-fault harness of the fault suite (wasm-tests/test_faults.py) and the soak
(bench/soak.py): simulated replicas publishing to one agent (the agent binds, the replicas
connect, so a restarted agent gets them back on the same ports), Envoy with the filter in front,
client threads that send requests through Envoy on fresh connections and count every one, and
the faults: the agent or a replica killed and started again, an engine's faults (/sim/fault)."""

from __future__ import annotations

import http.client
import re
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .client import DECISION_HEADER
from .envoy import filter_config, shipped_config
from .fleet import fleet_agent, new_sims, sim_command, start_router, wait_publishers, wait_sims
from .http import http_json, post_json
from .procs import free_port, wait_until

MODEL = "demo-model"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
_REPLICA = re.compile(r"replica=([\d.]+:\d+)")
_OUTCOME = re.compile(r"outcome=(\w+)")


@dataclass
class Rec:
    t0: float          # sent (time.monotonic())
    t1: float          # answered or failed
    status: int        # HTTP status; 0 = connection error
    replica: str | None  # where the filter routed it (x-llmgw-decision), if it says
    version: str | None  # x-fault-listener-version (listener reload test)
    outcome: str | None = None  # the decision's outcome (x-llmgw-decision), if it says
    decision: str = ""  # the whole x-llmgw-decision header, "" when absent


def send(port: int, path: str, body: bytes, headers: dict | None = None, timeout: float = 30.0) -> Rec:
    """POSTs `body` (JSON) to 127.0.0.1:port on a fresh connection and records the answer."""
    t0 = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, body=body,
                     headers={"content-type": "application/json", "connection": "close", **(headers or {})})
        resp = conn.getresponse()
        resp.read()
        decision = resp.getheader(DECISION_HEADER) or ""
        m, o = _REPLICA.search(decision), _OUTCOME.search(decision)
        return Rec(t0, time.monotonic(), resp.status, m.group(1) if m else None,
                   resp.getheader("x-fault-listener-version"), o.group(1) if o else None, decision)
    except (OSError, http.client.HTTPException):
        return Rec(t0, time.monotonic(), 0, None, None)
    finally:
        conn.close()


def failed(recs: list[Rec]) -> list[Rec]:
    return [r for r in recs if not 200 <= r.status < 300]


class ClientLoad:
    """`concurrency` client threads sending `request(i)` -> (path, JSON body bytes) to
    127.0.0.1:port until stop(), each request on a fresh connection (as many clients behind a
    proxy do), pausing `pause_s` between requests. Counts every request (sent, failed: non-2xx or
    connection error) and, with `keep`, records each one. Subclasses set their own fields before
    calling this constructor: it starts the clients."""

    def __init__(self, port: int, concurrency: int, timeout: float = 30.0, pause_s: float = 0.0, keep: bool = True):
        self.port, self.timeout, self.pause_s, self.keep = port, timeout, pause_s, keep
        self.recs: list[Rec] = []
        self.sent = self.failed = 0
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        # When each client's current request was sent (None between requests).
        self.current: list[float | None] = [None] * concurrency
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(concurrency)]
        for t in self.threads:
            t.start()

    def request(self, i: int) -> tuple[str, bytes]:
        """Client i's next request: (path, JSON body)."""
        raise NotImplementedError

    def send(self, path: str, body: bytes, headers: dict | None = None) -> Rec:
        return send(self.port, path, body, headers, self.timeout)

    def _run(self, i: int) -> None:
        while not self.stopping.is_set():
            path, body = self.request(i)
            self.current[i] = time.monotonic()
            self.record(self.send(path, body))
            self.current[i] = None
            if self.pause_s:
                self.stopping.wait(self.pause_s)

    def record(self, r: Rec) -> None:
        with self.lock:
            self.sent += 1
            self.failed += int(not 200 <= r.status < 300)
            if self.keep:
                self.recs.append(r)

    def since(self, t: float) -> list[Rec]:
        with self.lock:
            return [r for r in self.recs if r.t0 >= t]

    def wait_answered(self, n: int, after: float | None = None, timeout: float = 30.0, what: str = "") -> None:
        """Waits until n more requests sent after `after` (default: now) were answered."""
        start = time.monotonic() if after is None else after
        wait_until(lambda: len(self.since(start)) >= n, timeout, f"{n} requests answered {what}".strip())

    def settled(self, t: float) -> bool:
        """Every request sent before t has been answered or given up on."""
        return all(c is None or c >= t for c in list(self.current))

    def stop(self) -> list[Rec]:
        self.stopping.set()
        for t in self.threads:
            t.join(60)
        with self.lock:
            return list(self.recs)


class SimFleet:
    """`n` simulated replicas (`blocks` KV blocks, sha256_cbor with seed "0", `decode_ms` per
    token, a replay buffer of `buffer_steps` steps) publishing to one agent whose loads are
    scraped every 100 ms (a replica whose /metrics fails for 300 ms is down), every publisher
    connected; Envoy (start_envoy) with the filter `profile` and the explain header. `sim_flags`:
    more of llmgw-sim's flags (`max_batch=...`)."""

    def __init__(self, procs, workdir: Path, agent_bin, sim_bin, envoy_bin, n: int, blocks: int, decode_ms: float,
                 buffer_steps: int, profile: dict, connected_timeout: float = 20.0, sim_flags: dict | None = None):
        self.procs, self.workdir, self.agent_bin = procs, workdir, agent_bin
        self.sim_bin, self.envoy_bin = sim_bin, envoy_bin
        self.sims = new_sims(n)
        self.agent = fleet_agent(procs, agent_bin, workdir, self.sims, MODEL,
                                 load={"interval_ms": 100, "down_after_ms": 300, "timeout_ms": 200})
        self.sim_cmds = {s["name"]: sim_command(sim_bin, s, MODEL, blocks=blocks, seed="0", decode_ms=decode_ms,
                                                buffer_steps=buffer_steps, **(sim_flags or {})) for s in self.sims}
        self.sim_procs = {s["name"]: procs.start(self.sim_cmds[s["name"]], s["name"]) for s in self.sims}
        wait_sims(self.sims)
        wait_publishers(self.agent, n, connected_timeout)
        self.listen, self.admin = free_port(), free_port()
        self.filter_cfg = filter_config(profile, explain_header=True)

    def shipped(self, wasm_path) -> str:
        """The shipped bootstrap for this fleet's ports, agent and filter configuration."""
        return shipped_config(wasm_path, self.listen, self.admin, self.agent.feed, self.filter_cfg)

    def start_envoy(self, wasm_path, name: str = "envoy", config: str | None = None):
        """Envoy on `config` (default: the shipped bootstrap), ready and subscribed to the feed."""
        self.envoy_proc, self.envoy = start_router(self.procs, self.envoy_bin, self.workdir, name,
                                                   config or self.shipped(wasm_path), self.admin,
                                                   feed=True, feed_timeout=60)
        return self

    def kill_agent(self) -> None:
        self.procs.stop(self.agent.proc, signal.SIGKILL)

    def restart_agent(self) -> None:
        """The agent again, same configuration and ports (the Envoy cluster points there)."""
        a = self.agent
        a.attempts += 1
        a.proc = self.procs.start([self.agent_bin, "run", "--config", a.config], f"{a.name}-{a.attempts}")
        a.log_path = a.proc.log_path
        a.wait_ready()

    def kill_sim(self, sim: dict) -> None:
        self.procs.stop(self.sim_procs[sim["name"]], signal.SIGKILL)

    def restart_sim(self, sim: dict, name: str) -> None:
        """`sim` started again on its ports (an empty cache), its process logged as `name`."""
        self.sim_procs[sim["name"]] = self.procs.start(self.sim_cmds[sim["name"]], name)
        wait_sims([sim])

    def addr(self, sim: dict) -> str:
        return f"127.0.0.1:{sim['port']}"

    def agent_total(self) -> int:
        return sum(r["blocks"] for r in self.agent.replicas())

    def indexes_equal_agent(self) -> bool:
        """Every VM's index holds the agent's (block, replica) pairs: the agent's count read
        before and after the VMs' gauges, unchanged, equal to each gauge."""
        a = self.agent_total()
        vals = self.envoy.index_blocks()
        b = self.agent_total()
        return a == b and a > 0 and bool(vals) and all(v == a for v in vals)

    def busiest(self) -> dict:
        """The replica whose publisher sent the agent the most batches so far."""
        received = {r["replica"]: r["received"] for r in self.agent.replicas()}
        return max(self.sims, key=lambda s: received.get(s["name"], 0))

    def resets(self, sim: dict) -> int:
        """The agent's resets of `sim`'s mirror, whatever the reason."""
        return sum(self.agent.replica(sim["name"])["resets"].values())

    def sim_keys(self, sim: dict) -> set[int]:
        """The block keys `sim` caches now."""
        return set(http_json(f"http://127.0.0.1:{sim['port']}/sim/blocks")[2]["keys"])

    def fault(self, sim: dict, **body) -> None:
        post_json(f"http://127.0.0.1:{sim['port']}/sim/fault", body)
