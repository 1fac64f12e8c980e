"""llmgw-agent against real libzmq peers (pyzmq), on loopback: both socket modes, real vLLM 0.33.0
payloads in both encodings, gap repair by replay, unrepairable gaps, restarts, clears, malformed
payloads and hash parity. Results are read from the agent's /debug/replicas and /metrics."""

import re

import pytest

from agent_support import Model, Publisher, capture, cleared, removed, stored
from llmgw_testkit import free_port, wait_until


def seq_is(n):
    return lambda r: r["last_seq"] == n


@pytest.fixture
def bound_pub():
    """A publisher bound on a free loopback port (as vLLM binds for `tcp://*:PORT`), closed
    after the test."""
    port = free_port()
    pub = Publisher(f"tcp://127.0.0.1:{port}", bind=True)
    pub.endpoint = f"tcp://127.0.0.1:{port}"
    yield pub
    pub.close()


def replica_of(pub, name="r0"):
    return [{"name": name, "address": "127.0.0.1:18000", "endpoint": pub.endpoint}]


@pytest.mark.parametrize("encoding", ["batches_native_seed0.jsonl", "batches_legacy_seed0.jsonl"])
def test_agent_bind_mode_real_capture_gives_exact_blocks_then_clear(start_agent, encoding):
    port = free_port()
    agent = start_agent([
        {"name": "r0", "address": "127.0.0.1:18000", "models": ["m"], "mode": "bind",
         "endpoint": f"tcp://127.0.0.1:{port}"}])
    # vLLM given a concrete address connects its PUB to the agent.
    pub = Publisher(f"tcp://127.0.0.1:{port}", bind=False)
    try:
        pub.wait_subscribed()
        batches = capture(encoding)
        model = Model()
        for seq, payload, events in batches[:-1]:
            pub.send(seq, payload)
            model.apply(events)
        last = batches[-2][0]
        r = agent.wait_for("r0", seq_is(last), f"seq {last}")
        assert r["block_keys"] == model.keys()
        assert r["blocks"] == len(model.keys()) > 0
        assert r["up"] and r["connected"]
        assert r["gaps"] == 0 and r["resets"] == {}
        # PYTHONHASHSEED=0 + sha256_cbor, as the capture: every verifiable block matches.
        assert r["parity"]["matched"] > 0 and r["parity"]["mismatched"] == 0
        # The capture's last batch is AllBlocksCleared.
        seq, payload, _ = batches[-1]
        pub.send(seq, payload)
        r = agent.wait_for("r0", seq_is(seq), "clear")
        assert r["blocks"] == 0 and r["clears"] == 1
        m = agent.metrics()
        assert 'llmgw_agent_blocks{replica="r0",dp_rank="0"} 0' in m
        assert f'llmgw_agent_events_received_total{{replica="r0",dp_rank="0"}} {len(batches)}' in m
        assert 'llmgw_agent_parity_mismatched_total{replica="r0",dp_rank="0"} 0' in m
    finally:
        pub.close()


def test_agent_connect_mode_publisher_binds_loopback(start_agent):
    port = free_port()
    # vLLM started with tcp://[::ffff:127.0.0.1]:PORT binds 127.0.0.1 only; the agent connects.
    pub = Publisher(f"tcp://127.0.0.1:{port}", bind=True, topic=b"kv-events")
    try:
        agent = start_agent([
            {"name": "r0", "address": "127.0.0.1:18000", "mode": "connect", "topic": "kv-events",
             "endpoint": f"tcp://[::ffff:127.0.0.1]:{port}"}])
        pub.wait_subscribed()
        model = Model()
        for seq, payload, events in capture()[:-1]:
            pub.send(seq, payload)
            model.apply(events)
        r = agent.wait_for("r0", seq_is(15), "seq 15")
        assert r["block_keys"] == model.keys()
        assert r["mode"] == "connect" and r["connected"]
    finally:
        pub.close()


