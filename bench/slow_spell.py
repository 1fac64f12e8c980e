#!/usr/bin/env python3
"""A replica's slow spell and its recovery behind llmgw (simulated replicas, llmgw-sim).

One replica (r0) stalls every request it starts by --stall-ms before its prefill, from
--spell-start to --spell-end seconds into the run, then answers as fast as the others again.
llmgw learns the stall from r0's first tokens and routes around it. r0 then gets no requests,
so no observation tells llmgw that it recovered.

Two arms, each on fresh replicas, agent and Envoy, under the same seeded shared-prefix traffic
(--prompts system prompts, each request one of them plus its own question, streamed, at
--concurrency) for --seconds:
- `forget`: the shipped defaults. Learned rates are forgotten after `rates_forget_ms`
  (30,000) without an observation.
- `keep`: `rates_forget_ms: 0`, rates kept for good: how llmgw routed before forgetting.

Reported per arm and per --window seconds: each replica's share of the requests finished
in the window (its own request counter), and the time to first token p50 and p99 at the
client of the requests started in it. The same figures are given over the
run's last third, well past the spell, where a replica left out shows as a share near 0.

Writes results/bench/slow_spell.md and slow_spell.json. A progress line per window goes to
stdout, readable in a log. Everything listens on 127.0.0.1; every process started is stopped
at exit, also on Ctrl-C."""

from __future__ import annotations

import argparse
import json
import random
import shlex
import sys
import threading
import time
from pathlib import Path

import llmgw_testkit as kit
from llmgw_testkit import stream_request
from llmgw_testkit.fleet import (SIM_WEIGHTS, fleet_agent, new_sims, pct, restart_sims, scrape, sim_command,
                                 start_router, stop_on_signals, wait_sims)
from llmgw_testkit.workloads import words

ROOT = kit.ROOT
MODEL = "demo-model"
BLOCK = 16
ARMS = {
    "forget": ("shipped defaults (rates forgotten after 30 s quiet)", {}),
    "keep": ("rates kept for good (`rates_forget_ms: 0`)", {"rates_forget_ms": 0}),
}


def stall(sim: dict, ms: int) -> None:
    """Sets the replica's stall before each prefill it starts (0: none)."""
    kit.post_json(f"http://127.0.0.1:{sim['port']}/sim/fault", {"first_token_delay_ms": ms})


def served(sims: list[dict]) -> list[float]:
    """Each replica's requests finished so far (its vllm:request_success_total)."""
    return [scrape(s["port"]).get("vllm:request_success_total", 0.0) for s in sims]


