"""Processes and waiting: a process group that stops everything it started, free loopback ports,
polling with a deadline, the CPU time processes used."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import time
from pathlib import Path


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_EPHEMERAL_LOW = _ephemeral_low()
_given: set[int] = set()
_rng = random.Random(os.getpid() ^ time.time_ns())


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the caller binds it soon after), never the same
    twice in one process. It is taken below the kernel's ephemeral range: a port from that range
    can be taken by any outgoing connection (Envoy's, the agent's) between this call and its
    owner's bind, which once failed a test with "Address already in use"."""
    low, high = 10000, _EPHEMERAL_LOW - 1
    for _ in range(200 if high - low >= 1000 else 0):
        port = _rng.randint(low, high)
        if port in _given:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _given.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _given.add(port)
    return port


def wait_until(pred, timeout: float = 20.0, what: str = "condition", interval: float = 0.05,
               errors: tuple = (OSError, KeyError, ValueError)):
    """Polls pred() until it returns something truthy and returns that value. Exceptions in
    `errors` count as "not yet"; on timeout, TimeoutError names `what` and the last such error."""
    deadline = time.monotonic() + timeout
    last_exc = None
    while True:
        try:
            v = pred()
            if v:
                return v
        except errors as e:
            last_exc = e
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}"
                               + (f" (last error: {last_exc})" if last_exc else ""))
        time.sleep(interval)


def wait_port(port: int, timeout: float = 20.0) -> None:
    """Waits until something accepts TCP connections on 127.0.0.1:port."""
    def accepts():
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    wait_until(accepts, timeout, f"something listening on 127.0.0.1:{port}")


def tail(path: Path, n: int = 40) -> str:
    """The last n lines of a log file ("" if unreadable)."""
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


class Procs:
    """Starts processes, each in its own process group with its output in `logdir/NAME.log`, and
    stops them (SIGTERM to the group, SIGKILL after `timeout`, then whatever is left of the group)
    one by one or all at once, newest first. Also a context manager."""

    def __init__(self, logdir: Path, cwd: Path | None = None):
        self.logdir = Path(logdir)
        self.cwd = cwd
        self.procs: list[subprocess.Popen] = []

    def start(self, args, name: str, env: dict | None = None, cpu: int | None = None) -> subprocess.Popen:
        """Starts `args` (any items, made strings); `cpu` pins it with taskset. The process gets
        `name` and `log_path` attributes."""
        argv = [str(a) for a in args]
        if cpu is not None:
            argv = ["taskset", "-c", str(cpu), *argv]
        path = self.logdir / f"{name}.log"
        with open(path, "ab") as log:
            p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env,
                                 cwd=None if self.cwd is None else str(self.cwd))
        p.name = name  # type: ignore[attr-defined]
        p.log_path = path  # type: ignore[attr-defined]
        self.procs.append(p)
        return p

    def stop(self, p: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
        if p.poll() is None:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        # Whatever is left of the group (a child the process started) goes too.
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

    def __enter__(self) -> "Procs":
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()


def _stat_fields(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name (which may hold spaces)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU time (seconds) one process has used so far (NaN when unreadable)."""
    try:
        f = _stat_fields(pid)
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time (seconds) the processes `pids` and all their descendants have used
    so far (what has exited or cannot be read counts 0)."""
    parent: dict[int, int] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            parent[int(entry.name)] = int(_stat_fields(int(entry.name))[1])
        except (OSError, IndexError, ValueError):
            continue
    wanted = set(pids)
    grew = True
    while grew:
        more = {p for p, pp in parent.items() if pp in wanted and p not in wanted}
        wanted |= more
        grew = bool(more)
    used = (process_cpu_seconds(p) for p in wanted)
    return sum(u for u in used if u == u)
