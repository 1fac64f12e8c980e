"""Issue 6, item 2: after a prompt is served by replica B, a follow-up sharing its prefix is routed
to B through Envoy with outcome `exact`, and the number of blocks the filter matched is what B
reports as cached (usage.prompt_tokens_details.cached_tokens) for that follow-up."""

import random

from conftest import agent_hash, wait_until, words


def test_completion_followup_routed_exact_to_the_replica_holding_its_prefix(fleet):
    b = fleet.replicas["b"]
    rng = random.Random("route-completion")
    prompt = words(rng, 50, "rc")
    fleet.completion(b, prompt, max_tokens=2)
    keys = agent_hash(fleet.tokenize(b, {"prompt": prompt}))
    fleet.wait_mirrored(b, keys)
    before = fleet.envoy.exact_decisions()
    headers, reply = fleet.completion(None, prompt + " " + words(rng, 15, "rd"), max_tokens=2)
    outcome, served, matched, cached = fleet.routed(headers, reply)
    assert (outcome, served.name) == ("exact", "b"), headers.get("x-llmgw-decision")
    assert matched == len(keys) and cached == 16 * len(keys), (matched, cached, len(keys))
    wait_until(lambda: fleet.envoy.exact_decisions() == before + 1, 10,
               'llmgw_prefix_decisions_total{outcome="exact"} to count the decision')


def test_chat_followup_routed_exact_to_the_replica_holding_its_prefix(fleet):
    b = fleet.replicas["b"]
    rng = random.Random("route-chat")
    first = [{"role": "system", "content": words(rng, 40, "cs")}, {"role": "user", "content": words(rng, 15, "cu")}]
    _, reply = fleet.chat(b, first, max_tokens=3)
    keys = agent_hash(fleet.tokenize(b, {"messages": first}))
    fleet.wait_mirrored(b, keys)
    followup = first + [{"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
                        {"role": "user", "content": words(rng, 10, "cq")}]
    before = fleet.envoy.exact_decisions()
    headers, reply = fleet.chat(None, followup, max_tokens=2)
    outcome, served, matched, cached = fleet.routed(headers, reply)
    assert (outcome, served.name) == ("exact", "b"), headers.get("x-llmgw-decision")
    # The follow-up shares every full block of the first prompt (the generation prompt's tail
    # block may differ once the assistant turn is appended).
    assert matched >= len(keys) - 1 and matched * 16 == cached, (matched, cached, len(keys))
    wait_until(lambda: fleet.envoy.exact_decisions() == before + 1, 10,
               'llmgw_prefix_decisions_total{outcome="exact"} to count the decision')