@pytest.mark.parametrize("legacy_replay", [False, True], ids=["replay-0.29+", "replay-pre-0.29"])
def test_agent_gap_is_repaired_by_replay_to_the_exact_state(start_agent, legacy_replay):
    port, rport = free_port(), free_port()
    pub = Publisher(f"tcp://127.0.0.1:{port}", bind=True, replay_endpoint=f"tcp://127.0.0.1:{rport}",
                    legacy_replay=legacy_replay)
    try:
        agent = start_agent([
            {"name": "r0", "address": "127.0.0.1:18000", "endpoint": f"tcp://127.0.0.1:{port}",
             "replay_endpoint": f"tcp://127.0.0.1:{rport}"}])
        pub.wait_subscribed()
        model = Model()
        for seq, payload, events in capture()[:-1]:
            # Batches 5..8 never reach the agent live; the replay buffer has them.
            pub.send(seq, payload, live=not 5 <= seq <= 8)
            model.apply(events)
        r = agent.wait_for("r0", seq_is(15), "seq 15")
        assert r["block_keys"] == model.keys()
        assert r["gaps"] == 1
        assert r["replays"] == {"complete": 1, "incomplete": 0, "batches": 4}
        assert r["resets"] == {}
        assert pub.replay_requests == [5]
        assert 'llmgw_agent_replays_total{replica="r0",dp_rank="0",result="complete"} 1' in agent.metrics()
    finally:
        pub.close()


def test_agent_gap_without_replay_resets_and_counts(start_agent, bound_pub):
    pub = bound_pub
    agent = start_agent(replica_of(pub))
    pub.wait_subscribed()
    for s in range(5):
        pub.send(s, stored([100 + s]))
    agent.wait_for("r0", lambda r: r["blocks"] == 5, "5 blocks")
    after = Model()
    pub.send(8, stored([200, 201]))  # 5..7 lost, no replay socket
    after.apply([{"type": "BlockStored", "block_hashes": [200, 201]}])
    pub.send(9, removed([100, 200]))  # 100 was dropped by the reset: nothing to remove
    after.apply([{"type": "BlockRemoved", "block_hashes": [100, 200]}])
    r = agent.wait_for("r0", seq_is(9), "seq 9")
    assert r["gaps"] == 1
    assert r["resets"] == {"gap_unrepaired": 1}
    assert r["block_keys"] == after.keys() == [201]
    m = agent.metrics()
    assert 'llmgw_agent_gaps_total{replica="r0",dp_rank="0"} 1' in m
    assert 'llmgw_agent_resets_total{replica="r0",dp_rank="0",reason="gap_unrepaired"} 1' in m


def test_agent_sequence_regression_resets(start_agent, bound_pub):
    pub = bound_pub
    agent = start_agent(replica_of(pub))
    pub.wait_subscribed()
    for s in range(6):
        pub.send(s, stored([10 + s]))
    agent.wait_for("r0", seq_is(5), "seq 5")
    # The engine restarted behind the same endpoint: numbering starts over.
    pub.send(0, stored([77]))
    r = agent.wait_for("r0", lambda r: r["resets"].get("restart") == 1 and r["last_seq"] == 0, "restart")
    assert r["block_keys"] == [77]
    assert r["gaps"] == 0


def test_agent_publisher_restart_in_bind_mode_starts_clean(start_agent):
    port = free_port()
    agent = start_agent([
        {"name": "r0", "address": "127.0.0.1:18000", "mode": "bind", "endpoint": f"tcp://127.0.0.1:{port}"}])
    pub = Publisher(f"tcp://127.0.0.1:{port}", bind=False)
    try:
        pub.wait_subscribed()
        for s in range(10):
            pub.send(s, stored([1000 + s]))
        agent.wait_for("r0", lambda r: r["blocks"] == 10, "10 blocks")
    finally:
        pub.close()
    # The old engine is gone; the agent sees the disconnect.
    agent.wait_for("r0", lambda r: not r["connected"] and r["disconnects"] >= 1, "disconnect")
    pub = Publisher(f"tcp://127.0.0.1:{port}", bind=False)
    try:
        pub.wait_subscribed()
        pub.send(0, stored([5]))
        pub.send(1, stored([6]))
        r = agent.wait_for("r0", lambda r: r["last_seq"] == 1 and r["connected"], "new engine")
        assert r["block_keys"] == [5, 6]
        assert sum(r["resets"].values()) == 1, r["resets"]
        assert set(r["resets"]) <= {"restart", "reconnect"}
    finally:
        pub.close()


