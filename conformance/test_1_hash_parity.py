"""Issue 6, item 1: the block hashes llmgw computes from a replica's /tokenize output (completions
and chat) are the hashes vLLM publishes for the same requests, for sha256_cbor with
PYTHONHASHSEED=0 and for vLLM's defaults (sha256 over pickle, no PYTHONHASHSEED)."""

import random

from conftest import BLOCK, agent_hash, wait_until, words


def _prompts(rng, tag):
    comp = [words(rng, n, tag) for n in (25, 60, 100)]
    chats = [[{"role": "system", "content": words(rng, 40, tag + "s")},
              {"role": "user", "content": words(rng, n, tag + "u")}] for n in (15, 50)]
    chats.append(chats[0] + [{"role": "assistant", "content": words(rng, 10, tag + "a")},
                             {"role": "user", "content": words(rng, 20, tag + "q")}])
    return comp, chats


def _check(fleet, r, algo, seed, tag):
    rng = random.Random(tag)
    comp, chats = _prompts(rng, tag)
    expected: list[int] = []
    for p in comp:
        toks = fleet.tokenize(r, {"prompt": p})
        keys = agent_hash(toks, algo, seed)
        assert len(keys) == len(toks) // BLOCK
        expected += keys
        fleet.completion(r, p, max_tokens=2)
    for msgs in chats:
        # /tokenize with messages uses the chat endpoint's defaults (template, no extra BOS).
        toks = fleet.tokenize(r, {"messages": msgs})
        expected += agent_hash(toks, algo, seed)
        fleet.chat(r, msgs, max_tokens=2)
    assert len(expected) >= 20
    # Every block of every prompt was published by vLLM under the hash llmgw computed (the pool is
    # large enough that none is evicted here).
    try:
        held = wait_until(lambda: (k := fleet.agent.keys(r.name)) >= set(expected) and k, 30,
                          f"replica {r.name}'s published blocks to include every computed hash")
    except TimeoutError:
        rep = fleet.agent.replica(r.name)
        held = set(rep.pop("block_keys"))
        raise AssertionError(f"{len(set(expected) - held)} of {len(set(expected))} computed hashes not in the "
                             f"agent's mirror of {r.name}; agent state: {rep}") from None
    missing = set(expected) - held
    assert not missing, f"{len(missing)} of {len(set(expected))} computed hashes were not published"
    # The agent's own parity check (recomputing each BlockStored from its token_ids) agrees.
    p = fleet.agent.replica(r.name)["parity"]
    assert p["mismatched"] == 0 and p["matched"] >= len(set(expected)), p


def test_hashes_from_tokenize_equal_published_sha256_cbor_seed0(fleet):
    _check(fleet, fleet.replicas["a"], "sha256_cbor", "0", "pa")


def test_hashes_from_tokenize_equal_published_vllm_default_sha256(fleet):
    _check(fleet, fleet.replicas["d"], "sha256", None, "pd")
