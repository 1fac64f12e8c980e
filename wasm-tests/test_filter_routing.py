"""End-to-end tests of llmgw.wasm in the real Envoy binary: a stub feed server (gRPC,
llmgw.feed.v1) tells the filter which blocks each stub vLLM replica holds; requests through
Envoy must land where the filter says, whatever the client sends."""

from __future__ import annotations

import importlib.util
import json
import threading

import pytest

import llmgw_testkit as kit

from filter_support import Replica, chat_tokens, completion_tokens
from llmgw_testkit import EnvoyAdmin, free_port, request, shipped_config, start_envoy, wait_until
from llmgw_testkit.feed import FeedStub, load_feed_proto
from llmgw_testkit.vllm_hash import block_keys

MODEL = "m1"
BLOCK = 4
DEST = "x-gateway-destination-endpoint"


def filter_cfg(**profile) -> dict:
    p = {"name": "default", "models": [MODEL], "kv_events": True, "block_size": BLOCK, "hash_algo": "sha256_cbor",
         "seed": "0", "tokenizer": "tokenize", "tokenizer_timeout_ms": 1000}
    p.update(profile)
    return {"agent_cluster": "llmgw_agent", "tokenizer_cluster": "llmgw_tokenizer", "explain_header": True,
            "max_body_bytes": 33554432, "profiles": [p]}


class Gateway:
    def __init__(self, procs, envoy_bin, wasm_path, tmp_path, replicas, feed, cfg, concurrency=2, access_log=False,
                 edit=None):
        self.listen = free_port()
        self.admin = free_port()
        self.replicas = replicas
        self.feed = feed
        path = tmp_path / "envoy.yaml"
        # Stats flushed every 0.2 s: histograms reach /stats/prometheus on a flush.
        text = shipped_config(wasm_path, self.listen, self.admin, feed.port, cfg, stats_flush_interval="0.2s")
        path.write_text(edit(text) if edit else text)
        # The shipped access log's lines written out every 0.1 s (Envoy's default: 10 s).
        args = ["--file-flush-interval-msec", "100"] if access_log else []
        self.proc = start_envoy(procs, envoy_bin, path, concurrency=concurrency, log_level="info", args=args)
        self.envoy = EnvoyAdmin(self.admin)
        self.envoy.wait_ready(proc=self.proc)
        # Every VM that ticks (one per worker and the main thread's) subscribes and applies the
        # snapshot before traffic starts.
        per_sub = len(feed.initial_messages())
        wait_until(lambda: feed.snapshots_sent >= concurrency + 1
                   and self.envoy.metric("llmgw_feed_messages_total") >= feed.snapshots_sent * per_sub,
                   what="feed snapshot applied by every VM")

    def assert_no_panic(self):
        log = self.proc.log_path.read_text(errors="replace")
        assert "panicked" not in log, "the filter panicked (see envoy.log)"

    def post(self, path: str, body, headers: dict | None = None):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        h = {"content-type": "application/json", "connection": "close"}
        h.update(headers or {})
        return request("POST", f"http://127.0.0.1:{self.listen}{path}", data, h)

    def served_by(self, path: str, body, headers: dict | None = None) -> tuple[int, dict]:
        status, hdrs, raw = self.post(path, body, headers)
        assert status == 200, (status, raw[:300])
        text = raw.decode()
        if text.startswith("data: "):
            text = text.split("\n", 1)[0][len("data: "):]
        return json.loads(text)["port"], hdrs


@pytest.fixture
def feed_pb(tmp_path):
    return load_feed_proto(tmp_path / "gen")


@pytest.fixture
def fleet():
    reps = [Replica(free_port()) for _ in range(3)]
    yield reps
    for r in reps:
        r.stop()


def table(reps, up=True, models=(MODEL,)):
    return [{"id": i, "name": f"r{i}", "address": r.address, "models": list(models), "up": up}
            for i, r in enumerate(reps)]


def start_feed(feed_pb, reps, blocks, **kw):
    pb, pb_grpc = feed_pb
    return FeedStub(pb, pb_grpc, free_port(), table(reps, **kw), blocks)


PROMPT = "The quick brown fox jumps over the lazy dog, again and again."
MESSAGES = [{"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": [{"type": "text", "text": "Name three primes."}]}]


