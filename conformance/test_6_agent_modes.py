"""Issue 6, item 6: both ways of wiring the agent to vLLM's publisher work with the real vLLM
(A: the agent binds, vLLM connects; B: vLLM binds tcp://[::ffff:127.0.0.1]:PORT on loopback and
the agent connects), and a gap in the live stream is repaired through vLLM's real replay socket;
the agent reads each replica's load from the series it asks for by name."""

import random
import threading

import pytest
import zmq

from conftest import Agent, agent_hash, agent_toml, free_port, wait_until, words


def test_the_agent_reads_the_replicas_load_by_name(fleet):
    """The agent asks the real vLLM's `/metrics` for the series it reads by name (vLLM renders
    the whole 48 KB page for about ten times the API server's CPU): every replica's load comes
    from those pages, and no replica's page had to be read whole."""
    for name in fleet.replicas:
        wait_until(lambda: fleet.agent.replica(name)["load"] is not None, 30, f"a load read from {name}")
    log = open(fleet.agent_proc.log_path, encoding="utf-8", errors="replace").read()
    by_name = [line for line in log.splitlines() if "by name" in line]
    assert not [line for line in by_name if "does not serve" in line], by_name
    for name in fleet.replicas:
        assert any("reading the load by name" in line and f"replica={name}#" in line for line in by_name), (name, by_name)


@pytest.mark.parametrize("name", ["a", "b"])
def test_both_agent_modes_mirror_and_route(fleet, name):
    r = fleet.replicas[name]
    rng = random.Random(f"mode-{name}")
    prompt = words(rng, 40, f"m{name}")
    fleet.completion(r, prompt, max_tokens=2)
    keys = agent_hash(fleet.tokenize(r, {"prompt": prompt}))
    state = fleet.agent.replica(name)
    assert state["mode"] == ("bind" if name == "a" else "connect")
    fleet.wait_mirrored(r, keys)
    headers, reply = fleet.completion(None, prompt + " " + words(rng, 10, f"n{name}"), max_tokens=2)
    outcome, served, matched, cached = fleet.routed(headers, reply)
    assert (outcome, served.name) == ("exact", name), headers.get("x-llmgw-decision")
    assert matched == len(keys)


class DroppingForwarder:
    """Forwards vLLM's live KV-event frames to a second agent, dropping every batch while armed."""

    def __init__(self, upstream: str, port: int):
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.connect(upstream)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind(f"tcp://127.0.0.1:{port}")
        self.armed = threading.Event()
        self.stop = threading.Event()
        self.forwarded: list[int] = []
        self.dropped: list[int] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop.is_set():
            if not self.sub.poll(50):
                continue
            frames = self.sub.recv_multipart()
            seq = int.from_bytes(frames[1], "big")
            if self.armed.is_set():
                self.dropped.append(seq)
            else:
                self.forwarded.append(seq)
                self.pub.send_multipart(frames)

    def close(self):
        self.stop.set()
        self.thread.join(5)
        self.sub.close(0)
        self.pub.close(0)
        self.ctx.term()


def test_gap_repaired_through_vllms_replay_socket(fleet, procs, logdir):
    b = fleet.replicas["b"]
    rng = random.Random("gap")
    fwd_port, feed, http = free_port(), free_port(), free_port()
    fwd = DroppingForwarder(f"tcp://127.0.0.1:{b.kv}", fwd_port)
    try:
        text = agent_toml([], feed, http, [
            {"name": "b", "address": b.address, "models": ["tiny"], "endpoint": f"tcp://127.0.0.1:{fwd_port}",
             "mode": "connect", "replay_endpoint": f"tcp://127.0.0.1:{b.replay}", "topic": "kv-events"}])
        (logdir / "agent-gap.toml").write_text(text)
        p = procs.start([fleet.agent_proc.args[0], "run", "--config", logdir / "agent-gap.toml"], "agent-gap")
        agent2 = Agent(http)
        wait_until(lambda: agent2.replica("b")["connected"], 60, "the second agent to connect")

        def served_and_keys(tag):
            prompt = words(rng, 30, tag)
            fleet.completion(b, prompt, max_tokens=2)
            return set(agent_hash(fleet.tokenize(b, {"prompt": prompt})))

        first = served_and_keys("g1")
        wait_until(lambda: agent2.keys("b") >= first, 30, "the second agent to mirror the first prompt")
        fwd.armed.set()
        lost = served_and_keys("g2")
        wait_until(lambda: fleet.agent.keys("b") >= lost, 30, "the main agent to mirror the second prompt")
        fwd.armed.clear()
        assert fwd.dropped, "no batch was dropped"
        assert not (agent2.keys("b") & lost)
        third = served_and_keys("g3")
        # The next live batch shows the gap; the agent fetches the dropped batches from vLLM's
        # replay ROUTER and applies them.
        held = wait_until(lambda: (k := agent2.keys("b")) >= (lost | third) and k, 30,
                          "the second agent to repair the gap through replay")
        st = agent2.replica("b")
        assert st["gaps"] >= 1 and st["replays"]["complete"] >= 1, st
        assert st["replays"]["batches"] >= len(fwd.dropped), (st["replays"], fwd.dropped)
        assert held >= first | lost | third
        procs.stop(p)
    finally:
        fwd.close()
