"""The whole product on loopback: simulated vLLM replicas publishing real-format KV events,
the real llmgw-agent, and the real Envoy with llmgw.wasm. Shows exact routing to the replica
holding a prefix, that a restarted replica loses its credit at once, and that a replica hashing
with another PYTHONHASHSEED is reported and never credited."""

import json
import re
import sys
import time
import urllib.request

import pytest

from conftest import ROOT, free_port, wait_port

sys.path.insert(0, str(ROOT / "demo"))
import demo  # noqa: E402  (config generators shared with the demo)

MODEL = demo.MODEL


def sim_bin():
    p = ROOT / "target" / "release" / "llmgw-sim"
    if not p.exists():
        raise FileNotFoundError("llmgw-sim not built (cargo build --release -p llmgw-sim)")
    return p


def get_json(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def chat(port, messages, extra_headers=None):
    body = json.dumps({"model": MODEL, "messages": messages, "max_tokens": 4}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                 headers={"content-type": "application/json", **(extra_headers or {})})
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.headers.get("x-llmgw-sim-replica"), r.headers.get("x-llmgw-decision"), json.loads(r.read())


def decision(header):
    m = re.match(r"outcome=(\w+); replica=([\d.:]+); matched=(\d+)/(\d+)", header or "")
    assert m, f"no decision header: {header!r}"
    return m.group(1), m.group(2), int(m.group(3)), int(m.group(4))


def wait_until(pred, timeout=20.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise TimeoutError(what)


@pytest.fixture
def fleet(procs, tmp_path, agent_bin, wasm_path, envoy_bin):
    sims = [{"name": f"r{i}", "port": free_port(), "kv": free_port(), "replay": free_port(), "seed": s}
            for i, s in enumerate(["0", "0", "1"])]
    feed, agent_http = free_port(), free_port()
    (tmp_path / "agent.toml").write_text(demo.agent_config(sims, feed, agent_http))
    procs.start([agent_bin, "run", "--config", tmp_path / "agent.toml"], "agent")
    wait_port(agent_http)
    for s in sims:
        procs.start([sim_bin(), "--port", s["port"], "--name", s["name"], "--model", MODEL, "--blocks", 256,
                     "--seed", s["seed"], "--kv-endpoint", f"tcp://127.0.0.1:{s['kv']}",
                     "--replay-endpoint", f"tcp://127.0.0.1:{s['replay']}", "--decode-ms", "1"], s["name"])
    for s in sims:
        wait_port(s["port"])
    listen, admin = free_port(), free_port()
    cfg = demo.envoy_llmgw_config(wasm_path, listen, admin, feed, True, filter_extra={"explain_header": True})
    (tmp_path / "envoy.yaml").write_text(cfg)
    procs.start([envoy_bin, "-c", tmp_path / "envoy.yaml", "--concurrency", "2", "--log-level", "warn", "--disable-hot-restart"], "envoy")

    def ready():
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{admin}/stats?filter=llmgw_feed_connected", timeout=2) as r:
                vals = re.findall(r": (\d+)", r.read().decode())
            return bool(vals) and all(v == "1" for v in vals)
        except OSError:
            return False

    wait_until(ready, 90, "every filter VM subscribed to the agent's feed")
    return {"sims": sims, "listen": listen, "admin": admin, "agent": f"http://127.0.0.1:{agent_http}"}


def agent_replica(fleet, name):
    for r in get_json(f"{fleet['agent']}/debug/replicas")["replicas"]:
        if r["replica"] == name:
            return r
    raise KeyError(name)


def index_matches_agent(fleet):
    """True when every filter VM's index holds exactly the agent's (block, replica) pairs."""
    total = sum(r["blocks"] for r in get_json(f"{fleet['agent']}/debug/replicas")["replicas"])
    with urllib.request.urlopen(f"http://127.0.0.1:{fleet['admin']}/stats?filter=llmgw_index_blocks", timeout=2) as r:
        vals = [int(v) for v in re.findall(r": (\d+)", r.read().decode())]
    return bool(vals) and all(v == total for v in vals)


def index_has(fleet, n_blocks):
    """True when every filter VM's index holds at least n_blocks (the feed delivered them)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{fleet['admin']}/stats?filter=llmgw_index_blocks", timeout=2) as r:
        vals = [int(v) for v in re.findall(r": (\d+)", r.read().decode())]
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
    outcome, addr, matched, total = decision(header)
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
    outcome, addr, matched, _ = decision(header)
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
    assert rep["parity"]["matched"] == 0 and rep["blocks"] > 0
    wait_until(lambda: index_has(fleet, rep["blocks"]), 20, "indexes")
    _, header, _ = chat(fleet["listen"], msgs + [{"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}])
    outcome, addr, matched, _ = decision(header)
    assert addr != f"127.0.0.1:{wrong['port']}" or matched == 0, header
    assert not (outcome == "exact" and addr == f"127.0.0.1:{wrong['port']}"), header
