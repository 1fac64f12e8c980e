"""Fixtures of the conformance suite: real `vllm serve` replicas (vLLM 0.33.0, with only the model
forward pass replaced by llmgw_conformance_executor.NoModelExecutor), the real llmgw-agent and the
real Envoy with llmgw.wasm, all on loopback. The fleet is started once per session; every process
started here is stopped at the end, also when a test fails."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import llmgw_testkit as kit
from llmgw_testkit import Procs, free_port, http_json, parse_decision
from llmgw_testkit.vllm_serve import VllmReplica

ROOT = kit.ROOT
HERE = Path(__file__).resolve().parent
VLLM_VENV = Path(os.environ.get("LLMGW_VLLM_VENV", ROOT / ".venv-vllm"))
MODEL_DIR = Path(os.environ.get("LLMGW_MODEL_DIR", ROOT / ".cache" / "llmgw-model"))
# Where cargo puts the release agent (CARGO_TARGET_DIR or `cargo metadata`); checked by the fleet fixture.
AGENT = kit.binary_path("llmgw-agent", "release")
ENVOY = os.environ.get("LLMGW_ENVOY", str(ROOT / ".venv" / "bin" / "envoy"))
WASM = ROOT / "dist" / "llmgw.wasm"
MODEL = "tiny"
BLOCK = 16
STARTUP_TIMEOUT = float(os.environ.get("LLMGW_VLLM_STARTUP_TIMEOUT", "240"))
LOG_DIR = Path(os.environ.get("LLMGW_CONFORMANCE_LOGS", ROOT / ".cache" / "conformance-logs"))


# ------------------------------------------------------------------------------------------------
# small helpers


def wait_until(pred, timeout: float, what: str, interval: float = 0.1):
    """Polls pred until it returns something truthy; returns that value (llmgw_testkit.wait_until)."""
    return kit.wait_until(pred, timeout, what, interval=interval)


def words(rng: random.Random, n: int, tag: str) -> str:
    return " ".join(f"{tag}{rng.randrange(100000)}" for _ in range(n))


def agent_hash(tokens: list[int], algo: str = "sha256_cbor", seed: str | None = "0") -> list[int]:
    """The block keys llmgw computes for these tokens (`llmgw-agent hash`)."""
    args = [str(AGENT), "hash", "--algo", algo, "--block-size", str(BLOCK)]
    if seed is not None:
        args += ["--seed", seed]
    out = subprocess.run(args, input=json.dumps(tokens), capture_output=True, text=True, check=True, timeout=30)
    return [b["u64"] for b in json.loads(out.stdout)["blocks"]]


# ------------------------------------------------------------------------------------------------
# vLLM replicas


def sse_events(raw: bytes) -> list[dict | str]:
    """A stream's events: each data line's JSON (its id and creation time left out), or its text."""
    out = []
    for event in raw.decode().split("\n\n"):
        if not event.strip():
            continue
        data = event.removeprefix("data: ")
        try:
            v = json.loads(data)
        except ValueError:
            out.append(data)
            continue
        v.pop("id", None)
        v.pop("created", None)
        out.append(v)
    return out


def stream(url: str, body: dict) -> tuple[dict, bytes]:
    """(headers, body) of a streamed answer."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return dict(resp.headers.items()), resp.read()


class Replica(VllmReplica):
    """One `vllm serve` process (llmgw_testkit.vllm_serve: its flags from `llmgw-agent
    vllm-args`). mode "bind": the agent binds `kv`, vLLM connects to it; mode "connect": vLLM
    binds tcp://[::ffff:127.0.0.1]:kv (loopback only), the agent connects."""

    def serve_args(self, with_events: bool = True) -> list[str]:
        return self.serve_command(VLLM_VENV / "bin" / "vllm", MODEL_DIR, AGENT, with_events)

    def agent_entry(self) -> dict:
        """This replica in the agent's configuration."""
        entry = super().agent_entry()
        # Only D is declared to the agent with its own hash settings; E (another seed) is declared
        # like the fleet, as an operator would who does not know it was started differently.
        if self.model != MODEL:
            entry["hash"] = {"algo": self.algo or "sha256", "block_size": BLOCK, "seed": self.seed}
        return entry


def wait_healthy(r: Replica, proc: subprocess.Popen, timeout: float = STARTUP_TIMEOUT) -> None:
    r.wait_healthy(proc, timeout)


# ------------------------------------------------------------------------------------------------
# agent and Envoy


