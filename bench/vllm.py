#!/usr/bin/env python3
"""llmgw against real vLLM: three `vllm serve` 0.33.0 replicas (the conformance suite's
no-model executor, each engine step given a cost: --step-us plus --token-us per computed token;
small KV pools so evictions happen), the same seeded traffic through every router, in one run:
Envoy round-robin, llmgw (Envoy + llmgw.wasm + llmgw-agent on the replicas' KV events), and
the peer routers from PyPI (sglang-router and SMG cache_aware, vllm-router cache_aware and
kv_aware); with --routers, also llmgw's variants (its tokenizer elsewhere, every new prompt
waiting, the endpoint picker, two gateways with the client's requests alternating between them).

Workloads: shared-prefix (groups of chats sharing a long system prompt), multi-turn (each
turn extends the conversation) and tenants (shared-prefix traffic over four tenants' cache
salts: the same text, no shared KV blocks); rolling-prefix (shared-prefix with the system
prompts arriving one after another, about four asked at a time) when asked for with --workloads;
at concurrency 4 by default, through the chat API
or, with `--api completions`, the same prompts written out as text through the completions API. Before every run the replicas'
prefix caches are emptied (vLLM's /reset_prefix_cache, dev mode) and the router is started
fresh. Hit rate is read from the replicas' own counters (vllm:prefix_cache_hits_total /
queries_total deltas); the oracle bound is the hit rate an infinite cache holding every earlier
request's blocks would give, computed from the replicas' own tokenization of the workload.
llmgw's time to first token is taken apart from its Envoy's phase histograms (p50 and p99 per
phase, docs/src/operations.md) beside every router's TTFT at the client.

Writes results/vllm/vllm.md, vllm.json and vllm.png. Everything listens on 127.0.0.1; every
process started is stopped at exit, also on Ctrl-C."""

from __future__ import annotations

import argparse
import itertools
import json
import random
import re
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import llmgw_testkit as kit  # the project's test kit: processes, configs, clients
from llmgw_testkit import http_json, stream_request
from llmgw_testkit.fleet import pct, peer_command, start_router, stop_on_signals
from llmgw_testkit.procs import cpu_seconds
from llmgw_testkit.sessions import run_sessions
from llmgw_testkit.vllm_serve import VllmReplica
from llmgw_testkit.workloads import Conversations, SharedPrefix, as_completion, make_sessions
from llmgw_testkit.charts import pyplot

ROOT = kit.ROOT
MODEL = "tiny"
BLOCK = 16

ROUTERS = {
    "rr": "Envoy round-robin",
    "llmgw": "llmgw (KV events)",
    "llmgw-render": "llmgw, tokenizer: vllm launch render",
    "llmgw-native": "llmgw, native tokenizer (agent)",
    "llmgw-waits": "llmgw, every new prompt waits for its tokenizer",
    "llmgw-2gw": "llmgw, two gateways (requests alternate)",
    "llmgw-epp": "llmgw as endpoint picker (ext_proc)",
    "sglang": "sglang-router cache_aware",
    "smg": "SMG cache_aware",
    "vllm-ca": "vllm-router cache_aware",
    "vllm-kv": "vllm-router kv_aware",
}
# Each peer's virtualenv (under the project) and the executable it installs.
PEER_BIN = {"sglang": (".venv-peers", "sglang-router"), "smg": (".venv-smg", "smg"),
            "vllm-ca": (".venv-peers", "vllm-router"), "vllm-kv": (".venv-peers", "vllm-router")}
WORKLOADS = {
    "shared-prefix": "groups of chats sharing a long system prompt",
    "multi-turn": "conversations, each turn extends the last",
    "tenants": "shared-prefix over 4 tenants' cache salts: same text, no shared KV",
    "rolling-prefix": "shared-prefix with the system prompts arriving one after another (about four asked at a time)",
}
# Run unless --workloads names others: every workload but rolling-prefix.
DEFAULT_WORKLOADS = [w for w in WORKLOADS if w != "rolling-prefix"]
# The request path of each API.
API_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# The workloads' shapes (llmgw_testkit.workloads), seeded: every router gets the same traffic;
# `concurrency` sessions run at once.
SHAPES = {
    "shared-prefix": SharedPrefix(groups=8, system_words=120, question_words=(8, 24), per_group=24, vocab=1000),
    "multi-turn": Conversations(48, 4, first_user_words=(60, 90), user_words=(10, 30), assistant_words=8, vocab=1000),
    "tenants": SharedPrefix(groups=6, system_words=120, question_words=(8, 24), per_group=32, vocab=1000, tenants=4),
    "rolling-prefix": SharedPrefix(groups=8, system_words=120, question_words=(8, 24), per_group=24, vocab=1000,
                                   stagger=0.25),
}


def make_workload(name: str, seed: int, scale: float, max_tokens: int, api: str = "chat") -> list[list[dict]]:
    """The workload's sessions as chat bodies, or with `api` "completions" as their completions twins."""
    sessions = make_sessions(SHAPES[name], f"{name}-{seed}", MODEL, max_tokens, scale)
    if api == "completions":
        sessions = [[as_completion(b) for b in session] for session in sessions]
    return sessions


