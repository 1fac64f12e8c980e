"""The session runner of the demo and the benchmarks: sessions (lists of requests one client sends
one after another) run `concurrency` at a time with a progress line, and the figures routing is
measured by: prefix-cache hit rate, request shares and the replicas' own time-to-first-token
means from the replicas' /metrics deltas, time to first token from the clients."""

from __future__ import annotations

import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from .fleet import pct, scrape


def drive(sessions, run_session: Callable, concurrency: int, progress: Callable[[float], None],
          every: float) -> float:
    """Runs `run_session(session)` for every session, `concurrency` at a time, calling
    `progress(elapsed seconds)` every `every` seconds meanwhile; returns the seconds it took."""
    stop = threading.Event()
    t_start = time.monotonic()

    def report():
        while not stop.wait(every):
            progress(time.monotonic() - t_start)

    th = threading.Thread(target=report, daemon=True)
    th.start()
    try:
        with ThreadPoolExecutor(concurrency) as ex:
            list(ex.map(run_session, sessions))
    finally:
        stop.set()
        th.join()
    return time.monotonic() - t_start


def run_sessions(label: str, send, sims: list[dict], sessions, concurrency: int, width: int = 28,
                 summary: Callable[[dict], str] | None = None) -> dict:
    """Sends each session's bodies in order through `send(body) -> (ttft_s, total_s, status)`,
    `concurrency` sessions at a time, with a progress line; returns the run's figures, read from
    the replicas' /metrics deltas and the clients' timings. A 200 without a first data line
    counts as an error. `summary(figures)`, when given, is the line that ends the progress; else
    a terminal's progress line is ended as it stands."""
    before = [scrape(s["port"]) for s in sims]
    results: list[tuple[float, float, int]] = []
    lock = threading.Lock()
    total = sum(len(c) for c in sessions)

    def worker(session):
        for body in session:
            r = send(body)
            with lock:
                results.append(r)

    # A terminal gets one line rewritten twice a second; a log a line every 5 s.
    tty = sys.stdout.isatty()
    start, end = ("\r", "") if tty else ("", "\n")

    def progress(el: float):
        with lock:
            n = len(results)
        sys.stdout.write(f"{start}  {label:<{width}} {n:>4}/{total} requests  {el:5.1f}s{end}")
        sys.stdout.flush()

    elapsed = drive(sessions, worker, concurrency, progress, 0.5 if tty else 5.0)
    after = [scrape(s["port"]) for s in sims]
    d = lambda k: [a.get(k, 0) - b.get(k, 0) for a, b in zip(after, before)]  # noqa: E731
    q, h = sum(d("vllm:prefix_cache_queries_total")), sum(d("vllm:prefix_cache_hits_total"))
    served = d("vllm:request_success_total")
    ttfts = [r[0] for r in results if r[2] == 200 and r[0] == r[0]]
    shares = [s / max(1, sum(served)) for s in served]

    def replica_mean_ms(name: str) -> float:
        # A vLLM histogram's mean over the run on every replica (its _sum and _count deltas).
        n = sum(d(f"vllm:{name}_count"))
        return sum(d(f"vllm:{name}_sum")) / n * 1000 if n else float("nan")
    out = {
        "label": label,
        "hit_rate": h / q if q else 0.0,
        "ttft_p50": pct(ttfts, 50) * 1000,
        "ttft_p99": pct(ttfts, 99) * 1000,
        "ttft_mean": (sum(ttfts) / len(ttfts) * 1000) if ttfts else float("nan"),
        # Every answered request's TTFT (ms, 0.1 ms apart), for intervals around the p50.
        "ttfts_ms": sorted(round(t * 1000, 1) for t in ttfts),
        "throughput": len(results) / elapsed,
        "shares": shares,
        "max_share_x_fair": max(shares) * len(shares) if sum(served) else float("nan"),
        "min_share_x_fair": min(shares) * len(shares) if sum(served) else float("nan"),
        "errors": sum(1 for r in results if r[2] != 200 or r[0] != r[0]),
        "requests": len(results),
        "elapsed_s": elapsed,
        # The replicas' own view (vLLM's histograms, means in ms): time to first token from the
        # request's arrival at the API server, and its parts in the engine, queued and prefilling.
        "replica_ttft_mean": replica_mean_ms("time_to_first_token_seconds"),
        "replica_queue_mean": replica_mean_ms("request_queue_time_seconds"),
        "replica_prefill_mean": replica_mean_ms("request_prefill_time_seconds"),
        # The engine steps the replicas ran (vLLM observes every step's tokens once).
        "engine_steps": sum(d("vllm:iteration_tokens_total_count")),
    }
    if summary is not None:
        sys.stdout.write(f"\r{summary(out)}\n")
    elif tty:
        sys.stdout.write("\n")
    sys.stdout.flush()
    return out