def agent_toml(replicas: list[Replica], feed: int, http: int, entries: list[dict] = ()) -> str:
    """The agent's configuration for these replicas (and any other `entries`)."""
    return kit.agent_config(
        feed, http, [r.agent_entry() for r in replicas] + list(entries),
        hash={"algo": "sha256_cbor", "seed": "0", "block_size": BLOCK}, parity={"min_verified": 1},
        # Long down timers: a restarted replica must lose its blocks because the agent sees the
        # restart (new publisher, sequence back to 0), not because it was unreachable for a while.
        load={"down_after_ms": 300000}, zmq={"down_after_disconnect_ms": 300000})


def envoy_yaml(listen: int, admin: int, feed: int) -> str:
    """envoy/llmgw-local.yaml with this run's ports and a filter config with the explain header."""
    cfg = kit.filter_config({"name": "conformance", "block_size": BLOCK, "tokenizer_timeout_ms": 5000},
                            destination_header="x-gateway-destination-endpoint", explain_header=True)
    return kit.shipped_config(WASM, listen, admin, feed, cfg)


class Agent(kit.AgentAPI):
    def wait_up(self, name: str, timeout: float = 60.0) -> dict:
        return wait_until(lambda: (r := self.replica(name))["up"] and r["connected"] and r, timeout,
                          f"the agent to see {name} up and its publisher connected")


class Envoy(kit.EnvoyAdmin):
    def __init__(self, listen: int, admin: int):
        super().__init__(admin)
        self.listen, self.admin = listen, admin

    def exact_decisions(self) -> int:
        return int(self.metric("llmgw_prefix_decisions_total", 'outcome="exact"'))

    def post(self, path: str, body: dict):
        return http_json(f"http://127.0.0.1:{self.listen}{path}", body, timeout=60)


def decision(headers) -> tuple[str, str, int, int]:
    return tuple(parse_decision(headers.get(kit.DECISION_HEADER)))


# ------------------------------------------------------------------------------------------------
# the fleet


class Fleet:
    def __init__(self, procs: Procs, logdir: Path):
        self.procs, self.logdir = procs, logdir
        self.feed, self.http = free_port(), free_port()
        self.agent = Agent(self.http)
        self.replicas: dict[str, Replica] = {}
        self.agent_proc = None
        self.envoy: Envoy | None = None
        self.envoy_proc = None

    def start_envoy(self, name: str = "envoy") -> Envoy:
        listen, admin = free_port(), free_port()
        (self.logdir / f"{name}.yaml").write_text(envoy_yaml(listen, admin, self.feed))
        self.envoy_proc = kit.start_envoy(self.procs, ENVOY, self.logdir / f"{name}.yaml", name)
        self.envoy = Envoy(listen, admin)
        self.envoy.wait_ready(60, proc=self.envoy_proc)
        self.envoy.wait_feed(60)
        return self.envoy

    def start_replica(self, r: Replica, with_events: bool = True) -> subprocess.Popen:
        r.proc = self.procs.start(r.serve_args(with_events), f"vllm-{r.name}", env=r.serve_env(AGENT))
        return r.proc

    def restart_replica(self, r: Replica) -> None:
        if r.proc is not None:
            self.procs.stop(r.proc)
        self.start_replica(r)
        wait_healthy(r, r.proc)

    def completion(self, r: Replica | None, prompt: str, max_tokens: int = 4, extra: dict | None = None):
        """A completion served directly by replica r (None: through Envoy)."""
        body = {"model": MODEL if r is None else r.model, "prompt": prompt, "max_tokens": max_tokens, **(extra or {})}
        url = (f"http://127.0.0.1:{self.envoy.listen}" if r is None else r.url) + "/v1/completions"
        status, headers, reply = http_json(url, body, timeout=60)
        assert status == 200, (status, reply)
        return headers, reply

    def chat(self, r: Replica | None, messages: list[dict], max_tokens: int = 4):
        body = {"model": MODEL if r is None else r.model, "messages": messages, "max_tokens": max_tokens}
        url = (f"http://127.0.0.1:{self.envoy.listen}" if r is None else r.url) + "/v1/chat/completions"
        status, headers, reply = http_json(url, body, timeout=60)
        assert status == 200, (status, reply)
        return headers, reply

    def tokenize(self, r: Replica, body: dict) -> list[int]:
        status, _, reply = http_json(f"{r.url}/tokenize", {"model": r.model, **body})
        assert status == 200, reply
        return reply["tokens"]

    def wait_mirrored(self, r: Replica, keys, timeout: float = 30.0) -> set[int]:
        """Waits until the agent's mirror of r holds every key, then until the filters caught up."""
        want = set(keys)
        held = wait_until(lambda: (k := self.agent.keys(r.name)) >= want and k, timeout,
                          f"the agent to mirror {len(want)} blocks of {r.name}")
        self.wait_index_converged()
        return held

    def routed(self, headers, reply) -> tuple[str, Replica, int, int]:
        """The filter's decision for a request sent through Envoy, checked against what the
        replica that served it reports: the blocks credited are the blocks it had cached."""
        outcome, addr, matched, total = decision(headers)
        r = self.by_address(addr)
        cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
        # Blocks credited only by speculative entries (this Envoy just sent them there, no KV
        # event confirmed them yet) are a claim about the near future, not about the index: the
        # index's own credit must be exact, and the speculative part no more than was cached.
        spec = kit.speculative_blocks(headers.get(kit.DECISION_HEADER))
        # Routed before its tokenizer answered, on a leading part of its prompt (the turn before,
        # or text it shares with earlier prompts): credited with those blocks, never more than
        # the replica had cached (it may hold more of the prompt).
        if outcome == "exact" and kit.scored_before_tokenizing(headers.get(kit.DECISION_HEADER)):
            assert (matched - spec) * BLOCK <= cached, (
                f"the index credited {r.name} with {matched - spec} blocks of the prompt's leading part, "
                f"vLLM served with {cached} cached tokens")
        elif outcome == "exact" and spec == 0:
            assert matched * BLOCK == cached, (f"filter credited {r.name} with {matched} blocks, "
                                               f"vLLM served with {cached} cached tokens")
        elif outcome == "exact":
            assert (matched - spec) * BLOCK <= cached, (
                f"the index credited {r.name} with {matched - spec} blocks (and speculation {spec} more), "
                f"vLLM served with {cached} cached tokens")
        return outcome, r, matched, cached

    def by_address(self, addr: str) -> Replica:
        for r in self.replicas.values():
            if r.address == addr:
                return r
        raise KeyError(addr)

    def wait_index_converged(self, timeout: float = 30.0) -> None:
        """Every filter VM's index holds as many blocks as the agent's mirrors of the routed model."""
        def ok():
            want = sum(r["blocks"] for r in self.agent.replicas() if r["up"])
            vals = self.envoy.index_blocks()
            return bool(vals) and all(v == want for v in vals)
        wait_until(ok, timeout, "the filters' indexes to match the agent's mirrors")


