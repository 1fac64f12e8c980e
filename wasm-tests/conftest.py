"""Shared fixtures for the end-to-end tests: paths to the built artifacts, free loopback
ports, and process management that always stops what a test started."""

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _bin(name: str) -> Path:
    for profile in ("release", "debug"):
        p = ROOT / "target" / profile / name
        if p.exists():
            return p
    raise FileNotFoundError(f"{name} not built (run ./build.sh build)")


@pytest.fixture(scope="session")
def agent_bin() -> Path:
    return _bin("llmgw-agent")


@pytest.fixture(scope="session")
def wasm_path() -> Path:
    p = ROOT / "dist" / "llmgw.wasm"
    if not p.exists():
        raise FileNotFoundError("dist/llmgw.wasm missing (run ./build.sh build)")
    return p


@pytest.fixture(scope="session")
def envoy_bin() -> str:
    p = shutil.which("envoy") or str(ROOT / ".venv" / "bin" / "envoy")
    if not Path(p).exists():
        raise FileNotFoundError("envoy not installed (run ./build.sh setup)")
    return p


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 20.0) -> None:
    """Waits until something accepts TCP connections on 127.0.0.1:port."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listening on 127.0.0.1:{port} after {timeout}s")


class Procs:
    """Starts processes in their own process group and stops all of them at teardown."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.procs: list[subprocess.Popen] = []

    def start(self, args, name: str, **kw) -> subprocess.Popen:
        log = open(self.tmp / f"{name}.log", "wb")
        p = subprocess.Popen([str(a) for a in args], stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True, **kw)
        p.log_path = self.tmp / f"{name}.log"  # type: ignore[attr-defined]
        self.procs.append(p)
        return p

    def stop(self, p: subprocess.Popen, sig=signal.SIGTERM) -> None:
        if p.poll() is None:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                return
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    def stop_all(self) -> None:
        for p in reversed(self.procs):
            self.stop(p)


@pytest.fixture
def procs(tmp_path):
    ps = Procs(tmp_path)
    yield ps
    ps.stop_all()
