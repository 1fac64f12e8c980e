"""`llmgw-agent doctor` against real `vllm serve` 0.33.0 replicas and the fleet's Envoy: every check
passes for a replica started as `llmgw-agent vllm-args` says, and each deliberately wrong setting
fails its own check with a line naming the problem and its fix (the same checks the end-to-end
suite runs against the simulator, here against what vLLM itself reports and publishes)."""

from __future__ import annotations

import subprocess

import llmgw_testkit as kit
from conftest import AGENT, BLOCK, MODEL
from llmgw_testkit import free_port

FLEET_HASH = {"algo": "sha256_cbor", "seed": "0", "block_size": BLOCK}


def doctor(tmp_path, name: str, replicas: list[dict], admin: str) -> tuple[int, list[str]]:
    cfg = tmp_path / f"{name}.toml"
    cfg.write_text(kit.agent_config(free_port(), free_port(), replicas, hash=FLEET_HASH))
    p = subprocess.run([str(AGENT), "doctor", "--config", str(cfg), "--envoy-admin", admin],
                       capture_output=True, text=True, timeout=300)
    lines = p.stdout.splitlines() + p.stderr.splitlines()
    print(f"doctor {name} (exit {p.returncode}):\n" + "\n".join(lines))  # shown with pytest -s
    return p.returncode, lines


def failures(lines: list[str]) -> list[tuple[str, str]]:
    """Each FAIL line with the fix line under it."""
    return [(line, lines[i + 1].strip() if i + 1 < len(lines) else "") for i, line in enumerate(lines)
            if line.startswith("FAIL")]


def test_doctor_passes_a_right_replica_and_names_each_wrong_setting(fleet, tmp_path):
    b, e = fleet.replicas["b"], fleet.replicas["e"]
    # Both bind their publisher (mode "connect" for the agent), so doctor can subscribe beside the
    # running agent; A and D are bound by the agent itself.
    right = b.agent_entry()
    admin = f"http://127.0.0.1:{fleet.envoy.admin}"

    rc, lines = doctor(tmp_path, "right", [right], admin)
    report = "\n".join(lines)
    assert rc == 0, report
    checks = [line for line in lines if not line.startswith("    ")]
    assert checks and all(line.startswith("ok") for line in checks), report
    for want in ["b: /health", f"b: /v1/models serves {MODEL}",
                 f"b: /metrics reports prefix caching on, hash algorithm sha256_cbor, block size {BLOCK}",
                 "KV-event batch(es) received on tcp://", "b: hash parity: ", "b: replay socket ",
                 "envoy: cluster llmgw_agent present", "envoy: cluster llmgw_replicas present",
                 "envoy: cluster llmgw_tokenizer present", "envoy: every filter VM ("]:
        assert any(want in line for line in checks), f"{want!r} not in\n{report}"

    # One wrong setting per check. Entries that share B's event endpoint go in configurations of
    # their own (the configuration refuses two replicas on one endpoint).
    wrong = {
        # E runs with PYTHONHASHSEED=1, declared like the fleet (seed 0).
        "seed": ([{**e.agent_entry(), "name": "wrong-seed"}],
                 "wrong-seed: hash parity: ", "fix: start every replica with the PYTHONHASHSEED"),
        "address": ([{**right, "name": "wrong-address", "address": f"127.0.0.1:{free_port()}",
                      "endpoint": f"tcp://127.0.0.1:{free_port()}",
                      "replay_endpoint": f"tcp://127.0.0.1:{free_port()}"}],
                    "replica wrong-address: /health", "fix: replicas[0].address must give the replica's vLLM API"),
        "endpoint": ([{**right, "name": "wrong-endpoint", "endpoint": f"tcp://127.0.0.1:{free_port()}"}],
                     "wrong-endpoint: no KV-event batch on tcp://127.0.0.1:",
                     "fix: start vLLM with the --kv-events-config"),
        "model": ([{**right, "name": "wrong-model", "models": ["not-served"]}],
                  f"replica wrong-model: /v1/models serves {MODEL}, not not-served", "fix: set replicas[0].models"),
        "replay": ([{**right, "name": "wrong-replay", "replay_endpoint": f"tcp://127.0.0.1:{free_port()}"}],
                   "wrong-replay: replay socket tcp://127.0.0.1:",
                   "fix: set replay_endpoint to vLLM's kv-events replay_endpoint"),
        "block size": ([{**right, "name": "wrong-block-size", "hash": {**FLEET_HASH, "block_size": 32}}],
                       f"wrong-block-size: /metrics reports block_size={BLOCK} where [hash].block_size = 32",
                       "fix: start vLLM with --block-size 32"),
        "algorithm": ([{**right, "name": "wrong-algo", "hash": {**FLEET_HASH, "algo": "sha256"}}],
                      'wrong-algo: /metrics reports prefix_caching_hash_algo=sha256_cbor where [hash].algo = "sha256"',
                      "fix: start vLLM with --prefix-caching-hash-algo sha256"),
    }
    for what, (entries, problem, fix) in wrong.items():
        rc, lines = doctor(tmp_path, f"wrong-{what.replace(' ', '-')}", entries, admin)
        report = "\n".join(lines)
        assert rc != 0, f"{what}: {report}"
        hits = [nxt for line, nxt in failures(lines) if problem in line]
        assert len(hits) == 1 and hits[0].startswith(fix), f"{what}: {problem!r} / {fix!r} not in\n{report}"
