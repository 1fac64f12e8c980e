"""Several gateways in front of one fleet, as the sidecar deployments run them: each gateway is
an Envoy with llmgw.wasm and its own agent, and every agent subscribes to every replica's bound
publisher (the replicas bind their event sockets, as vLLM does with `tcp://*:PORT`)."""

from __future__ import annotations

import http.client
import json
import random
import re
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from .agent import Agent, merged
from .envoy import EnvoyAdmin, filter_config, shipped_config
from .fleet import pct, sim_command, start_router
from .jetstream import jetstream_replica, start_publish
from .procs import free_port

# The IPv4-mapped loopback form: a replica binds it (like vLLM given tcp://[::ffff:127.0.0.1]:PORT)
# and listens on 127.0.0.1 only.
BIND_HOST = "[::ffff:127.0.0.1]"


def bound_sim_command(sim_bin, sim: dict, model: str, **flags) -> list:
    """llmgw-sim's command line with its publisher and replay socket bound on loopback, so that
    any number of agents can subscribe."""
    return sim_command(sim_bin, sim, model, host=BIND_HOST, **flags)


def subscribed_replica(sim: dict, model: str) -> dict:
    """An agent's entry for a replica whose publisher is bound: the agent connects."""
    return {"name": sim["name"], "address": f"127.0.0.1:{sim['port']}", "models": [model],
            "endpoint": f"tcp://127.0.0.1:{sim['kv']}", "mode": "connect",
            "replay_endpoint": f"tcp://127.0.0.1:{sim['replay']}", "topic": "kv-events"}


@dataclass
class Gateway:
    name: str
    agent: Agent
    envoy: EnvoyAdmin
    listen: int
    envoy_proc: object = None

    def stop(self, procs) -> None:
        procs.stop(self.envoy_proc)
        procs.stop(self.agent.proc)


MODEL = "demo-model"

# What every gateway's agent runs with unless told otherwise: the fleet tests' hash settings, a
# reconnecting publisher checked through its replay socket.
AGENT_BASE = {"hash": {"algo": "sha256_cbor", "seed": "0", "block_size": 16}, "zmq": {"verify_on_reconnect": True}}


def start_gateways(procs, agent_bin, envoy_bin, wasm, workdir: Path, sims: list[dict], model: str, n: int,
                   filter_cfg: dict | None = None, feed_timeout: float = 60.0, prefix: str = "",
                   nats: str | None = None, **agent_sections) -> list[Gateway]:
    """n gateways (agent + Envoy each) in front of `sims`, every filter VM subscribed to its own
    agent's feed when this returns (Envoy with 2 workers each). With `nats` (a JetStream URL)
    the replicas' events go through that broker: one `llmgw-agent publish` per replica, and
    each agent reads the stream instead of subscribing to every replica."""
    cfg = filter_cfg or filter_config({"name": "gw"}, explain_header=True)
    replicas = [subscribed_replica(s, model) for s in sims]
    if nats:
        for r in replicas:
            start_publish(procs, agent_bin, workdir, nats, r, name=f"{prefix}publish-{r['name']}")
        replicas = [jetstream_replica(r) for r in replicas]
        agent_sections = {**agent_sections, "jetstream": {"url": nats}}
    agents = []
    for i in range(n):
        a = Agent(procs, agent_bin, workdir, replicas, name=f"{prefix}agent{i}",
                  **merged(AGENT_BASE, agent_sections))
        agents.append(a)
    gws = []
    for i, a in enumerate(agents):
        a.wait_ready()
        listen, admin = free_port(), free_port()
        config = shipped_config(wasm, listen, admin, a.feed, cfg)
        proc, api = start_router(procs, envoy_bin, workdir, f"{prefix}envoy{i}", config, admin, feed=True,
                                 feed_timeout=feed_timeout)
        gws.append(Gateway(f"gw{i}", a, api, listen, proc))
    return gws


def agent_blocks(agent) -> int:
    """An agent's mirrored blocks over every replica, from its /metrics (llmgw_agent_blocks)."""
    total = 0
    for line in agent.metrics().splitlines():
        m = re.match(r"^llmgw_agent_blocks(\{[^}]*\})?\s+(\S+)$", line)
        if m:
            total += int(float(m.group(2)))
    return total


def indexes_equal_agents(gws: list[Gateway]) -> bool:
    """True when every filter VM of every gateway holds exactly its agent's (block, replica)
    pairs and every agent holds the same number."""
    totals = []
    for g in gws:
        total = agent_blocks(g.agent)
        vals = g.envoy.index_blocks()
        if not vals or any(v != total for v in vals):
            return False
        totals.append(total)
    return len(set(totals)) == 1


def stream(port: int, messages: list[dict], max_tokens: int, model: str = MODEL) -> tuple[float, str | None, int]:
    """(time to first token in seconds, the replica that served it, HTTP status; 0 when the
    connection failed)."""
    body = json.dumps({"model": model, "messages": messages, "max_tokens": max_tokens, "stream": True})
    t0 = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", "/v1/chat/completions", body=body, headers={"content-type": "application/json"})
        resp = conn.getresponse()
        replica = resp.getheader("x-llmgw-sim-replica")
        if resp.status != 200:
            resp.read()
            return float("nan"), replica, resp.status
        ttft = float("nan")
        while True:
            line = resp.readline()
            if not line:
                break
            if ttft != ttft and line.startswith(b"data: "):
                ttft = time.monotonic() - t0
        return ttft, replica, 200
    except (OSError, http.client.HTTPException):
        return float("nan"), None, 0
    finally:
        conn.close()


def shares(counts: dict[str, int], names: list[str]) -> dict:
    """Request counts per replica as the busiest and idlest against a fair share, the replicas
    used and the coefficient of variation."""
    n = [counts.get(x, 0) for x in names]
    total = sum(n) or 1
    fair = total / len(n)
    mean = statistics.mean(n)
    return {"max_x_fair": max(n) / fair, "min_x_fair": min(n) / fair, "used": sum(1 for x in n if x),
            "cov": (statistics.pstdev(n) / mean) if mean else float("nan")}


def burst(gws, sims, per_gateway: int, prefix_words: int, max_tokens: int, seed: int, model: str = MODEL) -> dict:
    """Every gateway receives `per_gateway` streaming requests at once, all sharing one system
    prompt of `prefix_words` words no replica holds yet; returns where they went (per replica,
    the busiest and idlest against a fair share, replicas used, CoV), TTFT p50/p99, errors."""
    rng = random.Random(seed)
    system = {"role": "system", "content": f"burst {rng.random()} " + " ".join(f"w{i}" for i in range(prefix_words))}
    jobs = [(g.listen, [system, {"role": "user", "content": f"question {i} from {g.name}"}])
            for g in gws for i in range(per_gateway)]
    rng.shuffle(jobs)
    start = threading.Barrier(len(jobs))

    def one(job):
        start.wait()
        return stream(job[0], job[1], max_tokens, model)
    with ThreadPoolExecutor(len(jobs)) as ex:
        results = list(ex.map(one, jobs))
    counts: dict[str, int] = {}
    for _, r, st in results:
        if st == 200 and r:
            counts[r] = counts.get(r, 0) + 1
    ttfts = [t for t, _, st in results if st == 200 and t == t]
    return {"requests": len(results), "errors": sum(1 for _, _, st in results if st != 200),
            "ttft_p50_ms": pct(ttfts, 50) * 1000, "ttft_p99_ms": pct(ttfts, 99) * 1000,
            "per_replica": counts, **shares(counts, [s["name"] for s in sims])}
