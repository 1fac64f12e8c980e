#!/usr/bin/env python3
"""llmgw.wasm and the endpoint picker in the real Envoy, against plain Envoy routing to the same
backends.

One run measures, for a 16 KB chat body whose prompt is 4,096 tokens (256 blocks of 16), in
five arms interleaved per round: plain Envoy; the filter with one prompt repeated (after the
first request its tokenization comes from the filter's tokenization cache); the filter with
every prompt new (the load generator writes a counter into each body, so every request makes a
tokenizer call; the stub's fixed answer keeps the blocks' digests memoised); the same two
through Envoy's ext_proc filter to the agent's endpoint picker (bench/epp_arm.py; --no-epp
leaves them out):

  (a) the filter's own decision time (body parse, tokenizer call body, tokenizer answer parse,
      hashing, scoring, routing; not the tokenizer round trip): p50 of the filter's
      `llmgw_decision_us` histogram, per round, read from Envoy's admin stats; for repeated and
      new prompts, and in a cold phase afterwards (second front Envoy, Python tokenizer stub
      answering a different prompt per call) for prompts that miss the digest memo: ones the
      index holds (every block hashed: the worst case) and ones nobody holds (hashing stops
      after the first batch);
  (b) latency added through Envoy at 1 connection (wrk p50, filter minus plain), both arms;
  (c) throughput at 8 connections (wrk requests/s, filter / plain), both arms;
  (d) index memory per VM per (block, replica): the filter's `llmgw_index_bytes` and
      `llmgw_index_blocks` gauges of one worker VM after the snapshot;
  (e) every arm side by side: p50 and p99 at 1 connection, added to plain Envoy's in the same
      round (ms and ratio), requests/s at 8 connections and its ratio; for the picker its mean
      decision time (`llmgw_epp_decision_us`), and the agent's CPU time per request (its idle
      rate taken off), from which the requests/s at which the picker saturates one core is
      derived (the agent is pinned to one CPU, beside wrk and the backend). No target: the
      figures are reported.

Setup (loopback only):
  * backend Envoy: one listener per replica, each a direct response (the generation endpoints
    answer a small JSON, `/tokenize` answers a fixed `{"count":4096,..,"tokens":[...]}` like
    vLLM's), behind the buffer filter so that every request is read whole. It is the fast
    tokenizer stub: its own p50 for a /tokenize call is measured and reported;
  * a stub agent feed (gRPC, llmgw.feed.v1) serving the replica table and a snapshot: replica 0
    holds every block of the prompt, replica 1 its first half, and every replica holds
    `--blocks` other blocks;
  * front Envoy: the shipped bootstrap (envoy/llmgw-local.yaml) with llmgw.wasm, plus a second
    listener without the filter that routes to replica 0 (the filter's choice) through a
    static cluster: the baseline;
  * the endpoint picker: the agent with [epp] mirroring the same blocks from vLLM-framed ZMQ
    publishers, and in the front Envoy the listener and clusters of envoy/llmgw-epp-local.yaml;
  * wrk with a Lua script posting the body.

Method (as in the project's Envoy notes): front Envoy `--concurrency 1` pinned to CPU 0; wrk,
the backend, the feed stub and the agent pinned to CPU 1 (when the machine has 2+ CPUs); interleaved
rounds (plain, filter, plain, filter, ...; the order alternates per round), ratios per round
against the baseline measured in the same round, median of rounds.

Usage: .venv/bin/python bench/filter_perf.py [--rounds 10] [--duration 3] [--json out.json]
   or: ./build.sh bench filter [same options]
Needs wrk (Debian: apt-get install wrk), Envoy in .venv, a current dist/llmgw.wasm and the
release llmgw-agent. Exits 1 when a target of (a)-(d) is missed. The machine's other load changes every figure: read the ratios, the
CPU per request and the load average printed with them.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import llmgw_testkit as kit  # the project's test kit: processes, configs, the feed stub
from llmgw_testkit import EnvoyAdmin, Procs, free_port, request, start_envoy, wait_until
from llmgw_testkit.feed import FeedStub, load_feed_proto
from llmgw_testkit.procs import process_cpu_seconds
from llmgw_testkit.stub import StubHandler, StubServer
from llmgw_testkit.vllm_hash import block_keys

from arms_table import arm_figures, fmt, med, print_arms  # bench/arms_table.py, beside this script
from epp_arm import EppArm, epp_pieces, with_epp  # bench/epp_arm.py, beside this script

ROOT = kit.ROOT
MODEL = "m1"
BLOCK = 16
SEED = "0"
# Prompts the cold phase cycles through: 200 x 256 blocks overflow the 8192-block digest memo.
COLD_PROMPTS = 200
TARGETS = {"decision_us": 150.0, "added_ms": 0.5, "throughput_ratio": 0.60, "bytes_per_entry": 24.0}

# The filter's configuration in the front Envoys.
FILTER_CONFIG = {
    "agent_cluster": "llmgw_agent", "tokenizer_cluster": "llmgw_tokenizer", "explain_header": False,
    "max_body_bytes": 33554432,
    "profiles": [{"name": "default", "models": [MODEL], "kv_events": True, "block_size": BLOCK,
                  "hash_algo": "sha256_cbor", "seed": SEED, "tokenizer": "tokenize",
                  "tokenizer_timeout_ms": 2000}]}

WRK_SCRIPT = r"""
wrk.method = "POST"
wrk.headers["content-type"] = "application/json"
local f = assert(io.open(os.getenv("LLMGW_BENCH_BODY"), "rb"))
wrk.body = f:read("*a")
f:close()
-- LLMGW_BENCH_VARY=1: every request's prompt differs (a counter replaces the body's marker), so
-- none is in the filter's tokenization cache.
if os.getenv("LLMGW_BENCH_VARY") == "1" then
  local n = 0
  local template = wrk.body
  request = function()
    n = n + 1
    local b = string.gsub(template, "@@@@@@@@@@", string.format("%010d", n), 1)
    return wrk.format(nil, nil, nil, b)
  end
