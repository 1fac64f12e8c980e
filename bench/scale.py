#!/usr/bin/env python3
"""llmgw scale benchmark (`./build.sh bench scale`, not in CI).

1. One filter VM's index at 16, 64, 256 and 1,024 replicas x 100,000 blocks each: memory per
   (block, replica) and decision time (`crates/llmgw-core/examples/scale_index.rs`: the real
   request path, sizes interleaved round by round, ratios against 16 replicas in the same round).
2. The agent (the release `llmgw-agent run`, pinned to one CPU) against 256 vLLM-like publishers
   (`crates/llmgw-agent/examples/kv_publishers.rs`: libzmq XPUB sockets bound on 127.0.0.1,
   vLLM's frames and msgpack batches, paced, on the other CPU) at the assumed realistic rate, 4x
   and 8x it, with one feed subscriber checking that every change arrives; then the feed to 1, 8,
   32 and 64 subscribers (`examples/feed_subscribers.rs`, one HTTP/2 connection each).
3. One agent with 256, 512 and 1,024 publishers at the realistic rate: CPU, threads, sockets,
   memory and bytes in, per agent and per replica.

Writes results/scale/scale.md (tables and the command), scale.json and two PNGs (also copied to
bench/charts/ with --charts). Everything listens on 127.0.0.1; every process started is stopped
at exit. Absolute figures depend on the machine; the ratios are measured within one run."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import llmgw_testkit as kit
from llmgw_testkit.agent import agent_config
from llmgw_testkit.procs import Procs, free_port, process_cpu_seconds, wait_port, wait_until

ROOT = kit.ROOT
# The assumed realistic event rate of one busy replica (see the manual's Scale chapter, docs/src/benchmarks/scale.md):
# 100 engine steps/s, each publishing 12 stored blocks (2 chains of 6) and 12 evicted ones.
RATE = 100.0
BLOCKS_PER_BATCH = 24
# Before measuring, every publisher sends more than the publishers' eviction lag (512 batches), so
# that every removal in the measured phases evicts a block the agent holds.
WARM = (RATE, 6.0)


def log(msg: str) -> None:
    print(f"[scale {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def proc_stat(pid: int) -> dict:
    """CPU seconds (user + system), threads, RSS and open sockets of a process."""
    cpu = process_cpu_seconds(pid)
    status = Path(f"/proc/{pid}/status").read_text()
    threads = int(re.search(r"^Threads:\s+(\d+)", status, re.M).group(1))
    rss = int(re.search(r"^VmRSS:\s+(\d+)", status, re.M).group(1)) * 1024
    socks = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            socks += os.readlink(fd).startswith("socket:")
        except OSError:
            pass
    return {"t": time.monotonic(), "cpu": cpu, "threads": threads, "rss": rss, "sockets": socks}


def json_lines(path: Path) -> list[dict]:
    out = []
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return out
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def wait_line(path: Path, pred, timeout: float, what: str) -> dict:
    return wait_until(lambda: next((j for j in json_lines(path) if pred(j)), None), timeout, what, interval=0.05)


def metric_sum(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


# ---------------------------------------------------------------------------------------------
# 1. the index


def run_index(args, out: Path) -> dict:
    exe = kit.built("examples/scale_index", "release")
    cmd = ["nice", str(exe), "--sizes", args.sizes, "--blocks", str(args.blocks), "--rounds", str(args.rounds),
           "--case-ms", str(args.case_ms)]
    log("index: " + " ".join(cmd[1:]))
    with open(out / "index.jsonl", "w") as f, open(out / "index.log", "w") as err:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.PIPE, text=True)
        for line in p.stderr:
            err.write(line)
            log("index: " + line.rstrip())
        if p.wait() != 0:
            raise SystemExit(f"scale_index failed ({p.returncode}); see {out / 'index.log'}")
    rows = json_lines(out / "index.jsonl")
    memory = [r for r in rows if r["kind"] == "memory"]
    times = [r for r in rows if r["kind"] == "time"]
    base = min(r["replicas"] for r in memory)
    # Per (case, scenario, tokens, replicas): median ns and median ratio to the base size in the same round.
    by = {}
    for r in times:
        by.setdefault((r["case"], r["scenario"], r["tokens"]), {}).setdefault(r["round"], {})[r["replicas"]] = r["ns"]
    summary = {}
    for key, rounds in by.items():
        sizes = sorted({n for rr in rounds.values() for n in rr})
        cell = {}
        for n in sizes:
            ns = [rr[n] for rr in rounds.values() if n in rr]
            ratios = [rr[n] / rr[base] for rr in rounds.values() if n in rr and base in rr]
            cell[n] = {"ns": statistics.median(ns), "ratio": statistics.median(ratios) if ratios else None}
        summary["|".join(map(str, key))] = cell
    shown = "cargo run --release -p llmgw-core --example scale_index -- " + " ".join(cmd[2:])
    return {"memory": memory, "summary": summary, "base": base, "cmd": shown}


# ---------------------------------------------------------------------------------------------
# 2 and 3. the agent


class AgentRun:
    """Publishers (CPU 1), the agent (CPU 0), CPU samples of the agent."""

    def __init__(self, procs: Procs, work: Path, count: int, phases: list[tuple[float, float]], name: str,
                 nats: str | None = None, nats_memory: bool = False):
        """With `nats` (a JetStream URL) the publishers put their batches on the stream and the
        agent reads it (replicas with events = "jetstream") instead of subscribing to each."""
        self.procs, self.work, self.count, self.name = procs, work, count, name
        self.pub_log = work / f"{name}-publishers.log"
        eps = work / f"{name}-endpoints.txt"
        exe = kit.built("examples/kv_publishers", "release")
        phase_arg = ",".join(f"{r:g}:{s:g}" for r, s in phases)
        via = (["--nats", nats] + (["--memory"] if nats_memory else [])) if nats else []
        self.pub = procs.start(["nice", exe, "--count", count, "--endpoints", eps, "--phases", phase_arg, *via],
                               f"{name}-publishers", cpu=1)
        wait_until(lambda: eps.exists() and len(eps.read_text().split()) == count, 60, "publisher endpoints")
        endpoints = eps.read_text().split()
        self.feed_port, self.http_port = free_port(), free_port()
        replicas = [{"name": f"r{i}", "address": f"127.0.{i >> 8}.{i & 255}:8000", "models": ["m"],
                     "endpoint": ep, "mode": "connect", "topic": "", "metrics_url": ""}
                    for i, ep in enumerate(endpoints)]
        extra = {}
        if nats:
            replicas = [{"name": r["name"], "address": r["address"], "models": ["m"], "metrics_url": "",
                         "events": "jetstream"} for r in replicas]
            extra = {"jetstream": {"url": nats, "max_messages_per_subject": 1000, "memory_storage": nats_memory}}
        cfg = agent_config(self.feed_port, self.http_port, replicas, **extra,
                           hash={"algo": "sha256_cbor", "seed": "0", "block_size": 16},
                           load={"enabled": False},
                           zmq={"verify_on_reconnect": False, "down_after_disconnect_ms": 0})
        path = work / f"{name}-agent.toml"
        path.write_text(cfg)
        agent = kit.built("llmgw-agent", "release")
        self.agent = procs.start([agent, "run", "--config", path, "--log-level", "warn"], f"{name}-agent", cpu=0)
        wait_port(self.feed_port, 60)
        wait_line(self.pub_log, lambda j: j.get("event") == "subscribed", 120, "every publisher subscribed")
        log(f"{name}: {count} publishers subscribed by the agent")

    def stat(self) -> dict:
        return proc_stat(self.agent.pid)

    def phase_start(self, i: int) -> dict:
        return wait_line(self.pub_log, lambda j: j.get("event") == "phase_start" and j["phase"] == i, 600,
                         f"phase {i}")

    def phase_end(self, i: int) -> dict:
        return wait_line(self.pub_log, lambda j: j.get("event") == "phase_end" and j["phase"] == i, 900,
                         f"end of phase {i}")

    def subscribers(self, n: int, warmup: float, secs: float, batches: bool = False) -> dict:
        """Runs n feed subscribers (`batches`: as the filter subscribes, taking gathered
        changes); the agent's CPU over their measured window."""
        exe = kit.built("examples/feed_subscribers", "release")
        tag = f"{self.name}-subs{n}-{time.monotonic_ns()}"
        p = self.procs.start(["nice", exe, "--agent", f"http://127.0.0.1:{self.feed_port}", "--count", n,
                              "--warmup", warmup, "--secs", secs, *(["--batches"] if batches else [])], tag)
        path = p.log_path
        start = wait_line(path, lambda j: j.get("event") == "measure_start", warmup + 180, "subscribers measuring")
        a, ma = self.stat(), self.applied()
        end = wait_line(path, lambda j: j.get("event") == "measure_end", secs + 60, "subscribers done")
        b, mb = self.stat(), self.applied()
        self.procs.stop(p)
        dt = b["t"] - a["t"]
        return {**end, "synced": start["synced"], "synced_s": start["synced_s"], "snapshot_bytes": start["snapshot_bytes"],
                "agent_cpu_share": (b["cpu"] - a["cpu"]) / dt, "agent_threads": b["threads"],
                "agent_rss": b["rss"], "agent_sockets": b["sockets"], "applied_batches_s": (mb - ma) / dt,
                "cpu_us_per_batch": (b["cpu"] - a["cpu"]) / max(mb - ma, 1) * 1e6}

    def applied(self) -> float:
        return metric_sum(self.http_port, "llmgw_agent_events_applied_total")

    def gaps(self) -> float:
        return metric_sum(self.http_port, "llmgw_agent_gaps_total")


