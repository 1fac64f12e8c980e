"""llmgw as a Gateway API Inference Extension endpoint picker in front of real `vllm serve` 0.33.0
replicas: the real Envoy with its ext_proc filter configured as GAIE gateways configure it
(envoy/llmgw-epp-local.yaml: the body streamed to the picker in full-duplex mode, the pool's
override_host cluster, the next endpoint of the picker's list on a connect failure), the agent
with an [epp] section mirroring the replicas from their own KV events. No wasm.

The replicas are this module's own (two, vLLM binding its publisher so that a second agent can
subscribe beside the first), not the session fleet's."""

from __future__ import annotations

import json
import random
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

import llmgw_testkit as kit
from llmgw_testkit.stub import Decoy
from conftest import (AGENT, BLOCK, ENVOY, MODEL, Replica, agent_hash, http_json, sse_events, stream, wait_healthy,
                      wait_until, words)
from llmgw_testkit import free_port

SERVED_BY = "x-llmgw-served-by"
FLEET_HASH = {"algo": "sha256_cbor", "seed": "0", "block_size": BLOCK}
EXACT = 'llmgw_epp_decisions_total{outcome="exact"}'


class Picker(kit.AgentAPI):
    """An agent with [epp] on `port`, started on `replicas` (agent entries)."""

    def __init__(self, procs, logdir, name: str, replicas: list[dict], routing_profile: dict | None = None, **sections):
        super().__init__(free_port())
        self.port = free_port()
        routing = logdir / f"{name}-routing.json"
        routing.write_text(json.dumps(kit.filter_config(
            {"name": "conformance", "block_size": BLOCK, "tokenizer_timeout_ms": 5000, **(routing_profile or {})})))
        cfg = logdir / f"{name}.toml"
        cfg.write_text(kit.agent_config(free_port(), self.http, replicas, hash=FLEET_HASH, parity={"min_verified": 1},
                                        epp={"listen": f"127.0.0.1:{self.port}", "routing": str(routing)},
                                        **sections))
        self.proc = procs.start([AGENT, "run", "--config", cfg, "--log-level", "info"], name)
        self.log_path = self.proc.log_path
        wait_until(lambda: http_json(f"{self.base}/healthz", timeout=2)[0] in (200, 503), 30, f"{name}'s HTTP")

    def counter(self, series: str) -> float:
        m = re.search(rf"^{re.escape(series)} (\S+)$", self.metrics(), re.M)
        return float(m.group(1)) if m else 0.0


class Gateway(kit.EnvoyAdmin):
    """Envoy on the shipped EPP bootstrap: the picker at `epp`, the pool at `pool` (ports)."""

    def __init__(self, procs, logdir, name: str, epp: int, pool: list[int], fail_open: bool = False):
        self.listen = free_port()
        super().__init__(free_port())
        path = logdir / f"{name}.yaml"
        path.write_text(kit.epp_bootstrap(self.listen, self.port, epp, pool, fail_open=fail_open,
                                          served_by_header=SERVED_BY))
        self.proc = kit.start_envoy(procs, ENVOY, path, name)
        self.wait_ready(60, proc=self.proc)

    def wait_picker_healthy(self, epp: int) -> None:
        """Until Envoy's gRPC health check of the picker passes (its index synced)."""
        flag = f"llmgw_epp::127.0.0.1:{epp}::health_flags::healthy"
        wait_until(lambda: flag in self.get("/clusters"), 60, "Envoy's gRPC health check of the picker")

    def completion(self, prompt: str, headers: dict | None = None):
        """(status, the address that served, the answer) of a completion through this Envoy."""
        status, hdrs, reply = http_json(f"http://127.0.0.1:{self.listen}/v1/completions",
                                        {"model": MODEL, "prompt": prompt, "max_tokens": 2}, timeout=60,
                                        headers=headers)
        return status, hdrs.get(SERVED_BY), reply


def direct(r: Replica, prompt: str) -> list[int]:
    """Serves `prompt` on replica r directly; returns the block keys of its full blocks."""
    status, _, reply = http_json(f"{r.url}/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2},
                                 timeout=60)
    assert status == 200, reply
    status, _, tok = http_json(f"{r.url}/tokenize", {"model": MODEL, "prompt": prompt})
    assert status == 200, tok
    return agent_hash(tok["tokens"])


