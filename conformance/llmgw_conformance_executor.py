"""A vLLM executor that replaces only the model forward pass: it reports one small
full-attention KV-cache layer, and returns a fixed sampled token for every request whose
prompt (and earlier output) has been computed. The scheduler, prefix cache, block pool,
eviction and KV-event publisher that drive it are vLLM's own.

With LLMGW_CONFORMANCE_SLIDING_WINDOW=W it reports a hybrid model instead: a full-attention
layer and a sliding-window layer of W tokens, so vLLM builds two KV-cache groups (its hybrid
coordinator, and events with group_idx, kv_cache_spec_kind and the window).

With LLMGW_STEP_US=S and LLMGW_TOKEN_US=T each engine step takes S µs plus T µs per token it
computes (prefill and decode alike), like a GPU whose step time grows with the tokens in the
batch: the real-vLLM benchmark (bench/vllm.py) uses it. Both default to 0 (no delay).

Selected with `--distributed-executor-backend llmgw_conformance_executor.NoModelExecutor`
(this directory on PYTHONPATH)."""

import os
import time
from concurrent.futures import Future

import torch
from vllm.v1.executor.abstract import Executor
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.worker.worker_base import CompilationTimes

# An ordinary token id of the local vocabulary (neither special nor EOS).
SAMPLED_TOKEN = 300


class NoModelExecutor(Executor):
    def _init_executor(self) -> None:
        self._prompt_len: dict[str, int] = {}
        self._num_output: dict[str, int] = {}
        self._step_s = float(os.environ.get("LLMGW_STEP_US", "0")) / 1e6
        self._token_s = float(os.environ.get("LLMGW_TOKEN_US", "0")) / 1e6
        mc = self.model_config
        shape = dict(
            block_size=self.cache_config.block_size or 16,
            num_kv_heads=mc.get_num_kv_heads(self.parallel_config),
            head_size=mc.get_head_size(),
            dtype=torch.float32,
        )
        self._specs = {"model.layers.0.self_attn.attn": FullAttentionSpec(**shape)}
        window = os.environ.get("LLMGW_CONFORMANCE_SLIDING_WINDOW")
        if window:
            self._specs["model.layers.1.self_attn.attn"] = SlidingWindowSpec(**shape, sliding_window=int(window))

    # Control-plane calls the engine core makes on its workers, answered here.
    def collective_rpc(self, method, timeout=None, args=(), kwargs=None, non_block=False):
        name = method if isinstance(method, str) else getattr(method, "__name__", "")
        result = self._rpc(name, *args, **(kwargs or {}))
        if non_block:
            f: Future = Future()
            f.set_result([result])
            return f
        return [result]

    def _rpc(self, name, *args, **kwargs):
        if name == "get_kv_cache_spec":
            return dict(self._specs)
        if name == "get_supported_kv_cache_layouts":
            return ["LBNHC"]
        if name == "determine_available_memory":
            return 1 << 30
        if name == "compile_or_warm_up_model":
            return CompilationTimes(language_model=0.0, encoder=0.0)
        if name == "get_supported_tasks":
            return ("generate",)
        if name in ("supports_draft_weight_updates",):
            return False
        if name == "list_loras":
            return set()
        if name == "get_kv_connector_handshake_metadata":
            return {}
        if name in ("take_draft_token_ids", "get_simple_cpu_offload_num_cpu_blocks"):
            return None
        # set_kv_cache_layout, initialize_from_config, shutdown, reset caches, sleep, ...
        return None

    def check_health(self) -> None:
        return None

    def execute_model(self, scheduler_output, non_block=False):
        out = self._step(scheduler_output)
        if non_block:
            f: Future = Future()
            f.set_result(out)
            return f
        return out

    def sample_tokens(self, grammar_output, non_block=False):
        raise RuntimeError("execute_model always returns its output")

    def _step(self, so) -> ModelRunnerOutput:
        for rid in so.finished_req_ids:
            self._prompt_len.pop(rid, None)
            self._num_output.pop(rid, None)
        done = {}  # req_id -> number of tokens that exist once this step's tokens are computed
        for new in so.scheduled_new_reqs:
            self._prompt_len[new.req_id] = len(new.prompt_token_ids or [])
            self._num_output[new.req_id] = 0
            done[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            self._num_output[rid] = cached.num_output_tokens[i]
            done[rid] = cached.num_computed_tokens[i]
        req_ids = list(so.num_scheduled_tokens.keys())
        if req_ids and (self._step_s or self._token_s):
            time.sleep(self._step_s + self._token_s * sum(so.num_scheduled_tokens.values()))
        sampled = []
        for rid in req_ids:
            computed = done.get(rid, 0) + so.num_scheduled_tokens[rid]
            needed = self._prompt_len.get(rid, 0) + self._num_output.get(rid, 0)
            sampled.append([SAMPLED_TOKEN] if computed >= needed else [])
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
        )