def ingest_phase(run: AgentRun, i: int, rate: float, warmup: float, secs: float) -> dict:
    """The agent's CPU and applied batches over `secs` of phase `i` (after `warmup`), and what one
    feed subscriber received over the same span."""
    run.phase_start(i)
    exe = kit.built("examples/feed_subscribers", "release")
    p = run.procs.start(["nice", exe, "--agent", f"http://127.0.0.1:{run.feed_port}", "--count", 1,
                         "--warmup", warmup, "--secs", secs, "--sync-timeout", 0], f"{run.name}-phase{i}-sub")
    time.sleep(warmup)
    a, ma = run.stat(), run.applied()
    time.sleep(max(0.0, a["t"] + secs - time.monotonic()))
    b, mb = run.stat(), run.applied()
    end = run.phase_end(i)
    try:
        sub = wait_line(p.log_path, lambda j: j.get("event") == "measure_end", 30, "subscriber done")
        start = wait_line(p.log_path, lambda j: j.get("event") == "measure_start", 1, "subscriber start")
    except TimeoutError:
        sub, start = {"delta_blocks": 0, "secs": secs, "bytes": 0, "msgs": 0}, {"synced": 0}
    run.procs.stop(p)
    dt = b["t"] - a["t"]
    applied = (mb - ma) / dt
    cpu = (b["cpu"] - a["cpu"]) / dt
    us = (b["cpu"] - a["cpu"]) / max(mb - ma, 1) * 1e6
    expected = end["achieved_rate"] * BLOCKS_PER_BATCH * run.count * sub["secs"]
    row = {"publishers": run.count, "rate_batches": rate, "achieved_batches": end["achieved_rate"],
           "block_events_per_replica_s": end["achieved_rate"] * BLOCKS_PER_BATCH,
           "agent_block_events_s": end["achieved_rate"] * BLOCKS_PER_BATCH * run.count,
           "payload_bytes_s": end["bytes"] / end["secs"], "pub_dropped": end["dropped"],
           "cpu_share": cpu, "applied_batches_s": applied, "cpu_us_per_batch": us,
           "kept_up": applied / max(end["achieved_rate"] * run.count, 1),
           # Batches one core can take at this cost, over the realistic demand of these publishers.
           "headroom": 1e6 / us / (RATE * run.count),
           "delivered_ratio": sub["delta_blocks"] / expected if expected else 0.0, "sub_synced": start.get("synced", 0),
           "threads": b["threads"], "rss": b["rss"], "sockets": b["sockets"],
           "feed_bytes_s": sub["bytes"] / sub["secs"], "feed_msgs_s": sub["msgs"] / sub["secs"]}
    log(f"ingest {run.count} publishers x {rate:g} batches/s: agent CPU {cpu:.3f} of a core, {us:.1f} µs per batch, "
        f"applied {applied:.0f} of {end['achieved_rate'] * run.count:.0f} batches/s offered, headroom {row['headroom']:.2f}x, "
        f"subscriber synced {row['sub_synced']}, got {row['delivered_ratio']:.3f} of the changes")
    return row