@pytest.fixture(scope="module")
def pool(procs):
    """Two replicas (vLLM binds its publisher: mode "connect"), healthy; stopped after this
    module's tests (the session's fleet may run beside them)."""
    reps = [Replica("epp-p", "connect", blocks=256), Replica("epp-q", "connect", blocks=256)]
    try:
        for r in reps:
            r.proc = procs.start(r.serve_args(), f"vllm-{r.name}", env=r.serve_env(AGENT))
        with ThreadPoolExecutor(len(reps)) as ex:
            list(ex.map(lambda r: wait_healthy(r, r.proc), reps))
        yield reps
    finally:
        for r in reps:
            if r.proc is not None:
                procs.stop(r.proc)


@pytest.fixture(scope="module")
def gateway(procs, logdir, pool):
    """The picker over both replicas and the gateway's Envoy in front of them."""
    picker = Picker(procs, logdir, "epp-agent", [r.agent_entry() for r in pool])
    for r in pool:
        wait_until(lambda r=r: (s := picker.replica(r.name))["up"] and s["connected"], 60,
                   f"the picker to see {r.name} up and its publisher connected")
    gw = Gateway(procs, logdir, "epp-envoy", picker.port, [r.port for r in pool])
    try:
        gw.wait_picker_healthy(picker.port)
        yield picker, gw
    finally:
        procs.stop(gw.proc)
        procs.stop(picker.proc)


def test_a_followup_lands_exactly_on_the_replica_holding_its_prefix(pool, gateway):
    picker, gw = gateway
    rng = random.Random("epp-followup")
    for holder in pool + pool[::-1]:
        prompt = words(rng, 50, f"ef{holder.name[-1]}")
        keys = direct(holder, prompt)
        wait_until(lambda: picker.keys(holder.name) >= set(keys), 30, f"the picker to mirror {holder.name}'s blocks")
        exact = picker.counter(EXACT)
        status, served_by, reply = gw.completion(prompt + " " + words(rng, 15, "eg"))
        assert status == 200, reply
        assert served_by == holder.address, f"the follow-up went to {served_by}, its prefix is on {holder.address}"
        # vLLM itself: every block of the first prompt was a cache hit there.
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == BLOCK * len(keys), reply["usage"]
        # Decided from the index (the approximate fallback keys on the same text).
        wait_until(lambda e=exact: picker.counter(EXACT) == e + 1, 10, "the picker to count an exact decision")


def tokenize_calls(pool) -> float:
    """/tokenize requests the pool's replicas answered (vLLM's own HTTP metrics)."""
    return sum(kit.prom_sum(kit.get_text(f"{r.url}/metrics"), "http_requests_total", 'handler="/tokenize"')
               for r in pool)


