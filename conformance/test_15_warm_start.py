"""A gateway started after real `vllm serve` 0.33.0 replicas' replay buffers rolled past the
prefixes they cache: each replica runs the `llmgw-agent publish --snapshot-listen` sidecar beside
it from its start, long prefixes are warmed directly on the replicas, other traffic rolls vLLM's
replay buffer (`buffer_steps` 8) past every batch that stored them (checked on the replay socket),
then an agent (joining from the sidecars' snapshots) and Envoy with llmgw.wasm start: the agent's
mirrors hold the warmed prefixes and are complete, and every follow-up is decided `exact` for the
replica holding its prefix and served there from cache from the first request on.

The replicas are this module's own (two, vLLM binding its publisher so that the sidecar and later
the agent both subscribe), not the session fleet's."""

from __future__ import annotations

import json
import random
import subprocess
from concurrent.futures import ThreadPoolExecutor

import msgpack
import pytest
import zmq

import llmgw_testkit as kit
from conftest import (AGENT, BLOCK, ENVOY, MODEL, Agent, Envoy, Replica, agent_toml, decision, envoy_yaml, wait_healthy,
                      wait_until, words)
from llmgw_testkit import free_port, http_json, request, toml, wait_port

BUFFER_STEPS = 8
FLEET_HASH = {"algo": "sha256_cbor", "seed": "0", "block_size": BLOCK}
END_SEQ = b"\xff" * 8


class SmallBufferReplica(Replica):
    """A replica whose KV-events publisher keeps only BUFFER_STEPS batches for replay."""

    def serve_args(self, with_events: bool = True) -> list[str]:
        args = super().serve_args(with_events)
        i = args.index("--kv-events-config")
        cfg = json.loads(args[i + 1])
        cfg["buffer_steps"] = BUFFER_STEPS
        return args[:i + 1] + [json.dumps(cfg)] + args[i + 2:]


def replay_batches(r: Replica) -> list[tuple[int, bytes]]:
    """(sequence, payload) of every batch r's replay buffer holds, asked from 0 over DEALER
    (vLLM answers `"", topic, seq, payload` per batch, then `"", "", -1, ""`)."""
    d = zmq.Context.instance().socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(f"tcp://127.0.0.1:{r.replay}")
    try:
        d.send_multipart([b"", (0).to_bytes(8, "big")])
        out = []
        while True:
            assert d.poll(5000), f"no replay answer from {r.name}"
            frames = d.recv_multipart()
            if frames[2] == END_SEQ:
                return out
            out.append((int.from_bytes(frames[2], "big"), frames[3]))
    finally:
        d.close()


def block_hashes(r: Replica, prompt: str) -> list[dict]:
    """The blocks (`hash_hex`, `u64`) vLLM stores for `prompt` (its /tokenize, `llmgw-agent hash`)."""
    status, _, tok = http_json(f"{r.url}/tokenize", {"model": MODEL, "prompt": prompt})
    assert status == 200, tok
    out = subprocess.run([str(AGENT), "hash", "--algo", "sha256_cbor", "--block-size", str(BLOCK), "--seed", "0"],
                         input=json.dumps(tok["tokens"]), capture_output=True, text=True, check=True, timeout=30)
    return json.loads(out.stdout)["blocks"]


def stored_keys(payload: bytes) -> set[int]:
    """The block keys a replayed batch stores: vLLM's BlockStored events (maps tagged by `type`)
    carry each hash as an int (its low 64 bits, vLLM's default) or as its bytes."""
    _ts, events, *_ = msgpack.unpackb(payload, raw=False)
    out = set()
    for ev in events:
        if ev.get("type") == "BlockStored":
            for h in ev["block_hashes"]:
                out.add(h & (2**64 - 1) if isinstance(h, int) else int.from_bytes(h[-8:], "big"))
    return out


def batches_storing(r: Replica, keys: set[int]) -> list[int]:
    """The sequence numbers of the batches in r's replay buffer that store any of `keys`."""
    return [seq for seq, payload in replay_batches(r) if stored_keys(payload) & keys]


def snapshot_head(port: int) -> tuple[int, dict]:
    status, headers, _ = request("GET", f"http://127.0.0.1:{port}/snapshot?dp_rank=0", timeout=5)
    return status, {k.lower(): v for k, v in headers.items()}


def completion(r: Replica, prompt: str) -> dict:
    status, _, reply = http_json(f"{r.url}/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2},
                                 timeout=60)
    assert status == 200, reply
    return reply


@pytest.fixture(scope="module")
def warm_pool(procs, logdir):
    """Two replicas with small replay buffers, each with its snapshot sidecar started before any
    traffic; stopped after this module's tests."""
    reps = [SmallBufferReplica("ws-p", "connect", blocks=1024), SmallBufferReplica("ws-q", "connect", blocks=1024)]
    started = []
    try:
        for r in reps:
            r.proc = procs.start(r.serve_args(), f"vllm-{r.name}", env=r.serve_env(AGENT))
            started.append(r.proc)
        with ThreadPoolExecutor(len(reps)) as ex:
            list(ex.map(lambda r: wait_healthy(r, r.proc), reps))
        for r in reps:
            r.snap = free_port()
            cfg = logdir / f"sidecar-{r.name}.toml"
            cfg.write_text(toml({"hash": FLEET_HASH, "replicas": [r.agent_entry()]}))
            started.append(procs.start([AGENT, "publish", "--config", cfg, "--snapshot-listen",
                                        f"127.0.0.1:{r.snap}", "--log-level", "info"], f"sidecar-{r.name}"))
            wait_port(r.snap)
        yield reps
    finally:
        for p in reversed(started):
            procs.stop(p)