def test_filter_exact_routing_to_the_replica_holding_the_prefix(procs, envoy_bin, wasm_path, tmp_path, feed_pb,
                                                              fleet):
    # Replica 1 holds the completion prompt's blocks; replica 2 holds the chat's; replica 0 holds
    # the first block of the completion only (shorter prefix).
    comp = block_keys(completion_tokens(PROMPT), BLOCK)
    chat = block_keys(chat_tokens(MESSAGES), BLOCK)
    salted = block_keys(completion_tokens(PROMPT), BLOCK, cache_salt="tenant-a")
    feed = start_feed(feed_pb, fleet, {0: comp[:1] + salted, 1: comp, 2: chat})
    try:
        gw = Gateway(procs, envoy_bin, wasm_path, tmp_path, fleet, feed, filter_cfg())
        port, hdrs = gw.served_by("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 4})
        assert port == fleet[1].port
        assert hdrs.get("x-llmgw-decision", "").startswith(
            f"outcome=exact; replica={fleet[1].address}; matched={len(comp)}/{len(comp)}"), hdrs

        # A client-supplied destination naming another replica is overwritten.
        port, _ = gw.served_by("/v1/completions", {"model": MODEL, "prompt": PROMPT, "stream": True},
                               headers={DEST: fleet[2].address})
        assert port == fleet[1].port
        assert all(r["headers"].get(DEST) == fleet[1].address for r in fleet[1].requests)

        # Chat: tokenized with the chat form (no special tokens, generation prompt on).
        port, hdrs = gw.served_by("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES})
        assert port == fleet[2].port, hdrs
        calls = [c for r in fleet for c in r.tokenize_calls if "messages" in c]
        assert calls and calls[-1]["add_special_tokens"] is False and calls[-1]["add_generation_prompt"] is True

        # The cache salt changes every block hash: the salted copy lives on replica 0.
        port, _ = gw.served_by("/v1/completions", {"model": MODEL, "prompt": PROMPT, "cache_salt": "tenant-a"})
        assert port == fleet[0].port

        # Token-id prompts need no tokenizer call.
        before = sum(len(r.tokenize_calls) for r in fleet)
        port, _ = gw.served_by("/v1/completions", {"model": MODEL, "prompt": completion_tokens(PROMPT)})
        assert port == fleet[1].port
        assert sum(len(r.tokenize_calls) for r in fleet) == before

        assert gw.envoy.metric("llmgw_prefix_decisions_total", 'outcome="exact"') >= 5
        wait_until(lambda: gw.envoy.metric("llmgw_matched_blocks_count") >= 5
                   and gw.envoy.metric("llmgw_decision_us_count") >= 5
                   and gw.envoy.metric("llmgw_tokenizer_latency_us_count") >= 3, timeout=5, what="histograms")
        gw.assert_no_panic()
    finally:
        feed.stop()


def tokenize_count(fleet) -> int:
    return sum(len(r.tokenize_calls) for r in fleet)


def test_filter_tokenization_cache_skips_the_call_for_a_prompt_seen_before(procs, envoy_bin, wasm_path, tmp_path,
                                                                           feed_pb, fleet):
    chat = block_keys(chat_tokens(MESSAGES), BLOCK)
    feed = start_feed(feed_pb, fleet, {2: chat, 0: chat[:2]})
    try:
        # One worker, so every request meets the same VM's cache.
        gw = Gateway(procs, envoy_bin, wasm_path, tmp_path, fleet, feed, filter_cfg(), concurrency=1)
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4}
        assert gw.served_by("/v1/chat/completions", body)[0] == fleet[2].port
        assert tokenize_count(fleet) == 1
        # Same prompt, other sampling parameters: routed exactly with no tokenizer call.
        port, hdrs = gw.served_by("/v1/chat/completions", dict(body, max_tokens=9, stream=True))
        assert port == fleet[2].port
        assert hdrs["x-llmgw-decision"].startswith(f"outcome=exact; replica={fleet[2].address}; "
                                                   f"matched={len(chat)}/{len(chat)}"), hdrs
        assert tokenize_count(fleet) == 1
        wait_until(lambda: gw.envoy.metric("llmgw_tokenizer_cache_total", 'result="hit"') == 1
                   and gw.envoy.metric("llmgw_tokenizer_cache_total", 'result="miss"') == 1, timeout=5,
                   what="cache counters")
        # The byte-identical body again: resolved from the cache without being parsed.
        port, hdrs = gw.served_by("/v1/chat/completions", dict(body, max_tokens=9, stream=True))
        assert port == fleet[2].port and hdrs["x-llmgw-decision"].startswith("outcome=exact"), hdrs
        assert tokenize_count(fleet) == 1
        wait_until(lambda: gw.envoy.metric("llmgw_tokenizer_cache_total", 'result="hit"') == 2, timeout=5,
                   what="second hit")
        # Anything that changes the tokens or the hashes is a different entry: another message,
        # tools, a cache salt. (A request sharing a prefix with an earlier one may be routed on it
        # before its tokenizer call answers, so the call is counted when it comes.)
        other = [MESSAGES[0], {"role": "user", "content": "Name three primes!"}]
        gw.served_by("/v1/chat/completions", dict(body, messages=other))
        wait_until(lambda: tokenize_count(fleet) == 2, timeout=5, what="another message's tokenizer call")
        gw.served_by("/v1/chat/completions", dict(body, tools=[{"type": "function", "function": {"name": "f"}}]))
        wait_until(lambda: tokenize_count(fleet) == 3, timeout=5, what="the tools' tokenizer call")
        _, hdrs = gw.served_by("/v1/chat/completions", dict(body, cache_salt="tenant-b"))
        wait_until(lambda: tokenize_count(fleet) == 4, timeout=5, what="the salted request's tokenizer call")
        assert hdrs["x-llmgw-decision"].startswith("outcome=approx"), hdrs  # salted blocks are held nowhere
        # The index moves on (replica 2 evicts, replica 1 gains the prompt): a cached
        # tokenization is scored against the index as it is now.
        feed.publish({"delta": feed_pb[0].BlockDelta(replica=2, removed=chat)})
        feed.publish({"delta": feed_pb[0].BlockDelta(replica=1, added=chat)})
        wait_until(lambda: gw.served_by("/v1/chat/completions", body)[0] == fleet[1].port, timeout=5,
                   what="delta applied")
        assert tokenize_count(fleet) == 4
        gw.assert_no_panic()
    finally:
        feed.stop()


def test_filter_tokenization_cache_off(procs, envoy_bin, wasm_path, tmp_path, feed_pb, fleet):
    feed = start_feed(feed_pb, fleet, {2: block_keys(chat_tokens(MESSAGES), BLOCK)})
    try:
        cfg = dict(filter_cfg(), tokenizer_cache_bytes=0)
        gw = Gateway(procs, envoy_bin, wasm_path, tmp_path, fleet, feed, cfg, concurrency=1)
        for _ in range(2):
            assert gw.served_by("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES})[0] == fleet[2].port
        assert tokenize_count(fleet) == 2
        gw.assert_no_panic()
    finally:
        feed.stop()


def test_filter_tokenizer_down_falls_back_to_approx(procs, envoy_bin, wasm_path, tmp_path, feed_pb, fleet):
    for r in fleet:
        r.tokenize_status = 500
    comp = block_keys(completion_tokens(PROMPT), BLOCK)
    feed = start_feed(feed_pb, fleet, {1: comp})
    try:
        gw = Gateway(procs, envoy_bin, wasm_path, tmp_path, fleet, feed, filter_cfg())
        ports, vms = set(), set()
        for _ in range(40):  # fresh connections: both workers
            port, hdrs = gw.served_by("/v1/completions", {"model": MODEL, "prompt": PROMPT})
            assert hdrs.get("x-llmgw-decision", "").startswith("outcome=approx"), hdrs
            ports.add(port)
            vms.add(hdrs["x-llmgw-decision"].rsplit("vm=", 1)[1])
            if len(vms) > 1 and _ >= 6:
                break
        # The approximate choice is consistent across requests and across the two workers.
        assert len(vms) == 2, vms
        assert len(ports) == 1
        assert gw.envoy.metric("llmgw_prefix_decisions_total", 'outcome="approx"') >= 6
        assert gw.envoy.metric("llmgw_tokenizer_failures_total", 'reason="status"') >= 6
        assert gw.envoy.metric("llmgw_fallbacks_total", 'reason="tokenizer"') >= 6
        gw.assert_no_panic()
    finally:
        feed.stop()


def test_filter_routes_non_json_and_large_bodies(procs, envoy_bin, wasm_path, tmp_path, feed_pb, fleet):
    feed = start_feed(feed_pb, fleet, {})
    try:
        gw = Gateway(procs, envoy_bin, wasm_path, tmp_path, fleet, feed, filter_cfg())
        port, hdrs = gw.served_by("/v1/completions", b"this is not json", {"content-type": "text/plain"})
        assert port in {r.port for r in fleet}
        assert gw.envoy.metric("llmgw_fallbacks_total", 'reason="unparseable"') >= 1

        big = {"model": MODEL, "prompt": "x" * (8 * 1024 * 1024), "stream": True}
        port, hdrs = gw.served_by("/v1/completions", big)
        assert port in {r.port for r in fleet}
        landed = [r for r in fleet if r.port == port][0]
        assert landed.requests[-1]["size"] > 8 * 1024 * 1024

        # No body at all (a GET on an inference path; other paths are 404 at Envoy): routed by load.
        status, _, raw = request("GET", f"http://127.0.0.1:{gw.listen}/v1/completions")
        assert status == 200 and json.loads(raw)["port"] in {r.port for r in fleet}
        gw.assert_no_panic()
    finally:
        feed.stop()


def test_filter_no_healthy_replica_is_a_503_with_json(procs, envoy_bin, wasm_path, tmp_path, feed_pb, fleet):
    feed = start_feed(feed_pb, fleet, {}, up=False)
    try:
        gw = Gateway(procs, envoy_bin, wasm_path, tmp_path, fleet, feed, filter_cfg())
        status, hdrs, raw = gw.post("/v1/completions", {"model": MODEL, "prompt": PROMPT})
        assert status == 503
        assert hdrs.get("content-type") == "application/json"
        err = json.loads(raw)["error"]
        assert "no healthy replica" in err["message"] and MODEL in err["message"]
        assert gw.envoy.metric("llmgw_prefix_decisions_total", 'outcome="no_replica"') >= 1
        assert not any(r.requests for r in fleet)
        gw.assert_no_panic()
    finally:
        feed.stop()


def test_filter_load_overrides_prefix_and_survives_agent_restart(procs, envoy_bin, wasm_path, tmp_path, feed_pb,
                                                                 fleet):
    comp = block_keys(completion_tokens(PROMPT), BLOCK)
    feed = start_feed(feed_pb, fleet, {1: comp})
    pb = feed_pb[0]
    try:
        gw = Gateway(procs, envoy_bin, wasm_path, tmp_path, fleet, feed, filter_cfg())
        req = {"model": MODEL, "prompt": PROMPT}
        assert gw.served_by("/v1/completions", req)[0] == fleet[1].port
        # Every replica the prompt went to holds it as far as the filter knows (its speculative
        # entries), and equal holders take turns: the ports it was served by.
        served = {fleet[1].port}

        def served_by() -> int:
            port = gw.served_by("/v1/completions", req)[0]
            served.add(port)
            return port

        # The agent reports replica 1 overloaded (queue past max_waiting): it loses its prefix.
        feed.publish({"load": pb.LoadReport(loads=[pb.ReplicaLoad(replica=1, running=8, waiting=500)])})
        wait_until(lambda: served_by() != fleet[1].port, timeout=5, what="load report applied")
        feed.publish({"load": pb.LoadReport(loads=[pb.ReplicaLoad(replica=1, running=0, waiting=0)])})
        wait_until(lambda: served_by() == fleet[1].port, timeout=5, what="load recovered")

        # The agent goes away: routing continues from the last index (to a holder, exactly).
        connects = gw.envoy.metric("llmgw_feed_connects_total")
        feed.stop()
        wait_until(lambda: gw.envoy.metric("llmgw_feed_disconnects_total") >= 3, what="feed disconnects")
        port, hdrs = gw.served_by("/v1/completions", req)
        assert port in served and hdrs["x-llmgw-decision"].startswith("outcome=exact"), (port, served, hdrs)

        # It comes back (same port) with the blocks now on replica 2: every VM resubscribes and
        # resyncs from the new snapshot.
        pb_, pb_grpc = feed_pb
        feed = FeedStub(pb_, pb_grpc, feed.port, table(fleet), {2: comp})
        wait_until(lambda: gw.envoy.metric("llmgw_feed_connects_total") >= connects + 3, timeout=30,
                   what="feed reconnects")
        wait_until(lambda: gw.served_by("/v1/completions", req)[0] == fleet[2].port, timeout=5,
                   what="resynced index")
        wait_until(lambda: gw.envoy.metric("llmgw_feed_connected") >= 3, timeout=5, what="feed_connected gauges")
        gw.assert_no_panic()
    finally:
        feed.stop()


def test_filter_tokenizer_timeout_is_a_fallback(procs, envoy_bin, wasm_path, tmp_path, feed_pb, fleet):
    for r in fleet:
        r.tokenize_delay = 2.0
    feed = start_feed(feed_pb, fleet, {1: block_keys(completion_tokens(PROMPT), BLOCK)})
    try:
        gw = Gateway(procs, envoy_bin, wasm_path, tmp_path, fleet, feed, filter_cfg(tokenizer_timeout_ms=200))
        port, hdrs = gw.served_by("/v1/completions", {"model": MODEL, "prompt": PROMPT})
        assert hdrs["x-llmgw-decision"].startswith("outcome=approx"), hdrs
        assert gw.envoy.metric("llmgw_tokenizer_failures_total", 'reason="timeout"') >= 1
        gw.assert_no_panic()
    finally:
        feed.stop()


def test_filter_render_endpoint_and_lora(procs, envoy_bin, wasm_path, tmp_path, feed_pb, fleet):
    # Blocks of a LoRA request carry ("lora", name, path) in every hash: the adapter's copy of
    # the chat lives on replica 0, the base model's on replica 2.
    chat = chat_tokens(MESSAGES)
    feed = start_feed(feed_pb, fleet, {0: block_keys(chat, BLOCK, lora=("sql-lora", "/adapters/sql")),
                                       2: block_keys(chat, BLOCK)}, models=(MODEL, "sql-lora"))
    try:
        cfg = filter_cfg(tokenizer="render", models=[MODEL, "sql-lora"], lora_adapters={"sql-lora": "/adapters/sql"})
        gw = Gateway(procs, envoy_bin, wasm_path, tmp_path, fleet, feed, cfg)
        body = {"model": MODEL, "messages": MESSAGES, "temperature": 0.2}
        port, hdrs = gw.served_by("/v1/chat/completions", body)
        assert port == fleet[2].port, hdrs
        renders = [c for r in fleet for c in r.tokenize_calls if c.get("render")]
        assert renders and renders[-1]["render"] == "/v1/chat/completions/render"
        assert renders[-1]["temperature"] == 0.2  # the generation body, unchanged
        port, hdrs = gw.served_by("/v1/chat/completions", dict(body, model="sql-lora"))
        assert port == fleet[0].port, hdrs
        gw.assert_no_panic()
    finally:
        feed.stop()


def test_filter_resubscribes_when_the_feed_goes_silent(procs, envoy_bin, wasm_path, tmp_path, feed_pb, fleet):
    pb, pb_grpc = feed_pb
    feed = FeedStub(pb, pb_grpc, free_port(), table(fleet), {1: block_keys(completion_tokens(PROMPT), BLOCK)},
                    heartbeats=False)
    try:
        cfg = dict(filter_cfg(), feed_idle_timeout_ms=1000, agent_token="s3cret")
        gw = Gateway(procs, envoy_bin, wasm_path, tmp_path, fleet, feed, cfg)
        first = feed.subscriptions
        assert set(feed.tokens) == {"s3cret"}
        # No heartbeats: each VM drops the silent stream and subscribes again, serving meanwhile.
        wait_until(lambda: feed.subscriptions >= 2 * first, timeout=10, what="resubscription")
        assert gw.served_by("/v1/completions", {"model": MODEL, "prompt": PROMPT})[0] == fleet[1].port
        gw.assert_no_panic()
    finally:
        feed.stop()



def hashed_feed(feed_pb, fleet, blocks):
    """A feed stub whose replica table carries every replica's hash settings: sha256_cbor,
    PYTHONHASHSEED 0, BLOCK-token blocks."""
    pb, pb_grpc = feed_pb
    reps = table(fleet)
    for r in reps:
        r["hash"] = {"algo": "sha256_cbor", "seeded": True, "seed": "0", "block_size": BLOCK}
    return FeedStub(pb, pb_grpc, free_port(), reps, blocks)


def test_filter_hashes_as_the_feed_says_where_its_profile_is_silent(procs, envoy_bin, wasm_path, tmp_path,
                                                                   feed_pb, fleet):
    """Issue 15, item 5: a profile that names no hash settings (its defaults, 16-token blocks
    and no seed, would match nothing here) routes exactly with the ones the feed carries."""
    comp = block_keys(completion_tokens(PROMPT), BLOCK)
    feed = hashed_feed(feed_pb, fleet, {1: comp})
    try:
        silent = filter_cfg()
        for k in ("block_size", "hash_algo", "seed"):
            del silent["profiles"][0][k]
        gw = Gateway(procs, envoy_bin, wasm_path, tmp_path, fleet, feed, silent)
        port, hdrs = gw.served_by("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 4})
        assert port == fleet[1].port and hdrs["x-llmgw-decision"].startswith(
            f"outcome=exact; replica={fleet[1].address}; matched={len(comp)}/{len(comp)}"), hdrs
        assert gw.envoy.metric("llmgw_hash_mismatch_total") == 0
        gw.assert_no_panic()
    finally:
        feed.stop()


def test_filter_counts_logs_and_falls_back_when_its_seed_disagrees_with_the_feed(procs, envoy_bin, wasm_path,
                                                                                 tmp_path, feed_pb, fleet):
    """Issue 15, item 5: the profile says PYTHONHASHSEED 1, the feed says the replicas run with
    0: every request counts llmgw_hash_mismatch_total and the hash_mismatch fallback and is
    routed approximately; the log names both values once."""
    comp = block_keys(completion_tokens(PROMPT), BLOCK)
    feed = hashed_feed(feed_pb, fleet, {1: comp})
    try:
        gw = Gateway(procs, envoy_bin, wasm_path, tmp_path, fleet, feed, filter_cfg(seed="1"))
        for _ in range(2):
            status, hdrs, _ = gw.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 4})
            assert status == 200 and hdrs["x-llmgw-decision"].startswith("outcome=approx"), hdrs
        wait_until(lambda: gw.envoy.metric("llmgw_hash_mismatch_total") == 2, what="the mismatch counted")
        assert gw.envoy.metric("llmgw_fallbacks_total", 'reason="hash_mismatch"') == 2
        log = gw.proc.log_path.read_text(errors="replace")
        want = f'replica `r1` rank 0 ({fleet[1].address}) hashes with seed "0" (profile `default` uses "1")'
        lines = [line for line in log.splitlines() if "hash settings mismatch" in line]
        assert lines and want in lines[0] and "routing by the fallback" in lines[0], lines or log[-3000:]
        gw.assert_no_panic()
    finally:
        feed.stop()


def test_filter_avoids_a_replica_answering_5xx_then_tries_it_again(procs, envoy_bin, wasm_path, tmp_path, feed_pb,
                                                                     fleet):
    """Passive health: the replica holding the prompt starts answering 503 (its engine died
    behind its API server; a refused connect gives Envoy's own 503 the same way). That request
    fails, as it would through any proxy; from the next request on, every worker avoids the
    replica; once its avoidance (1 s) ends it is tried again, and used when it answers."""
    tokens = completion_tokens(PROMPT)
    feed = start_feed(feed_pb, fleet, {1: block_keys(tokens, BLOCK)})
    try:
        gw = Gateway(procs, envoy_bin, wasm_path, tmp_path, fleet, feed, filter_cfg())
        body = {"model": MODEL, "prompt": tokens, "max_tokens": 2}
        port, _ = gw.served_by("/v1/completions", body)
        assert port == fleet[1].port
        fleet[1].generate_status = 503
        status, _, _ = gw.post("/v1/completions", body)
        assert status == 503
        sick = len(fleet[1].requests)
        # Every following request, on either worker (a fresh connection each), goes elsewhere.
        for _ in range(10):
            port, hdrs = gw.served_by("/v1/completions", body)
            assert port != fleet[1].port, hdrs
        assert len(fleet[1].requests) == sick
        # Healthy again: tried once its avoidance ends, and used (it holds the prefix).
        fleet[1].generate_status = 200
        wait_until(lambda: gw.served_by("/v1/completions", body)[0] == fleet[1].port, timeout=10,
                   what="the replica tried again", interval=0.2)
        gw.assert_no_panic()
    finally:
        feed.stop()


def load_bench_vllm():
    """bench/vllm.py as a module (its own name would be taken for the vllm package)."""
    spec = importlib.util.spec_from_file_location("bench_vllm", kit.ROOT / "bench" / "vllm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def logged(line: str, name: str) -> dict[str, str]:
    """A filter-state field of an access log line of envoy/llmgw-local.yaml's format (`name=[k=v ...]`)."""
    inner = line.split(f"{name}=[", 1)[1].split("]", 1)[0]
    return dict(kv.split("=", 1) for kv in inner.split())


def phases_of(line: str) -> dict[str, int]:
    """The filter's breakdown in an access log line: {"body_us": 12, ...}."""
    return {k: int(v) for k, v in logged(line, "llmgw_phases").items()}


def test_filter_records_where_the_time_goes_in_histograms_and_the_access_log(procs, envoy_bin, wasm_path, tmp_path,
                                                                          feed_pb, fleet):
    comp = block_keys(completion_tokens(PROMPT), BLOCK)
    feed = start_feed(feed_pb, fleet, {1: comp})
    try:
        # One worker, so the second request meets the first one's tokenization cache.
        gw = Gateway(procs, envoy_bin, wasm_path, tmp_path, fleet, feed, filter_cfg(), concurrency=1, access_log=True)
        # A tokenizer that takes 50 ms: the tokenizer phase and the gateway's time show it.
        for r in fleet:
            r.tokenize_delay = 0.05
        port, _ = gw.served_by("/v1/completions", {"model": MODEL, "prompt": PROMPT, "stream": True})
        assert port == fleet[1].port and tokenize_count(fleet) == 1
        # The same prompt again: from the tokenization cache, no tokenizer phase.
        port, _ = gw.served_by("/v1/completions", {"model": MODEL, "prompt": PROMPT, "stream": True})
        assert port == fleet[1].port and tokenize_count(fleet) == 1

        def lines():
            log = gw.proc.log_path.read_text(errors="replace")
            return [ln for ln in log.splitlines() if '"POST /v1/completions HTTP/1.1" 200' in ln]
        wait_until(lambda: len(lines()) == 2, timeout=10, what="two access log lines")
        called, cached = (phases_of(ln) for ln in lines())
        assert set(called) == {"body_us", "tokenizer_us", "decision_us", "gateway_us", "upstream_first_byte_us",
                               "upstream_first_chunk_us"}, called
        assert 50_000 <= called["tokenizer_us"] < 1_000_000, called
        assert called["gateway_us"] >= called["tokenizer_us"] + called["decision_us"], called
        assert called["upstream_first_chunk_us"] >= called["upstream_first_byte_us"], called
        assert "tokenizer_us" not in cached and cached["gateway_us"] < 50_000, cached
        assert all(r.address not in ln.split("llmgw_phases=")[1] for r in fleet for ln in lines()), \
            "no replica address in the breakdown"
        print(f"access log line of a routed request:\n{lines()[0]}")  # shown with pytest -s
        # The decision, beside it: where each request went and why.
        first, again = (logged(ln, "llmgw_decision") for ln in lines())
        blocks = len(comp)
        assert first["outcome"] == "exact" and first["replica"] == fleet[1].address, first
        assert first["matched"] == f"{blocks}/{blocks}" and int(first["predicted_us"]) > 0, first
        assert int(first["tokenizer_us"]) >= 50_000 and "fallback" not in first, first
        assert "tokenizer_us" not in again and again["replica"] == fleet[1].address, again

        # The histograms: each phase once per request, the tokenizer's only for the call.
        def count(name):
            return gw.envoy.metric(f"{name}_count")
        wait_until(lambda: all(count(n) == 2 for n in ("llmgw_phase_body_us", "llmgw_phase_gateway_us",
                                                       "llmgw_phase_upstream_first_byte_us",
                                                       "llmgw_phase_upstream_first_chunk_us", "llmgw_decision_us"))
                   and count("llmgw_tokenizer_latency_us") == 1, timeout=5, what="phase histograms")
        # The gateway's time sums both requests' (one of them waited 50 ms on the tokenizer).
        assert gw.envoy.metric("llmgw_phase_gateway_us_sum") >= 50_000
        # bench/vllm.py's reading of the same histograms (its report's phase table).
        bench = load_bench_vllm()
        phases = bench.parse_phases(gw.envoy.get(f"/stats?filter={bench.PHASE_FILTER}&histogram_buckets=none"))
        assert list(phases) == list(bench.PHASES), phases
        assert phases["tokenizer"][0] >= 50_000 and phases["gateway"][1] >= 50_000, phases
        assert all(0 <= p50 <= p99 for p50, p99 in phases.values()), phases
        # And their means (the report's time outside the replicas is a difference of means): the
        # gateway's over both requests, the tokenizer's over the one call.
        means = bench.parse_phase_means(gw.envoy.get(f"/stats/prometheus?filter={bench.PHASE_FILTER}"))
        assert list(means) == list(bench.PHASES), means
        assert means["tokenizer"] >= 50_000 and 25_000 <= means["gateway"] < means["tokenizer"], means
        gw.assert_no_panic()
    finally:
        feed.stop()


def test_filter_charges_a_replica_only_for_failures_it_caused(procs, envoy_bin, wasm_path, tmp_path, feed_pb, fleet):
    """Envoy's own replies are not the replica's. With the replicas' circuit breaker at one
    request and a 2 s route timeout, a request the replica holding the prompt keeps makes Envoy
    answer the next ones 503 itself (overflow) and the kept one 504 (route timeout): the replica
    is still chosen for each (the decision header names it) and serves the next request. A
    connect that fails (another replica gone) still gets it avoided."""
    tokens = completion_tokens(PROMPT)
    other = completion_tokens("An unrelated prompt, held by the replica that goes away.")
    feed = start_feed(feed_pb, fleet, {1: block_keys(tokens, BLOCK), 2: block_keys(other, BLOCK)})

    def edit(text: str) -> str:
        for old, new in (("max_requests: 16384", "max_requests: 1"), ("timeout: 300s", "timeout: 2s")):
            assert old in text, old
            text = text.replace(old, new)
        return text

    holder = fleet[1]
    try:
        gw = Gateway(procs, envoy_bin, wasm_path, tmp_path, fleet, feed, filter_cfg(), edit=edit)
        body = {"model": MODEL, "prompt": tokens, "max_tokens": 2}
        assert gw.served_by("/v1/completions", body)[0] == holder.port
        chosen = f"outcome=exact; replica={holder.address};"
        holder.released.clear()
        seen = len(holder.requests)
        kept: dict = {}
        t = threading.Thread(target=lambda: kept.update(answer=gw.post("/v1/completions", body)))
        t.start()
        wait_until(lambda: len(holder.requests) == seen + 1, what="the kept request at its replica")
        for _ in range(3):
            status, hdrs, raw = gw.post("/v1/completions", body)
            assert status == 503 and hdrs.get("x-llmgw-decision", "").startswith(chosen), (status, hdrs, raw[:200])
        overflow = "cluster.llmgw_replicas.upstream_rq_active_overflow"
        assert gw.envoy.stats(overflow).get(overflow) == 3
        t.join(timeout=30)
        assert kept["answer"][0] == 504, kept
        holder.released.set()
        port, hdrs = gw.served_by("/v1/completions", body)
        assert port == holder.port, hdrs
        # A replica gone (no connection to it yet): Envoy's 503 for the failed connect avoids it
        # from the next request on (served: elsewhere).
        gone = fleet[2]
        gone.stop()
        moved = {"model": MODEL, "prompt": other, "max_tokens": 2}
        status, hdrs, _ = gw.post("/v1/completions", moved)
        assert status == 503 and hdrs.get("x-llmgw-decision", "").startswith(
            f"outcome=exact; replica={gone.address};"), hdrs
        for _ in range(5):
            port, hdrs = gw.served_by("/v1/completions", moved)
            assert port != gone.port, hdrs
        gw.assert_no_panic()
    finally:
        holder.released.set()
        feed.stop()


def test_a_body_past_max_body_bytes_is_routed_by_its_head_not_refused(procs, envoy_bin, wasm_path, tmp_path, feed_pb,
                                                                      fleet):
    """The shipped max_body_bytes sits below the listener's buffer, so the filter's own path for a
    larger body runs: routed by its leading bytes (fallback body_too_large) and streamed whole
    to the replica, even past the buffer, where Envoy would otherwise answer 413."""
    import re

    from llmgw_testkit.envoy import SHIPPED

    text = SHIPPED.read_text()
    (max_body,) = {int(v) for v in re.findall(r'"max_body_bytes": (\d+)', text)}
    (buffer,) = {int(v) for v in re.findall(r"per_connection_buffer_limit_bytes: (\d+)", text)}
    feed = start_feed(feed_pb, fleet, {})
    try:
        gw = Gateway(procs, envoy_bin, wasm_path, tmp_path, fleet, feed, {**filter_cfg(), "max_body_bytes": max_body})
        # Between max_body_bytes and the buffer: always the filter's path.
        for size in (max_body + 1024, (max_body + buffer) // 2):
            body = json.dumps({"model": MODEL, "prompt": "x" * size, "max_tokens": 2}).encode()
            status, hdrs, raw = gw.post("/v1/completions", body)
            assert status == 200, (size, status, raw[:200])
            assert json.loads(raw)["bytes"] == len(body), size
            assert hdrs["x-llmgw-decision"].startswith("outcome=approx"), hdrs
        wait_until(lambda: gw.envoy.metric("llmgw_fallbacks_total", 'reason="body_too_large"') == 2,
                   what="both bodies counted as too large")
        # Past the buffer it depends on how much Envoy reads before the filter has seen
        # max_body_bytes: streamed whole when the reads are small, Envoy's 413 when one read
        # overfills the buffer (seen on a loaded machine). Never anything else.
        body = json.dumps({"model": MODEL, "prompt": "x" * (buffer + (1 << 20)), "max_tokens": 2}).encode()
        status, _, raw = gw.post("/v1/completions", body)
        assert status in (200, 413), (status, raw[:200])
        if status == 200:
            assert json.loads(raw)["bytes"] == len(body)
        gw.assert_no_panic()
    finally:
        feed.stop()


def test_hostile_media_requests_do_not_open_the_tokenizer_circuit_for_everyone(procs, envoy_bin, wasm_path, tmp_path,
                                                                              feed_pb, fleet):
    """Chats whose image URL never answers make every replica's render time out. They are
    charged to themselves: twice as many of them as there are replicas, then an ordinary
    prompt is still tokenized and routed exactly (without the fix: the circuit is open for
    everyone and it falls back)."""
    comp = block_keys(completion_tokens(PROMPT), BLOCK)
    feed = start_feed(feed_pb, fleet, {1: comp})
    for r in fleet:
        r.slow_marker, r.slow_delay = b"never.png", 1.0
    try:
        gw = Gateway(procs, envoy_bin, wasm_path, tmp_path, fleet, feed, filter_cfg(tokenizer_timeout_ms=150))
        hostile = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "describe"},
            {"type": "image_url", "image_url": {"url": "http://203.0.113.1/never.png"}}]}]}
        for _ in range(2 * len(fleet)):
            status, hdrs, _ = gw.post("/v1/chat/completions", hostile)
            assert status == 200
            assert hdrs["x-llmgw-decision"].startswith("outcome=approx"), hdrs
        assert gw.envoy.metric("llmgw_tokenizer_failures_total", 'reason="timeout"') == 2 * len(fleet)
        assert gw.envoy.metric("llmgw_tokenizer_failures_request_caused_total") == 2 * len(fleet)
        calls = tokenize_count(fleet)
        port, hdrs = gw.served_by("/v1/completions", {"model": MODEL, "prompt": PROMPT})
        assert port == fleet[1].port and hdrs["x-llmgw-decision"].startswith("outcome=exact"), hdrs
        assert tokenize_count(fleet) == calls + 1
        assert gw.envoy.metric("llmgw_tokenizer_failures_total", 'reason="circuit_open"') == 0
        gw.assert_no_panic()
    finally:
        feed.stop()


