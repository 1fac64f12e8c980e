"""Issue 6, item 5: a replica started with another PYTHONHASHSEED (E: seed 1, the fleet: 0) is
reported by the agent as a parity mismatch and is never credited with blocks it does not hold."""

import random

import llmgw_testkit as kit
from conftest import BLOCK, agent_hash, wait_until, words


def test_replica_with_another_seed_is_a_parity_mismatch_and_never_credited(fleet):
    e = fleet.replicas["e"]
    rng = random.Random("seed")
    prompt = words(rng, 40, "se")
    fleet.completion(e, prompt, max_tokens=2)
    rep = wait_until(lambda: (r := fleet.agent.replica(e.name))["parity"]["mismatched"] > 0 and r, 30,
                     "the agent's parity check to flag E")
    assert rep["parity"]["matched"] == 0, rep["parity"]
    # Its stores' token ids do not hash to the keys it publishes: those claims are rejected.
    assert rep["parity"]["rejected"]["hash_mismatch"] >= 1, rep["parity"]
    assert "parity" in fleet.agent.metrics()
    # What E publishes is not what the fleet's hash gives for the same tokens.
    keys = set(agent_hash(fleet.tokenize(e, {"prompt": prompt})))
    assert not (fleet.agent.keys(e.name) & keys)
    fleet.wait_index_converged()
    for i in range(3):
        headers, reply = fleet.completion(None, prompt + " " + words(rng, 10, f"sf{i}"), max_tokens=2)
        outcome, served, matched, cached = fleet.routed(headers, reply)
        explain = headers.get(kit.DECISION_HEADER)
        if served.name == "e":
            # The index never credits E. Once a request was sent there, speculative entries may
            # (for 2 s, no event of E's confirming them): blocks E was just sent and holds.
            spec = kit.speculative_blocks(explain)
            assert matched == spec, explain
            assert matched * BLOCK <= cached, (explain, cached)
