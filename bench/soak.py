#!/usr/bin/env python3
"""Soak (not CI): the whole product on loopback for a long run of churning traffic, with the
agent and the replicas killed and restarted along the way, memory sampled every minute and
decisions checked against the simulator's ground truth.

- 4 simulated replicas (small caches, so blocks are evicted all the time), the agent, Envoy
  with llmgw.wasm (2 workers), the shipped local bootstrap.
- Load: `--concurrency` clients, each request on a fresh connection; prompts of token ids in 16
  families of shared prefixes, each with a new suffix, plus chat requests that are tokenized.
- Faults: every `--fault-every-min` minutes, alternately the agent and one replica are killed
  (SIGKILL) and started again on the same ports.
- Every minute: Envoy's and the agent's resident memory (/proc), the VMs' index gauges, requests
  sent and failed so far.
- Ground truth: every few seconds a checker reads every replica's cached blocks (/sim/blocks),
  sends a prompt whose block keys it computes itself, and compares the filter's decision
  (x-llmgw-decision: replica, matched blocks) with what the replicas held: the matched count
  against the chosen replica's leading blocks, and the choice against the best holder.

Target: memory growth at most 1 MB/h after warm-up (the first `--warmup-min` minutes), for
Envoy over the whole run and for the agent over its last lifetime (it is restarted).

`./build.sh bench soak [--minutes 60]` writes results/soak/soak.json, soak.md and
bench/charts/soak.png. Progress lines go to stdout (one per minute, readable in a log). Every
process started is stopped at exit, also on Ctrl-C."""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import threading
import time
from pathlib import Path

import llmgw_testkit as kit
from llmgw_testkit.charts import pyplot
from llmgw_testkit.fleet import stop_on_signals
from llmgw_testkit.load_faults import CHAT, COMPLETIONS, MODEL, ClientLoad, SimFleet, send
from llmgw_testkit.vllm_hash import block_keys

BLOCK = 16


def repo_relative(v) -> str:
    """An argument as the record shows it: a path inside the repository relative to it."""
    if isinstance(v, Path) and v.resolve().is_relative_to(kit.ROOT):
        return str(v.resolve().relative_to(kit.ROOT))
    return str(v)

DECISION = re.compile(r"outcome=(\w+); replica=([\d.]+:\d+); matched=(\d+)/(\d+)")
FAMILIES = 16
REPLICAS = 4


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def rss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def family_prefix(f: int) -> list[int]:
    rng = random.Random(f)
    return [rng.randrange(1000, 30000) for _ in range(BLOCK * 24)]


class Load(ClientLoad):
    """Each client: a chat request (tokenized) every fifth request, else a completion of token
    ids, a family's prefix and a new suffix; counted, not recorded (the run is long)."""

    def __init__(self, port: int, concurrency: int, pause_s: float):
        self.rngs = [random.Random(i) for i in range(concurrency)]
        self.counts = [0] * concurrency
        super().__init__(port, concurrency, pause_s=pause_s, keep=False)

    def request(self, i: int) -> tuple[str, bytes]:
        rng = self.rngs[i]
        self.counts[i] += 1
        n = self.counts[i]
        f = rng.randrange(FAMILIES)
        if n % 5 == 0:
            body = {"model": MODEL, "max_tokens": 2, "messages": [
                {"role": "system", "content": f"family {f} " + " ".join(f"f{f}w{j}" for j in range(60))},
                {"role": "user", "content": f"question {i} {n}"}]}
            return CHAT, json.dumps(body).encode()
        suffix = [rng.randrange(1000, 30000) for _ in range(BLOCK * rng.randrange(1, 4))]
        body = {"model": MODEL, "max_tokens": 2, "prompt": family_prefix(f) + suffix}
        return COMPLETIONS, json.dumps(body).encode()


