#!/usr/bin/env python3
"""llmgw fleet benchmark: simulated vLLM replicas (llmgw-sim) behind each routing policy, on
identical seeded traffic, with the replicas restarted (empty caches) before every run.

Workloads: shared-prefix groups (like SGLang's generated-shared-prefix benchmark), multi-turn
chat, a mix of shared-prefix and unique prompts, skewed (Zipf) prefix popularity, and tenants
(shared-prefix traffic over four tenants' cache salts: the same text, no shared KV blocks, where
matching text misleads a router and KV events do not); each at a low and a high concurrency.

Policies: Envoy ROUND_ROBIN and LEAST_REQUEST, an oracle that reads every replica's true cache
contents and load (POST /sim/probe) and sends directly, llmgw (Envoy + llmgw.wasm + llmgw-agent)
with only its approximate fallback and with KV events, and peer routers from PyPI
(sglang-router cache_aware, vllm-router cache_aware and kv_aware) in front of the same replicas.

Writes results/bench/bench.md (tables, targets, the command), bench.json and one PNG per
workload. Everything listens on 127.0.0.1; every process started is stopped at exit, also on
Ctrl-C. Absolute timings depend on the machine: compare policies within one run."""

from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
import zlib
from pathlib import Path

import llmgw_testkit as kit  # the project's test kit: processes, configs, clients
from llmgw_testkit import plain_request, stream_request
from llmgw_testkit.fleet import (SIM_WEIGHTS, fleet_agent, new_sims, peer_command, restart_sims, sim_command,
                                 start_router, stop_on_signals, wait_sims)
from llmgw_testkit.sessions import run_sessions
from llmgw_testkit.workloads import Conversations, SharedPrefix, make_sessions
from llmgw_testkit.charts import pyplot

ROOT = kit.ROOT
MODEL = "demo-model"
BLOCK = 16
REPLICAS = 4  # the default fleet size (--replicas)

POLICIES = {
    "rr": "Envoy round-robin",
    "lr": "Envoy least-request",
    "oracle": "oracle (true cache + load)",
    "approx": "llmgw approximate only",
    "exact": "llmgw with KV events",
    "sglang": "sglang-router cache_aware",
    "vllm-ca": "vllm-router cache_aware",
    "vllm-kv": "vllm-router kv_aware (KV events)",
}
PEERS = ("sglang", "vllm-ca", "vllm-kv")
WORKLOADS = {
    "shared-prefix": "groups of requests sharing long system prompts",
    "multi-turn": "conversations, each turn extends the last",
    "mixed": "half shared-prefix, half unique prompts",
    "skewed": "Zipf popularity over many system prompts",
    "tenants": "shared-prefix over 4 tenants' cache salts: same text, no shared KV",
}


# The workloads' shapes (llmgw_testkit.workloads); every count is scaled by --scale and everything
# derives from the seed, so every policy gets the same traffic.
SHAPES = {
    "shared-prefix": SharedPrefix(groups=16, system_words=800),
    "multi-turn": Conversations(48, 4, first_user_words=(300, 500), user_words=(40, 120), assistant_words=24),
    "mixed": SharedPrefix(groups=8, system_words=800, unique_words=(500, 900)),
    "skewed": SharedPrefix(groups=32, system_words=600, zipf=1.1, requests=256),
    "tenants": SharedPrefix(groups=8, system_words=800, per_group=32, tenants=4),
}


def make_workload(name: str, seed: int, scale: float, max_tokens: int) -> list[list[dict]]:
    return make_sessions(SHAPES[name], f"{name}-{seed}", MODEL, max_tokens, scale)


# ----------------------------------------------------------------------------------------------
# The fleet