def run_agent(args, out: Path) -> dict:
    res = {"ingest": [], "feed": [], "reach": []}
    with Procs(out) as procs:
        # 256 publishers: the realistic rate, 4x and 8x it, one subscriber checking delivery.
        w, s = args.warmup, args.secs
        phases = [WARM, (RATE, w + s + 4), (4 * RATE, w + s + 4), (8 * RATE, w + s + 4)]
        run = AgentRun(procs, out, args.publishers, phases, "ingest")
        for i in (1, 2, 3):
            res["ingest"].append(ingest_phase(run, i, phases[i][0], w, s))
        res["ingest_gaps"] = run.gaps()
        procs.stop_all()
        # The feed to N subscribers, from --feed-publishers publishers at the realistic rate (a
        # change rate the agent sustains here, so every subscriber's snapshot completes).
        sub_counts = [int(x) for x in args.subscribers.split(",")]
        run = AgentRun(procs, out, args.feed_publishers, [WARM, (RATE, 0)], "feed")
        run.phase_start(1)
        # Each N twice: one message per change, then as the filter subscribes (the changes
        # gathered, feed.gather_ms).
        for batches in (False, True):
            for n in sub_counts:
                r = run.subscribers(n, w, s, batches)
                row = {"subscribers": n, "batches": batches, "publishers": run.count, "cpu_share": r["agent_cpu_share"],
                       "feed_bytes_s_total": r["bytes"] / r["secs"], "feed_bytes_s_each": r["bytes"] / r["secs"] / n,
                       "msgs_s_each": r["msgs"] / r["secs"] / n, "connected": r["connected"],
                       "delta_blocks_s_each": r["delta_blocks"] / r["secs"] / n, "synced": r["synced"],
                       "synced_s": r["synced_s"], "snapshot_bytes_each": r["snapshot_bytes"] / n,
                       "snapshot_blocks_measured": r["snapshot_blocks"], "cpu_us_per_batch": r["cpu_us_per_batch"],
                       "applied_batches_s": r["applied_batches_s"], "rss": r["agent_rss"]}
                log(f"feed {n} subscribers{' (batching)' if batches else ''}: agent CPU {row['cpu_share']:.3f}, "
                    f"{row['msgs_s_each']:.0f} messages/s and {row['feed_bytes_s_each'] / 1e3:.0f} kB/s each, "
                    f"{row['synced']} snapshots complete after {row['synced_s']:.1f} s, applied {row['applied_batches_s']:.0f} batches/s")
                res["feed"].append(row)
        (out / "feed-endpoints.txt.advance").touch()
        run.phase_end(1)
        procs.stop_all()
        # Past one agent's reach: 256 (above), 512, 1024 publishers at the realistic rate.
        for count in [int(x) for x in args.reach.split(",")]:
            if count == args.publishers:
                continue
            run = AgentRun(procs, out, count, [WARM, (RATE, w + s + 4)], f"reach{count}")
            row = ingest_phase(run, 1, RATE, w, s)
            row["gaps"] = run.gaps()
            res["reach"].append(row)
            procs.stop_all()
    res["reach"].insert(0, {**res["ingest"][0], "gaps": res["ingest_gaps"]})
    return res