end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRKJSON {"requests":%d,"duration_us":%d,"p50_us":%d,"p90_us":%d,"p99_us":%d,"non2xx":%d,"errors":%d}\n',
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(90),
    latency:percentile(99), e.status, e.connect + e.read + e.write + e.timeout))
end
"""


# ---------------------------------------------------------------------------------------------
# Workload.


def chat_body(target_bytes: int) -> bytes:
    """An OpenAI chat body of about `target_bytes`: a system prompt and a long user message."""
    rng = random.Random(7)
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet",
             "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango"]
    system = "You are a careful assistant. Answer from the documents below and cite them."
    base = {"model": MODEL, "messages": [{"role": "system", "content": system},
                                         {"role": "user", "content": ""}],
            "max_tokens": 16, "temperature": 0.0, "stream": False}
    room = target_bytes - len(json.dumps(base).encode())
    text = []
    size = 0
    while size < room:
        w = rng.choice(words)
        text.append(w)
        size += len(w) + 1
    # The marker lets the load generator make every prompt distinct (see WRK_SCRIPT).
    base["messages"][1]["content"] = ("@@@@@@@@@@ " + " ".join(text))[:room]
    return json.dumps(base).encode()


def prompt_tokens(n: int) -> list[int]:
    rng = random.Random(11)
    return [rng.randrange(100, 150_000) for _ in range(n)]


def tokenize_answer(tokens: list[int]) -> str:
    # vLLM's /tokenize answer shape.
    return json.dumps({"count": len(tokens), "max_model_len": 32768, "tokens": tokens, "token_strs": None},
                      separators=(",", ":"))


# ---------------------------------------------------------------------------------------------
# Envoy configurations.


def backend_config(admin: int, ports: list[int], tokenize_json: str) -> str:
    """A backend Envoy: one listener per replica port; /tokenize answers the fixed token list."""
    listeners = []
    for i, port in enumerate(ports):
        listeners.append({
            "name": f"replica_{i}",
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
            "per_connection_buffer_limit_bytes": 33554432,
            "filter_chains": [{"filters": [{
                "name": "envoy.filters.network.http_connection_manager",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3"
                             ".HttpConnectionManager",
                    "stat_prefix": f"replica_{i}",
                    # The endpoint picker's tokenizer client speaks HTTP/1.0.
                    "http_protocol_options": {"accept_http_10": True},
                    "route_config": {
                        "max_direct_response_body_size_bytes": 4 << 20,
                        "virtual_hosts": [{"name": "r", "domains": ["*"], "routes": [
                            {"match": {"path": "/tokenize"},
                             "direct_response": {"status": 200, "body": {"inline_string": tokenize_json}}},
                            {"match": {"prefix": "/"},
                             "direct_response": {"status": 200, "body": {
                                 "inline_string": json.dumps({"replica": i, "choices": [{"text": "ok"}]})}}},
                        ]}]},
                    "http_filters": [
                        # Read every request whole before answering (keeps connections reusable).
                        {"name": "envoy.filters.http.buffer", "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer",
                            "max_request_bytes": 33554432}},
                        {"name": "envoy.filters.http.router", "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}},
                    ]}}]}],
        })
    return json.dumps({"admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
                       "static_resources": {"listeners": listeners}})


def front_config(wasm: Path, listen: int, plain: int, admin: int, agent: int, replica0_port: int,
                 filter_cfg: dict, epp: tuple[list[dict], list[dict]] | None = None) -> str:
    """The shipped bootstrap with the filter, plus a plain listener (no filter) to replica 0, and
    with `epp` the endpoint picker's listener and clusters (epp_arm.epp_pieces)."""
    # Stats flushed every 0.2 s: histograms reach the admin stats on a flush.
    text = kit.shipped_config(wasm, listen, admin, agent, filter_cfg, stats_flush_interval="0.2s")
    listener = "  listeners:\n" + kit.envoy.listener_yaml("plain", plain, "plain_replica", buffer_limit=33554432)
    cluster = "  clusters:\n" + kit.envoy.cluster_yaml("plain_replica", [replica0_port])
    assert text.count("\n  listeners:\n") == 1 and text.count("\n  clusters:\n") == 1
    text = text.replace("\n  listeners:\n", "\n" + listener, 1)
    text = text.replace("\n  clusters:\n", "\n" + cluster, 1)
    return text if epp is None else with_epp(text, *epp)