class Fleet:
    """`--replicas` llmgw-sim processes. `events`: "agent" (they connect to the agent's bound
    ports, topic kv-events) or "bind" (they bind on loopback, topic "", for vllm-router)."""

    def __init__(self, procs: kit.Procs, args, events: str):
        self.procs, self.args, self.events = procs, args, events
        self.sims = new_sims(args.replicas)
        self.running: list = []

    def start(self) -> None:
        a = self.args
        for s in self.sims:
            # "agent": the agent binds, the replicas connect; "bind": they bind on loopback, topic "".
            ev = {} if self.events == "agent" else {"host": "[::ffff:127.0.0.1]", "topic": ""}
            self.running.append(self.procs.start(
                sim_command(a.sim_bin, s, MODEL, blocks=a.blocks, seed=0, block_size=BLOCK, prefill_tps=a.prefill_tps,
                            decode_ms=a.decode_ms, max_batch=a.max_batch, **ev), f"{s['name']}-{self.events}"))
        wait_sims(self.sims)

    def restart(self) -> None:
        restart_sims(self.sims)

    def stop(self) -> None:
        for p in self.running:
            self.procs.stop(p)
        self.running = []

    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{s['port']}" for s in self.sims]


# ----------------------------------------------------------------------------------------------
# Routers: each is started fresh for every run (no state carried between runs) and exposes
# `send(body) -> (ttft, total, status)` plus `trivial()` for the overhead probe.


def envoy_llmgw_config(wasm: Path, listen: int, admin: int, agent: int, kv_events: bool, weights: dict | None) -> str:
    """The shipped bootstrap with one catch-all profile at this run's block size (and any weight overrides)."""
    profile = {"name": "demo", "kv_events": kv_events, "block_size": BLOCK, **({"weights": weights} if weights else {})}
    return kit.shipped_config(wasm, listen, admin, agent, kit.filter_config(profile))


class Router:
    def __init__(self, bench: "Bench", policy: str):
        self.b, self.policy = bench, policy
        self.port = 0
        self.procs_started: list = []

    def _start(self, args, name):
        p = self.b.procs.start(args, name)
        self.procs_started.append(p)
        return p

    def start(self, fleet: Fleet) -> None:
        b, pol = self.b, self.policy
        sims = fleet.sims
        if pol == "oracle":
            self.oracle = Oracle(b.args, sims)
            return
        self.port, admin = kit.free_port(), kit.free_port()
        self.admin = admin
        if pol in ("rr", "lr", "approx", "exact"):
            llmgw = pol in ("approx", "exact")
            if llmgw:
                load = {"load": {"interval_ms": b.args.agent_load_interval_ms}} if b.args.agent_load_interval_ms else {}
                agent = fleet_agent(b.procs, b.args.agent_bin, b.logdir, sims, MODEL, name=f"agent-{pol}", **load)
                self.procs_started.append(agent.proc)
                text = envoy_llmgw_config(b.args.wasm, self.port, admin, agent.feed, pol == "exact", b.weights)
            else:
                text = kit.lb_config(self.port, admin, [s["port"] for s in sims], "ROUND_ROBIN" if pol == "rr" else "LEAST_REQUEST")
            envoy, self.envoy = start_router(b.procs, b.args.envoy, b.logdir, f"envoy-{pol}", text, admin, feed=llmgw)
            self.procs_started.append(envoy)
            return
        peers = b.args.peers_venv / "bin"
        prom = kit.free_port()
        self.prom = prom
        binary = peers / ("sglang-router" if pol == "sglang" else "vllm-router")
        sources = [(f"http://127.0.0.1:{s['port']}", s["kv"], s["replay"]) for s in sims]
        cmd = peer_command(pol, binary, self.port, fleet.urls(), prom, sources, BLOCK, MODEL)
        self.cmd = " ".join(shlex.quote(str(c)) for c in cmd)
        self._start(cmd, pol)

        def ready() -> bool:
            return self.trivial()[2] == 200
        kit.wait_until(ready, 60, f"{pol} to route")

    def stats(self) -> dict:
        """The router's own view: llmgw's decisions by outcome; vllm-router's KV lookups."""
        out: dict = {}
        try:
            if self.policy in ("approx", "exact"):
                out.update(self.envoy.decisions())
                # The rates the filter learned, per replica (gauges llmgw_rates_*{replica}).
                rates: dict = {}
                for k, v in self.envoy.stats("llmgw_rates_").items():
                    m = re.search(r"llmgw_rates_(\w+?)\.replica\.(\w+)", k)
                    if m:
                        rates.setdefault(m.group(2), {})[m.group(1)] = int(v)
                if rates:
                    out["learned_rates"] = rates
            elif self.policy == "vllm-kv":
                text = kit.get_text(f"http://127.0.0.1:{self.prom}/metrics")
                for res, v in re.findall(r'vllm_router_kv_placement_lookups_total\{result="(\w+)"\} ([0-9.]+)', text):
                    out[f"lookup_{res}"] = int(float(v))
        except OSError:
            pass
        return out

    def stop(self) -> None:
        for p in reversed(self.procs_started):
            self.b.procs.stop(p)
        self.procs_started = []

    def send(self, body: dict):
        if self.policy == "oracle":
            return self.oracle.send(body)
        return stream_request(self.port, body)

    def trivial(self):
        """A trivial non-streaming request (prompt shorter than a block: nothing is cached)."""
        b = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
        if self.policy == "oracle":
            t0 = time.monotonic()
            port, i = self.oracle.pick(b)
            t1 = time.monotonic()
            try:
                r = plain_request(port, b)
            finally:
                self.oracle.done(i)
            return (r[0] + (t1 - t0), r[1], r[2])
        return plain_request(self.port, b)


