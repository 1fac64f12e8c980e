#!/usr/bin/env python3
"""Prints the fuzz figures of `./build.sh fuzz` runs as a Markdown table (fuzz/RESULTS.md), from
the libFuzzer logs in results/fuzz/ (or the directory given): per target the seconds run, total
execs, exec/s, the final coverage (cov, ft), the corpus libFuzzer ended with and the crashes."""
import pathlib
import re
import sys

logs = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "results/fuzz")
targets = sys.argv[2:] or sorted(p.stem for p in logs.glob("*.log") if p.stem != "fuzz")
print("| target | seconds | execs | exec/s | cov | ft | corpus (files/bytes) | crashes |")
print("|---|---:|---:|---:|---:|---:|---:|---:|")
for t in targets:
    text = (logs / f"{t}.log").read_text(errors="replace")
    done = re.findall(r"^Done (\d+) runs in (\d+) second", text, re.M)
    stat = dict(re.findall(r"^stat::(\w+):\s*(\d+)", text, re.M))
    status = re.findall(r"^#\d+\s+\w+\s+cov: (\d+) ft: (\d+) corp: (\d+)/(\S+)", text, re.M)
    crashes = len(re.findall(r"Test unit written to .*(?:crash|leak|timeout|oom)-", text))
    seconds = done[-1][1] if done else "?"
    execs = int(stat.get("number_of_executed_units", 0))
    rate = stat.get("average_exec_per_sec", "?")
    cov, ft, files, size = status[-1] if status else ("?",) * 4
    print(f"| `{t}` | {seconds} | {execs:,} | {rate} | {cov} | {ft} | {files}/{size} | {crashes} |")
