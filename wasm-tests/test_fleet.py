"""The whole product on loopback: simulated vLLM replicas publishing real-format KV events,
the real llmgw-agent, and the real Envoy with llmgw.wasm. Shows exact routing to the replica
holding a prefix, that a restarted replica loses its credit at once, and that a replica hashing
with another PYTHONHASHSEED is reported and never credited."""

import json
import urllib.request

import pytest

import llmgw_testkit as kit
from llmgw_testkit import wait_until
from llmgw_testkit.fleet import fleet_agent, new_sims, sim_command, start_router, wait_publishers

MODEL = "demo-model"


def chat(port, messages, extra_headers=None):
    body = json.dumps({"model": MODEL, "messages": messages, "max_tokens": 4}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                 headers={"content-type": "application/json", **(extra_headers or {})})
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.headers.get("x-llmgw-sim-replica"), r.headers.get(kit.DECISION_HEADER), json.loads(r.read())


@pytest.fixture
def fleet(procs, tmp_path, agent_bin, sim_bin, wasm_path, envoy_bin):
    sims = new_sims(3)
    for s, seed in zip(sims, ["0", "0", "1"]):
        s["seed"] = seed
    agent = fleet_agent(procs, agent_bin, tmp_path, sims, MODEL)
    for s in sims:
        procs.start(sim_command(sim_bin, s, MODEL, blocks=256, seed=s["seed"], decode_ms=1), s["name"])
    for s in sims:
        kit.wait_port(s["port"])
    wait_publishers(agent, len(sims))
    listen, admin = kit.free_port(), kit.free_port()
    config = kit.shipped_config(wasm_path, listen, admin, agent.feed,
                                kit.filter_config({"name": "demo"}, explain_header=True))
    _, admin_api = start_router(procs, envoy_bin, tmp_path, "envoy", config, admin, feed=True, feed_timeout=90)
    return {"sims": sims, "listen": listen, "admin": admin, "agent_api": agent, "envoy": admin_api}


def agent_replica(fleet, name):
    return fleet["agent_api"].replica(name)


def index_matches_agent(fleet):
    """True when every filter VM's index holds exactly the agent's (block, replica) pairs."""
    total = sum(r["blocks"] for r in fleet["agent_api"].replicas())
    vals = fleet["envoy"].index_blocks()
    return bool(vals) and all(v == total for v in vals)


def index_has(fleet, n_blocks):
    """True when every filter VM's index holds at least n_blocks (the feed delivered them)."""
    vals = fleet["envoy"].index_blocks()
    return bool(vals) and all(v >= n_blocks for v in vals)


SYSTEM = {"role": "system", "content": " ".join(f"policy{i}" for i in range(300))}


def first_turn_on_a_matching_replica(fleet, tag):
    """Sends first turns (varying the question) until one is served by a replica hashing with
    the router's seed, and returns (messages, replica name, sim)."""
    good = {s["name"]: s for s in fleet["sims"] if s["seed"] == "0"}
    for attempt in range(20):
        # The approximate fallback keys on the prompt's leading text: vary the system prompt.
        system = {"role": "system", "content": f"{tag} {attempt} " + SYSTEM["content"]}
        msgs = [system, {"role": "user", "content": f"{tag} question {attempt} " * 20}]
        served_by, _, _ = chat(fleet["listen"], msgs)
        if served_by in good:
            return msgs, served_by, good[served_by]
    raise AssertionError("no first turn landed on a replica with the router's seed")


def test_followup_goes_to_the_replica_holding_its_prefix(fleet):
    first, served_by, sim = first_turn_on_a_matching_replica(fleet, "first")
    # The agent mirrors the new blocks, then every VM's index has them.
    blocks = wait_until(lambda: agent_replica(fleet, served_by)["blocks"], 20, "the agent mirrored the blocks")
    wait_until(lambda: index_has(fleet, blocks), 20, "the filters' indexes")
    followup = first + [{"role": "assistant", "content": "an answer"}, {"role": "user", "content": "and then?"}]
    again, header, reply = chat(fleet["listen"], followup)
    outcome, addr, matched, total = kit.parse_decision(header)
    assert again == served_by, f"follow-up went to {again}, prefix is on {served_by}"
    assert outcome == "exact" and addr == f"127.0.0.1:{sim['port']}"
    # What the replica reports as cached is what the router matched.
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == matched * 16
    assert 0 < matched <= total


def test_restarted_replica_loses_its_credit_at_once(fleet):
    first, served_by, sim = first_turn_on_a_matching_replica(fleet, "restart")
    blocks = wait_until(lambda: agent_replica(fleet, served_by)["blocks"], 20, "blocks mirrored")
    wait_until(lambda: index_has(fleet, blocks), 20, "indexes")
    urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{sim['port']}/sim/restart", data=b"{}"), timeout=10).read()
    wait_until(lambda: agent_replica(fleet, served_by)["blocks"] == 0, 20, "the agent dropped the restarted replica's blocks")
    wait_until(lambda: index_matches_agent(fleet), 20, "the filters dropped them too")
    _, header, reply = chat(fleet["listen"], first + [{"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}])
    outcome, addr, matched, _ = kit.parse_decision(header)
    assert matched == 0 and outcome != "exact", header


def test_replica_with_another_seed_is_reported_and_never_credited(fleet):
    wrong = next(s for s in fleet["sims"] if s["seed"] == "1")
    msgs = [SYSTEM, {"role": "user", "content": "seeded differently " * 20}]
    # Served directly by the replica with the other seed: it caches and publishes its blocks.
    body = json.dumps({"model": MODEL, "messages": msgs, "max_tokens": 4}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{wrong['port']}/v1/chat/completions", data=body,
                                 headers={"content-type": "application/json"})
    urllib.request.urlopen(req, timeout=30).read()
    rep = wait_until(lambda: (r := agent_replica(fleet, wrong["name"]))["parity"]["mismatched"] > 0 and r, 20,
                     "the agent's parity check")
    # Its blocks' token ids do not hash to the keys it published: the claims are rejected, the
    # replica holds nothing in the index, and the metric and the log say so.
    assert rep["parity"]["matched"] == 0 and rep["blocks"] == 0, rep
    assert rep["parity"]["rejected"]["hash_mismatch"] >= 1, rep["parity"]
    rejected = [line for line in fleet["agent_api"].metrics().splitlines()
                if line.startswith("llmgw_agent_block_claims_rejected_total{") and f'replica="{wrong["name"]}"' in line
                and 'reason="hash_mismatch"' in line]
    assert rejected and float(rejected[0].rsplit(" ", 1)[1]) >= 1, rejected
    wait_until(lambda: "block claims rejected" in fleet["agent_api"].log(), 10, "the agent's warning")
    _, header, _ = chat(fleet["listen"], msgs + [{"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}])
    outcome, addr, matched, _ = kit.parse_decision(header)
    assert addr != f"127.0.0.1:{wrong['port']}" or matched == 0, header
    assert not (outcome == "exact" and addr == f"127.0.0.1:{wrong['port']}"), header
