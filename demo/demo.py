#!/usr/bin/env python3
"""llmgw demo: 4 simulated vLLM replicas, the agent and Envoy with llmgw.wasm, driven by a
chat workload (shared system prompts, multi-turn conversations). Three runs on identical
traffic: Envoy's round-robin, llmgw with only its approximate fallback, llmgw with KV events.
Prints a table and writes a PNG chart. Everything listens on 127.0.0.1 and is stopped at exit,
also on Ctrl-C."""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = "demo-model"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if pred():
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"timed out waiting for {what}")


def http_get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def http_post(url: str, body: dict | None = None) -> None:
    req = urllib.request.Request(url, data=json.dumps(body or {}).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        r.read()


class Procs:
    def __init__(self, logdir: Path):
        self.logdir = logdir
        self.procs: list[subprocess.Popen] = []

    def start(self, args, name: str) -> subprocess.Popen:
        log = open(self.logdir / f"{name}.log", "wb")
        p = subprocess.Popen([str(a) for a in args], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        p.name = name  # type: ignore[attr-defined]
        self.procs.append(p)
        return p

    def stop(self, p: subprocess.Popen) -> None:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(timeout=10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if p in self.procs:
            self.procs.remove(p)

    def stop_all(self) -> None:
        for p in list(reversed(self.procs)):
            self.stop(p)


# ----------------------------------------------------------------------------------------------
# Workload


def make_workload(seed: int, conversations: int, groups: int, system_words: int, turns: int):
    """Conversations, each a list of chat bodies (turn k extends turn k-1). Groups share a
    long system prompt; group popularity is skewed (Zipf-like)."""
    rng = random.Random(seed)
    systems = [" ".join(f"s{g}x{rng.randrange(50000)}" for _ in range(system_words)) for g in range(groups)]
    weights = [1.0 / (g + 1) for g in range(groups)]
    convs = []
    for c in range(conversations):
        g = rng.choices(range(groups), weights)[0]
        msgs = [{"role": "system", "content": systems[g]}]
        bodies = []
        for t in range(turns):
            user = " ".join(f"u{rng.randrange(50000)}" for _ in range(rng.randrange(20, 60)))
            msgs = msgs + [{"role": "user", "content": user}]
            bodies.append({"model": MODEL, "messages": list(msgs), "max_tokens": 8, "stream": True})
            msgs = msgs + [{"role": "assistant", "content": f"reply {c} {t} " + " ".join(f"a{c}x{t}x{i}" for i in range(8))}]
        convs.append(bodies)
    return convs


def stream_request(port: int, body: dict) -> tuple[float, float, int]:
    """Sends one streaming chat request; returns (ttft seconds, total seconds, status)."""
    t0 = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"content-type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            resp.read()
            return (float("nan"), time.monotonic() - t0, resp.status)
        ttft = None
        while True:
            line = resp.readline()
            if not line:
                break
            if line.startswith(b"data: ") and ttft is None:
                ttft = time.monotonic() - t0
        return (ttft if ttft is not None else float("nan"), time.monotonic() - t0, 200)
    except OSError:
        return (float("nan"), time.monotonic() - t0, 0)
    finally:
        conn.close()


def scrape(port: int) -> dict[str, float]:
    out = {}
    for line in http_get(f"http://127.0.0.1:{port}/metrics").splitlines():
        m = re.match(r"^(vllm:[a-z_]+)\{[^}]*\} ([0-9.eE+-]+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def pct(xs: list[float], p: float) -> float:
    xs = sorted(x for x in xs if x == x)
    if not xs:
        return float("nan")
    k = min(len(xs) - 1, max(0, int(round(p / 100 * (len(xs) - 1)))))
    return xs[k]


def run_sessions(label: str, send, sims: list[dict], sessions, concurrency: int, width: int = 28) -> dict:
    """Sends each session's bodies in order through `send(body) -> (ttft_s, total_s, status)`,
    `concurrency` sessions at a time, with a progress line; returns the run's figures, read from
    the replicas' /metrics deltas and the clients' timings. A 200 without a first data line
    counts as an error."""
    before = [scrape(s["port"]) for s in sims]
    results: list[tuple[float, float, int]] = []
    lock = threading.Lock()
    total = sum(len(c) for c in sessions)
    t_start = time.monotonic()

    def worker(session):
        for body in session:
            r = send(body)
            with lock:
                results.append(r)

    stop_progress = threading.Event()

    def progress():
        while not stop_progress.wait(0.5):
            with lock:
                n = len(results)
            el = time.monotonic() - t_start
            sys.stdout.write(f"\r  {label:<{width}} {n:>4}/{total} requests  {el:5.1f}s")
            sys.stdout.flush()

    th = threading.Thread(target=progress, daemon=True)
    th.start()
    with ThreadPoolExecutor(concurrency) as ex:
        list(ex.map(worker, sessions))
    stop_progress.set()
    th.join()
    elapsed = time.monotonic() - t_start
    after = [scrape(s["port"]) for s in sims]
    d = lambda k: [a.get(k, 0) - b.get(k, 0) for a, b in zip(after, before)]  # noqa: E731
    q, h = sum(d("vllm:prefix_cache_queries_total")), sum(d("vllm:prefix_cache_hits_total"))
    served = d("vllm:request_success_total")
    ttfts = [r[0] for r in results if r[2] == 200 and r[0] == r[0]]
    shares = [s / max(1, sum(served)) for s in served]
    return {
        "label": label,
        "hit_rate": h / q if q else 0.0,
        "ttft_p50": pct(ttfts, 50) * 1000,
        "ttft_p99": pct(ttfts, 99) * 1000,
        "ttft_mean": (sum(ttfts) / len(ttfts) * 1000) if ttfts else float("nan"),
        "throughput": len(results) / elapsed,
        "shares": shares,
        "max_share_x_fair": max(shares) * len(shares) if sum(served) else float("nan"),
        "min_share_x_fair": min(shares) * len(shares) if sum(served) else float("nan"),
        "errors": sum(1 for r in results if r[2] != 200 or r[0] != r[0]),
        "requests": len(results),
        "elapsed_s": elapsed,
    }


def run_traffic(label: str, port: int, sims: list[dict], convs, concurrency: int) -> dict:
    r = run_sessions(label, lambda body: stream_request(port, body), sims, convs, concurrency)
    sys.stdout.write(f"\r  {label:<28} {r['requests']:>4}/{r['requests']} requests  {r['elapsed_s']:5.1f}s\n")
    return r


# ----------------------------------------------------------------------------------------------
# Configs


def agent_config(sims: list[dict], feed_port: int, http_port: int) -> str:
    out = [f'[feed]\nlisten = "127.0.0.1:{feed_port}"\n', f'[http]\nlisten = "127.0.0.1:{http_port}"\n',
           '[hash]\nalgo = "sha256_cbor"\nseed = "0"\nblock_size = 16\n',
           # A reconnecting publisher is checked through its replay socket: a restarted engine's
           # blocks leave at once.
           '[zmq]\nverify_on_reconnect = true\n']
    for s in sims:
        out.append(
            f'[[replicas]]\nname = "{s["name"]}"\naddress = "127.0.0.1:{s["port"]}"\nmodels = ["{MODEL}"]\n'
            f'endpoint = "tcp://127.0.0.1:{s["kv"]}"\nmode = "bind"\n'
            f'replay_endpoint = "tcp://127.0.0.1:{s["replay"]}"\ntopic = "kv-events"\n')
    return "\n".join(out)


def shipped_envoy_config(wasm: Path, listen: int, admin: int, agent: int, filter_cfg: dict) -> str:
    """The shipped bootstrap (envoy/llmgw-local.yaml) with these ports, an absolute wasm path and
    the given filter configuration."""
    text = (ROOT / "envoy" / "llmgw-local.yaml").read_text()
    text = text.replace("port_value: 9901", f"port_value: {admin}")
    text = text.replace("port_value: 10000", f"port_value: {listen}")
    text = text.replace("port_value: 9090", f"port_value: {agent}")
    text = text.replace("filename: dist/llmgw.wasm", f"filename: {wasm}")
    # A YAML double-quoted scalar is a JSON string.
    text, n = re.subn(r"value: \|\n(?:\s{20}.*\n)+", f"value: {json.dumps(json.dumps(filter_cfg))}\n", text)
    if n != 1:
        raise RuntimeError("filter configuration block not found in envoy/llmgw-local.yaml")
    return text


def envoy_llmgw_config(wasm: Path, listen: int, admin: int, agent: int, kv_events: bool,
                       filter_extra: dict | None = None, profile_extra: dict | None = None) -> str:
    """The shipped bootstrap with one catch-all profile; `filter_extra` / `profile_extra` add or
    override configuration fields."""
    profile = {"name": "demo", "models": ["*"], "kv_events": kv_events, "block_size": 16,
               "hash_algo": "sha256_cbor", "seed": "0", "tokenizer": "tokenize", "tokenizer_timeout_ms": 500,
               **(profile_extra or {})}
    cfg = {"agent_cluster": "llmgw_agent", "tokenizer_cluster": "llmgw_tokenizer", **(filter_extra or {}),
           "profiles": [profile]}
    return shipped_envoy_config(wasm, listen, admin, agent, cfg)


def envoy_round_robin_config(listen: int, admin: int, sims: list[dict]) -> str:
    eps = "\n".join(f"        - endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {s['port']}}}}}}}" for s in sims)
    return f"""admin:
  address: {{socket_address: {{address: 127.0.0.1, port_value: {admin}}}}}
static_resources:
  listeners:
  - name: rr
    address: {{socket_address: {{address: 127.0.0.1, port_value: {listen}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: rr
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{prefix: /}}
                route: {{cluster: replicas, timeout: 300s}}
          http_filters:
          - name: envoy.filters.http.router
            typed_config: {{"@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}}
  clusters:
  - name: replicas
    type: STATIC
    lb_policy: ROUND_ROBIN
    connect_timeout: 1s
    load_assignment:
      cluster_name: replicas
      endpoints:
      - lb_endpoints:
{eps}
"""


# ----------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--envoy", default=str(ROOT / ".venv" / "bin" / "envoy"))
    ap.add_argument("--conversations", type=int, default=160)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--system-words", type=int, default=600)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=160, help="GPU blocks per simulated replica")
    ap.add_argument("--out", default=str(ROOT / "results" / "demo"))
    args = ap.parse_args()

    sim_bin = ROOT / "target" / "release" / "llmgw-sim"
    agent_bin = ROOT / "target" / "release" / "llmgw-agent"
    wasm = ROOT / "dist" / "llmgw.wasm"
    for p in (sim_bin, agent_bin, wasm, Path(args.envoy)):
        if not p.exists():
            print(f"missing {p}: run ./build.sh build", file=sys.stderr)
            return 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logdir = Path(tempfile.mkdtemp(prefix="llmgw-demo-"))
    procs = Procs(logdir)

    def on_signal(signum, frame):
        procs.stop_all()
        print("\ninterrupted: every process stopped", file=sys.stderr)
        sys.exit(130)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        sims = [{"name": f"r{i}", "port": free_port(), "kv": free_port(), "replay": free_port()} for i in range(4)]
        feed_port, agent_http = free_port(), free_port()
        cfg_path = logdir / "agent.toml"
        cfg_path.write_text(agent_config(sims, feed_port, agent_http))
        procs.start([agent_bin, "run", "--config", cfg_path], "agent")
        wait_until(lambda: http_get(f"http://127.0.0.1:{agent_http}/healthz") is not None, 20, "the agent")
        for s in sims:
            procs.start([sim_bin, "--port", s["port"], "--name", s["name"], "--model", MODEL, "--blocks", args.blocks,
                         "--seed", "0", "--kv-endpoint", f"tcp://127.0.0.1:{s['kv']}",
                         "--replay-endpoint", f"tcp://127.0.0.1:{s['replay']}",
                         "--prefill-tps", "4000", "--decode-ms", "8", "--max-batch", "4"], s["name"])
        for s in sims:
            wait_until(lambda s=s: http_get(f"http://127.0.0.1:{s['port']}/health") == "", 20, f"replica {s['name']}")
        convs = make_workload(7, args.conversations, args.groups, args.system_words, args.turns)
        n = sum(len(c) for c in convs)
        print(f"llmgw demo: 4 simulated vLLM replicas ({args.blocks} KV blocks each), {n} chat requests per run "
              f"({args.conversations} conversations x {args.turns} turns, {args.groups} shared system prompts), "
              f"concurrency {args.concurrency}")
        runs = []
        for label, mode in [("Envoy round-robin", "rr"), ("llmgw approximate only", "approx"), ("llmgw with KV events", "exact")]:
            for s in sims:  # identical starting state: empty caches
                http_post(f"http://127.0.0.1:{s['port']}/sim/restart")
            listen, admin = free_port(), free_port()
            path = logdir / f"envoy-{mode}.yaml"
            path.write_text(envoy_round_robin_config(listen, admin, sims) if mode == "rr"
                            else envoy_llmgw_config(wasm, listen, admin, feed_port, mode == "exact"))
            envoy = procs.start([args.envoy, "-c", path, "--concurrency", "2", "--log-level", "warn", "--disable-hot-restart"], f"envoy-{mode}")
            wait_until(lambda: http_get(f"http://127.0.0.1:{admin}/ready").strip() == "LIVE", 30, "Envoy")
            if mode != "rr":
                # The replica table comes from the agent's feed: wait for every VM's subscription.
                def feed_up() -> bool:
                    vals = re.findall(r"llmgw_feed_connected\S*: (\d+)", http_get(f"http://127.0.0.1:{admin}/stats?filter=llmgw_feed_connected"))
                    return bool(vals) and all(v == "1" for v in vals)
                wait_until(feed_up, 20, "the filter's feed subscriptions")
            runs.append(run_traffic(label, listen, sims, convs, args.concurrency))
            procs.stop(envoy)
        print_table(runs)
        (out / "demo.json").write_text(json.dumps(runs, indent=2))
        chart(runs, out / "demo.png")
        return 0
    finally:
        procs.stop_all()


def print_table(runs: list[dict]) -> None:
    print()
    print("| routing | prefix-cache hit rate | TTFT p50 | TTFT p99 | throughput | requests per replica | errors |")
    print("|---|---|---|---|---|---|---|")
    for r in runs:
        shares = " / ".join(f"{s * 100:.0f}%" for s in r["shares"])
        print(f"| {r['label']} | {r['hit_rate'] * 100:.1f} % | {r['ttft_p50']:.0f} ms | {r['ttft_p99']:.0f} ms | "
              f"{r['throughput']:.1f} req/s | {shares} | {r['errors']} |")
    print()


def chart(runs: list[dict], path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no chart)")
        return
    labels = [r["label"].replace("llmgw ", "llmgw\n") for r in runs]
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.8))
    axes[0].bar(labels, [r["hit_rate"] * 100 for r in runs], color="#4c72b0")
    axes[0].set_title("prefix-cache hit rate (%)")
    x = range(len(runs))
    axes[1].bar([i - 0.2 for i in x], [r["ttft_p50"] for r in runs], 0.4, label="p50", color="#55a868")
    axes[1].bar([i + 0.2 for i in x], [r["ttft_p99"] for r in runs], 0.4, label="p99", color="#c44e52")
    axes[1].set_xticks(list(x), labels)
    axes[1].set_title("time to first token (ms)")
    axes[1].legend()
    axes[2].bar(labels, [r["throughput"] for r in runs], color="#8172b2")
    axes[2].set_title("throughput (req/s)")
    for i, r in enumerate(runs):
        bottom = 0.0
        for j, s in enumerate(r["shares"]):
            axes[3].bar(i, s * 100, bottom=bottom, color=f"C{j}", label=f"r{j}" if i == 0 else None)
            bottom += s * 100
    axes[3].set_xticks(list(x), labels)
    axes[3].set_title("requests per replica (%)")
    axes[3].legend(fontsize=7)
    for ax in axes:
        ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"chart: {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")


if __name__ == "__main__":
    sys.exit(main())