class Checker:
    """Every `period` s: the replicas' blocks, then a prompt of a family whose keys it computes,
    then the decision compared with them."""

    def __init__(self, port: int, sims: list[dict], period: float):
        self.port, self.sims, self.period = port, sims, period
        self.checks: list[dict] = []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def held(self) -> dict[str, set[int]] | None:
        out = {}
        for s in self.sims:
            try:
                out[f"127.0.0.1:{s['port']}"] = set(kit.http_json(f"http://127.0.0.1:{s['port']}/sim/blocks")[2]["keys"])
            except Exception:  # noqa: BLE001 - a replica being restarted: skip this check
                return None
        return out

    def run(self) -> None:
        rng = random.Random(7)
        while not self.stopping.wait(self.period):
            f = rng.randrange(FAMILIES)
            tokens = family_prefix(f) + [rng.randrange(1000, 30000) for _ in range(BLOCK)]
            keys = block_keys(tokens, BLOCK, seed="0")
            held = self.held()
            if held is None:
                continue
            leading = {}
            for addr, ks in held.items():
                n = 0
                while n < len(keys) and keys[n] in ks:
                    n += 1
                leading[addr] = n
            r = send(self.port, COMPLETIONS, json.dumps({"model": MODEL, "max_tokens": 1, "prompt": tokens}).encode())
            status, decision = r.status, r.decision
            m = DECISION.search(decision)
            if status != 200 or not m:
                self.checks.append({"t": time.time(), "ok": False, "why": f"status {status} {decision!r}"})
                continue
            outcome, replica, matched = m.group(1), m.group(2), int(m.group(3))
            best = max(leading.values())
            self.checks.append({
                "t": time.time(), "ok": True, "outcome": outcome, "matched": matched,
                "held_by_choice": leading.get(replica, 0), "best": best,
                # The index said what the chosen replica held (a block more or less: one stored
                # or evicted between the read and the decision).
                "index_right": abs(matched - leading.get(replica, 0)) <= 1 if outcome == "exact" else True,
                # The choice was the best holder, or load (spill) sent it elsewhere on purpose.
                "choice_right": leading.get(replica, 0) >= best - 1 or outcome in ("spill", "load", "overloaded"),
            })

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(30)


