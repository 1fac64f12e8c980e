"""llmgw-sim behaves like vLLM where routing can see it: /tokenize agrees with the engine,
KV events in vLLM's wire format carry the block hashes llmgw computes, prefix hits, replay,
restart, metrics."""

import json
import subprocess
import time
import urllib.request

import msgpack
import pytest
import zmq

from llmgw_testkit import free_port, wait_port
from llmgw_testkit import get_text as get
from llmgw_testkit import post_json as post


def recv_batches(sub, want_blocks, timeout=10.0):
    """Receives [topic, seq, payload] messages until `want_blocks` stored keys were seen."""
    got, stored = [], []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and len(stored) < want_blocks:
        if sub.poll(100):
            topic, seq, payload = sub.recv_multipart()
            batch = msgpack.unpackb(payload, raw=False)
            got.append((topic, int.from_bytes(seq, "big"), batch))
            for ev in batch[1]:
                if ev["type"] == "BlockStored":
                    stored.extend(ev["block_hashes"])
    return got, stored


@pytest.fixture
def sim(procs, sim_bin):
    port, kv, replay = free_port(), free_port(), free_port()
    p = procs.start([sim_bin, "--port", port, "--name", "r0", "--model", "m", "--blocks", "64",
                     "--block-size", "16", "--seed", "0", "--kv-endpoint", f"tcp://[::ffff:127.0.0.1]:{kv}",
                     "--replay-endpoint", f"tcp://127.0.0.1:{replay}", "--decode-ms", "1"], "sim")
    wait_port(port)
    return {"url": f"http://127.0.0.1:{port}", "kv": kv, "replay": replay, "proc": p}


def test_events_hashes_hits_replay_restart(sim, agent_bin):
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
    sub.connect(f"tcp://127.0.0.1:{sim['kv']}")
    url = sim["url"]
    # PUB/SUB drops messages sent before the subscription is live: send first requests (a new
    # prompt each time, so each stores new blocks) until their events arrive.
    deadline = time.monotonic() + 30
    stored, attempt = [], 0
    while not stored and time.monotonic() < deadline:
        prompt = f"attempt{attempt} " + " ".join(f"word{i}" for i in range(69))  # 71 tokens with BOS: 4 full blocks
        toks = post(f"{url}/tokenize", {"model": "m", "prompt": prompt})["tokens"]
        assert len(toks) == 71
        post(f"{url}/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": 2})
        _, stored = recv_batches(sub, 4, timeout=2.0)
        attempt += 1
    expected = json.loads(subprocess.run([agent_bin, "hash", "--algo", "sha256_cbor", "--seed", "0", "--block-size", "16"],
                                         input=json.dumps(toks).encode(), capture_output=True, check=True).stdout)
    assert stored[:4] == [b["u64"] for b in expected["blocks"]]
    # The same prompt again hits the 4 cached blocks.
    r = post(f"{url}/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": 2})
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
    # Replay over DEALER returns every buffered batch, then the end marker.
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{sim['replay']}")

    def replay_seqs():
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        seqs = []
        while True:
            assert dealer.poll(5000)
            frames = dealer.recv_multipart()
            if frames[1] == b"" and frames[2] == b"\xff" * 8:
                return seqs
            seqs.append(int.from_bytes(frames[2], "big"))

    seqs = replay_seqs()
    assert seqs == list(range(len(seqs))) and len(seqs) >= 1
    metrics = get(f"{url}/metrics")
    assert 'vllm:prefix_cache_hits_total{model_name="m"} 64' in metrics
    assert "vllm:num_requests_running" in metrics and "vllm:kv_cache_usage_perc" in metrics
    sources = json.loads(get(f"{url}/kv_event_sources"))
    assert sources["0"]["topic"] == "kv-events"
    # A restart empties the cache and a new publisher starts again at sequence 0.
    post(f"{url}/sim/restart", {})
    r = post(f"{url}/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": 2})
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # The publisher runs on its own thread: poll the replay buffer until the batch is in.
    deadline = time.monotonic() + 10
    after = replay_seqs()
    while not after and time.monotonic() < deadline:
        after = replay_seqs()
    assert after == list(range(len(after))) and len(after) >= 1
    sub.close(0)
    dealer.close(0)


def test_chat_tokenize_matches_render_and_streams(sim):
    url = sim["url"]
    body = {"model": "m", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]}
    t = post(f"{url}/tokenize", body)["tokens"]
    r = post(f"{url}/v1/chat/completions/render", body)["token_ids"]
    assert t == r and t[0] == 1
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps({**body, "stream": True, "max_tokens": 3}).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=20) as resp:
        lines = [l for l in resp.read().decode().split("\n") if l.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and len(lines) == 4
    # Unknown model → 404 like vLLM.
    with pytest.raises(urllib.error.HTTPError) as e:
        post(f"{url}/tokenize", {"model": "other", "prompt": "x"})
    assert e.value.code == 404


def test_a_first_token_stall_is_injected_and_cleared(sim):
    """`POST /sim/fault {"first_token_delay_ms": N}` stalls every request started after it by N
    ms before its prefill (the slow-spell benchmark's replica); 0 clears it; a value that is not
    a count of ms up to 600,000 is refused with its reason."""
    url = sim["url"]

    def first_token_s() -> float:
        t0 = time.monotonic()
        req = urllib.request.Request(f"{url}/v1/completions", method="POST", headers={"content-type": "application/json"},
                                     data=json.dumps({"model": "m", "prompt": "a b c", "max_tokens": 2,
                                                      "stream": True}).encode())
        with urllib.request.urlopen(req, timeout=10) as r:
            while not r.readline().startswith(b"data: "):
                pass
        return time.monotonic() - t0

    assert first_token_s() < 0.3
    post(f"{url}/sim/fault", {"first_token_delay_ms": 400})
    assert first_token_s() >= 0.4
    post(f"{url}/sim/fault", {"first_token_delay_ms": 0})
    assert first_token_s() < 0.3
    for bad in (-1, "400", 600_001):
        req = urllib.request.Request(f"{url}/sim/fault", method="POST", headers={"content-type": "application/json"},
                                     data=json.dumps({"first_token_delay_ms": bad}).encode())
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=5)
        assert e.value.code == 400 and b"first_token_delay_ms" in e.value.read()
