"""Issue 6, item 4: B restarted (a new vLLM process on the same ports, empty cache, sequence back
to 0): the blocks of its previous life are dropped at once, and it is credited again only for
what it caches afterwards."""

import random

import pytest

from conftest import agent_hash, wait_until, words


@pytest.mark.parametrize("name", ["b", "a"])  # vLLM binds (agent connects); agent binds (vLLM connects)
def test_restarted_replica_drops_old_blocks_and_is_credited_only_for_new_ones(fleet, name):
    b = fleet.replicas[name]
    rng = random.Random(f"restart-{name}")
    old = words(rng, 40, "ro")
    fleet.completion(b, old, max_tokens=2)
    old_keys = set(agent_hash(fleet.tokenize(b, {"prompt": old})))
    fleet.wait_mirrored(b, old_keys)

    fleet.restart_replica(b)
    # The agent's down timers are longer than the restart (see conftest.agent_toml): the old blocks
    # must go because the agent recognises the new vLLM process, by the time it serves again (its
    # publisher is up a few seconds before its HTTP server).
    wait_until(lambda: not (fleet.agent.keys(b.name) & old_keys), 3,
               "the agent to drop the restarted replica's old blocks")
    fleet.agent.wait_up(b.name)
    fleet.wait_index_converged()
    headers, reply = fleet.completion(None, old + " " + words(rng, 10, "rf"), max_tokens=2)
    outcome, served, matched, cached = fleet.routed(headers, reply)
    if served.name == name:
        assert matched == cached == 0, (outcome, matched, cached)
    assert not (outcome == "exact" and served.name == name and matched > 0), headers.get("x-llmgw-decision")

    new = words(rng, 40, "rn")
    fleet.completion(b, new, max_tokens=2)
    new_keys = set(agent_hash(fleet.tokenize(b, {"prompt": new})))
    fleet.wait_mirrored(b, new_keys)
    headers, reply = fleet.completion(None, new + " " + words(rng, 10, "rg"), max_tokens=2)
    outcome, served, matched, cached = fleet.routed(headers, reply)
    assert (outcome, served.name) == ("exact", name), headers.get("x-llmgw-decision")
    assert matched == len(new_keys) and cached == 16 * matched
