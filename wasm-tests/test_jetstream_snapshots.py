"""Warm start on the JetStream path: `llmgw-agent publish` beside a simulated replica (its replay
buffer 4 batches, as vLLM's `buffer_steps`) writes the engine's snapshot into the
`[jetstream.snapshots]` object-store bucket, and the stream keeps only an engine's last 4
batches. Prefixes are warmed, then traffic rolls both the replay buffer and the stream past
them. An agent started afterwards joins from the bucket's snapshot and the stream's tail and
holds exactly the simulator's cache; an agent without the bucket has only what the stream
still holds and says the engine is incomplete."""

import json

from llmgw_testkit import free_port, request, toml, wait_port, wait_until
from llmgw_testkit import get_text as get
from llmgw_testkit import post_json as post
from llmgw_testkit.jetstream import start_nats
from test_warm_start import BUFFER_STEPS, prompt, replay_seqs, snapshot_of, start_small_buffer_sim

PER_SUBJECT = 4


def bucket_seq(snap: int) -> int:
    """The batch the sidecar's last snapshot written to the bucket is exact at (-1: none)."""
    _, _, body = request("GET", f"http://127.0.0.1:{snap}/metrics", timeout=5)
    line = next(l for l in body.decode().splitlines() if l.startswith('llmgw_publish_bucket_seq{dp_rank="0"}'))
    return int(line.split()[1])


def test_an_agent_started_after_the_stream_rolled_joins_from_the_bucket(
        procs, tmp_path, sim_bin, agent_bin, start_agent):
    nats_url = start_nats(procs, tmp_path)
    port, kv, replay, snap = free_port(), free_port(), free_port(), free_port()
    start_small_buffer_sim(procs, sim_bin, port, kv, replay)
    url = f"http://127.0.0.1:{port}"
    address = f"127.0.0.1:{port}"
    jetstream = {"url": nats_url, "max_messages_per_subject": PER_SUBJECT, "memory_storage": True}
    snapshots = {"bucket": "llmgw-snapshots", "interval_secs": 1}
    cfg = tmp_path / "sidecar.toml"
    cfg.write_text(toml({
        "hash": {"algo": "sha256_cbor", "seed": "0"},
        "jetstream": {**jetstream, "snapshots": snapshots},
        "replicas": [{"name": "r0", "address": address, "models": ["m"], "mode": "connect",
                      "endpoint": f"tcp://[::ffff:127.0.0.1]:{kv}", "topic": "kv-events",
                      "replay_endpoint": f"tcp://127.0.0.1:{replay}"}]}))
    procs.start([agent_bin, "publish", "--config", cfg, "--snapshot-listen", f"127.0.0.1:{snap}"], "sidecar")
    wait_port(snap)

    # The sidecar starts with its replica: the first batches it hears are still replayable.
    n = [0]

    def sidecar_heard():
        post(f"{url}/v1/completions", {"model": "m", "prompt": prompt(f"prime-{n[0]}"), "max_tokens": 2})
        n[0] += 1
        return snapshot_of(snap)[0] == 200
    wait_until(sidecar_heard, 20, "the sidecar has a snapshot", interval=0.2)
    for i in range(2):
        post(f"{url}/v1/completions", {"model": "m", "prompt": prompt(f"system-{i}"), "max_tokens": 2})
    warmed_at = replay_seqs(replay)[-1]
    for i in range(3 * BUFFER_STEPS):
        post(f"{url}/v1/completions", {"model": "m", "prompt": prompt(f"roll-{i}"), "max_tokens": 2})
    last = replay_seqs(replay)[-1]
    assert replay_seqs(replay)[0] > warmed_at, "the replay buffer still reaches the warm batches"
    assert last - warmed_at > PER_SUBJECT, "the stream still holds the warm batches"
    wait_until(lambda: snapshot_of(snap)[1].get("x-llmgw-snapshot-seq") == str(last), 10, "the sidecar caught up")
    assert "x-llmgw-snapshot-incomplete-from" not in snapshot_of(snap)[1]
    # The bucket's object is rewritten within its interval once the ledger changed.
    wait_until(lambda: bucket_seq(snap) == last, 15, f"the bucket holds the snapshot at {last}", interval=0.2)
    cache = set(json.loads(get(f"{url}/sim/blocks"))["keys"])

    replica = {"name": "r0", "address": address, "models": ["m"], "events": "jetstream"}
    agent = start_agent([replica], name="joined", jetstream={**jetstream, "snapshots": snapshots})
    r = agent.wait_for("r0", lambda r: set(r["block_keys"]) == cache, "the agent holds the replica's cache")
    assert r["snapshot"]["joins"] == 1 and r["incomplete_from"] is None, r
    assert r["resets"] == {} and r["incomplete_starts"] == 0, r
    m = agent.metrics()
    assert 'llmgw_agent_snapshot_joins_total{replica="r0",dp_rank="0"} 1' in m
    assert 'llmgw_agent_engine_incomplete{replica="r0",dp_rank="0"} 0' in m

    # The stream's tail goes on from the snapshot: a new prefix arrives, and nothing is lost.
    post(f"{url}/v1/completions", {"model": "m", "prompt": prompt("after-join"), "max_tokens": 2})
    now = replay_seqs(replay)[-1]
    cache = set(json.loads(get(f"{url}/sim/blocks"))["keys"])
    r = agent.wait_for("r0", lambda r: r["last_seq"] == now, f"seq {now}")
    assert set(r["block_keys"]) == cache and r["resets"] == {}, r

    # Without the bucket the same agent has only what the stream still holds, and says so.
    plain = start_agent([replica], name="plain", jetstream=jetstream)
    r = plain.wait_for("r0", lambda r: r["last_seq"] == now, f"seq {now}")
    assert r["snapshot"]["joins"] == 0 and r["incomplete_from"] is not None, r
    assert not cache <= set(r["block_keys"]), "the stream's tail alone held the whole cache"