class Oracle:
    """Reads every replica's true prefix-cache hit for the request and its load, and picks the
    replica with the lowest estimated time to first token: uncached prompt tokens at the
    prefill rate plus the queueing its in-flight requests imply. Ties (e.g. a new prefix
    everywhere) go to a stable hash of the prompt's start, so a burst of a new prefix lands
    together until load spreads it. Its probe time is reported as its overhead, not counted in
    TTFT: it is the yardstick, not a deployable router."""

    def __init__(self, args, sims):
        self.args, self.sims = args, sims
        self.inflight = [0] * len(sims)
        self.lock = threading.Lock()

    def probe(self, s: dict, b: dict) -> dict:
        req = urllib.request.Request(f"http://127.0.0.1:{s['port']}/sim/probe", data=json.dumps(b).encode(),
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())

    def pick(self, b: dict) -> tuple[int, int]:
        a = self.args
        probes = [self.probe(s, b) for s in self.sims]
        key = json.dumps(b.get("messages") or b.get("prompt"))[:1024]
        service_ms = a.max_tokens * a.decode_ms + 20.0
        with self.lock:
            def cost(i: int):
                p = probes[i]
                uncached = max(0, p["prompt_tokens"] - p["cached_blocks"] * BLOCK)
                load = max(self.inflight[i], p["running"] + p["waiting"])
                queue = max(0, load + 1 - a.max_batch) * service_ms / a.max_batch
                return (uncached / a.prefill_tps * 1000 + queue, load, zlib.crc32(f"{i}|{key}".encode()))
            best = min(range(len(self.sims)), key=cost)
            self.inflight[best] += 1
        return self.sims[best]["port"], best

    def done(self, i: int) -> None:
        with self.lock:
            self.inflight[i] -= 1

    def send(self, b: dict):
        port, i = self.pick(b)
        try:
            return stream_request(port, b, keepalive=True)
        finally:
            self.done(i)


# ----------------------------------------------------------------------------------------------


def run_traffic(label: str, router: Router, sims: list[dict], sessions, concurrency: int) -> dict:
    def summary(out: dict) -> str:
        return (f"  {label:<58} {out['requests']:>4}/{out['requests']}  {out['elapsed_s']:5.1f}s  hit "
                f"{out['hit_rate'] * 100:5.1f}%  TTFT p50 {out['ttft_p50']:6.1f} ms  mean {out['ttft_mean']:6.1f} ms  "
                f"max share {out['max_share_x_fair']:.2f}x  err {out['errors']}")
    out = run_sessions(label, router.send, sims, sessions, concurrency, width=58, summary=summary)
    out.pop("label")
    return out