def test_agent_late_start_catches_up_through_replay(start_agent):
    port, rport = free_port(), free_port()
    pub = Publisher(f"tcp://127.0.0.1:{port}", bind=True, replay_endpoint=f"tcp://127.0.0.1:{rport}")
    try:
        model = Model()
        batches = capture()[:-1]
        # Published before the agent existed: PUB/SUB drops them, the replay buffer keeps them.
        for seq, payload, events in batches[:10]:
            pub.send(seq, payload)
            model.apply(events)
        agent = start_agent([
            {"name": "r0", "address": "127.0.0.1:18000", "endpoint": f"tcp://127.0.0.1:{port}",
             "replay_endpoint": f"tcp://127.0.0.1:{rport}"}])
        pub.wait_subscribed()
        for seq, payload, events in batches[10:]:
            pub.send(seq, payload)
            model.apply(events)
        r = agent.wait_for("r0", seq_is(15), "seq 15")
        assert r["block_keys"] == model.keys()
        assert r["replays"]["complete"] == 1 and r["resets"] == {}
        assert pub.replay_requests == [0]
    finally:
        pub.close()


def test_agent_malformed_payload_is_counted_and_skipped(start_agent, bound_pub):
    pub = bound_pub
    agent = start_agent(replica_of(pub))
    pub.wait_subscribed()
    pub.send(0, stored([1, 2]))
    pub.send(1, b"\xc1\xff\x00not msgpack")
    pub.send(2, stored([3]))
    # A frame with a bad sequence number.
    pub.pub.send_multipart([b"", b"\x01\x02", stored([4])])
    pub.send(3, cleared())
    pub.send(4, stored([9]))
    r = agent.wait_for("r0", seq_is(4), "seq 4")
    assert r["block_keys"] == [9]
    assert r["skipped"] == {"malformed": 1, "bad_seq": 1}
    assert r["gaps"] == 0 and r["resets"] == {}
    assert agent.proc.poll() is None
    assert re.search(r'llmgw_agent_events_skipped_total\{replica="r0",dp_rank="0",reason="malformed"\} 1', agent.metrics())


def test_agent_parity_mismatch_is_reported_with_cause(start_agent, bound_pub):
    pub = bound_pub
    # The capture was produced with PYTHONHASHSEED=0; the agent expects seed 1.
    agent = start_agent(replica_of(pub, "wrong-seed"),
                        hash={"algo": "sha256_cbor", "seed": "1"})
    pub.wait_subscribed()
    for seq, payload, _ in capture()[:-1]:
        pub.send(seq, payload)
    r = agent.wait_for("wrong-seed", seq_is(15), "seq 15")
    assert r["parity"]["mismatched"] > 0 and r["parity"]["matched"] == 0
    assert r["parity"]["match_ratio"] == 0
    # The warning names the replica and the likely cause.
    import time
    deadline = time.monotonic() + 10
    while "PYTHONHASHSEED" not in agent.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    line = next(l for l in agent.log().splitlines() if "PYTHONHASHSEED" in l)
    assert "wrong-seed" in line and "hash-algo" in line


def test_agent_connect_mode_restart_whose_seq_passed_the_old_one_is_rebuilt_by_replay(start_agent):
    port, rport = free_port(), free_port()
    ep, rep = f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}"
    pub = Publisher(ep, bind=True, replay_endpoint=rep)
    try:
        # Without the replay check on reconnect (the default), the reconnect itself resets.
        agent = start_agent([
            {"name": "r0", "address": "127.0.0.1:18000", "endpoint": ep, "replay_endpoint": rep}],
            zmq={"verify_on_reconnect": False})
        pub.wait_subscribed()
        for s in range(5):
            pub.send(s, stored([1000 + s]))
        agent.wait_for("r0", lambda r: r["blocks"] == 5, "5 blocks")
    finally:
        pub.close()
    agent.wait_for("r0", lambda r: r["disconnects"] >= 1, "disconnect")
    # The engine came back and published 20 batches while the agent was reconnecting: its
    # numbering already passed the old engine's, so only the reconnect tells a restart.
    pub = Publisher(ep, bind=True, replay_endpoint=rep)
    try:
        for s in range(20):
            pub.send(s, stored([2000 + s]), live=False)
        pub.wait_subscribed()
        pub.send(20, stored([3000]))
        r = agent.wait_for("r0", seq_is(20), "seq 20")
        assert r["resets"] == {"reconnect": 1}
        assert r["block_keys"] == [2000 + s for s in range(20)] + [3000]
        assert r["replays"]["complete"] == 1 and pub.replay_requests == [0]
        assert r["gaps"] == 0
    finally:
        pub.close()