# ---------------------------------------------------------------------------------------------
# report


def fmt_us(ns: float) -> str:
    us = ns / 1e3
    return f"{us:.1f} µs" if us < 100 else f"{us:.0f} µs" if us < 10_000 else f"{us / 1e3:.1f} ms"


def report(ix: dict | None, ag: dict | None, out: Path, cmdline: str) -> str:
    md = [f"# llmgw scale benchmark\n\n`{cmdline}`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n"]
    if ix:
        sm, base = ix["summary"], ix["base"]
        sizes = sorted(m["replicas"] for m in ix["memory"])
        md.append(f"## Index of one filter VM\n\n`{ix['cmd']}`\n")
        md.append("| replicas | (block, replica) entries | index bytes | bytes per entry | build from snapshot |")
        md.append("|---|---|---|---|---|")
        for m in ix["memory"]:
            md.append(f"| {m['replicas']} | {m['entries']:,} | {m['index_bytes'] / 1e6:.1f} MB | {m['bytes_per_entry']:.2f} | {m['build_s']:.1f} s |")
        md.append("")
        md.append(f"Decision time, 4,096-token prompt: median; in brackets the median per-round ratio against {base} replicas.\n")
        md.append("| case | scenario | " + " | ".join(f"{n} replicas" for n in sizes) + " |")
        md.append("|---|---|" + "---|" * len(sizes))
        for case in ["decide_token_ids", "parse_only", "prefix_scores", "decide_cached_text", "score"]:
            for scen in ["one", "all", "none"]:
                cell = sm.get(f"{case}|{scen}|4096")
                if not cell:
                    continue
                md.append(f"| {case} | {scen} | " + " | ".join(
                    f"{fmt_us(cell[n]['ns'])} ({cell[n]['ratio']:.2f}×)" if n in cell else "—" for n in sizes) + " |")
        md.append("")
        md.append("Cost by prompt length (`prefix_scores` = hash + score; `score` alone), scenario `one` / `all`:\n")
        md.append("| case | tokens | " + " | ".join(f"{n} replicas" for n in sizes) + " |")
        md.append("|---|---|" + "---|" * len(sizes))
        for case in ["prefix_scores", "score"]:
            for tokens in [1024, 4096, 16384]:
                a, b = sm.get(f"{case}|one|{tokens}"), sm.get(f"{case}|all|{tokens}")
                if a and b:
                    md.append(f"| {case} | {tokens:,} | " + " | ".join(
                        f"{fmt_us(a[n]['ns'])} / {fmt_us(b[n]['ns'])}" for n in sizes) + " |")
        md.append("")
    if ag:
        md.append(f"## Agent ({ag.get('publishers', 256)} publishers, agent pinned to one CPU)\n")
        md.append(f"Realistic rate assumed: {RATE:g} batches/s per replica × {BLOCKS_PER_BATCH} block events = "
                  f"{RATE * BLOCKS_PER_BATCH:,.0f} block events/s per replica.\n")
        md.append("| rate × realistic | offered batches/s per publisher | block events/s offered | payload MB/s | agent CPU (share of one core) | batches/s applied (÷ offered) | CPU per batch | changes a feed subscriber got | headroom: one core ÷ realistic demand |")
        md.append("|---|---|---|---|---|---|---|---|---|")
        for r in ag["ingest"]:
            md.append(f"| {r['rate_batches'] / RATE:g}× | {r['achieved_batches']:.1f} | {r['agent_block_events_s'] / 1e6:.2f} M | "
                      f"{r['payload_bytes_s'] / 1e6:.1f} | {r['cpu_share']:.3f} | {r['applied_batches_s']:,.0f} ({r['kept_up']:.2f}) | {r['cpu_us_per_batch']:.1f} µs | "
                      f"{r['delivered_ratio']:.3f} | {r['headroom']:.2f}× |")
        md.append(f"\nSequence gaps seen by the agent over the whole run: {ag.get('ingest_gaps', 0):g}.\n")
        fp = ag["feed"][0]["publishers"] if ag["feed"] else 0
        md.append(f"\nFeed fan-out: {fp} publishers at the realistic rate ({fp * RATE:,.0f} batches/s, "
                  f"{fp * RATE * BLOCKS_PER_BATCH:,.0f} block events/s), N subscribers on one HTTP/2 connection each:\n")
        md.append("| feed subscribers | agent CPU (share of one core) | ratio to 1 subscriber | CPU per batch | feed bytes/s per subscriber | messages/s per subscriber | total feed MB/s | snapshot per subscriber | all snapshots done after |")
        md.append("|---|---|---|---|---|---|---|---|---|")
        b = ag["feed"][0]["cpu_share"] if ag["feed"] else 1
        for r in ag["feed"]:
            batching = ", batching as the filter does" if r.get("batches") else ""
            md.append(f"| {r['subscribers']} ({r['synced']} synced{batching}) | {r['cpu_share']:.3f} | {r['cpu_share'] / b:.2f}× | {r['cpu_us_per_batch']:.1f} µs | "
                      f"{r['feed_bytes_s_each'] / 1e3:.0f} kB/s | {r['msgs_s_each']:.0f} | {r['feed_bytes_s_total'] / 1e6:.1f} | "
                      f"{r['snapshot_bytes_each'] / 1e6:.1f} MB | {r['synced_s']:.1f} s |")
        md.append("\n## One agent, more publishers (realistic rate, one subscriber)\n")
        md.append("| publishers | agent CPU (share of one core) | batches/s applied (offered) | CPU per batch | headroom | threads | sockets (fds) | RSS MB | payload MB/s in | changes delivered | gaps |")
        md.append("|---|---|---|---|---|---|---|---|---|---|---|")
        b = ag["reach"][0]["cpu_share"] if ag["reach"] else 1
        for r in ag["reach"]:
            md.append(f"| {r['publishers']} | {r['cpu_share']:.3f} | {r['applied_batches_s']:,.0f} ({r['achieved_batches'] * r['publishers']:,.0f}) | {r['cpu_us_per_batch']:.1f} µs | {r['headroom']:.2f}× | {r['threads']} | "
                      f"{r['sockets']} | {r['rss'] / 1e6:.0f} | {r['payload_bytes_s'] / 1e6:.1f} | {r['delivered_ratio']:.3f} | {r.get('gaps', 0):g} |")
        md.append("")
    text = "\n".join(md) + "\n"
    (out / "scale.md").write_text(text)
    return text


