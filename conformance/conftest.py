"""Fixtures of the conformance suite: real `vllm serve` replicas (vLLM 0.33.0, with only the model
forward pass replaced by llmgw_conformance_executor.NoModelExecutor), the real llmgw-agent and the
real Envoy with llmgw.wasm, all on loopback. The fleet is started once per session; every process
started here is stopped at the end, also when a test fails."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
VLLM_VENV = Path(os.environ.get("LLMGW_VLLM_VENV", ROOT / ".venv-vllm"))
MODEL_DIR = Path(os.environ.get("LLMGW_MODEL_DIR", ROOT / ".cache" / "llmgw-model"))
ENVOY = os.environ.get("LLMGW_ENVOY", str(ROOT / ".venv" / "bin" / "envoy"))
AGENT = ROOT / "target" / "release" / "llmgw-agent"
WASM = ROOT / "dist" / "llmgw.wasm"
MODEL = "tiny"
BLOCK = 16
STARTUP_TIMEOUT = float(os.environ.get("LLMGW_VLLM_STARTUP_TIMEOUT", "240"))
LOG_DIR = Path(os.environ.get("LLMGW_CONFORMANCE_LOGS", ROOT / ".cache" / "conformance-logs"))


# ------------------------------------------------------------------------------------------------
# small helpers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(pred, timeout: float, what: str, interval: float = 0.1):
    """Polls pred until it returns something truthy; returns that value."""
    deadline = time.monotonic() + timeout
    last_exc = None
    while time.monotonic() < deadline:
        try:
            v = pred()
            if v:
                return v
        except (OSError, KeyError, ValueError) as e:
            last_exc = e
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}" + (f" (last error: {last_exc})" if last_exc else ""))


def http_json(url: str, body: dict | None = None, timeout: float = 30.0, headers: dict | None = None):
    """GET (body None) or POST JSON; returns (status, response headers, parsed JSON or text)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw, status, hdrs = r.read(), r.status, r.headers
    except urllib.error.HTTPError as e:
        raw, status, hdrs = e.read(), e.code, e.headers
    try:
        return status, hdrs, json.loads(raw)
    except ValueError:
        return status, hdrs, raw.decode(errors="replace")


def words(rng: random.Random, n: int, tag: str) -> str:
    return " ".join(f"{tag}{rng.randrange(100000)}" for _ in range(n))


def agent_hash(tokens: list[int], algo: str = "sha256_cbor", seed: str | None = "0") -> list[int]:
    """The block keys llmgw computes for these tokens (`llmgw-agent hash`)."""
    args = [str(AGENT), "hash", "--algo", algo, "--block-size", str(BLOCK)]
    if seed is not None:
        args += ["--seed", seed]
    out = subprocess.run(args, input=json.dumps(tokens), capture_output=True, text=True, check=True, timeout=30)
    return [b["u64"] for b in json.loads(out.stdout)["blocks"]]


class Procs:
    """Starts processes in their own process group; stops them (TERM, then KILL) on request."""

    def __init__(self, logdir: Path):
        self.logdir = logdir
        self.procs: list[subprocess.Popen] = []

    def start(self, args, name: str, env: dict | None = None) -> subprocess.Popen:
        path = self.logdir / f"{name}.log"
        log = open(path, "ab")
        p = subprocess.Popen([str(a) for a in args], stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                             env=env, cwd=str(self.logdir))
        log.close()
        p.log_path = path  # type: ignore[attr-defined]
        self.procs.append(p)
        return p

    def stop(self, p: subprocess.Popen, timeout: float = 30.0) -> None:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        # Whatever is left of the group (vLLM's engine-core child) goes too.
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if p.poll() is None:
            p.wait()
        if p in self.procs:
            self.procs.remove(p)

    def stop_all(self) -> None:
        for p in list(reversed(self.procs)):
            self.stop(p)


def tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


# ------------------------------------------------------------------------------------------------
# vLLM replicas


