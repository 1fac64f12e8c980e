"""Issue 15, item 2: a hybrid model (a full-attention KV-cache group and a sliding-window group
of 32 tokens; the no-model executor reports the spec, vLLM's own scheduler, hybrid coordinator,
block pool and publisher do the rest). The agent mirrors both groups; the filter credits a
replica with what vLLM's hybrid coordinator would hit, which is what vLLM then reports as
cached:

* a follow-up extending a prompt hits every block (both groups hold the tail of the prompt);
* a prompt sharing only the first few blocks hits nothing, although the full-attention group
  holds them: the sliding-window group cached only the blocks inside the prompt's last window,
  so vLLM finds no window's worth of blocks before the shared prefix ends.

With the hybrid scoring switched off in the filter (every engine scored by group 0), the
second request failed: "filter credited 4 blocks, vLLM served 0 cached tokens".

This module starts its own replica, agent and Envoy (the session fleet is not needed)."""

import random

import pytest

from conftest import (AGENT, BLOCK, Fleet, Replica, agent_hash, agent_toml, decision, wait_healthy, wait_until,
                      words)
from llmgw_testkit import http_json

WINDOW = 32


class HybridReplica(Replica):
    """vLLM with two KV-cache groups; the groups share the pool, so more blocks and a shorter
    model length than the other replicas (64 blocks and 512 tokens do not start)."""

    def serve_args(self, with_events: bool = True) -> list[str]:
        args = super().serve_args(with_events)
        args[args.index("--max-model-len") + 1] = "256"
        return args


@pytest.fixture(scope="module")
def hybrid_fleet(procs, logdir):
    d = logdir / "hybrid"
    d.mkdir(exist_ok=True)
    f = Fleet(procs, d)
    r = HybridReplica("hy", "bind", blocks=128)
    f.replicas = {r.name: r}
    (d / "agent.toml").write_text(agent_toml([r], f.feed, f.http))
    f.agent_proc = procs.start([AGENT, "run", "--config", d / "agent.toml", "--log-level", "info"], "agent-hybrid")
    wait_until(lambda: http_json(f"{f.agent.base}/healthz", timeout=2)[0] in (200, 503), 30, "the agent's HTTP")
    env = r.serve_env(AGENT, LLMGW_CONFORMANCE_SLIDING_WINDOW=str(WINDOW))
    r.proc = procs.start(r.serve_args(), f"vllm-{r.name}", env=env)
    wait_healthy(r, r.proc)
    f.agent.wait_up(r.name)
    f.start_envoy("envoy-hybrid")
    yield f, r


def prompt_of(f: Fleet, r: Replica, rng: random.Random, tag: str, lo: int, hi: int) -> tuple[str, list[int]]:
    """A prompt of lo..hi tokens."""
    text = words(rng, 10, tag)
    while True:
        toks = f.tokenize(r, {"prompt": text})
        if len(toks) >= lo:
            assert len(toks) <= hi, len(toks)
            return text, toks
        text += " " + words(rng, 2, tag)


def test_hybrid_hits_are_credited_as_vllm_finds_them(hybrid_fleet):
    f, r = hybrid_fleet
    rng = random.Random("hybrid")
    prompt, toks = prompt_of(f, r, rng, "hy", 170, 200)
    status, _, reply = http_json(f"{r.url}/v1/completions", {"model": r.model, "prompt": prompt, "max_tokens": 2},
                                 timeout=60)
    assert status == 200, reply
    keys = agent_hash(toks)
    # Both groups' stores are mirrored: the full-attention group's keys are vLLM's hashes, the
    # window group's (its last blocks only) are kept apart, so the mirror holds more blocks.
    wait_until(lambda: f.agent.keys(r.name) >= set(keys) and f.agent.replica(r.name)["blocks"] > len(keys), 30,
               "the agent to mirror both KV-cache groups")
    held = f.agent.replica(r.name)["blocks"]
    assert held < 2 * len(keys), f"the window group holds only a few blocks: {held} for {len(keys)}"
    f.wait_index_converged()

    # A follow-up extending the prompt: both groups hit all of its blocks.
    followup = prompt + " " + words(rng, 6, "hz")
    headers, reply = f.completion(None, followup, max_tokens=2)
    outcome, served, matched, cached = f.routed(headers, reply)
    assert (outcome, matched, cached) == ("exact", len(keys), BLOCK * len(keys)), headers.get("x-llmgw-decision")

    # A prompt sharing only the first few blocks: the full-attention group holds them, the
    # window group none of the blocks before their end, so vLLM hits nothing.
    prefix_words = prompt.split()[:12]
    other = " ".join(prefix_words) + " " + words(rng, 25, "hq")
    shared = 0
    for a, b in zip(keys, agent_hash(f.tokenize(r, {"prompt": other}))):
        if a != b:
            break
        shared += 1
    assert 2 <= shared <= len(keys) - 3, shared
    f.wait_index_converged()
    headers, reply = f.completion(None, other, max_tokens=2)
    _, _, matched, _ = decision(headers)
    cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached < BLOCK * shared, f"vLLM hit {cached} tokens of the {shared} blocks group 0 holds"
    assert matched * BLOCK == cached, (f"filter credited {matched} blocks, vLLM served {cached} cached tokens "
                                       f"(group 0 alone holds {shared})")
