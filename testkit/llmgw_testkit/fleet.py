"""A fleet of simulated vLLM replicas (llmgw-sim): their command lines, the agent mirroring them,
Envoy in front, their /metrics, and the peer routers' command lines."""

from __future__ import annotations

import re
import signal
import sys
from pathlib import Path

from .agent import Agent, merged, sim_replica
from .envoy import EnvoyAdmin, start_envoy
from .http import get_text, post_json
from .procs import free_port, wait_until


# llmgw policy weights matching the simulator's physics, for the demo and the simulator
# benchmarks: it computes prefills side by side, so prefill queued on a replica delays no new
# request there (`queued_prefill` 0; the filter's default of 1 is vLLM's, whose steps compute
# every scheduled token together).
SIM_WEIGHTS = {"queued_prefill": 0}


def new_sims(n: int, **extra) -> list[dict]:
    """n replica descriptions {"name": "rI", "port", "kv", "replay", **extra} on free loopback ports."""
    return [{"name": f"r{i}", "port": free_port(), "kv": free_port(), "replay": free_port(), **extra}
            for i in range(n)]


def sim_command(sim_bin, sim: dict, model: str, host: str = "127.0.0.1", **flags) -> list:
    """llmgw-sim's command line for `sim`: its HTTP port and name, its publisher and replay
    socket at tcp://HOST:kv and tcp://HOST:replay, then `flags` as --flag-name value."""
    cmd = [sim_bin, "--port", sim["port"], "--name", sim["name"], "--model", model,
           "--kv-endpoint", f"tcp://{host}:{sim['kv']}", "--replay-endpoint", f"tcp://{host}:{sim['replay']}"]
    for k, v in flags.items():
        cmd += [f"--{k.replace('_', '-')}", v]
    return cmd


def wait_sims(sims: list[dict], timeout: float = 20.0) -> None:
    for s in sims:
        wait_until(lambda s=s: get_text(f"http://127.0.0.1:{s['port']}/health") == "", timeout, f"replica {s['name']}")


def restart_sims(sims: list[dict]) -> None:
    """Empties every replica's cache (a new engine: its publisher starts again at sequence 0)."""
    for s in sims:
        post_json(f"http://127.0.0.1:{s['port']}/sim/restart")


def fleet_agent(procs, agent_bin, workdir: Path, sims: list[dict], model: str, name: str = "agent",
                **sections) -> Agent:
    """A started, ready agent mirroring `sims` (sha256_cbor, seed "0", blocks of 16; a reconnecting
    publisher is checked through its replay socket, so a restarted engine's blocks leave at once);
    `sections` add to or override that configuration."""
    base = {"hash": {"algo": "sha256_cbor", "seed": "0", "block_size": 16}, "zmq": {"verify_on_reconnect": True}}
    agent = Agent(procs, agent_bin, workdir, [sim_replica(s, model) for s in sims], name=name,
                  **merged(base, sections))
    return agent.wait_ready()


def wait_publishers(agent, n: int, timeout: float = 20.0) -> None:
    """Until the agent lists n replicas, each with its events connected (its publisher, or the
    stream). Over ZMQ, what a replica publishes before then is dropped (a PUB socket drops what no
    subscriber takes), so a test that reads the mirror after a request waits for this first."""
    def connected() -> bool:
        replicas = agent.replicas()
        return len(replicas) == n and all(r["connected"] for r in replicas)
    wait_until(connected, timeout, "every replica's events connected to the agent")


def start_router(procs, envoy_bin, workdir: Path, name: str, config: str, admin: int, feed: bool,
                 timeout: float = 30.0, feed_timeout: float = 20.0):
    """Writes `config` to workdir/NAME.yaml, starts Envoy on it and waits until it is ready and,
    with `feed`, until every filter VM is subscribed to the agent's feed (the replica table comes
    from it). Returns (process, EnvoyAdmin)."""
    path = Path(workdir) / f"{name}.yaml"
    path.write_text(config)
    proc = start_envoy(procs, envoy_bin, path, name)
    api = EnvoyAdmin(admin)
    api.wait_ready(timeout, proc=proc)
    if feed:
        api.wait_feed(feed_timeout)
    return proc, api


def scrape(port: int) -> dict[str, float]:
    """A replica's vllm:* series from its /metrics, each summed over its label sets (vLLM
    counts `request_success_total` per finish reason)."""
    out: dict[str, float] = {}
    for line in get_text(f"http://127.0.0.1:{port}/metrics").splitlines():
        m = re.match(r"^(vllm:[a-z_]+)(?:\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def pct(xs: list[float], p: float) -> float:
    xs = sorted(x for x in xs if x == x)
    if not xs:
        return float("nan")
    k = min(len(xs) - 1, max(0, int(round(p / 100 * (len(xs) - 1)))))
    return xs[k]


def peer_command(policy: str, binary, port: int, worker_urls: list[str], prom_port: int,
                 kv_sources: list[tuple[str, int, int]] = (), block_size: int = 16, model: str = "") -> list:
    """A peer router from PyPI on 127.0.0.1:port in front of `worker_urls`, its metrics on
    `prom_port`: "sglang" or "smg" (`launch`, cache_aware), "vllm-ca" or "vllm-kv" (vllm-router
    cache_aware or kv_aware; kv_aware reads `kv_sources`, one (worker url, event port, replay
    port) per worker, publishers bound on loopback with vLLM's default topic)."""
    if policy in ("sglang", "smg"):
        return [binary, "launch", "--host", "127.0.0.1", "--port", port, "--worker-urls", *worker_urls,
                "--policy", "cache_aware", "--prometheus-host", "127.0.0.1", "--prometheus-port", prom_port,
                "--log-level", "warn"]
    cmd = [binary, "--host", "127.0.0.1", "--port", port, "--worker-urls", *worker_urls,
           "--policy", "cache_aware" if policy == "vllm-ca" else "kv_aware",
           "--prometheus-host", "127.0.0.1", "--prometheus-port", prom_port, "--log-level", "warning"]
    if policy == "vllm-kv":
        for url, kv, replay in kv_sources:
            cmd += ["--kv-event-source", f"{url}=tcp://[::ffff:127.0.0.1]:{kv}",
                    "--kv-event-replay-source", f"{url}=tcp://[::ffff:127.0.0.1]:{replay}"]
        cmd += ["--kv-event-block-size", block_size, "--kv-event-model", model]
    return cmd


def stop_on_signals(procs) -> None:
    """On SIGINT or SIGTERM: stop every process `procs` started, say so, exit 130."""
    def on_signal(signum, frame):
        procs.stop_all()
        print("\ninterrupted: every process stopped", file=sys.stderr)
        sys.exit(130)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
