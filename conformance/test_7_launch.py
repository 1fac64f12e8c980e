"""Issue 6, item 7: `llmgw-agent launch -- vllm serve ...` starts a real vLLM replica with the
flags and PYTHONHASHSEED matching the agent's configuration; Envoy routes to it exactly."""

import random

from llmgw_testkit.vllm_serve import vllm_env
from conftest import (AGENT, BLOCK, MODEL, MODEL_DIR, VLLM_VENV, Fleet, Replica, agent_hash, agent_toml, http_json,
                      wait_healthy, words)


def test_launched_replica_is_mirrored_and_routed_to(procs, logdir):
    f = Fleet(procs, logdir)
    r = Replica("launched", "bind", seed=None, blocks=128)
    f.replicas = {r.name: r}
    (logdir / "agent-launch.toml").write_text(agent_toml([r], f.feed, f.http))
    command = [str(VLLM_VENV / "bin" / "vllm"), "serve", str(MODEL_DIR), "--served-model-name", MODEL,
               "--host", "127.0.0.1", "--port", str(r.port), "--block-size", str(BLOCK),
               "--num-gpu-blocks-override", str(r.blocks), "--max-model-len", "512",
               "--enable-prompt-tokens-details", "--uvicorn-log-level", "warning",
               "--distributed-executor-backend", "llmgw_conformance_executor.NoModelExecutor"]
    # No PYTHONHASHSEED, hash algorithm or KV-events flags here: the agent adds them.
    f.agent_proc = procs.start([AGENT, "launch", "--config", logdir / "agent-launch.toml",
                                "--stop-timeout-secs", "20", "--", *command], "agent-launch", env=vllm_env(None))
    wait_healthy(r, f.agent_proc)
    sources = http_json(f"{r.url}/kv_event_sources")[2]
    assert sources["0"]["endpoint"] == f"tcp://127.0.0.1:{r.kv}", sources
    f.agent.wait_up(r.name)
    f.start_envoy("envoy-launch")

    rng = random.Random("launch")
    prompt = words(rng, 40, "la")
    headers, reply = f.completion(None, prompt, max_tokens=2)
    assert f.routed(headers, reply)[1].name == r.name
    keys = agent_hash(f.tokenize(r, {"prompt": prompt}))
    f.wait_mirrored(r, keys)
    parity = f.agent.replica(r.name)["parity"]
    assert parity["mismatched"] == 0 and parity["matched"] >= len(keys), parity
    headers, reply = f.completion(None, prompt + " " + words(rng, 10, "lb"), max_tokens=2)
    outcome, served, matched, cached = f.routed(headers, reply)
    assert (outcome, served.name) == ("exact", r.name), headers.get("x-llmgw-decision")
    assert matched == len(keys) and cached == BLOCK * matched