class Replica:
    """One `vllm serve` process. mode "bind": the agent binds `kv`, vLLM connects to it; mode
    "connect": vLLM binds tcp://[::ffff:127.0.0.1]:kv (loopback only), the agent connects."""

    def __init__(self, name: str, mode: str = "bind", seed: str | None = "0", algo: str | None = "sha256_cbor",
                 blocks: int = 64, model: str = MODEL):
        self.name, self.mode, self.seed, self.algo, self.blocks, self.model = name, mode, seed, algo, blocks, model
        self.port, self.kv, self.replay = free_port(), free_port(), free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kv_events_config(self) -> dict:
        host = "127.0.0.1" if self.mode == "bind" else "[::ffff:127.0.0.1]"
        return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://{host}:{self.kv}",
                "replay_endpoint": f"tcp://[::ffff:127.0.0.1]:{self.replay}", "topic": "kv-events"}

    def serve_args(self, with_events: bool = True) -> list[str]:
        args = [str(VLLM_VENV / "bin" / "vllm"), "serve", str(MODEL_DIR), "--served-model-name", self.model,
                "--host", "127.0.0.1", "--port", str(self.port), "--block-size", str(BLOCK),
                "--num-gpu-blocks-override", str(self.blocks), "--max-model-len", "512", "--max-num-seqs", "8",
                "--enable-prompt-tokens-details", "--uvicorn-log-level", "warning",
                "--distributed-executor-backend", "llmgw_conformance_executor.NoModelExecutor"]
        if self.algo:
            args += ["--prefix-caching-hash-algo", self.algo]
        if with_events:
            args += ["--kv-events-config", json.dumps(self.kv_events_config())]
        return args

    def agent_toml(self) -> str:
        ep = f"tcp://127.0.0.1:{self.kv}"
        text = (f'[[replicas]]\nname = "{self.name}"\naddress = "{self.address}"\nmodels = ["{self.model}"]\n'
                f'endpoint = "{ep}"\nmode = "{self.mode}"\nreplay_endpoint = "tcp://127.0.0.1:{self.replay}"\n'
                f'topic = "kv-events"\n')
        # Only D is declared to the agent with its own hash settings; E (another seed) is declared
        # like the fleet, as an operator would who does not know it was started differently.
        if self.model != MODEL:
            text += f'[replicas.hash]\nalgo = "{self.algo or "sha256"}"\nblock_size = {BLOCK}\n'
            if self.seed is not None:
                text += f'seed = "{self.seed}"\n'
        return text


def vllm_env(seed: str | None) -> dict:
    env = dict(os.environ)
    env.pop("PYTHONHASHSEED", None)
    if seed is not None:
        env["PYTHONHASHSEED"] = seed
    env["VLLM_TARGET_DEVICE"] = "cpu"
    env["PYTHONPATH"] = str(HERE) + os.pathsep + env.get("PYTHONPATH", "")
    env["VLLM_NO_USAGE_STATS"] = "1"
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    return env