def test_a_gateway_started_after_the_replay_buffers_rolled_routes_every_follow_up_to_its_holder(
        procs, logdir, warm_pool):
    rng = random.Random("warm-start")
    # PUB/SUB drops what is published before a subscription is live: traffic until each sidecar
    # serves a snapshot (its first batches are still replayable, so it is exact from batch 0).
    for r in warm_pool:
        n = [0]

        def sidecar_heard(r=r, n=n):
            completion(r, words(rng, 20, f"wp{r.name[-1]}{n[0]}"))
            n[0] += 1
            return snapshot_head(r.snap)[0] == 200
        wait_until(sidecar_heard, 30, f"the sidecar of {r.name} to serve a snapshot", interval=0.2)

    # Two long prefixes warmed directly on each replica; the replay buffer holds the batches
    # that stored them (so that their absence later means the buffer rolled past them).
    holder: dict[str, tuple[SmallBufferReplica, list[dict]]] = {}
    for r in warm_pool:
        mine = set()
        for i in range(2):
            prompt = words(rng, 40, f"ws{r.name[-1]}{i}")
            completion(r, prompt)
            blocks = block_hashes(r, prompt)
            assert len(blocks) >= 4, blocks
            holder[prompt] = (r, blocks)
            mine |= {b["u64"] for b in blocks}
        wait_until(lambda r=r, mine=mine: batches_storing(r, mine), 10,
                   f"{r.name}'s replay buffer to hold the batches storing the warmed prefixes")
        # Other traffic until no batch the replay buffer holds stored any warmed block.
        n = [0]

        def rolled(r=r, mine=mine, n=n):
            completion(r, words(rng, 20, f"wr{r.name[-1]}{n[0]}"))
            n[0] += 1
            return not batches_storing(r, mine)
        wait_until(rolled, 60, f"{r.name}'s replay buffer to roll past the warmed prefixes", interval=0)
        held = [seq for seq, _ in replay_batches(r)]
        assert len(held) == BUFFER_STEPS and held[0] > 0, held
        # The sidecar heard every batch up to the last one published, and its snapshot is whole.
        wait_until(lambda r=r: snapshot_head(r.snap)[1].get("x-llmgw-snapshot-seq")
                   == str(replay_batches(r)[-1][0]), 10, f"the sidecar of {r.name} to catch up")
        status, headers = snapshot_head(r.snap)
        assert status == 200 and "x-llmgw-snapshot-incomplete-from" not in headers, headers

    # Now the gateway: an agent that joins from the sidecars' snapshots, and Envoy.
    feed, http = free_port(), free_port()
    entries = [{**r.agent_entry(), "snapshot_url": f"http://127.0.0.1:{r.snap}"} for r in warm_pool]
    (logdir / "warm-agent.toml").write_text(agent_toml([], feed, http, entries))
    agent_proc = procs.start([AGENT, "run", "--config", logdir / "warm-agent.toml", "--log-level", "info"],
                             "warm-agent")
    envoy_proc = None
    try:
        agent = Agent(http)
        agent.log_path = agent_proc.log_path
        wait_until(lambda: http_json(f"{agent.base}/healthz", timeout=2)[0] in (200, 503), 30, "the agent's HTTP")
        for r in warm_pool:
            agent.wait_up(r.name)
            want = {b["u64"] for p, (h, blocks) in holder.items() if h is r for b in blocks}
            # No new traffic: what the agent holds of the warmed prefixes came from the snapshot.
            st = wait_until(lambda r=r, want=want: (s := agent.replica(r.name)) and set(s["block_keys"]) >= want and s,
                            15, f"the agent to mirror {r.name}'s warmed prefixes")
            assert st["snapshot"]["joins"] == 1 and st["incomplete_from"] is None, st
            assert st["resets"] == {} and st["incomplete_starts"] == 0, st
        m = agent.metrics()
        for r in warm_pool:
            assert f'llmgw_agent_engine_incomplete{{replica="{r.name}",dp_rank="0"}} 0' in m
            assert f'llmgw_agent_snapshot_joins_total{{replica="{r.name}",dp_rank="0"}} 1' in m

        listen, admin = free_port(), free_port()
        (logdir / "warm-envoy.yaml").write_text(envoy_yaml(listen, admin, feed))
        envoy_proc = kit.start_envoy(procs, ENVOY, logdir / "warm-envoy.yaml", "warm-envoy")
        envoy = Envoy(listen, admin)
        envoy.wait_ready(60, proc=envoy_proc)
        envoy.wait_feed(60)
        total = sum(s["blocks"] for s in agent.replicas() if s["up"])
        wait_until(lambda: (v := envoy.index_blocks()) and all(x == total for x in v), 30,
                   "every filter VM to hold the agent's index")

        # Every follow-up, from the first: decided exact for the holder, and a cache hit there
        # for every block of its prefix (vLLM's own count).
        for prompt, (r, blocks) in holder.items():
            status, headers, reply = envoy.post("/v1/completions", {"model": MODEL, "max_tokens": 2,
                                                                    "prompt": prompt + " " + words(rng, 10, "wf")})
            assert status == 200, reply
            explain = headers.get(kit.DECISION_HEADER)
            outcome, addr, matched, _ = decision(headers)
            assert (outcome, addr) == ("exact", r.address), f"{prompt[:12]}... held by {r.name}: {explain}"
            assert matched == len(blocks), explain
            assert "incomplete=" not in explain, explain
            cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached == BLOCK * len(blocks), (r.name, reply["usage"], explain)
    finally:
        if envoy_proc is not None:
            procs.stop(envoy_proc)
        procs.stop(agent_proc)