def slope_mb_per_h(samples: list[tuple[float, int]]) -> float | None:
    """Least-squares slope of (seconds, KiB) samples, in MB per hour."""
    if len(samples) < 3:
        return None
    n = len(samples)
    mx = sum(t for t, _ in samples) / n
    my = sum(v for _, v in samples) / n
    sxx = sum((t - mx) ** 2 for t, _ in samples)
    if sxx == 0:
        return None
    sxy = sum((t - mx) * (v - my) for t, v in samples)
    return sxy / sxx * 3600 * 1024 / 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=60)
    ap.add_argument("--warmup-min", type=float, default=10)
    ap.add_argument("--fault-every-min", type=float, default=10)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--pause-ms", type=float, default=50, help="each client's pause between requests")
    ap.add_argument("--check-every-s", type=float, default=5)
    ap.add_argument("--sample-every-s", type=float, default=60)
    ap.add_argument("--blocks", type=int, default=512, help="KV blocks per simulated replica")
    ap.add_argument("--out", type=Path, default=kit.ROOT / "results" / "soak")
    ap.add_argument("--chart", type=Path, default=kit.ROOT / "bench" / "charts" / "soak.png")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    work = a.out / "run"
    work.mkdir(exist_ok=True)
    sim_bin, agent_bin = kit.built("llmgw-sim", "release"), kit.built("llmgw-agent", "release")
    wasm, envoy_bin = kit.wasm(), kit.envoy_bin()
    samples: list[dict] = []
    faults: list[dict] = []
    with kit.Procs(work) as procs:
        stop_on_signals(procs)
        log(f"starting {REPLICAS} simulated replicas ({a.blocks} blocks each), the agent and Envoy")
        fleet = SimFleet(procs, work, agent_bin, sim_bin, envoy_bin, REPLICAS, blocks=a.blocks, decode_ms=2,
                         buffer_steps=100_000, profile={}, connected_timeout=30.0).start_envoy(wasm)
        sims, agent, envoy_proc, envoy = fleet.sims, fleet.agent, fleet.envoy_proc, fleet.envoy
        load = Load(fleet.listen, a.concurrency, a.pause_ms / 1000)
        checker = Checker(fleet.listen, sims, a.check_every_s)
        t0 = time.monotonic()
        end = t0 + a.minutes * 60
        next_sample, next_fault, fault_no = t0, t0 + a.fault_every_min * 60, 0
        try:
            while time.monotonic() < end:
                now = time.monotonic()
                if now >= next_sample:
                    next_sample += a.sample_every_s
                    s = {"min": (now - t0) / 60, "envoy_kib": rss_kib(envoy_proc.pid),
                         "agent_kib": rss_kib(agent.proc.pid), "agent_pid": agent.proc.pid,
                         "vm_kib": sum(envoy.stats("llmgw_vm_memory_bytes").values()) / 1024,
                         "index_blocks": envoy.index_blocks(), "sent": load.sent, "failed": load.failed,
                         "checks": len(checker.checks)}
                    samples.append(s)
                    log(f"{s['min']:5.1f} min: envoy {s['envoy_kib'] / 1024:.1f} MiB (VMs' linear memory "
                        f"{s['vm_kib'] / 1024:.1f} MiB), agent "
                        f"{s['agent_kib'] / 1024:.1f} MiB, index {s['index_blocks']}, sent {s['sent']}, "
                        f"failed {s['failed']}, checks {s['checks']}")
                if now >= next_fault:
                    next_fault += a.fault_every_min * 60
                    fault_no += 1
                    if fault_no % 2 == 1:
                        log("fault: agent SIGKILL, restarted")
                        fleet.kill_agent()
                        fleet.restart_agent()
                        faults.append({"min": (now - t0) / 60, "what": "agent"})
                    else:
                        victim = sims[fault_no // 2 % len(sims)]
                        log(f"fault: replica {victim['name']} SIGKILL, restarted")
                        fleet.kill_sim(victim)
                        fleet.restart_sim(victim, f"{victim['name']}-{fault_no}")
                        faults.append({"min": (now - t0) / 60, "what": f"replica {victim['name']}"})
                time.sleep(1)
        finally:
            load.stop()
            checker.stop()
    warm = [s for s in samples if s["min"] >= a.warmup_min]
    envoy_slope = slope_mb_per_h([(s["min"] * 60, s["envoy_kib"]) for s in warm])
    # The VMs' linear memory (llmgw_vm_memory_bytes, summed over VMs) and the rest of Envoy.
    vm_slope = slope_mb_per_h([(s["min"] * 60, s.get("vm_kib", 0)) for s in warm])
    rest_slope = slope_mb_per_h([(s["min"] * 60, s["envoy_kib"] - s.get("vm_kib", 0)) for s in warm])
    last_pid = samples[-1]["agent_pid"] if samples else None
    agent_life = [s for s in warm if s["agent_pid"] == last_pid]
    agent_slope = slope_mb_per_h([(s["min"] * 60, s["agent_kib"]) for s in agent_life])
    checks = [c for c in checker.checks if c["ok"]]
    exact = [c for c in checks if c["outcome"] == "exact"]
    result = {
        # Paths inside the repository are recorded relative to it (the record names no machine's paths).
        "args": {k: repo_relative(v) for k, v in vars(a).items()},
        "sent": load.sent, "failed": load.failed, "faults": faults, "samples": samples,
        "envoy_mb_per_h": envoy_slope, "agent_mb_per_h": agent_slope,
        "vm_linear_mb_per_h": vm_slope, "envoy_outside_vms_mb_per_h": rest_slope,
        "agent_last_lifetime_min": (agent_life[-1]["min"] - agent_life[0]["min"]) if len(agent_life) > 1 else 0,
        "checks": len(checker.checks), "checks_answered": len(checks),
        "index_right": sum(c["index_right"] for c in exact) / max(1, len(exact)),
        "choice_right": sum(c["choice_right"] for c in checks) / max(1, len(checks)),
        "exact_share": len(exact) / max(1, len(checks)),
    }
    (a.out / "soak.json").write_text(json.dumps(result, indent=1))
    fmt = lambda v: "n/a" if v is None else f"{v:+.2f}"  # noqa: E731
    md = [
        "# Soak\n", f"`{' '.join(sys.argv)}`\n",
        f"{a.minutes:.0f} min, {len(faults)} faults ({', '.join(f['what'] for f in faults)}); "
        f"{load.sent} requests, {load.failed} failed.\n",
        "| | after warm-up ({:g} min) |".format(a.warmup_min), "|---|---|",
        f"| Envoy RSS growth | {fmt(envoy_slope)} MB/h |",
        f"| of which the VMs' linear memory (`llmgw_vm_memory_bytes`) | {fmt(vm_slope)} MB/h |",
        f"| Envoy outside the VMs (RSS minus linear memory) | {fmt(rest_slope)} MB/h |",
        f"| agent RSS growth (its last lifetime, {result['agent_last_lifetime_min']:.0f} min) | {fmt(agent_slope)} MB/h |",
        f"| ground-truth checks answered | {len(checks)} of {len(checker.checks)} |",
        f"| decisions on exact data | {result['exact_share']:.3f} |",
        f"| of those, matched blocks = the chosen replica's held (±1) | {result['index_right']:.3f} |",
        f"| choice = the best holder (±1 block) or a load spill | {result['choice_right']:.3f} |",
    ]
    (a.out / "soak.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    plt = pyplot()
    if plt is None:
        log("matplotlib not installed: no chart (./build.sh setup installs it)")
        return 0
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot([s["min"] for s in samples], [s["envoy_kib"] / 1024 for s in samples], label="Envoy (2 workers)")
    ax.plot([s["min"] for s in samples], [s["agent_kib"] / 1024 for s in samples], label="agent")
    ax.plot([s["min"] for s in samples], [s.get("vm_kib", 0) / 1024 for s in samples],
            label="the VMs' linear memory (in Envoy)")
    for f in faults:
        ax.axvline(f["min"], color="grey", lw=0.6, ls=":")
    ax.axvline(a.warmup_min, color="black", lw=0.8, ls="--", label="end of warm-up")
    ax.set_xlabel("minutes (dotted: agent or replica killed and restarted)")
    ax.set_ylabel("resident memory, MiB")
    ax.set_title(f"llmgw soak: Envoy {fmt(envoy_slope)} MB/h, agent {fmt(agent_slope)} MB/h after warm-up")
    ax.legend(loc="center right")
    a.chart.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(a.chart, dpi=110)
    log(f"chart: {a.chart}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
