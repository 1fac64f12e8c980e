#!/usr/bin/env python3
"""Several gateways in front of one simulated fleet, as the sidecar deployments run them: each
gateway an Envoy with llmgw.wasm and its own agent, every agent subscribed to every replica's
bound publisher (llmgw-sim replicas, on loopback).

Two measurements, in one run on fresh replicas:
- burst: every gateway receives, at once, its share of a burst of requests sharing one prefix no
  replica holds yet (default 4 gateways x 64). Reported: where the requests went (the busiest and
  idlest replica against a fair share, how many replicas took any), time to first token, errors.
- sessions: multi-turn conversations, each turn sent to a gateway chosen at random. Reported: the
  share of follow-up turns that went to the replica holding the conversation (the one that
  served its previous turn) and the replicas' own prefix-cache hit rate, the coefficient of
  variation of the replicas' request shares and the busiest/idlest against a fair share, time to
  first token p50/p99, errors.

Writes results/bench/gateways.md and gateways.json. Progress lines go to stdout (one per phase
step, readable in a log). Every process started is stopped at exit, also on Ctrl-C."""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from pathlib import Path

import llmgw_testkit as kit
from llmgw_testkit.fleet import SIM_WEIGHTS, new_sims, pct, restart_sims, scrape, stop_on_signals, wait_sims
from llmgw_testkit.gateways import (bound_sim_command, burst, indexes_equal_agents, shares, start_gateways,
                                    stream)
from llmgw_testkit.sessions import drive

MODEL = "demo-model"