def oracle_hit_rate(replica_url: str, sessions: list[list[dict]]) -> float:
    """The hit rate of one infinite cache that holds every earlier request's prompt blocks, as
    vLLM counts hits (whole blocks, never the prompt's last token): the bound no router beats.
    Blocks are keyed by the request's cache salt too (vLLM mixes it into the first block)."""
    seen: set[tuple] = set()
    hits = queries = 0
    for session in sessions:
        for body in session:
            text = {"messages": body["messages"]} if "messages" in body else {"prompt": body["prompt"]}
            status, _, reply = http_json(f"{replica_url}/tokenize", {"model": MODEL, **text}, timeout=30)
            if status != 200:
                raise RuntimeError(f"/tokenize: HTTP {status}: {reply}")
            toks = reply["tokens"]
            salt = body.get("cache_salt")
            queries += len(toks)
            usable = (len(toks) - 1) // BLOCK
            matched = 0
            while matched < usable and (salt, *toks[: (matched + 1) * BLOCK]) in seen:
                matched += 1
            hits += matched * BLOCK
            for i in range(1, len(toks) // BLOCK + 1):
                seen.add((salt, *toks[: i * BLOCK]))
    return hits / queries if queries else 0.0


# ----------------------------------------------------------------------------------------------
# The fleet: real `vllm serve` processes.


class Replica(VllmReplica):
    """A `vllm serve` replica of the benchmark (llmgw_testkit.vllm_serve: its flags from
    `llmgw-agent vllm-args`). The publisher binds on loopback with vLLM's default topic (""):
    the agent and vllm-router both connect to it."""

    def __init__(self, i: int, blocks: int):
        super().__init__(f"v{i}", "connect", blocks=blocks, model=MODEL, topic="")

    def command(self, a) -> list:
        return self.serve_command(a.vllm_venv / "bin" / "vllm", a.model_dir, a.agent_bin, max_model_len=2048,
                                  max_num_seqs=a.max_num_seqs, extra=["--enable-scale-out"])

    def env(self, a) -> dict:
        return self.serve_env(a.agent_bin, VLLM_SERVER_DEV_MODE="1", LLMGW_STEP_US=str(a.step_us),
                              LLMGW_TOKEN_US=str(a.token_us))


def reset_caches(replicas: list[Replica]) -> None:
    """Empties every replica's prefix cache (retried while requests still hold blocks), then
    has each engine run one step. vLLM publishes the reset (`AllBlocksCleared`) with the events of
    its next step, not when the cache is emptied: without a step before the run, llmgw learns of
    the reset from the run's first batches, and drops the speculative entries of what it routed
    before (entries written before a reset it learns of are stale), so a conversation's next
    turn could go where its first was not. The step's prompt is shorter than a block, so it
    leaves nothing cached."""
    for r in replicas:
        def done(r=r) -> bool:
            status, _, reply = http_json(f"{r.url}/reset_prefix_cache", {}, timeout=10)
            return status == 200 and bool(reply.get("success"))
        kit.wait_until(done, 30, f"{r.name} to empty its prefix cache")
        status, _, reply = http_json(f"{r.url}/v1/completions", {"model": MODEL, "prompt": "reset", "max_tokens": 1},
                                     timeout=30)
        if status != 200:
            raise RuntimeError(f"{r.name}: the step after the reset failed: HTTP {status}: {reply}")


# ----------------------------------------------------------------------------------------------
# Routers: started fresh for every run.


class Router:
    def __init__(self, bench: "Bench", name: str):
        self.b, self.name = bench, name
        self.port = kit.free_port()
        # Where requests go: one port, or each gateway's in turn (llmgw-2gw).
        self.ports = [self.port]
        self.turn = itertools.count()
        self.procs: list = []
        self.envoy = None
        self.agent = None

    def next_port(self) -> int:
        return self.ports[next(self.turn) % len(self.ports)]

    def start(self) -> None:
        b, a, reps = self.b, self.b.args, self.b.replicas
        admin = kit.free_port()
        if self.name == "rr":
            text = kit.lb_config(self.port, admin, [r.port for r in reps], "ROUND_ROBIN")
            proc, self.envoy = start_router(b.procs, a.envoy, b.logdir, "envoy-rr", text, admin, feed=False)
            self.procs.append(proc)
        elif self.name == "llmgw-2gw":
            # Two gateways, each Envoy with its own agent (the sidecar deployment), in front of the
            # same replicas; the client sends each request to the next. Each sees half of the
            # requests in flight: the other half only through the engines' load reports.
            self.ports = [self.port, kit.free_port()]
            for i, port in enumerate(self.ports):
                self.start_llmgw(port, admin if i == 0 else kit.free_port(), f"-{i}")
        elif self.name in ("llmgw", "llmgw-render", "llmgw-native", "llmgw-waits"):
            self.start_llmgw(self.port, admin, "")
        elif self.name == "llmgw-epp":
            # The agent as a GAIE endpoint picker behind Envoy's ext_proc filter, configured as
            # envoy/llmgw-epp-local.yaml ships (the answer streamed through the picker), with the
            # filter's configuration as its routing configuration.
            epp_port = kit.free_port()
            profile = {"name": "bench", "block_size": BLOCK, "kv_events": True, **json.loads(a.llmgw_profile)}
            routing = b.logdir / "epp-routing.json"
            routing.write_text(json.dumps(kit.filter_config(profile)))
            agent = kit.Agent(b.procs, a.agent_bin, b.logdir, [r.agent_entry() for r in reps], name="agent-epp",
                              hash={"algo": "sha256_cbor", "seed": "0", "block_size": BLOCK},
                              epp={"listen": f"127.0.0.1:{epp_port}", "routing": str(routing)}).wait_ready()
            self.agent = agent
            self.procs.append(agent.proc)
            kit.wait_until(lambda: all(x["up"] and x["connected"] for x in agent.replicas()), 60,
                           "the agent to see every replica up and its publisher connected")
            text = kit.epp_bootstrap(self.port, admin, epp_port, [r.port for r in reps])
            proc, self.envoy = start_router(b.procs, a.envoy, b.logdir, "envoy-epp", text, admin, feed=False)
            self.procs.append(proc)
        else:
            venv, exe = PEER_BIN[self.name]
            cmd = peer_command(self.name, ROOT / venv / "bin" / exe, self.port, [r.url for r in reps], kit.free_port(),
                               [(r.url, r.kv, r.replay) for r in reps], BLOCK, MODEL)
            self.procs.append(b.procs.start(cmd, self.name))

        def ready() -> bool:
            if any(p.poll() is not None for p in self.procs):
                raise RuntimeError(f"{ROUTERS[self.name]} exited (log: {b.logdir})")
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
            return all(kit.plain_request(port, body)[2] == 200 for port in self.ports)
        kit.wait_until(ready, 90, f"{ROUTERS[self.name]} to route")

    def start_llmgw(self, port: int, admin: int, tag: str) -> None:
        """One llmgw gateway (its agent, then Envoy with the filter) listening on `port`; the
        first one started is the one whose phases are reported."""
        b, a, reps = self.b, self.b.args, self.b.replicas
        sections = {}
        if self.name == "llmgw-native":
            # The agent's native tokenizer beside Envoy, on the model's own tokenizer files.
            # Measured as it runs once past its start: its first answers are each checked
            # against a replica (`verify_first`, 200 by default: longer than a run here, so
            # every request would call a replica's /tokenize as well); after those, the
            # default share (1 %).
            self.tokenizer_port = kit.free_port()
            sections["tokenizer"] = {"listen": f"127.0.0.1:{self.tokenizer_port}", "verify_first": 16,
                                     "models": [{"names": [MODEL], "dir": str(a.model_dir)}]}
        agent = kit.Agent(b.procs, a.agent_bin, b.logdir, [r.agent_entry() for r in reps], name=f"agent{tag}",
                          hash={"algo": "sha256_cbor", "seed": "0", "block_size": BLOCK}, **sections).wait_ready()
        self.agent = self.agent or agent
        self.procs.append(agent.proc)
        kit.wait_until(lambda: all(x["up"] and x["connected"] for x in agent.replicas()), 60,
                       "the agent to see every replica up and its publisher connected")
        profile = {"name": "bench", "block_size": BLOCK, "kv_events": True, **json.loads(a.llmgw_profile)}
        if self.name == "llmgw-render":
            profile["tokenizer_address"] = f"127.0.0.1:{b.render.port}"
        if self.name == "llmgw-native":
            profile["tokenizer_address"] = f"127.0.0.1:{self.tokenizer_port}"
        # The ablation: no routing before the tokenizer answers (neither on a conversation's
        # turn before nor on what a request's siblings share).
        waits = {"route_on_earlier_turns": False, "route_on_shared_prefixes": False} if self.name == "llmgw-waits" else {}
        waits = {**json.loads(a.llmgw_config), **waits}
        # The shipped defaults: the explain header (a debugging aid, off by default) only
        # when asked for.
        cfg = kit.filter_config(profile, explain_header=a.explain_header, **waits)
        # Stats flushed when the benchmark reads them, not on a timer: the shipped
        # configuration flushes every 5 s (Envoy's default); a timer of 0.5 s took about
        # 0.25 of Envoy's 2.5 ms of CPU per request here (means of 6 runs each).
        text = kit.shipped_config(a.wasm, port, admin, agent.feed, cfg, stats_flush_on_admin=True)
        proc, envoy = start_router(b.procs, a.envoy, b.logdir, f"envoy-llmgw{tag}", text, admin, feed=True)
        self.procs.append(proc)
        self.envoy = self.envoy or envoy

    def stop(self) -> None:
        for p in reversed(self.procs):
            self.b.procs.stop(p)
        self.procs = []

    def phases_us(self) -> dict:
        """llmgw: where its time went (docs/src/operations.md, "Where a request's time goes"),
        p50 and p99 per phase in µs from Envoy's histograms; the tokenizer's also as before."""
        if not self.name.startswith("llmgw") or self.name == "llmgw-epp" or self.envoy is None:
            return {}
        try:
            text = kit.get_text(f"http://127.0.0.1:{self.envoy.port}/stats?filter={PHASE_FILTER}&histogram_buckets=none")
        except OSError:
            return {}
        phases = parse_phases(text)
        out: dict = {"phases_us": phases}
        # Their means too: means add up where medians do not (the time outside the replicas is a
        # difference of means).
        try:
            text = kit.get_text(f"http://127.0.0.1:{self.envoy.port}/stats/prometheus?filter={PHASE_FILTER}")
            out["phase_means_us"] = parse_phase_means(text)
        except OSError:
            pass
        # How its requests got their tokens: cached, routed on the conversation's turn before, or
        # waiting for a call.
        try:
            text = kit.get_text(f"http://127.0.0.1:{self.envoy.port}/stats?filter={CACHE_FILTER}")
            out["tokenizer_cache"] = {m.group(1): int(m.group(2)) for m in re.finditer(CACHE_LINE, text)}
            # Routed before their call: prompt ids read from the replica's answer, or called for.
            out["answer_tokens"] = {m.group(1): int(m.group(2)) for m in re.finditer(ANSWER_LINE, text)}
        except OSError:
            pass
        if self.name == "llmgw-native":
            # What the native tokenizer did: answered, checked against a replica, differed.
            try:
                metrics = self.agent.metrics()
            except OSError:
                metrics = ""
            out["native"] = {k: native_metric(metrics, f"llmgw_native_tokenizer_{k}_total")
                             for k in ("answered", "declined", "verified", "mismatches", "cache_hit_tokens", "cache_miss_tokens")}
        if "tokenizer" in phases:
            out.update(tokenizer_p50_us=phases["tokenizer"][0], tokenizer_p99_us=phases["tokenizer"][1])
        return out


def native_metric(text: str, name: str) -> float:
    """The sum of a counter's samples in Prometheus text (0 when absent)."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


# llmgw's phase histograms, in request order: report name -> Envoy stat.
PHASES = {"body": "llmgw_phase_body_us", "tokenizer": "llmgw_tokenizer_latency_us", "decision": "llmgw_decision_us",
          "gateway": "llmgw_phase_gateway_us", "first_byte": "llmgw_phase_upstream_first_byte_us",
          "first_chunk": "llmgw_phase_upstream_first_chunk_us"}
PHASE_FILTER = r"^wasmcustom\.(" + "|".join(PHASES.values()) + r")$"
CACHE_FILTER = r"^wasmcustom\.llmgw_(tokenizer_cache|answer_tokens)_total"
CACHE_LINE = re.compile(r"wasmcustom\.llmgw_tokenizer_cache_total\.result\.(\w+): (\d+)")
ANSWER_LINE = re.compile(r"wasmcustom\.llmgw_answer_tokens_total\.result\.(\w+): (\d+)")
_QUANTILES = re.compile(r"^wasmcustom\.(\w+): .*?P50\([^,]*,([^)]*)\).*?P99\([^,]*,([^)]*)\)")


def parse_phases(stats_text: str) -> dict[str, tuple[float, float]]:
    """Envoy's /stats text (histogram summaries: `name: P0(interval,cumulative) ...`) to
    {phase: (p50 µs, p99 µs)} over the whole run; a phase with no recorded values is left out."""
    by_stat = {v: k for k, v in PHASES.items()}
    out = {}
    for line in stats_text.splitlines():
        m = _QUANTILES.match(line.strip())
        if m and m.group(1) in by_stat:
            try:
                p50, p99 = float(m.group(2)), float(m.group(3))
            except ValueError:
                continue
            if p50 == p50 and p99 == p99:  # not nan
                out[by_stat[m.group(1)]] = (p50, p99)
    return {k: out[k] for k in PHASES if k in out}


def parse_phase_means(prom_text: str) -> dict[str, float]:
    """Envoy's /stats/prometheus text to {phase: mean µs} over the whole run (each histogram's
    `_sum` over its `_count`); a phase with no values is left out."""
    out = {}
    for phase, stat in PHASES.items():
        count = kit.prom_sum(prom_text, f"{stat}_count")
        if count > 0:
            out[phase] = kit.prom_sum(prom_text, f"{stat}_sum") / count
    return out


# ----------------------------------------------------------------------------------------------


# The series llmgw-agent asks vLLM's /metrics for by name (crates/llmgw-agent/src/load.rs).
LOAD_SERIES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
               "vllm:gpu_cache_usage_perc", "vllm:cache_config_info")


def call_costs(r: Replica, calls: int = 50) -> dict:
    """The CPU a replica's processes spend per call (ms, the mean of `calls`), idle, before the
    runs: its whole /metrics page, the page of the load series by name as llmgw-agent asks for
    it, and a /tokenize of a 300-word prompt."""
    named = f"{r.url}/metrics/?" + "&".join("name%5B%5D=" + s.replace(":", "%3A") for s in LOAD_SERIES)
    body = {"model": MODEL, "prompt": " ".join(f"w{i}" for i in range(300))}

    def cost(call) -> float:
        c0 = cpu_seconds([r.proc.pid])
        for _ in range(calls):
            call()
        return (cpu_seconds([r.proc.pid]) - c0) / calls * 1000
    return {"metrics_whole_ms": cost(lambda: kit.get_text(f"{r.url}/metrics")),
            "metrics_by_name_ms": cost(lambda: kit.get_text(named)),
            "tokenize_ms": cost(lambda: http_json(f"{r.url}/tokenize", body, timeout=10))}


class Bench:
    def __init__(self, args):
        self.args = args
        self.logdir = Path(tempfile.mkdtemp(prefix="llmgw-bench-vllm-"))
        self.procs = kit.Procs(self.logdir)
        self.replicas = [Replica(i, args.blocks) for i in range(args.replicas)]
        self.results: list[dict] = []
        self.skipped: dict[str, str] = {}
        self.oracle: dict[str, float] = {}
        self.call_costs: dict[str, float] = {}

    def start_fleet(self) -> None:
        a = self.args
        log(f"starting {len(self.replicas)} vllm serve replicas ({a.blocks} KV blocks of {BLOCK} tokens, "
            f"step {a.step_us} µs + {a.token_us} µs per computed token); logs in {self.logdir}")
        for r in self.replicas:
            r.proc = self.procs.start(r.command(a), f"vllm-{r.name}", env=r.env(a))
        t0 = time.monotonic()
        for r in self.replicas:
            r.wait_healthy(r.proc, a.startup_timeout)
            log(f"  {r.name} serving on 127.0.0.1:{r.port} ({time.monotonic() - t0:.0f} s)")

    def start_render(self) -> None:
        """vLLM's engine-less render server (`vllm launch render`): a dedicated tokenizer that
        never queues behind generation, as the deployment manifests offer it beside Envoy."""
        a = self.args
        self.render = VllmReplica("render", model=MODEL)
        cmd = [a.vllm_venv / "bin" / "vllm", "launch", "render", a.model_dir, "--served-model-name", MODEL,
               "--host", "127.0.0.1", "--port", self.render.port, "--uvicorn-log-level", "warning"]
        self.render.proc = self.procs.start(cmd, "vllm-render", env=self.render.serve_env(a.agent_bin))

        def serving() -> bool:
            if self.render.proc.poll() is not None:
                raise RuntimeError(f"vllm launch render exited:\n{kit.tail(self.render.proc.log_path, 30)}")
            try:
                return http_json(f"{self.render.url}/tokenize", {"model": MODEL, "prompt": "hi"}, timeout=5)[0] == 200
            except OSError:
                return False
        kit.wait_until(serving, a.startup_timeout, "vllm launch render to tokenize")
        log(f"  render (tokenizer) serving on 127.0.0.1:{self.render.port}")

    def run_one(self, router: Router, sessions: list[list[dict]], label: str) -> dict:
        """One router's run: the shared session runner's figures, plus the busiest replica's
        requests over the idlest's."""
        sims = [{"port": r.port} for r in self.replicas]
        path = API_PATHS[self.args.api]
        # CPU the router's processes and the replicas' used over the run: on one machine every
        # CPU-millisecond a router spends is taken from the replicas' API servers and engines.
        router_pids = [p.pid for p in router.procs]
        replica_pids = [r.proc.pid for r in self.replicas if r.proc is not None]
        cpu0 = cpu_seconds(router_pids), cpu_seconds(replica_pids)
        # Each of the router's processes alone too (llmgw: the agent, then Envoy).
        each0 = [cpu_seconds([p]) for p in router_pids]
        out = run_sessions(label, lambda body: stream_request(router.next_port(), body, path=path), sims, sessions,
                           self.args.concurrency, width=len(label))
        cpu1 = cpu_seconds(router_pids), cpu_seconds(replica_pids)
        n = max(1, out["requests"])
        out["router_cpu_ms_per_request"] = (cpu1[0] - cpu0[0]) / n * 1000
        out["replica_cpu_ms_per_request"] = (cpu1[1] - cpu0[1]) / n * 1000
        out["router_cpu_ms_per_request_each"] = [(cpu_seconds([p]) - c) / n * 1000 for p, c in zip(router_pids, each0)]
        shares = out["shares"]
        out["max_min"] = max(shares) / min(shares) if shares and min(shares) > 0 else float("inf")
        return out

    def run(self) -> None:
        a = self.args
        self.start_fleet()
        if "llmgw-render" in a.routers:
            try:
                self.start_render()
            except (TimeoutError, OSError, RuntimeError) as e:
                self.skipped["llmgw-render"] = f"{type(e).__name__}: {e}"
        self.call_costs = call_costs(self.replicas[0])
        log("  a replica's CPU per call: " + ", ".join(f"{k} {v:.2f}" for k, v in self.call_costs.items()))
        sessions = {w: make_workload(w, a.seed, a.scale, a.max_tokens, a.api) for w in a.workloads}
        for w in a.workloads:
            self.oracle[w] = oracle_hit_rate(self.replicas[0].url, sessions[w])
            log(f"  {w}: {sum(len(s) for s in sessions[w])} requests ({WORKLOADS[w]}); infinite-cache oracle hit rate "
                f"{self.oracle[w] * 100:.1f} %")
        routers = []
        for name in a.routers:
            if name in self.skipped:
                continue
            if name in PEER_BIN and not (ROOT / PEER_BIN[name][0] / "bin" / PEER_BIN[name][1]).exists():
                self.skipped[name] = f"not installed ({PEER_BIN[name][0]}/bin/{PEER_BIN[name][1]})"
                continue
            routers.append(name)
        for run in range(1, a.runs + 1):
            for w in a.workloads:
                for name in routers:
                    if name in self.skipped:
                        continue
                    reset_caches(self.replicas)
                    router = Router(self, name)
                    label = f"run {run} {w} {ROUTERS[name]}"
                    try:
                        router.start()
                        r = self.run_one(router, sessions[w], label)
                        r.update(router.phases_us())
                    except (TimeoutError, OSError, RuntimeError) as e:
                        self.skipped[name] = f"{type(e).__name__}: {e} (log: {self.logdir})"
                        log(f"  {ROUTERS[name]}: could not run: {e}")
                        continue
                    finally:
                        router.stop()
                    r.update({"run": run, "workload": w, "router": name, "oracle": self.oracle[w],
                              "of_oracle": r["hit_rate"] / self.oracle[w] if self.oracle[w] else float("nan")})
                    log(f"  {label}: hit {r['hit_rate'] * 100:.1f} % ({r['of_oracle']:.2f} of oracle), TTFT p50 "
                        f"{r['ttft_p50']:.0f} ms p99 {r['ttft_p99']:.0f} ms, max/min {r['max_min']:.2f}, errors {r['errors']}")
                    self.results.append(r)


