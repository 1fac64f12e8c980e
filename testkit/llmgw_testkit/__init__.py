"""llmgw's Python test kit: the one copy of what the demo, the benchmarks, the end-to-end tests
(wasm-tests/) and the conformance suite share. A package (testkit/pyproject.toml) that
./build.sh installs into .venv, editable: it finds the repository from its own files.

- paths: the repository, cargo's target directory (CARGO_TARGET_DIR or `cargo metadata`), built
  binaries, dist/llmgw.wasm, Envoy
- procs: Procs (stops every process it started), free_port, wait_until, wait_port, tail
- http: request, get_text, post_json, http_json
- agent: agent_config (TOML from Python values), AgentAPI, Agent (a runner)
- envoy: the shipped bootstraps filled in (the filter's, the endpoint picker's), filter_config, lb_config, start_envoy, EnvoyAdmin
- client: stream_request, plain_request, parse_decision, speculative_blocks, scored_before_tokenizing (x-llmgw-decision)
- fleet: simulated replicas (llmgw-sim), the agent mirroring them, Envoy in front, peer routers
- workloads: the workload generator (seeded chat sessions: shared prefixes, conversations)
- sessions: the session runner (sessions at a concurrency, progress, hit rate, TTFT, shares)
- load_faults: the load-and-fault harness (client load through Envoy, a simulated fleet whose
  agent and replicas are killed and restarted)
- vllm_serve: the `vllm serve` launcher, its flags from `llmgw-agent vllm-args`
- gateways: several gateways (Envoy and agent each) in front of one simulated fleet
- feed: code for feed.proto, FeedStub, FeedSubscriber
- jetstream: a NATS server and the agent's publisher
- vllm_hash: vLLM's sha256_cbor block keys
- stub: a base for stub HTTP servers on loopback
- charts: matplotlib's pyplot for PNG files, when installed
"""

from .agent import Agent, AgentAPI, agent_config, merged, sim_replica, toml
from .client import (DECISION_HEADER, Decision, parse_decision, plain_request, scored_before_tokenizing,
                     speculative_blocks, stream_request)
from .envoy import EnvoyAdmin, epp_bootstrap, filter_config, lb_config, prom_sum, shipped_config, start_envoy
from .http import get_text, http_json, post_json, request
from .paths import ROOT, VLLM_DATA, WASM_TARGET, binary_path, built, envoy_bin, target_dir, wasm
from .procs import Procs, free_port, tail, wait_port, wait_until

__all__ = [
    "ROOT", "VLLM_DATA", "WASM_TARGET", "Agent", "AgentAPI", "DECISION_HEADER", "Decision", "EnvoyAdmin", "Procs",
    "agent_config", "binary_path", "built", "envoy_bin", "epp_bootstrap", "filter_config", "free_port", "get_text", "http_json",
    "lb_config", "merged", "parse_decision", "plain_request", "post_json", "prom_sum", "request", "shipped_config", "scored_before_tokenizing", "speculative_blocks",
    "sim_replica", "start_envoy", "stream_request", "tail", "target_dir", "toml", "wait_port", "wait_until", "wasm",
]
