"""llmgw-agent: its configuration written from Python values, its HTTP API (/healthz,
/debug/replicas, /metrics), and a runner that starts it on fresh loopback ports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from .http import request
from .procs import free_port, wait_until

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _key(k: str) -> str:
    return k if _BARE_KEY.fullmatch(k) else json.dumps(k)


def _value(v, where: str) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float, str)):
        return json.dumps(v)  # a JSON string or number is a TOML one
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x, where) for x in v) + "]"
    raise TypeError(f"{where}: {v!r} ({type(v).__name__}) cannot be written as TOML")


def _tables(v) -> bool:
    return isinstance(v, (list, tuple)) and bool(v) and all(isinstance(x, dict) for x in v)


def _emit(out: list[str], path: list[str], table: dict, array: bool = False) -> None:
    if path:
        header = ".".join(_key(k) for k in path)
        out.append(f"\n[[{header}]]" if array else f"\n[{header}]")
    for k, v in table.items():
        if v is not None and not isinstance(v, dict) and not _tables(v):
            out.append(f"{_key(k)} = {_value(v, '.'.join([*path, k]))}")
    for k, v in table.items():
        if isinstance(v, dict):
            _emit(out, [*path, k], v)
        elif _tables(v):
            for item in v:
                _emit(out, [*path, k], item, array=True)


def toml(doc: dict) -> str:
    """TOML for a document of tables (dicts), arrays of tables (lists of dicts) and values
    (str, int, float, bool, lists of them); keys whose value is None are left out."""
    out: list[str] = []
    _emit(out, [], doc)
    return "\n".join(out).lstrip("\n") + "\n"


def merged(base: dict, over: dict) -> dict:
    """Configuration sections: `over`'s keys replace `base`'s within each section."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for k, v in over.items():
        out[k] = {**out[k], **v} if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def agent_config(feed_port: int, http_port: int, replicas=(), /, **sections) -> str:
    """The agent's TOML: feed and HTTP API on 127.0.0.1 at these ports, the given replicas
    (dicts, a nested dict such as "hash" becoming [replicas.hash]) and any other sections, e.g.
    `hash={"algo": "sha256_cbor", "seed": "0"}`, `discovery=[{...}]`, `feed={"token": "t"}`."""
    doc = {"feed": {"listen": f"127.0.0.1:{feed_port}", **sections.pop("feed", {})},
           "http": {"listen": f"127.0.0.1:{http_port}", **sections.pop("http", {})}, **sections}
    if replicas:
        doc["replicas"] = list(replicas)
    return toml(doc)


def sim_replica(sim: dict, model: str) -> dict:
    """The agent's entry for a simulated replica `sim` ({"name", "port", "kv", "replay"}) that
    connects its publisher to the agent (the agent binds), topic kv-events."""
    return {"name": sim["name"], "address": f"127.0.0.1:{sim['port']}", "models": [model],
            "endpoint": f"tcp://127.0.0.1:{sim['kv']}", "mode": "bind",
            "replay_endpoint": f"tcp://127.0.0.1:{sim['replay']}", "topic": "kv-events"}


class AgentAPI:
    """The agent's HTTP API at 127.0.0.1:http."""

    log_path: Path | None = None

    def __init__(self, http: int):
        self.http = http
        self.base = f"http://127.0.0.1:{http}"

    def get(self, path: str) -> bytes:
        status, _, body = request("GET", f"{self.base}{path}", timeout=5)
        if status != 200:
            raise OSError(f"GET {path}: HTTP {status}: {body[:200]!r}")
        return body

    def healthz(self) -> tuple[int, bytes]:
        return request("GET", f"{self.base}/healthz", timeout=2)[::2]

    def replicas(self) -> list[dict]:
        return json.loads(self.get("/debug/replicas"))["replicas"]

    def replica(self, name: str, rank: int = 0) -> dict:
        for r in self.replicas():
            if r["replica"] == name and r.get("dp_rank", 0) == rank:
                return r
        raise KeyError(f"replica {name} (dp rank {rank}) not in the agent's /debug/replicas")

    def keys(self, name: str, rank: int = 0) -> set[int]:
        return set(self.replica(name, rank)["block_keys"])

    def metrics(self) -> str:
        return self.get("/metrics").decode()

    def log(self) -> str:
        return Path(self.log_path).read_text(errors="replace") if self.log_path else ""

    def wait_for(self, name: str, cond, what: str, timeout: float = 20.0, rank: int = 0) -> dict:
        """Polls /debug/replicas until cond(replica) holds; returns that replica's entry."""
        last: list = [None]

        def check():
            last[0] = self.replica(name, rank)
            return cond(last[0]) and last[0]
        try:
            return wait_until(check, timeout, what)
        except TimeoutError as e:
            raise AssertionError(f"{e}; last state: {json.dumps(last[0])[:3000]}\n{self.log()[-4000:]}") from None


class Agent(AgentAPI):
    """An llmgw-agent process (`run`, or `launch` with the `launch` arguments) with a config
    written from `replicas` and `sections` (see agent_config), on fresh loopback ports. When a
    port picked as free was taken meanwhile, wait_ready starts it again on new ones."""

    def __init__(self, procs, agent_bin, workdir: Path, replicas=(), *, name: str = "agent",
                 launch: list | None = None, env: dict | None = None, args=(), **sections):
        self.procs, self.agent_bin, self.name = procs, agent_bin, name
        self.replicas_cfg, self.sections = list(replicas), sections
        self.launch, self.env, self.args = launch, env, list(args)
        self.config = Path(workdir) / f"{name}.toml"
        self.attempts = 0
        self._start()

    def _start(self) -> None:
        self.attempts += 1
        super().__init__(free_port())
        self.feed = free_port()
        self.config.write_text(agent_config(self.feed, self.http, self.replicas_cfg, **self.sections))
        cmd = ([self.agent_bin, "launch", "--config", self.config, *self.launch] if self.launch
               else [self.agent_bin, "run", "--config", self.config, *self.args])
        self.proc = self.procs.start(cmd, f"{self.name}-{self.attempts}", env=self.env)
        self.log_path = self.proc.log_path

    def wait_ready(self, timeout: float = 30.0) -> "Agent":
        """Waits until /healthz answers 200 "ok"; raises with the agent's log if it exits."""
        def ready():
            if self.proc.poll() is not None:
                if "Address already in use" in self.log() and self.attempts < 4:
                    self._start()
                    return False
                raise RuntimeError(f"agent exited with {self.proc.returncode}:\n{self.log()}")
            status, body = self.healthz()
            return status == 200 and body.strip() == b"ok" and self.proc.poll() is None
        try:
            wait_until(ready, timeout, f"{self.name} /healthz")
        except TimeoutError as e:
            raise TimeoutError(f"{e}:\n{self.log()}") from None
        return self