# ----------------------------------------------------------------------------------------------
# Report


def table(results: list[dict], run: int) -> list[str]:
    out = ["| router | " + " | ".join(f"{w}: hit (of oracle) | max/min | TTFT p50 (× rr) | p99 ms | errors" for w in WORKLOADS
                                       if any(r["workload"] == w for r in results)) + " |"]
    ws = [w for w in WORKLOADS if any(r["workload"] == w for r in results)]
    out.append("|---|" + "---|---|---|---|---|" * len(ws))
    for name in ROUTERS:
        cells = []
        for w in ws:
            r = next((r for r in results if r["run"] == run and r["workload"] == w and r["router"] == name), None)
            rr = next((r for r in results if r["run"] == run and r["workload"] == w and r["router"] == "rr"), None)
            if r is None:
                cells.append("— | — | — | — | —")
                continue
            x = f" ({r['ttft_p50'] / rr['ttft_p50']:.2f})" if rr and rr["ttft_p50"] else ""
            cells.append(f"{r['hit_rate']:.3f} ({r['of_oracle']:.2f}) | {r['max_min']:.2f} | {r['ttft_p50']:.0f} ms{x} | "
                         f"{r['ttft_p99']:.0f} | {r['errors']}")
        if any(c != "— | — | — | — | —" for c in cells):
            out.append(f"| {ROUTERS[name]} | " + " | ".join(cells) + " |")
    return out


