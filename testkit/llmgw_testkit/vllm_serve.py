"""The launcher of real `vllm serve` replicas on loopback, for the conformance suite and the
real-vLLM benchmark. The flags and environment that make a replica publish what the agent
expects (prefix caching, hash algorithm, block size, PYTHONHASHSEED, the KV-events publisher and
replay socket) are the ones `llmgw-agent vllm-args` prints for the replica's entry and hash
settings: one source for them. The rest (ports, model, pool size, the no-model executor that
replaces the forward pass) is the replica's own."""

from __future__ import annotations

import os
import shlex
import subprocess
import tempfile
import urllib.request
from pathlib import Path

from .agent import agent_config
from .paths import ROOT
from .procs import free_port, tail, wait_until

# The conformance suite's executor (conformance/llmgw_conformance_executor.py): vLLM's engine
# with the model forward pass replaced, so a replica runs on CPU without weights.
EXECUTOR_DIR = ROOT / "conformance"
NO_MODEL_EXECUTOR = "llmgw_conformance_executor.NoModelExecutor"
BLOCK = 16


def vllm_env(seed: str | None = None, **extra: str) -> dict:
    """The environment of a vLLM process: this one's without PYTHONHASHSEED (`seed` sets it),
    CPU, no usage stats, offline, one OpenMP thread, the no-model executor importable; `extra`
    added."""
    env = dict(os.environ)
    env.pop("PYTHONHASHSEED", None)
    if seed is not None:
        env["PYTHONHASHSEED"] = seed
    env["VLLM_TARGET_DEVICE"] = "cpu"
    env["PYTHONPATH"] = str(EXECUTOR_DIR) + os.pathsep + env.get("PYTHONPATH", "")
    env["VLLM_NO_USAGE_STATS"] = "1"
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def agent_vllm_args(agent_bin, entry: dict, hash_settings: dict) -> tuple[dict[str, str], list[str]]:
    """(environment, flags) that `llmgw-agent vllm-args` prints for one replica `entry` of the
    agent's configuration under `hash_settings` (its [hash] table)."""
    with tempfile.TemporaryDirectory(prefix="llmgw-vllm-args-") as d:
        path = Path(d) / "agent.toml"
        path.write_text(agent_config(free_port(), free_port(), [entry], hash=hash_settings))
        out = subprocess.run([str(agent_bin), "vllm-args", "--config", str(path)], capture_output=True, text=True,
                             timeout=30)
    if out.returncode != 0:
        raise RuntimeError(f"llmgw-agent vllm-args failed: {out.stderr.strip()}")
    lines = [line for line in out.stdout.splitlines() if line.strip() and not line.startswith("#")]
    if len(lines) != 1:
        raise RuntimeError(f"llmgw-agent vllm-args: expected one command line, got:\n{out.stdout}")
    words = shlex.split(lines[0])
    env = {}
    while words and "=" in words[0] and words[0] != "vllm":
        k, v = words.pop(0).split("=", 1)
        env[k] = v
    if words[:2] != ["vllm", "serve"] or len(words) < 3:
        raise RuntimeError(f"llmgw-agent vllm-args: not a `vllm serve` line: {lines[0]}")
    return env, words[3:]


def drop_flag(args: list[str], flag: str) -> list[str]:
    """`args` without `flag` and its value."""
    if flag not in args:
        return list(args)
    i = args.index(flag)
    return args[:i] + args[i + 2:]


class VllmReplica:
    """One `vllm serve` replica on loopback. mode "bind": the agent binds `kv`, vLLM connects to
    it; mode "connect": vLLM binds it (loopback only), the agent connects. vLLM runs hash
    algorithm `algo` (None: vLLM's default, no flag) with PYTHONHASHSEED `seed` (None: unset);
    `blocks` KV blocks of BLOCK tokens."""

    def __init__(self, name: str, mode: str = "bind", seed: str | None = "0", algo: str | None = "sha256_cbor",
                 blocks: int = 64, model: str = "tiny", topic: str = "kv-events"):
        self.name, self.mode, self.seed, self.algo, self.blocks, self.model = name, mode, seed, algo, blocks, model
        self.topic = topic
        self.port, self.kv, self.replay = free_port(), free_port(), free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def agent_entry(self) -> dict:
        """This replica in the agent's configuration."""
        return {"name": self.name, "address": self.address, "models": [self.model],
                "endpoint": f"tcp://127.0.0.1:{self.kv}", "mode": self.mode,
                "replay_endpoint": f"tcp://127.0.0.1:{self.replay}", "topic": self.topic}

    def hash_settings(self) -> dict:
        """The hash settings vLLM runs with (sha256 is vLLM's default algorithm)."""
        return {"algo": self.algo or "sha256", "seed": self.seed, "block_size": BLOCK}

    def agent_args(self, agent_bin) -> tuple[dict[str, str], list[str]]:
        """The environment and flags the agent prints for this replica (without the algorithm
        flag when vLLM runs its default)."""
        env, args = agent_vllm_args(agent_bin, VllmReplica.agent_entry(self), self.hash_settings())
        return env, args if self.algo else drop_flag(args, "--prefix-caching-hash-algo")

    def serve_command(self, vllm_bin, model_dir, agent_bin, with_events: bool = True, max_model_len: int = 512,
                      max_num_seqs: int = 8, extra: list = ()) -> list[str]:
        """`vllm serve` for this replica: the agent's flags (without the KV-events publisher
        when not `with_events`), this replica's ports, model and pool, the no-model executor."""
        _, flags = self.agent_args(agent_bin)
        if not with_events:
            flags = drop_flag(flags, "--kv-events-config")
        return [str(vllm_bin), "serve", str(model_dir), "--served-model-name", self.model,
                "--host", "127.0.0.1", "--port", str(self.port), *flags,
                "--num-gpu-blocks-override", str(self.blocks), "--max-model-len", str(max_model_len),
                "--max-num-seqs", str(max_num_seqs), "--enable-prompt-tokens-details", "--uvicorn-log-level", "warning",
                "--distributed-executor-backend", NO_MODEL_EXECUTOR, *map(str, extra)]

    def serve_env(self, agent_bin, **extra: str) -> dict:
        """vllm_env with the agent's environment for this replica (its PYTHONHASHSEED)."""
        env, _ = self.agent_args(agent_bin)
        return vllm_env(None, **env, **extra)

    def wait_healthy(self, proc: subprocess.Popen, timeout: float) -> None:
        """Until /health answers 200; raises with the log's tail if `proc` exits first."""
        def up():
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve {self.name} exited with {proc.returncode}:\n{tail(proc.log_path)}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                    return resp.status == 200
            except OSError:
                return False
        try:
            wait_until(up, timeout, f"vllm serve {self.name} /health", interval=0.25)
        except TimeoutError as e:
            raise TimeoutError(f"{e}\n{tail(proc.log_path)}") from None
