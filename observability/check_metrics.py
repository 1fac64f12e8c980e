#!/usr/bin/env python3
"""Checks that every metric the alerting rules (prometheus/llmgw-alerts.yaml) and the Grafana
dashboard (grafana/llmgw-dashboard.json) name is one the project defines:

- the filter's, as the manual lists them (docs/src/operations.md, names in code spans from its
  "Metrics (Envoy /stats/prometheus)" section to the agent's; a histogram's _bucket, _sum and
  _count series included);
- the agent's, as its /metrics renders them (crates/llmgw-agent/src/http/exposition.rs: each
  name given with its help text, prefixed llmgw_agent_);
- the native tokenizer's (crates/llmgw-agent/src/native_tokenizer/mod.rs).

Prints each unknown name with where it is used; exits 1 if there is any.
Usage: python3 observability/check_metrics.py [RULES.yaml ...] [DASHBOARD.json ...]
"""

import json
import re
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
NAME = re.compile(r"\b(llmgw_[a-z0-9_]+)\b")
QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def defined() -> set[str]:
    names = set()
    ops = (ROOT / "docs/src/operations.md").read_text()
    # The filter's metrics: the manual's sections from its Envoy metrics to the agent's.
    start, end = ops.index("### Metrics (Envoy `/stats/prometheus`)"), ops.index("### The agent's metrics")
    for span in re.findall(r"`([^`]+)`", ops[start:end]):
        names.update(m for m in NAME.findall(span) if not m.startswith("llmgw_agent_"))
    exposition = (ROOT / "crates/llmgw-agent/src/http/exposition.rs").read_text()
    # `counter("blocks", "Blocks held per engine.", ...)` and `("jetstream_connected", "Whether ...", ...)`.
    names.update(f"llmgw_agent_{n}" for n in re.findall(r'"([a-z][a-z0-9_]*)",\s*"[A-Z0-9]', exposition))
    native = (ROOT / "crates/llmgw-agent/src/native_tokenizer/mod.rs").read_text()
    names.update(re.findall(r'"(llmgw_native_tokenizer_[a-z0-9_]+)"', native))
    return names


def known(name: str, names: set[str]) -> bool:
    if name in names:
        return True
    return any(name.endswith(s) and name[: -len(s)] in names for s in HISTOGRAM_SUFFIXES)


def expressions(path: Path) -> list[tuple[str, str]]:
    """(where, PromQL expression) of every rule or panel target in `path`."""
    if path.suffix == ".json":
        dash = json.loads(path.read_text())
        out = []
        for p in dash.get("panels", []):
            for t in p.get("targets", []):
                out.append((f"{path.name}: panel {p.get('title')!r}", t.get("expr", "")))
        return out
    doc = yaml.safe_load(path.read_text())
    return [(f"{path.name}: {r.get('alert') or r.get('record')}", r["expr"])
            for g in doc["groups"] for r in g["rules"]]


def unknown_names(paths: list[Path], names: set[str]) -> list[str]:
    problems = []
    for path in paths:
        for where, expr in expressions(path):
            for n in sorted(set(NAME.findall(QUOTED.sub('""', expr)))):
                if not known(n, names):
                    problems.append(f"{where}: {n} is not a metric the project defines")
    return problems


def main(argv: list[str]) -> int:
    paths = [Path(a) for a in argv] or [HERE / "prometheus/llmgw-alerts.yaml", HERE / "grafana/llmgw-dashboard.json"]
    names = defined()
    used = sum(len(expressions(p)) for p in paths)
    problems = unknown_names(paths, names)
    if problems:
        print(f"observability: {len(problems)} unknown metric(s):")
        for p in problems:
            print(f"  {p}")
        return 1
    print(f"observability: {used} expressions in {len(paths)} files name only defined metrics ({len(names)} defined)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
