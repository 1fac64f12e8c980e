"""Models read from the replicas: the agent's configuration names no model, the agent reads each
replica's /v1/models (as vLLM lists them: the base model, its --served-model-name aliases, and
LoRA adapters with `parent` and their path as `root`) and the filter routes a request naming an
alias or an adapter to the replicas serving it, exactly: an adapter's blocks are hashed with its
path, as vLLM hashes them."""

import json

import llmgw_testkit as kit
from llmgw_testkit import parse_decision, request, speculative_blocks, wait_until
from llmgw_testkit.fleet import new_sims, sim_command, start_router
from llmgw_testkit.agent import Agent, sim_replica

BASE = "base-model"


def post(port: int, model: str, prompt):
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 2}).encode()
    status, headers, raw = request("POST", f"http://127.0.0.1:{port}/v1/completions", body,
                                   {"content-type": "application/json", "connection": "close"})
    return status, {k.lower(): v for k, v in headers.items()}, raw


def test_an_alias_or_adapter_a_replica_lists_is_routed_there_exactly(procs, tmp_path, agent_bin, sim_bin,
                                                                       wasm_path, envoy_bin):
    sims = new_sims(2)
    # r0 serves the base model, an alias and a LoRA adapter; r1 the base model alone.
    procs.start(sim_command(sim_bin, sims[0], BASE, seed="0", alias="chat", lora_module="sql=/adapters/sql"), "r0")
    procs.start(sim_command(sim_bin, sims[1], BASE, seed="0"), "r1")
    for s in sims:
        kit.wait_port(s["port"])
    replicas = [{k: v for k, v in sim_replica(s, BASE).items() if k != "models"} for s in sims]
    agent = Agent(procs, agent_bin, tmp_path, replicas, hash={"algo": "sha256_cbor", "seed": "0", "block_size": 16},
                  load={"models_interval_ms": 200}).wait_ready()
    listen, admin = kit.free_port(), kit.free_port()
    config = kit.shipped_config(wasm_path, listen, admin, agent.feed, kit.filter_config(explain_header=True))
    _, envoy = start_router(procs, envoy_bin, tmp_path, "envoy", config, admin, feed=True)
    r0 = f"127.0.0.1:{sims[0]['port']}"

    # The feed's table says what each replica lists (read, not configured): until it does, a
    # request for `sql` might go to r1, which answers 404.
    def served():
        reps = {r["replica"]: r for r in agent.replicas()}
        return reps["r0"].get("models") == ["base-model", "chat", "sql"] and reps["r1"].get("models") == [BASE]
    wait_until(served, 20, "the agent read both replicas' /v1/models")
    for i in range(6):
        for model in ("chat", "sql"):
            status, headers, raw = post(listen, model, f"request {i} for {model}")
            assert status == 200, (model, status, raw[:200])
            assert parse_decision(headers.get(kit.DECISION_HEADER)).replica == r0, (model, headers)
    # A model no replica lists: answered 503 by the filter.
    status, _, raw = post(listen, "nope", "hello")
    assert status == 503 and b"no healthy replica" in raw, (status, raw)

    # The adapter's blocks, from r0's KV events, are matched by the index: the filter hashed the
    # request with ("lora", "sql", "/adapters/sql"), as the simulator (and vLLM) did.
    tokens = list(range(1000, 1064))
    assert post(listen, "sql", tokens)[0] == 200
    seen = {}

    def credited_by_index():
        status, headers, _ = post(listen, "sql", tokens)
        seen["header"] = header = headers.get(kit.DECISION_HEADER)
        d = parse_decision(header)
        assert status == 200 and d.replica == r0, header
        # Until r0's KV events reach the index, only the filter's speculative entries credit it.
        return d.outcome == "exact" and d.matched >= 3 and speculative_blocks(header) == 0
    try:
        wait_until(credited_by_index, 20, "the adapter's blocks credited from r0's KV events")
    except TimeoutError as e:
        raise AssertionError(f"{e}; the last decision: {seen}; r0 in the agent: {agent.replica('r0')}") from e
    # The agent verified those blocks' hashes with the adapter's path (no mismatch).
    parity = {r["replica"]: r["parity"] for r in agent.replicas()}["r0"]
    assert parity["mismatched"] == 0 and parity["matched"] >= 4, parity