def overhead(router: Router, fleet: Fleet, n: int) -> float:
    """Median latency of a trivial request through the router minus the same request sent
    straight to a replica (interleaved, same moment)."""
    via, direct = [], []
    for i in range(n):
        r = router.trivial()
        if r[2] == 200:
            via.append(r[0])
        d = plain_request(fleet.sims[i % len(fleet.sims)]["port"], {"model": MODEL, "prompt": "hi", "max_tokens": 1})
        if d[2] == 200:
            direct.append(d[0])
    if not via or not direct:
        return float("nan")
    return (statistics.median(via) - statistics.median(direct)) * 1000


class Bench:
    def __init__(self, args):
        self.args = args
        self.weights = json.loads(args.llmgw_weights) if args.llmgw_weights else None
        self.logdir = Path(tempfile.mkdtemp(prefix="llmgw-bench-"))
        self.procs = kit.Procs(self.logdir)
        self.results: list[dict] = []
        self.skipped: dict[str, str] = {}

    def run(self) -> None:
        a = self.args
        cells = [(w, c) for w in a.workloads for c in a.concurrency]
        sessions = {w: make_workload(w, a.seed, a.scale, a.max_tokens) for w in a.workloads}
        n_req = {w: sum(len(s) for s in sessions[w]) for w in a.workloads}
        print(f"llmgw fleet benchmark: {a.replicas} llmgw-sim replicas ({a.blocks} KV blocks of {BLOCK} tokens, prefill "
              f"{a.prefill_tps:.0f} tok/s, decode {a.decode_ms} ms/token, max batch {a.max_batch}), {a.max_tokens} output tokens")
        for w in a.workloads:
            print(f"  {w}: {n_req[w]} requests ({WORKLOADS[w]})")
        print(f"  concurrency {', '.join(map(str, a.concurrency))}; policies: {', '.join(a.policies)}; logs in {self.logdir}")
        groups = [("agent", [p for p in a.policies if p != "vllm-kv"]), ("bind", [p for p in a.policies if p == "vllm-kv"])]
        for events, pols in groups:
            if not pols:
                continue
            fleet = Fleet(self.procs, a, events)
            fleet.start()
            try:
                for pol in pols:
                    if pol in PEERS and not (a.peers_venv / "bin").exists():
                        self.skipped[pol] = f"peer routers not installed in {a.peers_venv.name}/"
                        continue
                    for w, c in cells:
                        fleet.restart()
                        router = Router(self, pol)
                        try:
                            router.start(fleet)
                            r = run_traffic(f"{w} c={c} {POLICIES[pol]}", router, fleet.sims, sessions[w], c)
                            # After the traffic: the probe's requests are routed too, and before it
                            # they would shape where the measured traffic goes (llmgw's recent
                            # request counts) without being counted in its shares.
                            ovh = overhead(router, fleet, a.overhead_samples)
                            r["router_stats"] = router.stats()
                        except (TimeoutError, OSError, RuntimeError) as e:
                            self.skipped[pol] = f"{type(e).__name__}: {e} (log: {self.logdir})"
                            print(f"\n  {POLICIES[pol]}: could not run: {e}")
                            break
                        finally:
                            router.stop()
                        r.update({"workload": w, "concurrency": c, "policy": pol, "label": POLICIES[pol], "overhead_ms": ovh})
                        self.results.append(r)
            finally:
                fleet.stop()


# ----------------------------------------------------------------------------------------------
# Report


def fmt_row(r: dict) -> str:
    shares = "/".join(f"{s * 100:.0f}" for s in r["shares"])
    return (f"| {r['label']} | {r['hit_rate'] * 100:.1f} % | {r['ttft_p50']:.0f} | {r['ttft_p99']:.0f} | {r['ttft_mean']:.0f} | "
            f"{r['throughput']:.1f} | {r['max_share_x_fair']:.2f} / {r['min_share_x_fair']:.2f} ({shares}) | {r['errors']} | "
            f"{r['overhead_ms']:+.1f} |")