class ColdTokenizer:
    """A stub replica whose /tokenize answers prompts of the same length as the benchmark's,
    differing from it (and from each other) in the first token, so no block is in the filter's
    digest memo: `mode = "indexed"` cycles through `indexed` such prompts (whose blocks the index
    holds: every block is hashed), `mode = "new"` answers a prompt never seen (nobody holds
    block 0: hashing stops early). Other paths answer a small JSON. Python: slow, but only the
    filter's own time is read from it."""

    FIRST = 1_000_000

    def __init__(self, port: int, tokens: list[int], indexed: int):
        import threading

        rest = json.dumps(tokens[1:], separators=(",", ":"))[1:].encode()
        head = f'{{"count":{len(tokens)},"max_model_len":32768,"tokens":['.encode()
        tail = b',"token_strs":null}'
        counter = iter(range(1 << 62))
        lock = threading.Lock()
        stub = self
        self.mode = "indexed"

        class Handler(StubHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers.get("content-length") or 0))
                if self.path == "/tokenize":
                    with lock:
                        n = next(counter)
                    first = ColdTokenizer.FIRST + (n % indexed if stub.mode == "indexed" else indexed + n)
                    body = head + str(first).encode() + b"," + rest + tail
                else:
                    body = b'{"replica":"cold","choices":[{"text":"ok"}]}'
                try:
                    self.reply(200, body)
                except OSError:  # the load generator closed the connection
                    self.close_connection = True

        self.stub = StubServer(port, Handler, quiet_errors=True)
        self.server = self.stub.server

    def stop(self):
        self.stub.stop()


def chunked_feed_class(pb):
    class ChunkedFeed(FeedStub):
        # Snapshot chunks of at most 20k keys (one message per chunk).
        def initial_messages(self):
            msgs = [{"replicas": pb.ReplicaTable(replicas=[pb.Replica(**r) for r in self.replicas])}]
            for rid, ks in self.blocks.items():
                for i in range(0, max(len(ks), 1), 20_000):
                    msgs.append({"snapshot": pb.SnapshotChunk(replica=rid, first=i == 0, blocks=ks[i:i + 20_000])})
            msgs.append({"snapshot_complete": pb.SnapshotComplete()})
            return msgs

    return ChunkedFeed


# ---------------------------------------------------------------------------------------------
# Processes.


def perf_split(pid: int, url: str, args, script: Path, body: Path, cpu, out: Path,
               vary: bool = False) -> dict[str, float]:
    """CPU per request of the front Envoy by code region (Envoy, kernel, JIT = V8's wasm code,
    libc, ...), sampled with perf during one wrk run."""
    rec = subprocess.Popen(["perf", "record", "-F", "4999", "-p", str(pid), "-o", str(out), "--", "sleep",
                            str(max(args.duration, 3) - 1)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    cpu0 = process_cpu_seconds(pid)
    time.sleep(0.5)
    r = run_wrk(url, args.connections, max(args.duration, 3), script, body, cpu, vary)
    rec.wait(timeout=30)
    busy_us = (process_cpu_seconds(pid) - cpu0) * 1e6 / max(r["requests"], 1)
    rep = subprocess.run(["perf", "report", "-i", str(out), "--sort", "dso", "--stdio"], capture_output=True,
                         text=True).stdout
    shares: dict[str, float] = {}
    for line in rep.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0].endswith("%"):
            name = "JIT (wasm)" if parts[1] == "[JIT]" else parts[1]
            shares[name] = shares.get(name, 0.0) + float(parts[0].rstrip("%"))
    return {"total": busy_us, **{k: busy_us * v / 100 for k, v in shares.items()}}


def run_wrk(url: str, connections: int, seconds: float, script: Path, body: Path, cpu: int | None,
            vary: bool = False) -> dict:
    args = ["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s", "--timeout", "5s", "-s", str(script), url]
    if cpu is not None:
        args = ["taskset", "-c", str(cpu)] + args
    env = dict(os.environ, LLMGW_BENCH_BODY=str(body), LLMGW_BENCH_VARY="1" if vary else "0")
    out = subprocess.run(args, capture_output=True, text=True, env=env, timeout=seconds + 30)
    for line in out.stdout.splitlines():
        if line.startswith("WRKJSON "):
            r = json.loads(line[len("WRKJSON "):])
            r["rps"] = r["requests"] / (r["duration_us"] / 1e6) if r["duration_us"] else 0.0
            return r
    raise RuntimeError(f"wrk failed: {out.stdout}\n{out.stderr}")


# ---------------------------------------------------------------------------------------------
# Envoy stats.


def stats_json(admin: int, flt: str, extra: str = "") -> dict:
    status, _, body = request("GET", f"http://127.0.0.1:{admin}/stats?format=json&filter={flt}{extra}")
    if status != 200:
        raise RuntimeError(f"admin /stats: {status} {body[:200]!r}")
    return json.loads(body)


def decision_buckets(admin: int) -> dict[float, tuple[float, int]]:
    """The cumulative llmgw_decision_us histogram as {lower_bound: (width, count)}."""
    doc = stats_json(admin, r"^wasmcustom\.llmgw_decision_us$", "&histogram_buckets=detailed")
    out: dict[float, tuple[float, int]] = {}
    for st in doc.get("stats", []):
        hs = st.get("histograms")
        if not hs:
            continue
        for h in hs.get("details", []) if isinstance(hs, dict) else hs:
            if h.get("name") != "wasmcustom.llmgw_decision_us":
                continue
            for b in h.get("totals", []):
                out[float(b["lower_bound"])] = (float(b["width"]), int(b["count"]))
    return out


def bucket_p50(before: dict, after: dict) -> tuple[float | None, int]:
    """p50 (bucket midpoint) and count of the samples recorded between two snapshots."""
    diff = []
    for lb, (w, c) in after.items():
        d = c - before.get(lb, (w, 0))[1]
        if d > 0:
            diff.append((lb, w, d))
    diff.sort()
    n = sum(d for _, _, d in diff)
    if n == 0:
        return None, 0
    acc = 0
    for lb, w, d in diff:
        acc += d
        if acc * 2 >= n:
            return lb + w / 2, n
    return None, n


def plain_stats(admin: int) -> dict[str, float]:
    return EnvoyAdmin(admin).stats("wasmcustom")


def decisions(admin: int) -> dict[str, int]:
    return EnvoyAdmin(admin).decisions()


def index_memory(admin: int) -> list[tuple[str, float, float]]:
    """(vm, index bytes, (block, replica) entries) for each VM that reports both."""
    s = plain_stats(admin)
    out = []
    for k, v in s.items():
        if k.startswith("wasmcustom.llmgw_index_bytes.vm."):
            vm = k.rsplit(".", 1)[1]
            entries = s.get(f"wasmcustom.llmgw_index_blocks.vm.{vm}")
            if entries:
                out.append((vm, v, entries))
    return out


# ---------------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--duration", type=int, default=3, help="seconds per wrk run")
    ap.add_argument("--connections", type=int, default=8, help="connections for the throughput runs")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=50_000, help="other blocks each replica holds")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--body-bytes", type=int, default=16 * 1024)
    ap.add_argument("--no-pin", action="store_true", help="do not pin processes to CPUs")
    ap.add_argument("--envoy", default=shutil.which("envoy") or str(ROOT / ".venv" / "bin" / "envoy"))
    ap.add_argument("--wasm", default=str(ROOT / "dist" / "llmgw.wasm"))
    ap.add_argument("--agent", default=None, help="the release llmgw-agent (default: the target directory's)")
    ap.add_argument("--no-epp", action="store_true", help="leave out the endpoint-picker arms")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--profile", action="store_true",
                    help="also sample the front Envoy with perf during one extra run of each arm (where the CPU goes)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs, configs)")
    return ap.parse_args()


