"""`llmgw-agent launch -- CMD`: the agent starts a replica process with the matching vLLM flags and
PYTHONHASHSEED, mirrors it, restarts it when it dies (its blocks leave at once) and forwards
SIGTERM to it on shutdown. The replica is a stand-in that reads --kv-events-config like vLLM and
publishes vLLM-framed batches to the endpoint it names."""

import json
import os
import signal
import sys
import time

from llmgw_testkit import free_port

FAKE_VLLM = r'''
import json, os, signal, sys, time
import msgpack, zmq

args = sys.argv[1:]
kv = json.loads(args[args.index("--kv-events-config") + 1])
out = os.environ["FAKE_VLLM_OUT"]
with open(out) as f:
    generation = sum(1 for line in f if '"argv"' in line)
with open(out, "a") as f:
    f.write(json.dumps({"argv": args, "seed": os.environ.get("PYTHONHASHSEED"), "pid": os.getpid()}) + "\n")

def on_term(*_):
    with open(out, "a") as f:
        f.write(json.dumps({"terminated": os.getpid()}) + "\n")
    sys.exit(0)

signal.signal(signal.SIGTERM, on_term)
ctx = zmq.Context()
pub = ctx.socket(zmq.XPUB)
# vLLM connects its PUB when the endpoint has no "*" or "::".
assert "*" not in kv["endpoint"] and "::" not in kv["endpoint"]
pub.connect(kv["endpoint"])
pub.recv()  # the agent's subscription
for seq in range(3):
    key = 100 * (generation + 1) + seq
    # No token ids: a made-up key, credited unverified (tokens that do not hash to it are rejected).
    ev = {"type": "BlockStored", "block_hashes": [key], "parent_block_hash": None, "token_ids": [],
          "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None}
    pub.send_multipart([kv["topic"].encode(), seq.to_bytes(8, "big"), msgpack.packb([time.time(), [ev], 0])])
while True:
    time.sleep(0.1)
'''


def records(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_agent_launch_sets_flags_restarts_and_forwards_sigterm(start_agent, tmp_path):
    fake = tmp_path / "fake_vllm.py"
    fake.write_text(FAKE_VLLM)
    out = tmp_path / "fake_vllm.jsonl"
    out.write_text("")
    port = free_port()
    agent = start_agent([
        {"name": "local", "address": "127.0.0.1:18000", "models": ["m"], "mode": "bind",
         "endpoint": f"tcp://127.0.0.1:{port}", "topic": "kv-events"}],
        launch=["--stop-timeout-secs", "10", "--", sys.executable, fake, "serve", "m"],
        env=dict(os.environ, FAKE_VLLM_OUT=str(out)))

    r = agent.wait_for("local", lambda r: r["block_keys"] == [100, 101, 102], "first generation")
    first = records(out)[0]
    argv = first["argv"]
    assert argv[:2] == ["serve", "m"]
    assert argv[argv.index("--prefix-caching-hash-algo") + 1] == "sha256_cbor"
    assert "--enable-prefix-caching" in argv
    kv = json.loads(argv[argv.index("--kv-events-config") + 1])
    assert kv["endpoint"] == f"tcp://127.0.0.1:{port}" and kv["topic"] == "kv-events"
    assert kv["enable_kv_cache_events"] is True
    assert first["seed"] == "0"

    # The replica dies: its blocks leave, it is restarted, the new engine's blocks come in.
    os.kill(first["pid"], signal.SIGKILL)
    r = agent.wait_for("local", lambda r: r["block_keys"] == [200, 201, 202], "second generation", timeout=30)
    assert r["resets"].get("engine_exited") == 1
    second = [x for x in records(out) if "argv" in x][1]

    # SIGTERM to the agent alone is forwarded to the replica, and both exit.
    os.kill(agent.proc.pid, signal.SIGTERM)
    assert agent.proc.wait(timeout=30) == 0
    deadline = time.monotonic() + 10
    while {"terminated": second["pid"]} not in records(out):
        assert time.monotonic() < deadline, records(out)
        time.sleep(0.05)
