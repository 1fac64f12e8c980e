"""llmgw as a Gateway API Inference Extension endpoint picker: the real Envoy with its ext_proc
filter configured as GAIE gateways configure it (envoy/llmgw-epp-local.yaml: the request body
streamed in full-duplex mode to the picker over HTTP/2, the pool's cluster choosing the endpoint
x-gateway-destination-endpoint names, the next one on a connect failure), the agent with an [epp]
section, simulated replicas publishing real-format KV events. No wasm."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

import pytest

import llmgw_testkit as kit
from llmgw_testkit.stub import Decoy
from llmgw_testkit import wait_until
from llmgw_testkit.fleet import fleet_agent, new_sims, sim_command, start_router, wait_publishers

MODEL = "demo-model"


def epp_config(listen: int, admin: int, epp: int, pool: list[int], fail_open: bool = False,
               buffered: bool = False) -> str:
    """envoy/llmgw-epp-local.yaml with these ports and the pool's replicas (llmgw_testkit.epp_bootstrap)."""
    return kit.epp_bootstrap(listen, admin, epp, pool, fail_open, buffered)


def chat(port, messages, headers=None):
    """(status, replica that served, reply) of a chat completion through Envoy."""
    body = json.dumps({"model": MODEL, "messages": messages, "max_tokens": 4}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                 headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.headers.get("x-llmgw-sim-replica"), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, None, e.read()


def metric(agent, name: str, labels: str = "") -> float:
    pat = re.compile(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", re.M)
    m = pat.search(agent.metrics())
    return float(m.group(1)) if m else 0.0


@pytest.fixture
def decoy():
    d = Decoy()
    yield d
    d.close()


def start_sims(procs, sim_bin, n=3):
    sims = new_sims(n)
    for s in sims:
        procs.start(sim_command(sim_bin, s, MODEL, blocks=256, seed="0", decode_ms=1), s["name"])
    for s in sims:
        kit.wait_port(s["port"])
    return sims


@pytest.fixture(params=["full_duplex", "buffered"])
def epp_fleet(request, procs, tmp_path, agent_bin, sim_bin, envoy_bin):
    sims = start_sims(procs, sim_bin)
    epp_port = kit.free_port()
    routing = tmp_path / "routing.json"
    routing.write_text(json.dumps(kit.filter_config({"name": "demo"})))
    agent = fleet_agent(procs, agent_bin, tmp_path, sims, MODEL,
                        epp={"listen": f"127.0.0.1:{epp_port}", "routing": str(routing)})
    kit.wait_port(epp_port)
    listen, admin = kit.free_port(), kit.free_port()
    config = epp_config(listen, admin, epp_port, [s["port"] for s in sims], buffered=request.param == "buffered")
    _, envoy = start_router(procs, envoy_bin, tmp_path, "envoy", config, admin, feed=False)
    # Ready to route: every publisher connected, and Envoy's gRPC health check of the ext_proc
    # service passing, which it does once the picker's index is synced.
    wait_publishers(agent, len(sims))
    wait_until(lambda: f"llmgw_epp::127.0.0.1:{epp_port}::health_flags::healthy" in envoy.get("/clusters"),
               20, "the picker's gRPC health check")
    return {"sims": sims, "listen": listen, "agent": agent, "envoy": envoy, "epp": epp_port,
            "buffered": request.param == "buffered"}


SYSTEM = " ".join(f"policy{i}" for i in range(300))


def test_a_followup_lands_exactly_on_its_prefix_holder(epp_fleet):
    agent = epp_fleet["agent"]
    for n in range(3):
        first = [{"role": "system", "content": f"conversation {n} " + SYSTEM},
                 {"role": "user", "content": f"question {n} " * 20}]
        status, served_by, _ = chat(epp_fleet["listen"], first)
        assert status == 200 and served_by, (status, served_by)
        agent.wait_for(served_by, lambda r: r["blocks"] > 0, "the agent mirrored the blocks")
        exact_before = metric(agent, "llmgw_epp_decisions_total", '{outcome="exact"}')
        turns_before = metric(agent, "llmgw_epp_tokenizer_cache_total", '{result="earlier_turn"}')
        followup = first + [{"role": "assistant", "content": "an answer"}, {"role": "user", "content": "and then?"}]
        status, again, reply = chat(epp_fleet["listen"], followup)
        assert status == 200 and again == served_by, f"follow-up went to {again}, its prefix is on {served_by}"
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        # Decided from the index (not by the approximate fallback, which keys on the same text),
        # on the tokens of the turn before, without waiting for its own tokenizer call.
        assert metric(agent, "llmgw_epp_decisions_total", '{outcome="exact"}') == exact_before + 1
        assert metric(agent, "llmgw_epp_tokenizer_cache_total", '{result="earlier_turn"}') == turns_before + 1


def chat_stream(port, messages) -> str:
    """The text of a streamed chat completion through Envoy."""
    body = json.dumps({"model": MODEL, "messages": messages, "max_tokens": 4, "stream": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200
        return r.read().decode()


def test_a_streamed_followup_reads_its_prompt_ids_from_its_answer_where_the_answer_passes_the_picker(epp_fleet):
    """A next turn routed on its turn before asks its answer for the prompt's ids where the body
    and the answer stream through the picker both ways: no tokenizer call is made for it, the
    client's stream carries no ids, and its ids are kept for the turn after it. Buffered, the
    picker sees no answer: the call is made, and nothing is asked."""
    agent, listen = epp_fleet["agent"], epp_fleet["listen"]
    calls = lambda: metric(agent, "llmgw_epp_tokenizer_calls_total")
    read = lambda: metric(agent, "llmgw_epp_answer_tokens_total", '{result="read"}')
    turns = lambda: metric(agent, "llmgw_epp_tokenizer_cache_total", '{result="earlier_turn"}')
    first = [{"role": "system", "content": "streamed " + SYSTEM}, {"role": "user", "content": "question " * 20}]
    status, served_by, _ = chat(listen, first)
    assert status == 200 and served_by
    agent.wait_for(served_by, lambda r: r["blocks"] > 0, "the agent mirrored the blocks")
    second = first + [{"role": "assistant", "content": "an answer"}, {"role": "user", "content": "and then? " * 8}]
    calls_before, read_before, turns_before = calls(), read(), turns()
    text = chat_stream(listen, second)
    assert turns() == turns_before + 1, "routed on its turn before"
    assert text.rstrip().endswith("data: [DONE]"), text[-200:]
    assert '"prompt_token_ids":[' not in text and '"token_ids":[' not in text, text[:400]
    if epp_fleet["buffered"]:
        wait_until(lambda: calls() == calls_before + 1, 10, "the call made after routing")
        assert read() == read_before
        return
    wait_until(lambda: read() == read_before + 1, 10, "the ids read from the answer")
    assert calls() == calls_before, "no tokenizer call for a turn whose answer carried its ids"
    # The turn after it is routed at once on the ids read, and finds its whole turn before.
    third = second + [{"role": "assistant", "content": "more"}, {"role": "user", "content": "and after that?"}]
    text = chat_stream(listen, third)
    assert turns() == turns_before + 2
    wait_until(lambda: read() == read_before + 2, 10, "the third turn's ids read")
    assert calls() == calls_before


def complete(port, prompt: str):
    """(status, replica that served) of a completion through Envoy."""
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 4}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.status, r.headers.get("x-llmgw-sim-replica")


def test_a_text_prompt_extending_an_earlier_one_is_routed_at_once_on_its_tokens(epp_fleet):
    """The picker's one router keeps the text prompts it tokenized: a completion that begins
    with an earlier prompt (a conversation written out as text) goes at once, on the earlier
    prompt's tokens, to the replica holding them."""
    agent, listen = epp_fleet["agent"], epp_fleet["listen"]
    turns = lambda: metric(agent, "llmgw_epp_tokenizer_cache_total", '{result="earlier_turn"}')
    first = "A conversation written out as text. " + SYSTEM
    status, served_by = complete(listen, first)
    assert status == 200 and served_by
    agent.wait_for(served_by, lambda r: r["blocks"] > 0, "the agent mirrored the blocks")
    before = turns()
    status, again = complete(listen, first + " Then the next question, and its answer.")
    assert status == 200 and again == served_by, f"went to {again}, the earlier prompt is on {served_by}"
    assert turns() == before + 1, "routed on the earlier prompt's tokens, before its own call"


def test_the_picker_learns_each_endpoints_rates_from_its_streamed_answers_first_chunks(epp_fleet):
    """Where the answer's body is streamed through the picker (the shipped configuration), each
    streamed answer's first chunk teaches its endpoint's rates, and the answer arrives whole;
    buffered, nothing reaches the picker to time, and nothing is learned."""
    agent, listen = epp_fleet["agent"], epp_fleet["listen"]
    n = 6
    for i in range(n):
        body = json.dumps({"model": MODEL, "stream": True, "max_tokens": 4,
                           "messages": [{"role": "user", "content": f"question {i} " * 30}]}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{listen}/v1/chat/completions", data=body,
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            text = r.read().decode()
        assert r.status == 200 and text.rstrip().endswith("data: [DONE]"), text[-200:]

    def observations() -> float:
        return sum(float(v) for v in re.findall(r"^llmgw_rates_observations\{replica=\"[^\"]+\"\} (\S+)$",
                                                  agent.metrics(), re.M))
    if epp_fleet["buffered"]:
        assert observations() == 0
    else:
        wait_until(lambda: observations() >= n, 10, f"{n} first tokens taught")
        assert observations() == n


def test_a_client_destination_header_is_never_honoured(epp_fleet, decoy):
    sims, agent = epp_fleet["sims"], epp_fleet["agent"]
    for n in range(2):
        first = [{"role": "system", "content": f"client header {n} " + SYSTEM},
                 {"role": "user", "content": f"where do I go {n} " * 20}]
        status, holder, _ = chat(epp_fleet["listen"], first, {"x-gateway-destination-endpoint": decoy.address})
        assert status == 200 and holder in {s["name"] for s in sims}
        agent.wait_for(holder, lambda r: r["blocks"] > 0, "the agent mirrored the blocks")
        # The client names another replica of the pool (one the gateway could reach): ignored.
        other = next(s for s in sims if s["name"] != holder)
        followup = first + [{"role": "assistant", "content": "an answer"}, {"role": "user", "content": "and then?"}]
        status, again, _ = chat(epp_fleet["listen"], followup,
                                {"x-gateway-destination-endpoint": f"127.0.0.1:{other['port']}"})
        assert status == 200 and again == holder, f"went to {again} (the client named {other['name']})"
    assert decoy.hits == 0


@pytest.mark.parametrize("fail_open", [False, True], ids=["fail_close", "fail_open"])
def test_an_unreachable_picker_fails_open_or_closed_as_configured(procs, tmp_path, sim_bin, envoy_bin, fail_open):
    sims = start_sims(procs, sim_bin, 2)
    listen, admin, nobody = kit.free_port(), kit.free_port(), kit.free_port()
    start_router(procs, envoy_bin, tmp_path, "envoy", epp_config(listen, admin, nobody, [s["port"] for s in sims],
                                                                 fail_open), admin, feed=False)
    served = []
    for n in range(4):
        # Every request names r0: without the picker a client must still not choose.
        status, served_by, _ = chat(listen, [{"role": "user", "content": f"is anyone there? {n} " * 10}],
                                    {"x-gateway-destination-endpoint": f"127.0.0.1:{sims[0]['port']}"})
        if fail_open:
            assert status == 200 and served_by in {"r0", "r1"}, (status, served_by)
        else:
            assert status >= 500 and served_by is None, status
        served.append(served_by)
    if fail_open:
        assert "r1" in served, f"every request went where the client said: {served}"


def test_a_connect_failure_to_the_primary_is_retried_on_the_fallback_list(procs, tmp_path, agent_bin, sim_bin,
                                                                           envoy_bin):
    # r3's events reach the agent, but the address it is routed at refuses connections: the
    # picker credits it with the prefix (primary) and Envoy must go on down the list.
    sims = start_sims(procs, sim_bin, 4)
    dead = kit.free_port()
    epp_port = kit.free_port()
    routing = tmp_path / "routing.json"
    # Prompts are tokenized by r0: the tokenizer call must not go to the dead address (that is a
    # tokenizer failure and an approximate decision, not what this test is about).
    routing.write_text(json.dumps(kit.filter_config({"name": "demo",
                                                     "tokenizer_address": f"127.0.0.1:{sims[0]['port']}"})))
    replicas = [kit.sim_replica(s, MODEL) for s in sims]
    # The agent's entry for r3 names the dead address (its events still come from r3's publisher).
    replicas[3]["address"] = f"127.0.0.1:{dead}"
    agent = kit.Agent(procs, agent_bin, tmp_path, replicas, hash={"algo": "sha256_cbor", "seed": "0", "block_size": 16},
                      load={"enabled": False}, epp={"listen": f"127.0.0.1:{epp_port}", "routing": str(routing)})
    agent.wait_ready()
    kit.wait_port(epp_port)
    wait_publishers(agent, len(sims))
    listen, admin = kit.free_port(), kit.free_port()
    _, envoy = start_router(procs, envoy_bin, tmp_path, "envoy",
                            epp_config(listen, admin, epp_port, [s["port"] for s in sims[:3]] + [dead]), admin,
                            feed=False)
    first = [{"role": "system", "content": "dead primary " + SYSTEM}, {"role": "user", "content": "hello? " * 20}]
    body = json.dumps({"model": MODEL, "messages": first, "max_tokens": 4}).encode()
    urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{sims[3]['port']}/v1/chat/completions", data=body,
                                                  headers={"content-type": "application/json"}), timeout=30).read()
    agent.wait_for("r3", lambda r: r["blocks"] > 0, "the agent mirrored r3's blocks")
    exact_before = metric(agent, "llmgw_epp_decisions_total", '{outcome="exact"}')
    followup = first + [{"role": "assistant", "content": "an answer"}, {"role": "user", "content": "and then?"}]
    status, served_by, _ = chat(listen, followup)
    assert status == 200 and served_by in {"r0", "r1", "r2"}, (status, served_by)
    assert metric(agent, "llmgw_epp_decisions_total", '{outcome="exact"}') == exact_before + 1
    stats = envoy.stats("cluster.llmgw_pool.upstream_")
    assert stats.get("cluster.llmgw_pool.upstream_cx_connect_fail", 0) >= 1, stats
    assert stats.get("cluster.llmgw_pool.upstream_rq_retry", 0) >= 1, stats