def tables(results: list[dict]) -> str:
    out = []
    keys = sorted({(r["workload"], r["concurrency"]) for r in results}, key=lambda k: (list(WORKLOADS).index(k[0]), k[1]))
    for w, c in keys:
        out.append(f"\n**{w}**, concurrency {c} ({next(r['requests'] for r in results if r['workload'] == w and r['concurrency'] == c)} requests)\n")
        out.append("| policy | hit rate | TTFT p50 ms | p99 ms | mean ms | req/s | max / min share × fair (% per replica) | errors | overhead ms |")
        out.append("|---|---|---|---|---|---|---|---|---|")
        for r in results:
            if r["workload"] == w and r["concurrency"] == c:
                out.append(fmt_row(r))
    return "\n".join(out)


def summary(results: list[dict]) -> str:
    """One row per policy: hit rate / mean TTFT / busiest replica for every (workload, concurrency)."""
    keys = sorted({(r["workload"], r["concurrency"]) for r in results}, key=lambda k: (list(WORKLOADS).index(k[0]), k[1]))
    out = ["| policy | " + " | ".join(f"{w} c={c}" for w, c in keys) + " |", "|---|" + "---|" * len(keys)]
    for p in POLICIES:
        cells = []
        for w, c in keys:
            r = next((r for r in results if r["policy"] == p and r["workload"] == w and r["concurrency"] == c), None)
            cells.append("—" if r is None else f"{r['hit_rate'] * 100:.0f} % / {r['ttft_mean']:.0f} ms / {r['max_share_x_fair']:.2f}")
        if any(c != "—" for c in cells):
            out.append(f"| {POLICIES[p]} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def targets(results: list[dict]) -> list[str]:
    """The issue's targets on the shared-prefix workload."""
    lines = []
    sp = [r for r in results if r["workload"] == "shared-prefix"]
    get = lambda p, c: next((r for r in sp if r["policy"] == p and r["concurrency"] == c), None)  # noqa: E731
    for c in sorted({r["concurrency"] for r in sp}):
        oracle, rr = get("oracle", c), get("rr", c)
        peers = [get(p, c) for p in PEERS if get(p, c)]
        for pol in ("approx", "exact"):
            me = get(pol, c)
            if not me:
                continue
            name = f"{POLICIES[pol]}, concurrency {c}"
            if oracle:
                ratio = me["hit_rate"] / oracle["hit_rate"] if oracle["hit_rate"] else float("nan")
                lines.append(f"- {name}: hit rate {me['hit_rate'] * 100:.1f} % = {ratio * 100:.0f} % of the oracle's "
                             f"{oracle['hit_rate'] * 100:.1f} % (target ≥ 90 %): {'met' if ratio >= 0.9 else f'MISSED by {(0.9 - ratio) * 100:.1f} points'}")
            if rr:
                ratio = me["ttft_mean"] / rr["ttft_mean"]
                lines.append(f"- {name}: mean TTFT {me['ttft_mean']:.0f} ms = {ratio:.2f} × round-robin's {rr['ttft_mean']:.0f} ms "
                             f"(target ≤ 0.50): {'met' if ratio <= 0.5 else f'MISSED by {ratio - 0.5:.2f}'}")
            mx = me["max_share_x_fair"]
            lines.append(f"- {name}: busiest replica {mx:.2f} × its fair share (target ≤ 1.5): {'met' if mx <= 1.5 else f'MISSED by {mx - 1.5:.2f}'}")
            if peers:
                worse = [p for p in peers if not (me["ttft_p50"] < p["ttft_p50"] and me["errors"] <= p["errors"])]
                desc = ", ".join(f"{p['label']} {p['ttft_p50']:.0f} ms/{p['errors']} err" for p in peers)
                lines.append(f"- {name}: TTFT p50 {me['ttft_p50']:.0f} ms, {me['errors']} errors vs peers ({desc}): "
                             + ("met" if not worse else "MISSED against " + ", ".join(p["label"] for p in worse)))
    return lines


def chart(results: list[dict], out: Path) -> list[Path]:
    plt = pyplot()
    if plt is None:
        print("(matplotlib not installed: no charts)")
        return []
    paths = []
    for w in WORKLOADS:
        rs = [r for r in results if r["workload"] == w]
        if not rs:
            continue
        concs = sorted({r["concurrency"] for r in rs})
        pols = [p for p in POLICIES if any(r["policy"] == p for r in rs)]
        fig, axes = plt.subplots(1, 5, figsize=(22, 4.2))
        metrics = [("hit_rate", "prefix-cache hit rate (%)", 100), ("ttft_p50", "TTFT p50 (ms)", 1),
                   ("ttft_mean", "TTFT mean (ms)", 1), ("throughput", "throughput (req/s)", 1),
                   ("max_share_x_fair", "busiest replica (× fair share)", 1)]
        width = 0.8 / max(1, len(pols))
        for ax, (key, title, mul) in zip(axes, metrics):
            for j, p in enumerate(pols):
                vals = [next((r[key] * mul for r in rs if r["policy"] == p and r["concurrency"] == c), float("nan")) for c in concs]
                ax.bar([i + (j - (len(pols) - 1) / 2) * width for i in range(len(concs))], vals, width, label=POLICIES[p], color=f"C{j}")
            ax.set_xticks(range(len(concs)), [f"concurrency {c}" for c in concs])
            ax.set_title(title, fontsize=10)
            if key == "max_share_x_fair":
                ax.axhline(1.5, color="k", ls="--", lw=0.8)
        handles, labels = axes[0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=len(pols), fontsize=8, frameon=False)
        fig.suptitle(f"{w}: {WORKLOADS[w]}")
        fig.tight_layout(rect=(0, 0.07, 1, 1))
        p = out / f"{w}.png"
        fig.savefig(p, dpi=100)
        plt.close(fig)
        paths.append(p)
    return paths


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="half the requests, shared-prefix and multi-turn only")
    ap.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=None)
    ap.add_argument("--policies", nargs="+", choices=list(POLICIES), default=list(POLICIES))
    ap.add_argument("--concurrency", nargs="+", type=int, default=[4, 16], help="low and high (default 4 16)")
    ap.add_argument("--scale", type=float, default=None, help="request count multiplier (default 1, --quick 0.5)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--replicas", type=int, default=REPLICAS, help=f"simulated replicas (default {REPLICAS})")
    ap.add_argument("--blocks", type=int, default=256, help="KV blocks per replica")
    ap.add_argument("--prefill-tps", type=float, default=8000.0)
    ap.add_argument("--decode-ms", type=float, default=5.0)
    ap.add_argument("--max-batch", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--overhead-samples", type=int, default=20)
    ap.add_argument("--llmgw-weights", default=json.dumps(SIM_WEIGHTS),
                    help=f"JSON object passed as the llmgw profile's `weights` (default {json.dumps(SIM_WEIGHTS)}: "
                         "the simulator's physics, see llmgw_testkit.fleet.SIM_WEIGHTS)")
    ap.add_argument("--agent-load-interval-ms", type=int, default=None,
                    help="llmgw-agent's /metrics scrape interval (its default when omitted)")
    ap.add_argument("--wasm", type=Path, default=None, help="the filter to load (default dist/llmgw.wasm)")
    ap.add_argument("--envoy", type=Path, default=ROOT / ".venv" / "bin" / "envoy")
    ap.add_argument("--peers-venv", type=Path, default=ROOT / ".venv-peers")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "bench")
    ap.add_argument("--from-json", type=Path, default=None, help="rewrite the report from a saved bench.json (no runs)")
    args = ap.parse_args()
    if args.workloads is None:
        args.workloads = ["shared-prefix", "multi-turn"] if args.quick else list(WORKLOADS)
    if args.scale is None:
        args.scale = 0.5 if args.quick else 1.0
    try:
        args.sim_bin, args.agent_bin = kit.built("llmgw-sim", "release"), kit.built("llmgw-agent", "release")
        args.wasm = args.wasm or kit.wasm()
    except FileNotFoundError as e:
        print(e, file=sys.stderr)
        return 1
    if not args.envoy.exists():
        print(f"missing {args.envoy}: run ./build.sh setup", file=sys.stderr)
        return 1
    command = "./build.sh bench" + ("" if len(sys.argv) <= 1 else " " + " ".join(shlex.quote(x) for x in sys.argv[1:]))
    bench = Bench(args)

    stop_on_signals(bench.procs)
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        header = saved.get("header") or [f"Command: `{saved['command']}`\n", setup_line(saved["args"])]
        return report(args.out, header, saved["results"], saved["skipped"], saved["command"])
    t0 = time.monotonic()
    try:
        bench.run()
    finally:
        bench.procs.stop_all()
    header = [f"Command: `{command}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {time.monotonic() - t0:.0f} s)\n",
              setup_line({k: str(v) for k, v in vars(args).items()})]
    return report(args.out, header, bench.results, bench.skipped, command)