def p50_gap(mine: list[float], theirs: list[float], draws: int = 2000) -> tuple[float, float] | None:
    """A 95 % interval of p50(mine) - p50(theirs), in ms: each router's requests of the run
    resampled with replacement (percentile bootstrap, a fixed seed so a report reads the same
    twice). An interval that spans 0 says the run cannot tell the two p50s apart."""
    if len(mine) < 2 or len(theirs) < 2:
        return None
    rng = random.Random(1)
    gaps = sorted(pct(rng.choices(mine, k=len(mine)), 50) - pct(rng.choices(theirs, k=len(theirs)), 50)
                  for _ in range(draws))
    return gaps[int(0.025 * draws)], gaps[int(0.975 * draws) - 1]


def gap_text(me: dict, other: dict) -> str:
    """llmgw's p50 against `other`'s, with its interval where the run kept every TTFT."""
    d = me["ttft_p50"] - other["ttft_p50"]
    iv = p50_gap(me.get("ttfts_ms", []), other.get("ttfts_ms", []))
    return f"{d:+.1f} ms" + (f" (95 % interval {iv[0]:+.1f} to {iv[1]:+.1f})" if iv else "")


def targets(results: list[dict]) -> list[str]:
    """The issue's targets for llmgw, per run: checked, with the miss stated."""
    lines = []
    limit = {"shared-prefix": 0.45, "multi-turn": 0.75}
    ours = ("llmgw", "llmgw-render")
    for run, w, mine in ((run, w, mine) for run in sorted({r["run"] for r in results}) for w in WORKLOADS for mine in ours):
        me = next((r for r in results if r["run"] == run and r["workload"] == w and r["router"] == mine), None)
        if me is None:
            continue
        rr = next((r for r in results if r["run"] == run and r["workload"] == w and r["router"] == "rr"), None)
        others = [r for r in results if r["run"] == run and r["workload"] == w and r["router"] not in (*ours, "rr")]
        checks = []
        if rr and w in limit:
            x = me["ttft_p50"] / rr["ttft_p50"]
            checks.append(f"TTFT p50 {x:.2f}× round-robin (≤ {limit[w]}: {'met' if x <= limit[w] else 'missed'})")
        elif rr:
            checks.append(f"TTFT p50 {me['ttft_p50'] / rr['ttft_p50']:.2f}× round-robin")
        faster = [o for o in others if o["ttft_p50"] < me["ttft_p50"]]
        if faster:
            checks.append("lowest TTFT p50: missed (" + ", ".join(
                f"{ROUTERS[o['router']]} {o['ttft_p50']:.0f} ms" for o in faster) + f" vs {me['ttft_p50']:.0f} ms; "
                + ", ".join(f"llmgw {gap_text(me, o)} against {ROUTERS[o['router']]}" for o in faster) + ")")
        elif others:
            nearest = min(others, key=lambda o: o["ttft_p50"])
            checks.append(f"lowest TTFT p50: met ({gap_text(me, nearest)} against {ROUTERS[nearest['router']]})")
        else:
            checks.append("lowest TTFT p50: met (no other router ran)")
        checks.append(f"hit {me['of_oracle']:.2f} of oracle (≥ 0.95: {'met' if me['of_oracle'] >= 0.95 else 'missed'})")
        checks.append(f"max/min {me['max_min']:.2f} (≤ 1.25: {'met' if me['max_min'] <= 1.25 else 'missed'})")
        checks.append(f"errors {me['errors']} ({'met' if me['errors'] == 0 else 'missed'})")
        lines.append(f"- run {run}, {w}, {ROUTERS[mine]}: " + "; ".join(checks))
    return lines