def test_agent_replica_without_publisher_goes_down_and_comes_back_clean(start_agent):
    port = free_port()
    agent = start_agent([
        {"name": "r0", "address": "127.0.0.1:18000", "mode": "bind", "endpoint": f"tcp://127.0.0.1:{port}"}],
        zmq={"down_after_disconnect_ms": 500})
    pub = Publisher(f"tcp://127.0.0.1:{port}", bind=False)
    try:
        pub.wait_subscribed()
        pub.send(0, stored([1, 2]))
        r = agent.wait_for("r0", lambda r: r["blocks"] == 2 and r["up"], "2 blocks, up")
        gone_before = r["resets"].get("publisher_gone", 0)
    finally:
        pub.close()
    r = agent.wait_for("r0", lambda r: not r["up"], "down after the publisher left")
    assert r["blocks"] == 0 and r["resets"]["publisher_gone"] == gone_before + 1
    assert not r["publisher_ok"]
    pub = Publisher(f"tcp://127.0.0.1:{port}", bind=False)
    try:
        pub.wait_subscribed()
        pub.send(0, stored([7]))
        r = agent.wait_for("r0", lambda r: r["up"] and r["last_seq"] == 0 and r["blocks"] == 1, "back up")
        assert r["block_keys"] == [7]
    finally:
        pub.close()


def test_agent_verified_reconnect_drops_a_restarted_engine_at_once_and_keeps_the_same_one(start_agent):
    port, rport = free_port(), free_port()
    ep, rep = f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}"
    agent = start_agent([
        {"name": "r0", "address": "127.0.0.1:18000", "mode": "bind", "endpoint": ep, "replay_endpoint": rep}],
        zmq={"verify_on_reconnect": True})
    a = Publisher(ep, bind=False, replay_endpoint=rep)
    try:
        a.wait_subscribed()
        for s in range(5):
            a.send(s, stored([1000 + s]))
        agent.wait_for("r0", lambda r: r["blocks"] == 5, "5 blocks")
    finally:
        a.close()
    agent.wait_for("r0", lambda r: r["disconnects"] == 1, "disconnect")

    # A restarted engine: its replay buffer does not hold batch 4. Its blocks leave before it
    # publishes anything.
    b = Publisher(ep, bind=False, replay_endpoint=rep)
    try:
        b.wait_subscribed()
        r = agent.wait_for("r0", lambda r: r["blocks"] == 0, "restarted engine dropped at once")
        assert r["resets"] == {"restart_on_reconnect": 1}
        assert b.replay_requests[:1] == [4]
        b.send(0, stored([9]))
        agent.wait_for("r0", lambda r: r["block_keys"] == [9] and r["last_seq"] == 0, "new engine's blocks")
        kept = list(b.buffer)
    finally:
        b.close()
    agent.wait_for("r0", lambda r: r["disconnects"] == 2, "second disconnect")

    # The same engine reconnecting (a network blip): its buffer holds the last batch, nothing resets.
    c = Publisher(ep, bind=False, replay_endpoint=rep, buffer=kept)
    try:
        c.wait_subscribed()
        c.send(1, stored([10]))
        r = agent.wait_for("r0", lambda r: r["last_seq"] == 1, "continued")
        assert c.replay_requests[:1] == [0]
        assert r["block_keys"] == [9, 10]
        assert r["resets"] == {"restart_on_reconnect": 1} and r["gaps"] == 0
    finally:
        c.close()


def test_agent_drops_an_event_message_past_the_size_cap(start_agent, bound_pub):
    """A publisher sending a message larger than zmq.max_message_bytes loses its connection
    before the agent allocates or applies it (counted as a publisher disconnect); it reconnects
    and later batches apply."""
    pub = bound_pub
    agent = start_agent(replica_of(pub), zmq={"max_message_bytes": 1 << 20})
    pub.wait_subscribed()
    pub.send(0, stored([1]))
    agent.wait_for("r0", seq_is(0), "seq 0")
    many = range(1 << 40, (1 << 40) + 160_000)  # 9 bytes of msgpack each
    big = stored(many)  # a valid batch of about 1.4 MB
    assert len(big) > 1 << 20
    pub.send(1, big)
    wait_until(lambda: re.search(r'llmgw_agent_publisher_disconnects_total\{replica="r0",dp_rank="0"\} [1-9]',
                                 agent.metrics()), 20, "the oversized message's connection dropped")

    def applied_after_reconnect():
        pub.send(2, stored([3]))
        return 3 in agent.keys("r0")
    wait_until(applied_after_reconnect, 20, "a batch after the reconnect applied", interval=0.2)
    keys = agent.keys("r0")
    assert not keys & set(many), "the oversized batch was applied"
    assert agent.proc.poll() is None