def wait_healthy(r: Replica, proc: subprocess.Popen, timeout: float = STARTUP_TIMEOUT) -> None:
    def up():
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve {r.name} exited with {proc.returncode}:\n{tail(proc.log_path)}")
        try:
            with urllib.request.urlopen(f"{r.url}/health", timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False
    try:
        wait_until(up, timeout, f"vllm serve {r.name} /health", interval=0.25)
    except TimeoutError as e:
        raise TimeoutError(f"{e}\n{tail(proc.log_path)}") from None


# ------------------------------------------------------------------------------------------------
# agent and Envoy


def agent_toml(replicas: list[Replica], feed: int, http: int) -> str:
    parts = [f'[feed]\nlisten = "127.0.0.1:{feed}"\n', f'[http]\nlisten = "127.0.0.1:{http}"\n',
             f'[hash]\nalgo = "sha256_cbor"\nseed = "0"\nblock_size = {BLOCK}\n',
             '[parity]\nmin_verified = 1\n',
             # Long down timers: a restarted replica must lose its blocks because the agent sees the
             # restart (new publisher, sequence back to 0), not because it was unreachable for a while.
             '[load]\ndown_after_ms = 300000\n', '[zmq]\ndown_after_disconnect_ms = 300000\n']
    parts += [r.agent_toml() for r in replicas]
    return "\n".join(parts)


def envoy_yaml(listen: int, admin: int, feed: int) -> str:
    """envoy/llmgw-local.yaml with this run's ports and a filter config with the explain header."""
    text = (ROOT / "envoy" / "llmgw-local.yaml").read_text()
    for old, new in (("port_value: 9901", admin), ("port_value: 10000", listen), ("port_value: 9090", feed)):
        assert old in text, old
        text = text.replace(old, f"port_value: {new}")
    text = text.replace("filename: dist/llmgw.wasm", f"filename: {WASM}")
    cfg = {"agent_cluster": "llmgw_agent", "tokenizer_cluster": "llmgw_tokenizer",
           "destination_header": "x-gateway-destination-endpoint", "explain_header": True,
           "profiles": [{"name": "conformance", "models": ["*"], "kv_events": True, "block_size": BLOCK,
                         "hash_algo": "sha256_cbor", "seed": "0", "tokenizer": "tokenize",
                         "tokenizer_timeout_ms": 5000}]}
    text, n = re.subn(r"value: \|\n(?:\s{20}.*\n)+", f"value: {json.dumps(json.dumps(cfg))}\n", text)
    assert n == 1, "filter configuration block not found in envoy/llmgw-local.yaml"
    return text


class Agent:
    def __init__(self, http: int):
        self.base = f"http://127.0.0.1:{http}"

    def replicas(self) -> list[dict]:
        return http_json(f"{self.base}/debug/replicas", timeout=5)[2]["replicas"]

    def replica(self, name: str) -> dict:
        for r in self.replicas():
            if r["replica"] == name:
                return r
        raise KeyError(name)

    def keys(self, name: str) -> set[int]:
        return set(self.replica(name)["block_keys"])

    def metrics(self) -> str:
        with urllib.request.urlopen(f"{self.base}/metrics", timeout=5) as r:
            return r.read().decode()

    def wait_up(self, name: str, timeout: float = 60.0) -> dict:
        return wait_until(lambda: (r := self.replica(name))["up"] and r["connected"] and r, timeout,
                          f"the agent to see {name} up and its publisher connected")


class Envoy:
    def __init__(self, listen: int, admin: int):
        self.listen, self.admin = listen, admin

    def stats(self, flt: str = "llmgw") -> dict[str, int]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin}/stats?filter={flt}", timeout=5) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            k, _, v = line.partition(": ")
            if v.strip().lstrip("-").isdigit():
                out[k.strip()] = int(v)
        return out

    def prom(self, name: str) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin}/stats/prometheus", timeout=5) as r:
            return "\n".join(l for l in r.read().decode().splitlines() if name in l and not l.startswith("#"))

    def exact_decisions(self) -> int:
        total = 0
        for line in self.prom("llmgw_prefix_decisions_total").splitlines():
            if 'outcome="exact"' in line:
                total += int(float(line.rsplit(" ", 1)[1]))
        return total

    def index_blocks(self) -> list[int]:
        return [v for k, v in self.stats("llmgw_index_blocks").items()]

    def wait_feed(self, timeout: float = 60.0) -> None:
        def ok():
            vals = [v for k, v in self.stats("llmgw_feed_connected").items()]
            return bool(vals) and all(v == 1 for v in vals)
        wait_until(ok, timeout, "every filter VM subscribed to the agent's feed")

    def post(self, path: str, body: dict):
        return http_json(f"http://127.0.0.1:{self.listen}{path}", body, timeout=60)


def decision(headers) -> tuple[str, str, int, int]:
    h = headers.get("x-llmgw-decision") or ""
    m = re.match(r"outcome=(\w+); replica=([\d.:]+); matched=(\d+)/(\d+)", h)
    assert m, f"no decision header in the response: {h!r}"
    return m.group(1), m.group(2), int(m.group(3)), int(m.group(4))


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
        self.envoy_proc = self.procs.start([ENVOY, "-c", self.logdir / f"{name}.yaml", "--concurrency", "2",
                                            "--log-level", "warn", "--disable-hot-restart"], name)
        self.envoy = Envoy(listen, admin)
        wait_until(lambda: http_json(f"http://127.0.0.1:{admin}/ready", timeout=2)[2].strip() == "LIVE", 60,
                   "Envoy /ready")
        self.envoy.wait_feed()
        return self.envoy

    def start_replica(self, r: Replica, with_events: bool = True) -> subprocess.Popen:
        r.proc = self.procs.start(r.serve_args(with_events), f"vllm-{r.name}", env=vllm_env(r.seed))
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
        if outcome == "exact":
            assert matched * BLOCK == cached, (f"filter credited {r.name} with {matched} blocks, "
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
    ps = Procs(logdir)
    yield ps
    ps.stop_all()


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