# ---------------------------------------------------------------------------------------------
# One run: its inputs, the Envoys and feed stubs it starts, and its phases.


class Run:
    """One benchmark run: the work directory, the processes and feed stubs started (stopped by
    close()), the CPU pinning, the body and the prompt with its block keys."""

    def __init__(self, args):
        self.args = args
        self.pin = not args.no_pin and (os.cpu_count() or 1) >= 2 and shutil.which("taskset") is not None
        self.cpu_front, self.cpu_rest = (0, 1) if self.pin else (None, None)
        self.tmp = Path(tempfile.mkdtemp(prefix="llmgw-filter-perf-"))
        self.procs = Procs(self.tmp)
        self.feeds: list = []
        self.cold_stub = None
        self.epp: EppArm | None = None
        self.arms = ["plain", "filter", "filter_new"] + ([] if args.no_epp else ["epp", "epp_new"])
        self.load_start = os.getloadavg()

    def prepare(self) -> None:
        """The body and wrk's script on disk, the prompt's tokens, the tokenizer's answer, the keys."""
        self.body = chat_body(self.args.body_bytes)
        self.body_path = self.tmp / "body.json"
        self.body_path.write_bytes(self.body)
        self.script = self.tmp / "post.lua"
        self.script.write_text(WRK_SCRIPT)
        self.tokens = prompt_tokens(self.args.tokens)
        self.answer = tokenize_answer(self.tokens)
        self.keys = block_keys(self.tokens, BLOCK, SEED)

    def start_backend(self) -> None:
        """The backend Envoy: the replicas and the tokenizer."""
        self.ports = [free_port() for _ in range(self.args.replicas)]
        b_admin = free_port()
        (self.tmp / "backend.json").write_text(backend_config(b_admin, self.ports, self.answer))
        self.backend = start_envoy(self.procs, self.args.envoy, self.tmp / "backend.json", "backend", concurrency=1,
                                   cpu=self.cpu_rest, args=["--base-id", random.randrange(1000, 60000)])
        EnvoyAdmin(b_admin).wait_ready(proc=self.backend)

    def feed_tables(self) -> None:
        """The feed: replica 0 holds the whole prompt, replica 1 its first half, all hold filler
        (a chain of blocks of random token ids, hashed as vLLM does: the endpoint picker's agent
        credits a published block only where its ids hash to its key)."""
        rng = random.Random(3)
        self.blocks: dict[int, list[int]] = {}
        self.filler_tokens: dict[int, list[int]] = {}
        for r in range(self.args.replicas):
            self.filler_tokens[r] = [rng.randrange(1, 50_000) for _ in range(self.args.blocks * BLOCK)]
            filler = block_keys(self.filler_tokens[r], BLOCK, SEED)
            own = self.keys if r == 0 else self.keys[: len(self.keys) // 2] if r == 1 else []
            self.blocks[r] = own + filler
        self.replicas = [{"id": r, "name": f"r{r}", "address": f"127.0.0.1:{p}", "models": [MODEL], "up": True}
                         for r, p in enumerate(self.ports)]
        self.pb, self.pb_grpc = load_feed_proto(self.tmp / "gen")
        self.chunked_feed = chunked_feed_class(self.pb)
        if self.pin:
            os.sched_setaffinity(0, {self.cpu_rest})

    def start_epp(self) -> None:
        """The agent as endpoint picker, mirroring the blocks the feed stub serves (pinned with
        the load generator and the backend)."""
        agent = self.args.agent or kit.binary_path("llmgw-agent", "release")
        self.epp = EppArm(self.procs, self.tmp, agent, MODEL, FILTER_CONFIG, BLOCK, SEED, self.cpu_rest)
        self.epp.start(self.ports, self.blocks, {0: len(self.keys), 1: len(self.keys) // 2}, self.tokens,
                       self.filler_tokens)

    def start_front(self, name: str, reps: list[dict], blks: dict[int, list[int]], with_epp: bool = False):
        """A feed stub and a front Envoy (filter listener, plain listener to the first replica,
        and `with_epp` the picker's listener); returns once the filter VMs applied the snapshot
        (and the picker passes Envoy's health check)."""
        fd = self.chunked_feed(self.pb, self.pb_grpc, free_port(), reps, blks)
        self.feeds.append(fd)
        n_initial = len(fd.initial_messages())
        lis, pln, adm = free_port(), free_port(), free_port()
        first_port = int(reps[0]["address"].rsplit(":", 1)[1])
        epp = None
        if with_epp and self.epp is not None:
            self.epp_listen = free_port()
            epp = epp_pieces(self.epp_listen, self.epp.port, self.ports)
        (self.tmp / f"{name}.yaml").write_text(front_config(Path(self.args.wasm).resolve(), lis, pln, adm, fd.port,
                                                            first_port, FILTER_CONFIG, epp))
        proc = start_envoy(self.procs, self.args.envoy, self.tmp / f"{name}.yaml", name, concurrency=1,
                           cpu=self.cpu_front, args=["--base-id", random.randrange(1000, 60000)])
        EnvoyAdmin(adm).wait_ready(proc=proc)
        # The worker VM and the main thread's ticking VM each apply the snapshot.
        wait_until(lambda: fd.snapshots_sent >= 2
                   and plain_stats(adm).get("wasmcustom.llmgw_feed_messages_total", 0) >= 2 * n_initial,
                   120, "the filter VMs to apply the feed snapshot", interval=0.2)
        if epp is not None:
            self.epp.wait_healthy(adm)
        return proc, lis, pln, adm

    def check_routing(self, listen: int, plain: int, admin: int) -> dict[str, int]:
        """Correctness check before timing: the filter routes exactly, the plain listener
        answers; returns the decisions so far."""
        for port in (listen, plain):
            status, _, raw = request("POST", f"http://127.0.0.1:{port}/v1/chat/completions", self.body,
                                     {"content-type": "application/json"})
            assert status == 200 and json.loads(raw)["replica"] == 0, (status, raw[:200])
        d0 = decisions(admin)
        assert d0.get("exact", 0) >= 1, d0
        if self.epp is not None:
            before = self.epp.metrics().get('llmgw_epp_decisions_total{outcome="exact"}', 0)
            status, headers, raw = request("POST", f"http://127.0.0.1:{self.epp_listen}/v1/chat/completions",
                                           self.body, {"content-type": "application/json"})
            assert status == 200 and json.loads(raw)["replica"] == 0, (status, raw[:200], self.epp.metrics())
            after = self.epp.metrics().get('llmgw_epp_decisions_total{outcome="exact"}', 0)
            assert after == before + 1, ("the picker did not decide exactly", self.epp.metrics())
        return d0

    def tokenizer_alone(self) -> dict:
        """The tokenizer stub's own cost, directly (1 connection)."""
        tok_body = self.tmp / "tok.json"
        tok_body.write_bytes(json.dumps({"model": MODEL, "messages": json.loads(self.body)["messages"]}).encode())
        return run_wrk(f"http://127.0.0.1:{self.ports[0]}/tokenize", 1, min(self.args.duration, 2.0), self.script,
                       tok_body, self.cpu_rest)

    def profile_arms(self, front, urls: dict[str, str]) -> dict:
        """With --profile and perf: where the front Envoy's CPU goes in each arm."""
        profile = {}
        if self.args.profile and shutil.which("perf"):
            for arm, vary in (("plain", False), ("filter", False), ("filter_new", True)):
                profile[arm] = perf_split(front.pid, urls[arm], self.args, self.script, self.body_path, self.cpu_rest,
                                          self.tmp / f"perf-{arm}.data", vary)
                print(f"perf, front Envoy, {arm} at {self.args.connections} conns: " + ", ".join(
                    f"{k} {v:.0f} µs/request" for k, v in profile[arm].items()), flush=True)
        return profile

    def one_arm(self, front, admin: int, url: str, conns: int, arm: str) -> dict:
        """One wrk run of `arm`: its figures, the CPU per request of both Envoys (and of the
        picker's agent), through the filter the decision time's p50, through the picker its
        mean decision time and its decisions."""
        vary = arm.endswith("_new")
        before = decision_buckets(admin) if arm.startswith("filter") else None
        epp0 = self.epp.metrics() if self.epp is not None and arm.startswith("epp") else None
        cpu0 = (process_cpu_seconds(front.pid), process_cpu_seconds(self.backend.pid),
                self.epp.cpu_seconds() if self.epp is not None else 0.0)
        r = run_wrk(url, conns, self.args.duration, self.script, self.body_path, self.cpu_rest, vary)
        cpu1 = (process_cpu_seconds(front.pid), process_cpu_seconds(self.backend.pid),
                self.epp.cpu_seconds() if self.epp is not None else 0.0)
        n_req = max(r["requests"], 1)
        r["front_cpu_us"] = (cpu1[0] - cpu0[0]) * 1e6 / n_req
        r["backend_cpu_us"] = (cpu1[1] - cpu0[1]) * 1e6 / n_req
        # The agent's CPU over the run: per request through the picker, per second otherwise
        # (what it spends idle: event threads, timers, health reports).
        r["agent_cpu_s"] = cpu1[2] - cpu0[2]
        if before is not None:
            time.sleep(0.5)  # stats flush (0.2 s)
            p50, n = bucket_p50(before, decision_buckets(admin))
            r["decision_p50_us"], r["decision_n"] = p50, n
        if epp0 is not None:
            epp1 = self.epp.metrics()
            d = {k: epp1.get(k, 0) - epp0.get(k, 0) for k in epp1}
            count = d.get("llmgw_epp_decision_us_count", 0)
            r["epp_decision_mean_us"] = d.get("llmgw_epp_decision_us_sum", 0) / count if count else None
            r["epp_decisions"] = {k.split('"')[1]: int(v) for k, v in d.items() if "outcome" in k and v}
            r["epp_tokenizer_calls"] = int(d.get("llmgw_epp_tokenizer_calls_total", 0))
            r["epp_tokenizer_failures"] = int(d.get("llmgw_epp_tokenizer_failures_total", 0))
        return r

    def rounds(self, front, admin: int, urls: dict[str, str]) -> list[dict]:
        """The interleaved rounds (the order reversed every other round), a line printed per round."""
        args, rounds = self.args, []
        for i in range(args.rounds):
            order = self.arms if i % 2 == 0 else self.arms[::-1]
            rr: dict = {"round": i}
            for conns, tag in ((1, "c1"), (args.connections, f"c{args.connections}")):
                for arm in order:
                    rr[f"{arm}_{tag}"] = self.one_arm(front, admin, urls[arm], conns, arm)
            rounds.append(rr)
            c1p, cnp = rr["plain_c1"], rr[f"plain_c{args.connections}"]
            parts = [f"c1 p50 plain {c1p['p50_us']} µs"]
            for arm in self.arms[1:]:
                a = rr[f"{arm}_c1"]
                parts.append(f"{arm} {a['p50_us']} µs (+{(a['p50_us'] - c1p['p50_us']) / 1000:.3f} ms)")
            parts.append(f"c{args.connections} rps plain {cnp['rps']:.0f}")
            for arm in self.arms[1:]:
                a = rr[f"{arm}_c{args.connections}"]
                parts.append(f"{arm} {a['rps']:.0f} ({a['rps'] / cnp['rps']:.2f})")
            parts.append(f"decision p50 filter {rr['filter_c1']['decision_p50_us']}, filter_new "
                         f"{rr['filter_new_c1']['decision_p50_us']} µs")
            if self.epp is not None:
                parts.append(f"epp mean {fmt(rr['epp_c1']['epp_decision_mean_us'])}, epp_new "
                             f"{fmt(rr['epp_new_c1']['epp_decision_mean_us'])} µs")
            print(f"round {i}: " + "; ".join(parts) + f"; load {os.getloadavg()[0]:.2f}", flush=True)
        return rounds

    def cold(self) -> tuple[dict, dict]:
        """Cold: every request's prompt is new (no block in the digest memo). A second front Envoy
        whose only replica is a Python stub answering a fresh prompt per /tokenize call; only the
        filter's own time is read (1 connection). Returns ({mode: (p50, samples)}, decisions)."""
        self.cold_stub = ColdTokenizer(free_port(), self.tokens, COLD_PROMPTS)
        cold_keys = [k for j in range(COLD_PROMPTS)
                     for k in block_keys([ColdTokenizer.FIRST + j] + self.tokens[1:], BLOCK, SEED)]
        cold_reps = [{"id": 0, "name": "cold", "address": f"127.0.0.1:{self.cold_stub.server.server_address[1]}",
                      "models": [MODEL], "up": True}]
        _, cold_listen, _, cold_admin = self.start_front("front-cold", cold_reps, {0: cold_keys + self.blocks[0]})
        cold_url = f"http://127.0.0.1:{cold_listen}/v1/chat/completions"
        cold = {}
        for mode in ("indexed", "new"):
            self.cold_stub.mode = mode
            run_wrk(cold_url, 1, 1, self.script, self.body_path, self.cpu_rest, vary=True)
            before = decision_buckets(cold_admin)
            run_wrk(cold_url, 1, max(self.args.duration, 4), self.script, self.body_path, self.cpu_rest, vary=True)
            time.sleep(0.5)
            cold[mode] = bucket_p50(before, decision_buckets(cold_admin))
        return cold, decisions(cold_admin)

    def close(self) -> None:
        for fd in self.feeds:
            fd.stop()
        if self.epp is not None:
            self.epp.close()
        self.procs.stop_all()
        if self.cold_stub is not None:
            self.cold_stub.stop()
        if self.args.keep:
            print(f"work directory: {self.tmp}")
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)


def upstream_counts(admin: int) -> dict[str, int]:
    """The front Envoy's upstream connections and requests per cluster."""
    _, _, raw = request("GET", f"http://127.0.0.1:{admin}/stats?filter=^cluster\\.(llmgw_tokenizer|llmgw_replicas|plain_replica|llmgw_pool|llmgw_epp)\\.upstream_(cx|rq)_total$")
    return {line.split(": ")[0].replace("cluster.", ""): int(line.split(": ")[1])
            for line in raw.decode().splitlines() if ": " in line}


# ---------------------------------------------------------------------------------------------
# Results.


def summarize(run: Run, rounds: list[dict], d0: dict, d1: dict, tok: dict, mem, cold: dict, cold_decisions: dict,
              profile: dict, upstream: dict) -> dict:
    """The run's figures (medians of rounds), as written to --json."""
    args = run.args
    conn_tag = f"c{args.connections}"
    per_entry = [b / e for _, b, e in mem]
    return {
        "command": " ".join([".venv/bin/python", "bench/filter_perf.py"] + sys.argv[1:]),
        "pinned": run.pin, "rounds": args.rounds, "duration_s": args.duration,
        "loadavg_start": run.load_start, "loadavg_end": os.getloadavg(),
        "body_bytes": len(run.body), "prompt_tokens": len(run.tokens), "blocks": len(run.keys),
        "tokenizer_stub_p50_us": tok["p50_us"], "tokenizer_stub_rps_c1": tok["rps"],
        "decisions": {k: d1.get(k, 0) - d0.get(k, 0) for k in d1},
        "errors": sum(rr[k]["non2xx"] + rr[k]["errors"] for rr in rounds for k in rr if k != "round"),
        "a_decision_p50_us": med([rr["filter_c1"]["decision_p50_us"] for rr in rounds]),
        f"a_decision_p50_us_{conn_tag}": med([rr[f"filter_{conn_tag}"]["decision_p50_us"] for rr in rounds]),
        "a_new_prompt_decision_p50_us": med([rr["filter_new_c1"]["decision_p50_us"] for rr in rounds]),
        "a_cold_indexed_decision_p50_us": cold["indexed"][0], "a_cold_indexed_samples": cold["indexed"][1],
        "a_cold_new_decision_p50_us": cold["new"][0], "a_cold_new_samples": cold["new"][1],
        "cold_decisions": cold_decisions,
        "perf_front_us_per_request": profile,
        "upstream_connections_requests": upstream,
        "b_plain_p50_ms": med([rr["plain_c1"]["p50_us"] / 1000 for rr in rounds]),
        "b_filter_p50_ms": med([rr["filter_c1"]["p50_us"] / 1000 for rr in rounds]),
        "b_added_p50_ms": med([(rr["filter_c1"]["p50_us"] - rr["plain_c1"]["p50_us"]) / 1000 for rr in rounds]),
        "b_p50_ratio": med([rr["filter_c1"]["p50_us"] / rr["plain_c1"]["p50_us"] for rr in rounds]),
        "b_plain_p99_ms": med([rr["plain_c1"]["p99_us"] / 1000 for rr in rounds]),
        "b_new_prompt_filter_p50_ms": med([rr["filter_new_c1"]["p50_us"] / 1000 for rr in rounds]),
        "b_new_prompt_added_p50_ms": med([(rr["filter_new_c1"]["p50_us"] - rr["plain_c1"]["p50_us"]) / 1000
                                          for rr in rounds]),
        "c_plain_rps": med([rr[f"plain_{conn_tag}"]["rps"] for rr in rounds]),
        "c_filter_rps": med([rr[f"filter_{conn_tag}"]["rps"] for rr in rounds]),
        "c_throughput_ratio": med([rr[f"filter_{conn_tag}"]["rps"] / rr[f"plain_{conn_tag}"]["rps"] for rr in rounds]),
        "c_new_prompt_filter_rps": med([rr[f"filter_new_{conn_tag}"]["rps"] for rr in rounds]),
        "c_new_prompt_throughput_ratio": med([rr[f"filter_new_{conn_tag}"]["rps"] / rr[f"plain_{conn_tag}"]["rps"]
                                              for rr in rounds]),
        "front_cpu_us_per_request": {arm: med([rr[f"{arm}_{conn_tag}"]["front_cpu_us"] for rr in rounds])
                                     for arm in run.arms},
        "backend_cpu_us_per_request": {arm: med([rr[f"{arm}_{conn_tag}"]["backend_cpu_us"] for rr in rounds])
                                       for arm in run.arms},
        "arms": arm_figures(run.arms, args.connections, rounds),
        "d_index": [{"vm": vm, "bytes": b, "entries": e, "bytes_per_entry": b / e} for vm, b, e in mem],
        "d_bytes_per_entry": max(per_entry) if per_entry else None,
        "rounds_detail": rounds,
    }


def targets_met(result: dict) -> dict[str, bool]:
    def at_most(v, limit) -> bool:
        return v is not None and v <= limit

    def at_least(v, limit) -> bool:
        return v is not None and v >= limit
    return {
        "a": at_most(result["a_decision_p50_us"], TARGETS["decision_us"]),
        "a_cold": at_most(result["a_cold_indexed_decision_p50_us"], TARGETS["decision_us"]),
        "b": at_most(result["b_added_p50_ms"], TARGETS["added_ms"]),
        "b_new": at_most(result["b_new_prompt_added_p50_ms"], TARGETS["added_ms"]),
        "c": at_least(result["c_throughput_ratio"], TARGETS["throughput_ratio"]),
        "c_new": at_least(result["c_new_prompt_throughput_ratio"], TARGETS["throughput_ratio"]),
        "d": at_most(result["d_bytes_per_entry"], TARGETS["bytes_per_entry"]),
    }


def print_report(args, result: dict, ok: dict[str, bool]) -> None:
    conn_tag = f"c{args.connections}"
    load_start, errors, upstream = result["loadavg_start"], result["errors"], result["upstream_connections_requests"]
    decision, decision_cn = result["a_decision_p50_us"], result[f"a_decision_p50_us_{conn_tag}"]
    decision_new, added, added_new = (result["a_new_prompt_decision_p50_us"], result["b_added_p50_ms"],
                                      result["b_new_prompt_added_p50_ms"])
    tput, tput_new, bpe = result["c_throughput_ratio"], result["c_new_prompt_throughput_ratio"], result["d_bytes_per_entry"]
    cold = {"indexed": (result["a_cold_indexed_decision_p50_us"], result["a_cold_indexed_samples"]),
            "new": (result["a_cold_new_decision_p50_us"], result["a_cold_new_samples"])}
    print()
    print(f"command: {result['command']}   (pinned: {result['pinned']}; load average {load_start[0]:.2f} -> "
          f"{result['loadavg_end'][0]:.2f})")
    print(f"body {result['body_bytes']} B, {result['prompt_tokens']} prompt tokens, {result['blocks']} blocks; "
          f"{args.replicas} replicas x "
          f"{args.blocks} filler blocks; {args.rounds} interleaved rounds of {args.duration:g} s; "
          f"decisions in rounds: {result['decisions']}; errors/non-2xx: {errors}")
    print(f"upstream connections / requests (front Envoy): {upstream}")
    print(f"tokenizer stub alone (backend Envoy direct response, 1 conn): p50 {result['tokenizer_stub_p50_us']} µs")
    mm = lambda k: "MET" if ok[k] else "MISSED"  # noqa: E731
    print(f"(a) decision time p50 (llmgw_decision_us, 1 conn, median of rounds) [target <= {TARGETS['decision_us']:g}]:")
    print(f"    repeated prompt (tokenization cache hit): {decision} µs ({conn_tag}: {decision_cn} µs) {mm('a')}")
    print(f"    new prompt, blocks in the digest memo (tokenizer call; its answer parsed): {decision_new} µs")
    print(f"    new prompt, memo-cold, the index holds it (256 sha256; {cold['indexed'][1]} samples): "
          f"{cold['indexed'][0]} µs {mm('a_cold')}")
    print(f"    new prompt nobody holds (hashing stops after the first batch; {cold['new'][1]} samples): "
          f"{cold['new'][0]} µs; cold decisions: {result['cold_decisions']}")
    print(f"(b) added latency p50, 1 conn (plain {result['b_plain_p50_ms']:.3f} ms) [target <= {TARGETS['added_ms']:g} ms]:")
    print(f"    repeated prompt: filter {result['b_filter_p50_ms']:.3f} ms, added {added:.3f} ms {mm('b')}")
    print(f"    new prompts (tokenizer call each): filter {result['b_new_prompt_filter_p50_ms']:.3f} ms, added "
          f"{added_new:.3f} ms {mm('b_new')}")
    print(f"(c) throughput at {args.connections} conns (plain {result['c_plain_rps']:.0f} rps) "
          f"[target >= {TARGETS['throughput_ratio']:g}]:")
    print(f"    repeated prompt: {result['c_filter_rps']:.0f} rps, ratio {tput:.2f} {mm('c')}")
    print(f"    new prompts (tokenizer call each): {result['c_new_prompt_filter_rps']:.0f} rps, ratio {tput_new:.2f} "
          f"{mm('c_new')}")
    fc, bc = result["front_cpu_us_per_request"], result["backend_cpu_us_per_request"]
    print(f"    CPU per request at {args.connections} conns: front Envoy " + ", ".join(
        f"{a} {fc[a]:.0f} µs" for a in fc) + "; backend " + ", ".join(f"{a} {bc[a]:.0f} µs" for a in bc)
        + " (tokenizer stub included)")
    for d in result["d_index"]:
        print(f"(d) vm {d['vm']}: index {d['bytes'] / 1e6:.2f} MB for {d['entries']:.0f} (block, replica) "
              f"entries = {d['bytes_per_entry']:.1f} B/entry")
    print(f"(d) worst VM: {bpe} B per (block, replica) [target <= {TARGETS['bytes_per_entry']:g}] "
          f"{'MET' if ok['d'] else 'MISSED'}")
    print_arms(args, result)


def main() -> int:
    args = parse_args()
    if not shutil.which("wrk"):
        print("wrk not found (Debian: apt-get install wrk)", file=sys.stderr)
        return 2
    run = Run(args)
    try:
        run.prepare()
        run.start_backend()
        run.feed_tables()
        if not args.no_epp:
            run.start_epp()
        front, listen, plain, admin = run.start_front("front", run.replicas, run.blocks, with_epp=True)
        # (d) index memory, after the snapshot.
        time.sleep(0.5)
        mem = index_memory(admin)
        d0 = run.check_routing(listen, plain, admin)
        tok = run.tokenizer_alone()
        # Warm-up.
        # Arms: plain Envoy; the filter with one prompt repeated (its tokenization cached after the
        # first request); the filter with every prompt new (a tokenizer call per request; the
        # stub's fixed answer keeps the blocks' digests memoised); the same two through the
        # endpoint picker.
        urls = {"plain": f"http://127.0.0.1:{plain}/v1/chat/completions",
                "filter": f"http://127.0.0.1:{listen}/v1/chat/completions",
                "filter_new": f"http://127.0.0.1:{listen}/v1/chat/completions"}
        if run.epp is not None:
            urls["epp"] = urls["epp_new"] = f"http://127.0.0.1:{run.epp_listen}/v1/chat/completions"
        for arm in ("plain", "filter", "epp"):
            if arm in urls:
                run_wrk(urls[arm], args.connections, 1.0, run.script, run.body_path, run.cpu_rest)
        profile = run.profile_arms(front, urls)
        rounds = run.rounds(front, admin, urls)
        d1 = decisions(admin)
        upstream = upstream_counts(admin)
        cold, cold_decisions = run.cold()
        result = summarize(run, rounds, d0, d1, tok, mem, cold, cold_decisions, profile, upstream)
        ok = targets_met(result)
        result["targets_met"] = ok
        print_report(args, result, ok)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
        return 0 if all(ok.values()) and result["errors"] == 0 else 1
    finally:
        run.close()


if __name__ == "__main__":
    sys.exit(main())