# Filter weights per arm: today's defaults, and the same without the holders' load bound and the
# tie margin (how llmgw routed before them), as the baseline in the same run. Every arm has the
# simulator's physics (SIM_WEIGHTS), as in the demo.
ARMS = {
    "llmgw": ("llmgw (defaults)", {**SIM_WEIGHTS}),
    "unbounded": ("llmgw without the holders' load bound and tie margin",
                  {**SIM_WEIGHTS, "holder_spill_factor": 0, "tie_margin": 0}),
    "all-choices": ("llmgw, a new prefix to the least loaded of all replicas", {**SIM_WEIGHTS, "approx_choices": 1024}),
}
DEFAULT_ARMS = ["llmgw", "unbounded"]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sessions(gws, sims, n: int, turns: int, concurrency: int, max_tokens: int, seed: int) -> dict:
    rng = random.Random(seed)
    before = [scrape(s["port"]) for s in sims]
    plans = []
    for i in range(n):
        system = {"role": "system", "content": f"session {i} system " + " ".join(f"s{i}w{j}" for j in range(150))}
        plans.append((system, [rng.randrange(len(gws)) for _ in range(turns)]))
    lock = threading.Lock()
    out = {"follow_ups": 0, "stuck": 0, "ttfts": [], "errors": 0, "counts": {}}
    done = [0]

    def run(plan):
        system, route = plan
        msgs = [system]
        last = None
        for t, gi in enumerate(route):
            msgs = msgs + [{"role": "user", "content": f"turn {t}: " + "tell me more " * 10}]
            ttft, replica, st = stream(gws[gi].listen, msgs, max_tokens)
            with lock:
                done[0] += 1
                if st != 200:
                    out["errors"] += 1
                    continue
                out["ttfts"].append(ttft)
                out["counts"][replica] = out["counts"].get(replica, 0) + 1
                if t > 0:
                    out["follow_ups"] += 1
                    out["stuck"] += replica == last
            last = replica
            msgs = msgs + [{"role": "assistant", "content": f"answer {t} " * 8}]

    total = n * turns
    elapsed = drive(plans, run, concurrency, lambda _: log(f"  sessions: {done[0]}/{total} requests"), 5.0)
    after = [scrape(s["port"]) for s in sims]
    d = lambda k: sum(a.get(k, 0) - b.get(k, 0) for a, b in zip(after, before))  # noqa: E731
    q, h = d("vllm:prefix_cache_queries_total"), d("vllm:prefix_cache_hits_total")
    return {"requests": total, "errors": out["errors"], "elapsed_s": elapsed,
            "follow_ups_on_holder": out["stuck"] / out["follow_ups"] if out["follow_ups"] else float("nan"),
            "hit_rate": h / q if q else float("nan"),
            "ttft_p50_ms": pct(out["ttfts"], 50) * 1000, "ttft_p99_ms": pct(out["ttfts"], 99) * 1000,
            **shares(out["counts"], [s["name"] for s in sims])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gateways", type=int, default=4)
    ap.add_argument("--replicas", type=int, default=32)
    ap.add_argument("--burst", type=int, default=64, help="requests per gateway in the burst")
    ap.add_argument("--burst-prefix-words", type=int, default=400)
    ap.add_argument("--sessions", type=int, default=256)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--prefill-tps", type=float, default=20000)
    ap.add_argument("--decode-ms", type=float, default=5)
    ap.add_argument("--blocks", type=int, default=2048, help="KV blocks per simulated replica")
    ap.add_argument("--load-interval-ms", type=int, default=100, help="the agents' load scrape interval")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--skip", choices=["burst", "sessions"], action="append", default=[])
    ap.add_argument("--arms", type=lambda v: v.split(","), default=DEFAULT_ARMS,
                    help=f"comma-separated, of {', '.join(ARMS)}")
    ap.add_argument("--out", type=Path, default=kit.ROOT / "results" / "bench")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    work = a.out / "gateways-run"
    work.mkdir(exist_ok=True)
    sim_bin, agent_bin = kit.built("llmgw-sim", "release"), kit.built("llmgw-agent", "release")
    wasm, envoy_bin = kit.wasm(), kit.envoy_bin()
    result = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}, "arms": {}}
    with kit.Procs(work) as procs:
        stop_on_signals(procs)
        log(f"starting {a.replicas} simulated replicas (publishers bound on loopback)")
        sims = new_sims(a.replicas)
        for s in sims:
            procs.start(bound_sim_command(sim_bin, s, MODEL, blocks=a.blocks, seed="0", decode_ms=a.decode_ms,
                                          prefill_tps=a.prefill_tps), s["name"])
        wait_sims(sims, 60)
        for arm in a.arms:
            restart_sims(sims)
            log(f"[{arm}] starting {a.gateways} gateways (Envoy + agent each; load scraped every "
                f"{a.load_interval_ms} ms): {ARMS[arm][0]}")
            cfg = kit.filter_config({"name": "gw", "weights": ARMS[arm][1]}, explain_header=True)
            gws = start_gateways(procs, agent_bin, envoy_bin, wasm, work, sims, MODEL, a.gateways, cfg,
                                 prefix=f"{arm}-", load={"interval_ms": a.load_interval_ms})
            kit.wait_until(lambda: indexes_equal_agents(gws), 60, "every gateway's index equal to its agent's")
            out = result["arms"][arm] = {}
            if "burst" not in a.skip:
                log(f"[{arm}] burst: {a.gateways} x {a.burst} requests sharing one new prefix")
                out["burst"] = b = burst(gws, sims, a.burst, a.burst_prefix_words, a.max_tokens, a.seed)
                log(f"  busiest {b['max_x_fair']:.2f}x fair, idlest {b['min_x_fair']:.2f}x, {b['used']}/{len(sims)} "
                    f"replicas used, TTFT p50 {b['ttft_p50_ms']:.0f} ms p99 {b['ttft_p99_ms']:.0f} ms, "
                    f"errors {b['errors']}")
            if "sessions" not in a.skip:
                log(f"[{arm}] sessions: {a.sessions} x {a.turns} turns, concurrency {a.concurrency}, "
                    "each turn to a random gateway")
                out["sessions"] = s = sessions(gws, sims, a.sessions, a.turns, a.concurrency, a.max_tokens, a.seed)
                log(f"  follow-ups on their holder {s['follow_ups_on_holder']:.3f}, hit rate {s['hit_rate']:.3f}, "
                    f"CoV {s['cov']:.3f}, max/min {s['max_x_fair']:.2f}/{s['min_x_fair']:.2f} x fair, "
                    f"TTFT p50 {s['ttft_p50_ms']:.0f} ms p99 {s['ttft_p99_ms']:.0f} ms, errors {s['errors']}")
            for g in gws:
                g.stop(procs)
    (a.out / "gateways.json").write_text(json.dumps(result, indent=1))
    lines = ["# Gateways benchmark\n", f"`{' '.join(sys.argv)}`\n",
             f"{a.gateways} gateways x {a.replicas} simulated replicas, load scraped every {a.load_interval_ms} ms; "
             "arms on the same replicas, caches emptied before each.\n"]
    if "burst" not in a.skip:
        lines += [f"Burst: {a.gateways} x {a.burst} requests sharing one new prefix.\n",
                  "| arm | busiest x fair | idlest x fair | replicas used | TTFT p50 ms | p99 ms | errors |",
                  "|---|---|---|---|---|---|---|"]
        for arm, r in result["arms"].items():
            b = r["burst"]
            lines.append(f"| {ARMS[arm][0]} | {b['max_x_fair']:.2f} | {b['min_x_fair']:.2f} | {b['used']}/{a.replicas} "
                         f"| {b['ttft_p50_ms']:.0f} | {b['ttft_p99_ms']:.0f} | {b['errors']} |")
        lines.append("")
    if "sessions" not in a.skip:
        lines += [f"Sessions: {a.sessions} x {a.turns} turns, concurrency {a.concurrency}, each turn to a random gateway.\n",
                  "| arm | follow-ups on holder | hit rate | CoV | max/min x fair | TTFT p50 ms | p99 ms | errors |",
                  "|---|---|---|---|---|---|---|---|"]
        for arm, r in result["arms"].items():
            s = r["sessions"]
            lines.append(f"| {ARMS[arm][0]} | {s['follow_ups_on_holder']:.3f} | {s['hit_rate']:.3f} | {s['cov']:.3f} "
                         f"| {s['max_x_fair']:.2f}/{s['min_x_fair']:.2f} | {s['ttft_p50_ms']:.0f} | {s['ttft_p99_ms']:.0f} "
                         f"| {s['errors']} |")
        lines.append("")
    (a.out / "gateways.md").write_text("\n".join(lines))
    log(f"wrote {a.out / 'gateways.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