PHASE_TITLES = {"body": "body", "tokenizer": "tokenizer", "decision": "decision", "gateway": "gateway (headers → decision)",
                "first_byte": "upstream first byte", "first_chunk": "upstream first chunk"}


def phase_table(results: list[dict]) -> list[str]:
    """Where llmgw's time to first token goes, beside every router's TTFT at the client: per
    run and workload, each phase's p50 (p99) in ms from llmgw's Envoy; `rest` = TTFT p50 minus
    the gateway's and the upstream first chunk's p50s (the client, Envoy's own forwarding; a
    difference of medians, so approximate)."""
    cols = list(PHASE_TITLES)
    out = ["| run | workload | router | TTFT p50 (p99) | " + " | ".join(PHASE_TITLES.values()) + " | rest | vs fastest peer |",
           "|---|---|---|---|" + "---|" * (len(cols) + 2)]
    ours = ("llmgw", "llmgw-render")
    for run in sorted({r["run"] for r in results}):
        for w in WORKLOADS:
            rows = [r for r in results if r["run"] == run and r["workload"] == w]
            if not any(r["router"] in ours and r.get("phases_us") for r in rows):
                continue
            peers = [r for r in rows if r["router"] not in (*ours, "rr")]
            fastest = min(peers, key=lambda r: r["ttft_p50"], default=None)
            for name in ROUTERS:
                r = next((r for r in rows if r["router"] == name), None)
                if r is None:
                    continue
                ph = r.get("phases_us") or {}
                cells = [f"{ph[c][0] / 1000:.2f} ({ph[c][1] / 1000:.2f})" if c in ph else "—" for c in cols]
                rest = gap = "—"
                if "gateway" in ph and "first_chunk" in ph:
                    rest = f"{r['ttft_p50'] - (ph['gateway'][0] + ph['first_chunk'][0]) / 1000:.2f}"
                if name in ours and fastest is not None:
                    gap = f"{r['ttft_p50'] - fastest['ttft_p50']:+.2f} ms ({ROUTERS[fastest['router']]})"
                out.append(f"| {run} | {w} | {ROUTERS[name]} | {r['ttft_p50']:.2f} ({r['ttft_p99']:.2f}) | "
                           + " | ".join(cells) + f" | {rest} | {gap} |")
    return out if len(out) > 2 else []