def test_a_streamed_next_turn_reads_its_prompt_ids_from_vllms_answer_through_the_picker(pool, gateway):
    """A conversation's next turn, routed by the picker on the turn before, asks vLLM for its
    prompt's token ids instead of calling /tokenize (the body and the answer stream through the
    picker both ways): the client gets the stream vLLM sends unasked, and the ids are kept, so
    the turn after it goes at once too."""
    picker, gw = gateway
    rng = random.Random("epp-answer-ids")
    url = f"http://127.0.0.1:{gw.listen}/v1/chat/completions"
    turns = 'llmgw_epp_tokenizer_cache_total{result="earlier_turn"}'
    read = 'llmgw_epp_answer_tokens_total{result="read"}'
    first = [{"role": "system", "content": words(rng, 40, "ea")}, {"role": "user", "content": words(rng, 12, "eb")}]
    status, _, reply = http_json(url, {"model": MODEL, "messages": first, "max_tokens": 3}, timeout=60)
    assert status == 200, reply
    second = first + [{"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
                      {"role": "user", "content": words(rng, 10, "ec")}]
    # One output token: vLLM's chunking of later tokens depends on timing, so only then are two
    # streams of the same request comparable event by event.
    body = {"model": MODEL, "messages": second, "max_tokens": 1, "stream": True}
    calls, turns_before, read_before = tokenize_calls(pool), picker.counter(turns), picker.counter(read)
    headers, through = stream(url, body)
    assert picker.counter(turns) == turns_before + 1, "routed on its turn before"
    served = next(r for r in pool if r.address == headers.get(SERVED_BY))
    wait_until(lambda: picker.counter(read) == read_before + 1, 10, "the picker to read the ids from the answer")
    _, direct = stream(f"{served.url}/v1/chat/completions", body)
    assert b'token_ids":[' not in through, through
    assert sse_events(through) == sse_events(direct), (through, direct)
    reply_text = "".join(e["choices"][0]["delta"].get("content") or "" for e in sse_events(through)
                         if isinstance(e, dict) and e.get("choices"))
    third = second + [{"role": "assistant", "content": reply_text}, {"role": "user", "content": words(rng, 8, "ed")}]
    stream(url, {**body, "messages": third})
    assert picker.counter(turns) == turns_before + 2, "the ids read were kept for the turn after"
    wait_until(lambda: picker.counter(read) == read_before + 2, 10, "the third turn's ids read")
    assert tokenize_calls(pool) == calls, "no tokenizer call for either turn"


def test_a_client_destination_header_is_never_honoured(pool, gateway):
    picker, gw = gateway
    rng = random.Random("epp-client-header")
    decoy = Decoy()
    try:
        for holder, other in ((pool[0], pool[1]), (pool[1], pool[0])):
            prompt = words(rng, 50, f"eh{holder.name[-1]}")
            keys = direct(holder, prompt)
            wait_until(lambda: picker.keys(holder.name) >= set(keys), 30, f"the picker to mirror {holder.name}")
            # The client names the other replica of the pool (one the gateway can reach), then a
            # server outside it: both ignored, the follow-up goes to the holder.
            for named in (other.address, decoy.address):
                status, served_by, reply = gw.completion(prompt + " " + words(rng, 10, "ei"),
                                                         {"x-gateway-destination-endpoint": named})
                assert status == 200, reply
                assert served_by == holder.address, f"went to {served_by}: the client named {named}"
        assert decoy.hits == 0
    finally:
        decoy.close()


def test_a_connect_failure_to_the_primary_is_retried_on_the_fallback_list(procs, logdir, pool):
    # A second picker whose entry for q names an address nobody listens on (q's events still
    # come from q's publisher): it makes that address the primary for q's prefix, Envoy cannot
    # connect, and the retry goes to the next endpoint of the list, p.
    p, q = pool
    dead = free_port()
    entry = {**q.agent_entry(), "address": f"127.0.0.1:{dead}"}
    # Prompts are tokenized by p (a tokenizer call to the dead address would make the decision
    # approximate); no load scraping of the dead address (it would go down).
    picker = Picker(procs, logdir, "epp-agent-dead", [p.agent_entry(), entry],
                    routing_profile={"tokenizer_address": p.address}, load={"enabled": False})
    wait_until(lambda: picker.replica(q.name)["connected"], 60, "the second picker to subscribe to q")
    gw = Gateway(procs, logdir, "epp-envoy-dead", picker.port, [p.port, dead])
    try:
        gw.wait_picker_healthy(picker.port)
        rng = random.Random("epp-retry")
        prompt = words(rng, 50, "er")
        keys = direct(q, prompt)
        # Joined after q served earlier tests: its blocks come through q's replay socket.
        wait_until(lambda: picker.keys(q.name) >= set(keys), 60, "the second picker to mirror q's blocks")
        exact = picker.counter(EXACT)
        status, served_by, reply = gw.completion(prompt + " " + words(rng, 10, "es"))
        assert status == 200, reply
        assert served_by == p.address, served_by
        wait_until(lambda: picker.counter(EXACT) == exact + 1, 10, "the picker to count an exact decision")
        stats = gw.stats("cluster.llmgw_pool.upstream_")
        assert stats.get("cluster.llmgw_pool.upstream_cx_connect_fail", 0) >= 1, stats
        assert stats.get("cluster.llmgw_pool.upstream_rq_retry", 0) >= 1, stats
    finally:
        procs.stop(gw.proc)
        procs.stop(picker.proc)


@pytest.mark.parametrize("fail_open", [False, True], ids=["fail_close", "fail_open"])
def test_an_unreachable_picker_fails_closed_or_open_as_configured(procs, logdir, pool, fail_open):
    nobody = free_port()
    gw = Gateway(procs, logdir, f"epp-envoy-{'open' if fail_open else 'close'}", nobody, [r.port for r in pool],
                 fail_open=fail_open)
    try:
        rng = random.Random(f"epp-down-{fail_open}")
        served = []
        for _ in range(4):
            # Every request names p: without the picker a client must still not choose.
            status, served_by, reply = gw.completion(words(rng, 20, "ed"),
                                                     {"x-gateway-destination-endpoint": pool[0].address})
            if fail_open:
                assert status == 200 and served_by in {r.address for r in pool}, (status, served_by, reply)
            else:
                assert status >= 500 and served_by in (None, "", "-"), (status, served_by, reply)
            served.append(served_by)
        if fail_open:
            assert pool[1].address in served, f"every request went where the client said: {served}"
    finally:
        procs.stop(gw.proc)