def charts(ix: dict | None, ag: dict | None, out: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    made = []
    if ix:
        sm = ix["summary"]
        sizes = sorted(m["replicas"] for m in ix["memory"])
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
        for case, scen, style in [("prefix_scores", "one", "-o"), ("prefix_scores", "all", "--o"),
                                  ("score", "one", "-s"), ("score", "all", "--s"),
                                  ("decide_token_ids", "one", "-^"), ("decide_cached_text", "all", "--^")]:
            cell = sm.get(f"{case}|{scen}|4096")
            if cell:
                a1.plot(sizes, [cell[n]["ns"] / 1e3 for n in sizes], style, label=f"{case} ({scen})")
        a1.set_xscale("log", base=2)
        a1.set_yscale("log")
        a1.set_xlabel("replicas (100,000 blocks each)")
        a1.set_ylabel("µs per 4,096-token prompt (median)")
        a1.set_title("Decision time")
        a1.legend(fontsize=8)
        a1.grid(True, which="both", alpha=0.3)
        a2.bar([str(m["replicas"]) for m in ix["memory"]], [m["bytes_per_entry"] for m in ix["memory"]])
        a2.axhline(24, color="red", linestyle="--", label="target ≤ 24")
        a2.set_xlabel("replicas")
        a2.set_ylabel("index bytes per (block, replica)")
        a2.set_title("Index memory per VM")
        a2.legend()
        fig.tight_layout()
        p = out / "scale_index.png"
        fig.savefig(p, dpi=100)
        plt.close(fig)
        made.append(p)
    if ag:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
        pts = [(r["agent_block_events_s"] / 1e6, r["cpu_share"], f"{r['publishers']} pub × {r['rate_batches'] / RATE:g}×")
               for r in ag["ingest"] + ag["reach"][1:]]
        a1.scatter([x for x, _, _ in pts], [y for _, y, _ in pts])
        for x, y, t in pts:
            a1.annotate(t, (x, y), fontsize=8, xytext=(4, 4), textcoords="offset points")
        a1.axhline(1.0, color="red", linestyle="--", label="one core")
        a1.set_xlabel("block events/s into the agent (millions)")
        a1.set_ylabel("agent CPU, share of one core")
        a1.set_title("Agent ingest")
        a1.legend()
        a1.grid(True, alpha=0.3)
        fan = [r for r in ag["feed"] if not r.get("batches")]
        subs = [r["subscribers"] for r in fan]
        a2.plot(subs, [r["cpu_share"] for r in fan], "-o", label="agent CPU (share of a core)")
        gathered = [r for r in ag["feed"] if r.get("batches")]
        if gathered:
            a2.plot([r["subscribers"] for r in gathered], [r["cpu_share"] for r in gathered], "-^",
                    label="agent CPU, subscribers batching as the filter does")
        a2.set_xlabel("feed subscribers (filter VMs)")
        a2.set_ylabel("agent CPU")
        a3 = a2.twinx()
        a3.plot(subs, [r["feed_bytes_s_total"] / 1e6 for r in fan], "-s", color="tab:orange", label="feed MB/s (all)")
        a3.set_ylabel("feed MB/s, all subscribers")
        a2.set_title(f"Feed fan-out, {ag['feed'][0]['publishers']} publishers at the realistic rate")
        a2.legend(loc="upper left")
        a3.legend(loc="lower right")
        a2.grid(True, alpha=0.3)
        fig.tight_layout()
        p = out / "scale_agent.png"
        fig.savefig(p, dpi=100)
        plt.close(fig)
        made.append(p)
    return made


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "results" / "scale"))
    ap.add_argument("--sizes", default="16,64,256,1024")
    ap.add_argument("--blocks", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--case-ms", type=float, default=40)
    ap.add_argument("--publishers", type=int, default=256)
    ap.add_argument("--subscribers", default="1,8,32,64")
    ap.add_argument("--feed-publishers", type=int, default=64,
                    help="publishers behind the feed fan-out measurement (default 64)")
    ap.add_argument("--reach", default="256,512,1024")
    ap.add_argument("--warmup", type=float, default=4)
    ap.add_argument("--secs", type=float, default=8)
    ap.add_argument("--skip-index", action="store_true")
    ap.add_argument("--skip-agent", action="store_true")
    ap.add_argument("--charts", help="also copy the PNGs into this directory (e.g. bench/charts)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # Logs are appended to and waited on: files of an earlier run must not answer for this one.
    for pattern in ("*-agent.log", "*-publishers.log", "*-sub*.log", "*-endpoints.txt*", "*-agent.toml"):
        for f in out.glob(pattern):
            f.unlink()
    t0 = time.monotonic()
    ix = None if args.skip_index else run_index(args, out)
    ag = None if args.skip_agent else run_agent(args, out)
    if ag:
        ag["publishers"] = args.publishers
    (out / "scale.json").write_text(json.dumps({"index": ix, "agent": ag}, indent=1))
    text = report(ix, ag, out, "./build.sh bench scale " + " ".join(sys.argv[1:]))
    print(text)
    for p in charts(ix, ag, out):
        log(f"chart: {p}")
        if args.charts:
            Path(args.charts).mkdir(parents=True, exist_ok=True)
            shutil.copy(p, Path(args.charts) / p.name)
    log(f"done in {time.monotonic() - t0:.0f} s; {out / 'scale.md'}")


if __name__ == "__main__":
    main()