def setup_line(a: dict) -> str:
    return (f"{a.get('replicas', REPLICAS)} llmgw-sim replicas, {a['blocks']} KV blocks of {BLOCK} tokens each, prefill {float(a['prefill_tps']):.0f} tok/s, "
            f"decode {a['decode_ms']} ms/token, max batch {a['max_batch']}, {a['max_tokens']} output tokens, seed {a['seed']}"
            + (f", llmgw weights {a['llmgw_weights']}" if a.get("llmgw_weights") not in (None, "None") else "")
            + (f", agent load scrape every {a['agent_load_interval_ms']} ms" if a.get("agent_load_interval_ms") not in (None, "None") else "")
            + ". Timings share 2 cores with everything else on the machine: compare policies within one run.")


def learned_rates(results: list[dict], header: list[str]) -> list[str]:
    """The rates llmgw learned in each run, beside the simulator's own prefill cost."""
    m = re.search(r"prefill (\d+) tok/s", " ".join(header))
    true_us = 1e6 / float(m.group(1)) if m else None
    lines = []
    for r in results:
        rates = (r.get("router_stats") or {}).get("learned_rates") or {}
        if not rates:
            continue
        def mean(k):
            return sum(v.get(k, 0) for v in rates.values()) / len(rates)
        sim = f" (the simulator's: {true_us:.0f})" if true_us else ""
        lines.append(f"- {r['workload']} c={r['concurrency']} {r['label']}: prefill {mean('prefill_ns_per_token') / 1000:.0f} µs "
                     f"per token{sim}, queued prefill {mean('queued_ns_per_token') / 1000:.0f} µs per token, "
                     f"{mean('request_us') / 1000:.1f} ms per request, base {mean('base_us') / 1000:.1f} ms; "
                     f"{mean('observations'):.0f} observations per replica")
    return lines