def run_arm(procs: kit.Procs, a, work: Path, sims: list[dict], arm: str) -> dict:
    """One arm's run on freshly restarted replicas: its windows and its last third."""
    restart_sims(sims)
    agent = fleet_agent(procs, a.agent_bin, work, sims, MODEL, name=f"agent-{arm}")
    port, admin = kit.free_port(), kit.free_port()
    weights = {**SIM_WEIGHTS, **ARMS[arm][1]}
    cfg = kit.filter_config({"name": "spell", "kv_events": True, "block_size": BLOCK, "weights": weights})
    text = kit.shipped_config(a.wasm, port, admin, agent.feed, cfg)
    envoy, _ = start_router(procs, a.envoy, work, f"envoy-{arm}", text, admin, feed=True)
    rng = random.Random(a.seed)
    systems = [words(rng, "w", a.system_words, vocab=5000) for _ in range(a.prompts)]
    lock = threading.Lock()
    done: list[tuple[float, float, int]] = []  # (start s, ttft s, status)
    stop = threading.Event()
    t0 = time.monotonic()

    def client(i: int) -> None:
        r = random.Random(a.seed * 1000 + i)
        while not stop.is_set():
            body = {"model": MODEL, "prompt": systems[r.randrange(len(systems))] + " " + words(r, "w", a.question_words, vocab=5000),
                    "max_tokens": a.max_tokens, "stream": True}
            start = time.monotonic() - t0
            ttft, _, status = stream_request(port, body, keepalive=True, path="/v1/completions")
            with lock:
                done.append((start, ttft, status))

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(a.concurrency)]
    for t in threads:
        t.start()
    windows, last = [], served(sims)
    spell = "before"
    try:
        for w in range(int(a.seconds // a.window)):
            w_end = (w + 1) * a.window
            while (now := time.monotonic() - t0) < w_end:
                if spell == "before" and now >= a.spell_start:
                    stall(sims[0], a.stall_ms)
                    spell = "during"
                elif spell == "during" and now >= a.spell_end:
                    stall(sims[0], 0)
                    spell = "after"
                time.sleep(min(0.05, max(0.0, w_end - now)))
            counts = served(sims)
            delta = [c - p for c, p in zip(counts, last)]
            last = counts
            with lock:
                ttfts = [d[1] * 1000 for d in done if w * a.window <= d[0] < w_end and d[2] == 200]
            total = sum(delta) or 1.0
            row = {"from_s": w * a.window, "to_s": w_end, "shares": [d / total for d in delta], "requests": sum(delta),
                   "p50": pct(ttfts, 50) if ttfts else None, "p99": pct(ttfts, 99) if ttfts else None}
            windows.append(row)
            print(f"[{arm}] {row['from_s']:.0f}-{row['to_s']:.0f} s: shares "
                  + " ".join(f"{s:.2f}" for s in row["shares"])
                  + f", {row['requests']:.0f} requests, TTFT p50 {ms(row['p50'])} ms", flush=True)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
        try:
            stall(sims[0], 0)
        except OSError as e:
            print(f"[{arm}] could not clear r0's stall: {e}", flush=True)
        procs.stop(envoy)
        procs.stop(agent.proc)
    # The last third of the windows (at least one).
    tail = windows[-max(1, len(windows) // 3):]
    tail_from = tail[0]["from_s"] if tail else 0.0
    n = sum(w["requests"] for w in tail) or 1.0
    tail_shares = [sum(w["shares"][i] * w["requests"] for w in tail) / n for i in range(len(sims))]
    with lock:
        tail_ttfts = [d[1] * 1000 for d in done if d[0] >= tail_from and d[2] == 200]
        errors = sum(1 for d in done if d[2] != 200)
    return {"arm": arm, "windows": windows, "tail_from_s": tail_from, "tail_shares": tail_shares,
            "tail_p50": pct(tail_ttfts, 50) if tail_ttfts else None, "tail_p99": pct(tail_ttfts, 99) if tail_ttfts else None,
            "errors": errors, "requests": len(done)}


def ms(v: float | None) -> str:
    """A time in ms for the report ("–" where no request was timed)."""
    return "–" if v is None or v != v else f"{v:.1f}"


def report(out: Path, command: str, a, results: list[dict]) -> None:
    lines = ["# A replica's slow spell and its recovery", "",
             f"Command: `{command}`", "",
             f"{a.replicas} simulated replicas ({a.prefill_tps:g} prompt tokens/s, {a.decode_ms:g} ms a step, "
             f"{a.blocks} blocks), {a.prompts} system prompts of {a.system_words} words, concurrency {a.concurrency}, "
             f"{a.max_tokens} output tokens. Replica r0 stalls every request {a.stall_ms} ms before its prefill from "
             f"{a.spell_start:g} s to {a.spell_end:g} s.", ""]
    names = [f"r{i}" for i in range(a.replicas)]
    for r in results:
        lines += [f"## {ARMS[r['arm']][0]}", "",
                  "| window, s | " + " | ".join(f"{n} share" for n in names) + " | requests | TTFT p50 ms | p99 ms |",
                  "|---|" + "---|" * (len(names) + 3)]
        for w in r["windows"]:
            lines.append(f"| {w['from_s']:.0f}–{w['to_s']:.0f} | " + " | ".join(f"{s:.2f}" for s in w["shares"])
                         + f" | {w['requests']:.0f} | {ms(w['p50'])} | {ms(w['p99'])} |")
        lines.append("")
    lines += ["## Past the spell", "",
              f"From {results[0]['tail_from_s']:.0f} s to the end:", "",
              "| arm | " + " | ".join(f"{n} share" for n in names) + " | TTFT p50 ms | p99 ms | errors |",
              "|---|" + "---|" * (len(names) + 3)]
    for r in results:
        lines.append(f"| {r['arm']} | " + " | ".join(f"{s:.2f}" for s in r["tail_shares"])
                     + f" | {ms(r['tail_p50'])} | {ms(r['tail_p99'])} | {r['errors']} |")
    out.mkdir(parents=True, exist_ok=True)
    (out / "slow_spell.md").write_text("\n".join(lines) + "\n")
    (out / "slow_spell.json").write_text(json.dumps({"command": command, "args": {k: str(v) for k, v in vars(a).items()},
                                                     "results": results}, indent=1))
    print("\n".join(lines))
    print(f"\nwritten: {out / 'slow_spell.md'}, {out / 'slow_spell.json'}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    ap.add_argument("--seconds", type=float, default=90.0, help="each arm's run (default 90)")
    ap.add_argument("--window", type=float, default=10.0, help="seconds per reported window (default 10)")
    ap.add_argument("--spell-start", type=float, default=10.0)
    ap.add_argument("--spell-end", type=float, default=25.0)
    ap.add_argument("--stall-ms", type=int, default=200, help="r0's stall per request during the spell")
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=6, help="system prompts")
    ap.add_argument("--system-words", type=int, default=600)
    ap.add_argument("--question-words", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=512, help="KV blocks per replica")
    ap.add_argument("--prefill-tps", type=float, default=8000.0)
    ap.add_argument("--decode-ms", type=float, default=5.0)
    ap.add_argument("--max-batch", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "bench")
    a = ap.parse_args()
    if a.window <= 0 or not 0 <= a.spell_start < a.spell_end < int(a.seconds // a.window) * a.window:
        print("need --window > 0 and 0 <= --spell-start < --spell-end < the last whole window's end", file=sys.stderr)
        return 2
    try:
        a.sim_bin, a.agent_bin = kit.built("llmgw-sim", "release"), kit.built("llmgw-agent", "release")
        a.wasm, a.envoy = kit.wasm(), kit.envoy_bin()
    except FileNotFoundError as e:
        print(e, file=sys.stderr)
        return 1
    command = "./build.sh bench slow-spell" + "".join(" " + shlex.quote(x) for x in sys.argv[1:])
    work = a.out / "slow-spell-run"
    work.mkdir(parents=True, exist_ok=True)
    results = []
    with kit.Procs(work) as procs:
        stop_on_signals(procs)
        sims = new_sims(a.replicas)
        for s in sims:
            procs.start(sim_command(a.sim_bin, s, MODEL, blocks=a.blocks, seed=0, block_size=BLOCK,
                                    prefill_tps=a.prefill_tps, decode_ms=a.decode_ms, max_batch=a.max_batch), s["name"])
        wait_sims(sims)
        for arm in a.arms:
            print(f"arm {arm}: {ARMS[arm][0]}, {a.seconds:g} s", flush=True)
            results.append(run_arm(procs, a, work, sims, arm))
    report(a.out, command, a, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