def test_filter_learns_a_replica_slow_to_its_first_token_and_routes_around_it(procs, envoy_bin, wasm_path, tmp_path,
                                                                             feed_pb, fleet):
    # Replica 1 holds the prompt's blocks but takes 80 ms to its first token; the others answer
    # at once. At the profile's rates the holder wins (nothing to compute there); the streams'
    # first chunks teach the filter its time, and the requests move to a replica that answers
    # sooner although it computes the whole prompt.
    comp = block_keys(completion_tokens(PROMPT), BLOCK)
    feed = start_feed(feed_pb, fleet, {1: comp})
    try:
        gw = Gateway(procs, envoy_bin, wasm_path, tmp_path, fleet, feed, filter_cfg(), concurrency=2)
        fleet[1].generate_delay = 0.08
        served, headers = [], []
        for _ in range(20):
            port, hdrs = gw.served_by("/v1/completions", {"model": MODEL, "prompt": PROMPT, "stream": True})
            served.append(port)
            headers.append(hdrs.get("x-llmgw-decision", ""))
        assert served[0] == fleet[1].port and "rates=profile" in headers[0], headers[0]
        assert fleet[1].port not in served[-5:], (served, headers)
        assert any("rates=learned/" in h for h in headers), headers
        # The gauges show what was learned of replica 1: its rates predict most of its 80 ms for
        # this prompt (the tokens past its last full block, perhaps a request of the other
        # worker still finishing there), from the first observation on (the profile's rates
        # weigh one).
        tag = fleet[1].address.replace(".", "_").replace(":", "_")

        def gauge(name):
            full = f"llmgw_rates_{name}.replica.{tag}"
            return gw.envoy.stats(full).get(f"wasmcustom.{full}", 0)
        wait_until(lambda: gauge("observations") > 0, timeout=5, what="rate gauges")
        n = len(completion_tokens(PROMPT))
        uncached = n - n // BLOCK * BLOCK
        idle = gauge("base_us") + gauge("prefill_ns_per_token") * uncached / 1000
        rates = {k: gauge(k) for k in ("base_us", "prefill_ns_per_token", "request_us", "observations")}
        assert 30_000 <= idle + gauge("request_us") and idle <= 160_000, (uncached, rates)
        gw.assert_no_panic()
    finally:
        feed.stop()


