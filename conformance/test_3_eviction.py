"""Issue 6, item 3: blocks vLLM evicts from B's small pool (LRU reuse under other traffic,
published as BlockRemoved) stop counting for B, in the agent's mirror and in Envoy's routing."""

import random

from conftest import agent_hash, wait_until, words


def test_evicted_blocks_no_longer_count_for_the_replica(fleet):
    b = fleet.replicas["b"]
    rng = random.Random("evict")
    prompt = words(rng, 50, "ev")
    fleet.completion(b, prompt, max_tokens=2)
    keys = set(agent_hash(fleet.tokenize(b, {"prompt": prompt})))
    fleet.wait_mirrored(b, keys)
    # Other traffic on B: more distinct blocks than its pool holds, so the LRU reuses every block
    # of the first prompt.
    for i in range(6):
        fleet.completion(b, words(rng, 60, f"o{i}x"), max_tokens=2)
    removed = wait_until(lambda: not (fleet.agent.keys(b.name) & keys) and True, 30,
                         "the agent to drop B's evicted blocks")
    assert removed
    assert len(fleet.agent.keys(b.name)) <= b.blocks
    fleet.wait_index_converged()
    headers, reply = fleet.completion(None, prompt + " " + words(rng, 10, "ef"), max_tokens=2)
    outcome, served, matched, cached = fleet.routed(headers, reply)
    # Not credited to B for blocks it no longer holds; if it served the follow-up, vLLM confirms
    # that nothing of the prompt was cached any more.
    if served.name == "b":
        assert matched == 0 and cached == 0, (outcome, matched, cached)
    assert not (outcome == "exact" and matched > 0 and served.name == "b"), headers.get("x-llmgw-decision")