def report(out: Path, header: list[str], results: list[dict], skipped: dict, command: str) -> int:
    out.mkdir(parents=True, exist_ok=True)
    tgt = targets(results)
    md = [*header,
          "Hit rate = prefix-cache hits / queries (tokens, from the replicas' /metrics deltas); TTFT = time to the first "
          "SSE data line at the client; share = vllm:request_success_total deltas (1.00 = fair share); overhead = median "
          "latency of a trivial request via the router minus direct to a replica (the oracle: its probe time).",
          "\n**All workloads**: hit rate / mean TTFT / busiest replica (× fair share)\n", summary(results),
          tables(results)]
    if tgt:
        md += ["\n**Targets** (shared-prefix workload):\n", *tgt]
    learned = learned_rates(results, header)
    if learned:
        md += ["\n**Rates llmgw learned** (mean over replicas, from its `llmgw_rates_*` gauges):\n", *learned]
    if skipped:
        md += ["\n**Not run:**\n", *[f"- {POLICIES[p]}: {why}" for p, why in skipped.items()]]
    text = "\n".join(md) + "\n"
    (out / "bench.md").write_text(text)
    (out / "bench.json").write_text(json.dumps({"command": command, "header": header, "results": results, "skipped": skipped}, indent=2))
    charts = chart(results, out)
    print()
    print(text)
    rel = lambda p: p.relative_to(ROOT) if p.is_relative_to(ROOT) else p  # noqa: E731
    print(f"written: {rel(out / 'bench.md')}, {rel(out / 'bench.json')}" + "".join(f", {rel(p)}" for p in charts))
    return 0 if results else 1


if __name__ == "__main__":
    sys.exit(main())
