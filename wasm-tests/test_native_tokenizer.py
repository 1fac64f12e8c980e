"""End-to-end: the agent's native tokenizer as the filter's dedicated tokenizer. What it
declines (421: here a model it refused at load) goes to a replica's /tokenize in the same
request, routes exactly, and never opens the dedicated tokenizer's circuit. (Token parity with
real tokenizers is proven in the conformance suite and the tokenizer crate's exactness tests.)"""

from __future__ import annotations

import re

from llmgw_testkit import free_port
from llmgw_testkit.vllm_hash import block_keys
from filter_support import completion_tokens
from test_filter_routing import (BLOCK, MODEL, PROMPT, Gateway, feed_pb, filter_cfg, fleet,  # noqa: F401 (fixtures)
                                 start_feed, tokenize_count)


def agent_metric(agent, name: str) -> float:
    m = re.search(rf"^{name}{{[^}}]*}} (\S+)$", agent.metrics(), re.M)
    return float(m.group(1)) if m else 0.0


def test_filter_asks_a_replica_when_the_native_tokenizer_declines(procs, envoy_bin, wasm_path, tmp_path, feed_pb,
                                                                  fleet, start_agent):
    tok_port = free_port()
    agent = start_agent([], tokenizer={"listen": f"127.0.0.1:{tok_port}",
                                       "models": [{"names": [MODEL], "dir": str(tmp_path / "no-such-model")}]})
    assert "native tokenizer refused this model" in agent.log()
    comp = block_keys(completion_tokens(PROMPT), BLOCK)
    feed = start_feed(feed_pb, fleet, {1: comp})
    try:
        gw = Gateway(procs, envoy_bin, wasm_path, tmp_path, fleet, feed,
                     filter_cfg(tokenizer_address=f"127.0.0.1:{tok_port}"))
        n = 8
        for i in range(n):
            # Distinct prompts (the filter's own cache would skip the call), same leading blocks.
            port, hdrs = gw.served_by("/v1/completions", {"model": MODEL, "prompt": f"{PROMPT} {i}"})
            assert port == fleet[1].port
            assert hdrs["x-llmgw-decision"].startswith("outcome=exact"), hdrs
        # Every call went to the native tokenizer first (its circuit never opened), then to a
        # replica.
        assert agent_metric(agent, "llmgw_native_tokenizer_declined_total") == n
        assert tokenize_count(fleet) == n
        assert gw.envoy.metric("llmgw_tokenizer_failures_total", 'reason="declined"') == n
        assert gw.envoy.metric("llmgw_fallbacks_total", 'reason="tokenizer"') == 0
        gw.assert_no_panic()
    finally:
        feed.stop()