def test_a_replica_that_recovers_is_tried_again_once_its_rates_are_forgotten(procs, envoy_bin, wasm_path, tmp_path,
                                                                             feed_pb, fleet):
    # Replica 1 holds the prompt but takes 80 ms to its first token, until its requests have
    # moved away; then it recovers. Observed no more, it would keep its slow rates for good and
    # never be tried again. Past `rates_forget_ms` without an observation (500 ms here) its rates
    # are forgotten: it is predicted at the profile's rates, holds the prompt, and takes it back.
    comp = block_keys(completion_tokens(PROMPT), BLOCK)
    feed = start_feed(feed_pb, fleet, {1: comp})
    try:
        cfg = filter_cfg(weights={"rates_forget_ms": 500})
        gw = Gateway(procs, envoy_bin, wasm_path, tmp_path, fleet, feed, cfg, concurrency=2)
        req = {"model": MODEL, "prompt": PROMPT, "stream": True}
        fleet[1].generate_delay = 0.08
        served = [gw.served_by("/v1/completions", req)[0] for _ in range(20)]
        assert fleet[1].port not in served[-5:], served
        fleet[1].generate_delay = 0.0
        decisions = []

        def back_on_replica_1() -> bool:
            port, hdrs = gw.served_by("/v1/completions", req)
            decisions.append((port, hdrs.get("x-llmgw-decision", "")))
            return port == fleet[1].port
        wait_until(back_on_replica_1, timeout=10, interval=0.1, what="the recovered replica tried again")
        # Tried at the profile's rates, and learned again from there: its next requests stay.
        assert "rates=profile" in decisions[-1][1], decisions[-3:]
        again = [gw.served_by("/v1/completions", req) for _ in range(5)]
        assert all(port == fleet[1].port for port, _ in again), [(p, h.get("x-llmgw-decision")) for p, h in again]
        assert "rates=learned/" in again[-1][1].get("x-llmgw-decision", ""), again[-1][1]
        gw.assert_no_panic()
    finally:
        feed.stop()
