"""Several gateways in front of one fleet, as the sidecar deployments run them: each gateway is
an Envoy with llmgw.wasm and its own agent, and every agent subscribes to every replica's bound
publisher (the replicas bind their event sockets, as vLLM does with `tcp://*:PORT`)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from .agent import Agent, merged
from .envoy import EnvoyAdmin, filter_config, shipped_config
from .fleet import sim_command, start_router
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


# What every gateway's agent runs with unless told otherwise: the fleet tests' hash settings, a
# reconnecting publisher checked through its replay socket.
AGENT_BASE = {"hash": {"algo": "sha256_cbor", "seed": "0", "block_size": 16}, "zmq": {"verify_on_reconnect": True}}


def start_gateways(procs, agent_bin, envoy_bin, wasm, workdir: Path, sims: list[dict], model: str, n: int,
                   filter_cfg: dict | None = None, feed_timeout: float = 60.0,
                   **agent_sections) -> list[Gateway]:
    """n gateways (agent + Envoy each) in front of `sims`, every filter VM subscribed to its own
    agent's feed when this returns (Envoy with 2 workers each)."""
    cfg = filter_cfg or filter_config({"name": "gw"}, explain_header=True)
    agents = []
    for i in range(n):
        a = Agent(procs, agent_bin, workdir, [subscribed_replica(s, model) for s in sims], name=f"agent{i}",
                  **merged(AGENT_BASE, agent_sections))
        agents.append(a)
    gws = []
    for i, a in enumerate(agents):
        a.wait_ready()
        listen, admin = free_port(), free_port()
        config = shipped_config(wasm, listen, admin, a.feed, cfg)
        _, api = start_router(procs, envoy_bin, workdir, f"envoy{i}", config, admin, feed=True,
                              feed_timeout=feed_timeout)
        gws.append(Gateway(f"gw{i}", a, api, listen))
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