@pytest.fixture(scope="session")
def logdir() -> Path:
    d = LOG_DIR / time.strftime("%Y%m%d-%H%M%S")
    d.mkdir(parents=True, exist_ok=True)
    for old in sorted(p for p in LOG_DIR.iterdir() if p.is_dir())[:-10]:  # keep the last 10 runs
        shutil.rmtree(old, ignore_errors=True)
    return d


@pytest.fixture(scope="session")
def procs(logdir):
    with Procs(logdir, cwd=logdir) as ps:
        yield ps


@pytest.fixture(scope="session")
def fleet(procs, logdir):
    for p in (AGENT, WASM, Path(ENVOY), VLLM_VENV / "bin" / "vllm", MODEL_DIR / "config.json"):
        if not p.exists():
            pytest.fail(f"missing {p}: run ./build.sh conformance")
    f = Fleet(procs, logdir)
    # A: the agent binds, vLLM connects. B: vLLM binds (loopback), the agent connects; small pool
    # for the eviction test. D: vLLM's defaults (sha256, no PYTHONHASHSEED), its own model name.
    # E: another PYTHONHASHSEED, same model as A and B.
    reps = [Replica("a", "bind", blocks=256), Replica("b", "connect", blocks=48),
            Replica("d", "bind", seed=None, algo=None, model="tiny-default-hash", blocks=256),
            Replica("e", "connect", seed="1")]
    f.replicas = {r.name: r for r in reps}
    (logdir / "agent.toml").write_text(agent_toml(reps, f.feed, f.http))
    f.agent_proc = procs.start([AGENT, "run", "--config", logdir / "agent.toml", "--log-level", "info"], "agent")
    wait_until(lambda: http_json(f"{f.agent.base}/healthz", timeout=2)[0] in (200, 503), 30, "the agent's HTTP")
    for r in reps:
        f.start_replica(r)
    with ThreadPoolExecutor(len(reps)) as ex:
        list(ex.map(lambda r: wait_healthy(r, r.proc), reps))
    for r in reps:
        f.agent.wait_up(r.name)
    f.start_envoy()
    yield f
