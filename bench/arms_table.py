"""bench/filter_perf.py's side-by-side figures: every arm against plain Envoy in the same rounds
(latency added at one connection, p50 and p99, in ms and as ratios; throughput ratio), and for
the endpoint picker's arms its decision time, the agent's CPU per request and the requests/s at
which it saturates one core. `rounds` are filter_perf's: {"<arm>_c1": wrk figures, ...}."""

from __future__ import annotations

import statistics


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def fmt(v, spec: str = ".0f") -> str:
    return "n/a" if v is None else format(v, spec)


def arm_figures(arms: list[str], connections: int, rounds: list[dict]) -> dict:
    """Per arm other than plain, medians of rounds: 1-connection p50 and p99 (ms), added to the
    same round's plain Envoy (ms) and as a ratio of it; requests/s at --connections and its ratio;
    through the picker also its mean decision time and the agent's CPU per request, and from
    that the requests/s at which it saturates one core."""
    tag = f"c{connections}"
    out = {}
    for arm in arms[1:]:
        f: dict = {}
        for q in ("p50", "p99"):
            f[f"{q}_ms"] = med([rr[f"{arm}_c1"][f"{q}_us"] / 1000 for rr in rounds])
            f[f"added_{q}_ms"] = med([(rr[f"{arm}_c1"][f"{q}_us"] - rr["plain_c1"][f"{q}_us"]) / 1000 for rr in rounds])
            f[f"{q}_ratio"] = med([rr[f"{arm}_c1"][f"{q}_us"] / rr["plain_c1"][f"{q}_us"] for rr in rounds])
        f["rps"] = med([rr[f"{arm}_{tag}"]["rps"] for rr in rounds])
        f["throughput_ratio"] = med([rr[f"{arm}_{tag}"]["rps"] / rr[f"plain_{tag}"]["rps"] for rr in rounds])
        if arm.startswith("epp"):
            f["decision_mean_us"] = med([rr[f"{arm}_c1"]["epp_decision_mean_us"] for rr in rounds])
            f["decisions"] = rounds[-1][f"{arm}_c1"]["epp_decisions"]
            f["tokenizer_calls_per_request_c1"] = med([rr[f"{arm}_c1"]["epp_tokenizer_calls"]
                                                       / max(rr[f"{arm}_c1"]["requests"], 1) for rr in rounds])
            f["tokenizer_failures"] = sum(rr[f"{arm}_{t}"]["epp_tokenizer_failures"] for rr in rounds
                                          for t in ("c1", tag))
            cpu_us = []
            for rr in rounds:
                a, p = rr[f"{arm}_{tag}"], rr[f"plain_{tag}"]
                idle_per_s = p["agent_cpu_s"] / (p["duration_us"] / 1e6) if p["duration_us"] else 0.0
                busy = a["agent_cpu_s"] - idle_per_s * a["duration_us"] / 1e6
                cpu_us.append(busy * 1e6 / max(a["requests"], 1))
            f["agent_cpu_us_per_request"] = med(cpu_us)
            f["agent_idle_cpu_ms_per_s"] = med([rr[f"plain_{tag}"]["agent_cpu_s"] * 1e3
                                                / (rr[f"plain_{tag}"]["duration_us"] / 1e6) for rr in rounds])
            f["saturation_rps_one_core"] = 1e6 / f["agent_cpu_us_per_request"] if f["agent_cpu_us_per_request"] else None
        out[arm] = f
    return out


ARM_LABELS = {"filter": "wasm filter, repeated prompt", "filter_new": "wasm filter, new prompts",
              "epp": "endpoint picker, repeated prompt", "epp_new": "endpoint picker, new prompts"}


def print_arms(args, result: dict) -> None:
    """The arms side by side against plain Envoy in the same rounds."""
    arms, tag = result["arms"], f"c{args.connections}"
    print(f"(e) every arm against plain Envoy in the same rounds (1 conn: plain p50 {result['b_plain_p50_ms']:.3f} ms, "
          f"p99 {result['b_plain_p99_ms']:.3f} ms; {tag}: plain {result['c_plain_rps']:.0f} rps); medians of rounds:")
    print(f"    {'arm':34} {'p50 ms':>7} {'+ms':>7} {'ratio':>6} {'p99 ms':>7} {'+ms':>7} {'ratio':>6} "
          f"{tag + ' rps':>8} {'ratio':>6}")
    for arm, f in arms.items():
        print(f"    {ARM_LABELS.get(arm, arm):34} {f['p50_ms']:7.3f} {f['added_p50_ms']:+7.3f} {f['p50_ratio']:6.2f} "
              f"{f['p99_ms']:7.3f} {f['added_p99_ms']:+7.3f} {f['p99_ratio']:6.2f} {f['rps']:8.0f} "
              f"{f['throughput_ratio']:6.2f}")
    for arm in ("epp", "epp_new"):
        f = arms.get(arm)
        if f is None:
            continue
        print(f"    {ARM_LABELS[arm]}: decision mean {fmt(f['decision_mean_us'])} µs (body complete to answer, "
              f"tokenizer call included), {f['tokenizer_calls_per_request_c1']:.2f} tokenizer calls per request "
              f"({f['tokenizer_failures']} failed), decisions {f['decisions']}")
        print(f"      agent CPU {fmt(f['agent_cpu_us_per_request'])} µs per request at {tag} (its idle "
              f"{fmt(f['agent_idle_cpu_ms_per_s'], '.1f')} ms/s taken off): saturates one core at "
              f"{fmt(f['saturation_rps_one_core'])} requests/s (derived from CPU time per request; the agent "
              f"pinned to one CPU)")
