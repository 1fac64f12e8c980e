#!/usr/bin/env python3
"""llmgw demo: 4 simulated vLLM replicas, the agent and Envoy with llmgw.wasm, driven by a
chat workload (shared system prompts, multi-turn conversations). Three runs on identical
traffic: Envoy's round-robin, llmgw with only its approximate fallback, llmgw with KV events.
Prints a table and writes a PNG chart. Everything listens on 127.0.0.1 and is stopped at exit,
also on Ctrl-C.

`--tenants N` spreads the conversations over N tenants, each with its own `cache_salt`: they send
the same system prompts but share no KV blocks, which the approximate arm (it matches text) cannot
see and the KV-event arm can."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import llmgw_testkit as kit  # the project's test kit: processes, configs, clients
from llmgw_testkit.fleet import (SIM_WEIGHTS, fleet_agent, new_sims, restart_sims,
                                 sim_command, start_router, stop_on_signals, wait_sims)
from llmgw_testkit.sessions import run_sessions
from llmgw_testkit.workloads import Conversations, make_sessions
from llmgw_testkit.charts import pyplot

ROOT = kit.ROOT
MODEL = "demo-model"


# ----------------------------------------------------------------------------------------------
# Workload


def make_workload(seed: int, conversations: int, groups: int, system_words: int, turns: int, tenants: int = 0):
    """Conversations, each a list of chat bodies (turn k extends turn k-1). Groups share a
    long system prompt; group popularity is skewed (Zipf-like); with `tenants`, each
    conversation carries one tenant's cache salt."""
    shape = Conversations(conversations, turns, first_user_words=(20, 60), user_words=(20, 60), assistant_words=None,
                          user_tag="u", system_groups=groups, system_words=system_words, shuffle=False, vocab=50000,
                          tenants=tenants)
    return make_sessions(shape, seed, MODEL, 8)


def run_traffic(label: str, port: int, sims: list[dict], convs, concurrency: int) -> dict:
    return run_sessions(label, lambda body: kit.stream_request(port, body), sims, convs, concurrency,
                        summary=lambda r: f"  {label:<28} {r['requests']:>4}/{r['requests']} requests  {r['elapsed_s']:5.1f}s")


# ----------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--envoy", default=str(ROOT / ".venv" / "bin" / "envoy"))
    ap.add_argument("--conversations", type=int, default=160)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--system-words", type=int, default=600)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--tenants", type=int, default=0,
                    help="spread the conversations over this many tenants, each with its own cache_salt: same text, "
                         "no shared KV blocks (where KV events beat matching text)")
    ap.add_argument("--blocks", type=int, default=160, help="GPU blocks per simulated replica")
    ap.add_argument("--out", default=str(ROOT / "results" / "demo"))
    ap.add_argument("--wasm", default=None, help="the filter to load (default dist/llmgw.wasm)")
    ap.add_argument("--runs", default="rr,approx,exact",
                    help="comma-separated arms: rr (Envoy round-robin), approx, exact (default all three)")
    ap.add_argument("--weights", default=json.dumps(SIM_WEIGHTS),
                    help=f"JSON object passed as the llmgw profile's `weights` (default {json.dumps(SIM_WEIGHTS)}: "
                         "the simulator's physics, see llmgw_testkit.fleet.SIM_WEIGHTS)")
    args = ap.parse_args()
    weights = json.loads(args.weights) if args.weights else None

    try:
        sim_bin, agent_bin, wasm = kit.built("llmgw-sim", "release"), kit.built("llmgw-agent", "release"), (
            Path(args.wasm) if args.wasm else kit.wasm())
    except FileNotFoundError as e:
        print(e, file=sys.stderr)
        return 1
    if not Path(args.envoy).exists():
        print(f"missing {args.envoy}: run ./build.sh setup", file=sys.stderr)
        return 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logdir = Path(tempfile.mkdtemp(prefix="llmgw-demo-"))
    procs = kit.Procs(logdir)
    stop_on_signals(procs)
    try:
        sims = new_sims(4)
        agent = fleet_agent(procs, agent_bin, logdir, sims, MODEL)
        for s in sims:
            procs.start(sim_command(sim_bin, s, MODEL, blocks=args.blocks, seed=0, prefill_tps=4000, decode_ms=8,
                                    max_batch=4), s["name"])
        wait_sims(sims)
        if args.tenants < 0:
            print("--tenants must be 0 or more", file=sys.stderr)
            return 2
        convs = make_workload(7, args.conversations, args.groups, args.system_words, args.turns, args.tenants)
        n = sum(len(c) for c in convs)
        tenants = f", {args.tenants} tenants (cache_salt)" if args.tenants else ""
        print(f"llmgw demo: 4 simulated vLLM replicas ({args.blocks} KV blocks each), {n} chat requests per run "
              f"({args.conversations} conversations x {args.turns} turns, {args.groups} shared system prompts{tenants}), "
              f"concurrency {args.concurrency}")
        runs = []
        arms = [("Envoy round-robin", "rr"), ("llmgw approximate only", "approx"), ("llmgw with KV events", "exact")]
        chosen = args.runs.split(",")
        for label, mode in [a for a in arms if a[1] in chosen]:
            restart_sims(sims)  # identical starting state: empty caches
            listen, admin = kit.free_port(), kit.free_port()
            config = (kit.lb_config(listen, admin, [s["port"] for s in sims]) if mode == "rr" else
                      kit.shipped_config(wasm, listen, admin, agent.feed,
                                         kit.filter_config({"name": "demo", "kv_events": mode == "exact",
                                                        **({"weights": weights} if weights else {})})))
            envoy, _ = start_router(procs, args.envoy, logdir, f"envoy-{mode}", config, admin, feed=mode != "rr")
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
    plt = pyplot()
    if plt is None:
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