def chart(results: list[dict], out: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        print("(matplotlib not installed: no chart)")
        return None
    ws = [w for w in WORKLOADS if any(r["workload"] == w for r in results)]
    names = [n for n in ROUTERS if any(r["router"] == n for r in results)]
    fig, axes = plt.subplots(len(ws), 3, figsize=(15, 4 * len(ws)), squeeze=False)
    metrics = [("of_oracle", "hit rate (of the oracle's)"), ("ttft_p50", "TTFT p50 (ms)"), ("max_min", "max/min request share")]
    for i, w in enumerate(ws):
        for j, (key, title) in enumerate(metrics):
            ax = axes[i][j]
            for k, n in enumerate(names):
                vals = [r[key] for r in results if r["workload"] == w and r["router"] == n]
                if not vals:
                    continue
                ax.bar(k, statistics.median(vals), color=f"C{k}")
                ax.scatter([k] * len(vals), vals, color="black", s=10, zorder=3)
            ax.set_xticks(range(len(names)), names, fontsize=8, rotation=20)
            ax.set_title(f"{w}: {title}", fontsize=9)
    fig.suptitle("3 real vllm serve 0.33.0 replicas, concurrency 4: bars = median of the runs, dots = each run. "
                 + ", ".join(f"{n} = {ROUTERS[n]}" for n in names), fontsize=8, wrap=True)
    fig.tight_layout()
    path = out / "vllm.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def side_table(results: list[dict]) -> list[str]:
    """Per run and workload, every router's mean TTFT at the client beside the replicas' own
    mean and its parts: a gap between routers shows as time in the replicas (placement, queueing)
    or outside them (the router's path)."""
    rows = [r for r in results if r.get("replica_ttft_mean", float("nan")) == r.get("replica_ttft_mean")]
    if not rows:
        return []
    ms = lambda v: f"{v:.1f}" if v == v else "—"  # noqa: E731
    steps = lambda r: f"{r['engine_steps'] / r['requests']:.1f}" if r.get("engine_steps") and r.get("requests") else "—"  # noqa: E731
    def gateway(r: dict) -> str:
        # llmgw's part of the time outside: headers in to the decision, mean, and how many
        # requests waited there for a tokenizer answer (the cache's misses).
        mean = (r.get("phase_means_us") or {}).get("gateway")
        if mean is None:
            return "—"
        misses = (r.get("tokenizer_cache") or {}).get("miss")
        waited = f" ({misses} of {r['requests']} waited" if misses is not None and r.get("requests") else ""
        read = (r.get("answer_tokens") or {}).get("read")
        if waited and read is not None:
            waited += f"; {read} read their ids from the answer"
        return f"{mean / 1000:.1f}{waited}{')' if waited else ''}"
    lines = ["| run | workload | router | client TTFT mean | replica TTFT mean | queued | prefilling | outside | "
             "of which llmgw's gateway phase | router CPU ms/request | replicas' CPU ms/request | engine steps/request |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        outside = r["ttft_mean"] - r["replica_ttft_mean"]
        each = r.get("router_cpu_ms_per_request_each") or []
        # llmgw's two processes: the agent's share, then Envoy's.
        split = f" ({' + '.join(ms(v) for v in each)})" if len(each) > 1 else ""
        lines.append(f"| {r['run']} | {r['workload']} | {ROUTERS[r['router']]} | {ms(r['ttft_mean'])} | "
                     f"{ms(r['replica_ttft_mean'])} | {ms(r['replica_queue_mean'])} | {ms(r['replica_prefill_mean'])} | "
                     f"{ms(outside)} | {gateway(r)} | {ms(r.get('router_cpu_ms_per_request', float('nan')))}{split} | "
                     f"{ms(r.get('replica_cpu_ms_per_request', float('nan')))} | {steps(r)} |")
    return lines


def report(out: Path, header: list[str], results: list[dict], skipped: dict, oracle: dict) -> int:
    out.mkdir(parents=True, exist_ok=True)
    md = [*header,
          "Hit rate = prefix-cache hits / queries (tokens, the replicas' own counters); of oracle = that over an infinite "
          "cache's hit rate on the same traffic; max/min = the busiest replica's requests over the idlest's; TTFT = time "
          "to the first SSE data line at the client (× rr: over round-robin's in the same run).",
          "", "Oracle hit rates: " + ", ".join(f"{w} {v:.3f}" for w, v in oracle.items())]
    for run in sorted({r["run"] for r in results}):
        md += ["", f"**Run {run}**", "", *table(results, run)]
    tgt = targets(results)
    if tgt:
        md += ["", "**Targets** (llmgw, every run):", "", *tgt]
    tok = [r for r in results if r["router"].startswith("llmgw") and r.get("tokenizer_p50_us") == r.get("tokenizer_p50_us")
           and "tokenizer_p50_us" in r]
    if tok:
        md += ["", "**llmgw's tokenizer callout** (`llmgw_tokenizer_latency_us`, Envoy's histogram): " + "; ".join(
            f"run {r['run']} {r['workload']} {ROUTERS[r['router']]}: p50 {r['tokenizer_p50_us'] / 1000:.1f} ms, p99 {r['tokenizer_p99_us'] / 1000:.1f} ms "
            f"({r['tokenizer_p50_us'] / 1000 / r['ttft_p50'] * 100:.0f} % of TTFT p50)" for r in tok)]
    native = [r for r in results if r.get("native")]
    if native:
        md += ["", "**The native tokenizer** (agent metrics): " + "; ".join(
            f"run {r['run']} {r['workload']}: answered {r['native']['answered']:.0f}, declined {r['native']['declined']:.0f}, "
            f"checked against a replica {r['native']['verified']:.0f}, mismatches {r['native']['mismatches']:.0f}, "
            f"piece-cache tokens {r['native']['cache_hit_tokens']:.0f} hit / {r['native']['cache_miss_tokens']:.0f} tokenized"
            for r in native)]
    phases = phase_table(results)
    if phases:
        md += ["", "**Where llmgw's time goes** (ms: p50 (p99) of each phase, Envoy's histograms over the run; the "
               "phases in docs/src/operations.md; peers: their TTFT at the client only):", "", *phases]
    sides = side_table(results)
    if sides:
        md += ["", "**Every router's time, inside and outside the replicas** (means in ms; replica = vLLM's own "
               "`time_to_first_token_seconds` from the request's arrival at its API server, of which queued and "
               "prefilling in the engine; outside = client TTFT − replica TTFT: the router, the network and the "
               "client; of which llmgw's gateway phase = its request headers in to its decision, of which some "
               "requests waited for a tokenizer answer; CPU = user + system time of the router's processes (for llmgw the agent's + Envoy's in brackets) and of the "
               "replicas' (API servers and engines), per request; engine steps = the steps the replicas' engines ran "
               "(`vllm:iteration_tokens_total` observations), per request: each costs the engine's loop its CPU, so a "
               "router that spreads requests over more replicas runs more of them):", "", *sides]
    if skipped:
        md += ["", "**Not run:**", "", *[f"- {ROUTERS[n]}: {why}" for n, why in skipped.items()]]
    text = "\n".join(md) + "\n"
    (out / "vllm.md").write_text(text)
    (out / "vllm.json").write_text(json.dumps({"header": header, "results": results, "skipped": skipped, "oracle": oracle}, indent=2))
    png = chart(results, out)
    print()
    print(text)
    rel = lambda p: p.relative_to(ROOT) if p.is_relative_to(ROOT) else p  # noqa: E731
    print(f"written: {rel(out / 'vllm.md')}, {rel(out / 'vllm.json')}" + (f", {rel(png)}" if png else ""))
    return 0 if results else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3, help="runs of every router on every workload (default 3)")
    ap.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=DEFAULT_WORKLOADS,
                    help=f"default: {' '.join(DEFAULT_WORKLOADS)}")
    ap.add_argument("--routers", nargs="+", choices=list(ROUTERS), default=[r for r in ROUTERS if r != "llmgw-waits"],
                    help="default: every router but the llmgw-waits ablation")
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--api", choices=list(API_PATHS), default="chat",
                    help="the request API: chat (default) or completions (the same prompts written out as text)")
    ap.add_argument("--scale", type=float, default=1.0, help="request count multiplier")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--blocks", type=int, default=192, help="KV blocks per replica (default 192: evictions happen)")
    ap.add_argument("--step-us", type=int, default=5000, help="cost of an engine step (µs, default 5000)")
    ap.add_argument("--token-us", type=int, default=200, help="cost per token computed in a step (µs, default 200)")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=8, help="output tokens per request")
    ap.add_argument("--llmgw-profile", default="{}", help="JSON fields added to llmgw's profile (e.g. its ttft rates)")
    ap.add_argument("--llmgw-config", default="{}",
                    help="JSON fields added to llmgw's filter configuration outside the profile (e.g. tokens_from_answers)")
    ap.add_argument("--explain-header", action="store_true",
                    help="llmgw adds its explain header to every answer (off by default, as shipped)")
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    ap.add_argument("--wasm", type=Path, default=None, help="the filter to load (default dist/llmgw.wasm)")
    ap.add_argument("--agent-bin", type=Path, default=None,
                    help="the agent to run (default the release build: target/release/llmgw-agent)")
    ap.add_argument("--envoy", type=Path, default=ROOT / ".venv" / "bin" / "envoy")
    ap.add_argument("--vllm-venv", type=Path, default=ROOT / ".venv-vllm")
    ap.add_argument("--model-dir", type=Path, default=ROOT / ".cache" / "llmgw-model")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "vllm")
    ap.add_argument("--from-json", type=Path, default=None, help="rewrite the report from a saved vllm.json (no runs)")
    args = ap.parse_args()
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        return report(args.out, saved["header"], saved["results"], saved["skipped"], saved["oracle"])
    try:
        args.agent_bin = args.agent_bin or kit.built("llmgw-agent", "release")
        args.wasm = args.wasm or kit.wasm()
    except FileNotFoundError as e:
        print(e, file=sys.stderr)
        return 1
    for p in (args.envoy, args.vllm_venv / "bin" / "vllm", args.model_dir / "config.json"):
        if not p.exists():
            print(f"missing {p}: run ./build.sh bench vllm (it installs vLLM and builds the model)", file=sys.stderr)
            return 1
    command = "./build.sh bench vllm" + ("" if len(sys.argv) <= 1 else " " + " ".join(shlex.quote(x) for x in sys.argv[1:]))
    bench = Bench(args)
    stop_on_signals(bench.procs)
    t0 = time.monotonic()
    try:
        bench.run()
    finally:
        bench.procs.stop_all()
    a = args
    header = [f"Command: `{command}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {time.monotonic() - t0:.0f} s)", "",
              f"{a.replicas} `vllm serve` 0.33.0 replicas (no-model executor: each step {a.step_us} µs + {a.token_us} µs per "
              f"computed token; {a.blocks} KV blocks of {BLOCK} tokens; max {a.max_num_seqs} sequences), concurrency "
              f"{a.concurrency}, {a.max_tokens} output tokens, {a.api} API, seed {a.seed}, {a.runs} runs. Everything shares this machine's "
              "cores: compare routers within a run."]
    if bench.call_costs:
        c = bench.call_costs
        header += ["", f"A replica's CPU per call (its API server and engine, idle, before the runs): the whole /metrics page "
                       f"{c['metrics_whole_ms']:.1f} ms, the load series by name as llmgw-agent asks for them "
                       f"{c['metrics_by_name_ms']:.1f} ms, a /tokenize of a 300-word prompt {c['tokenize_ms']:.1f} ms."]
    return report(args.out, header, bench.results, bench.skipped, bench.oracle)


if __name__ == "__main__":
    sys.exit(main())
