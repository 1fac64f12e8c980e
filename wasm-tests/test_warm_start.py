"""An agent that starts after an engine's replay buffer rolled past its early batches: without
a snapshot source it keeps what the buffer still holds (not an empty mirror), says which engine
is incomplete, and holds exactly the blocks those batches left in the engine's cache; with the
`publish` sidecar's snapshots it holds the engine's whole cache and a gateway started then
routes every follow-up to its holder. The simulator stands in for vLLM
(its replay buffer is `--buffer-steps` batches, as vLLM's `buffer_steps`)."""

import json
import time

import msgpack
import zmq

import llmgw_testkit as kit
from llmgw_testkit import free_port, request, toml, wait_port, wait_until
from llmgw_testkit import get_text as get
from llmgw_testkit import post_json as post
from llmgw_testkit.fleet import new_sims, start_router, wait_sims

BUFFER_STEPS = 4


def start_small_buffer_sim(procs, sim_bin, port, kv, replay):
    """One simulated replica `r0` whose replay buffer holds BUFFER_STEPS batches, listening."""
    procs.start([sim_bin, "--port", port, "--name", "r0", "--model", "m", "--blocks", "4096",
                 "--block-size", "16", "--seed", "0", "--kv-endpoint", f"tcp://[::ffff:127.0.0.1]:{kv}",
                 "--replay-endpoint", f"tcp://127.0.0.1:{replay}", "--decode-ms", "1",
                 "--buffer-steps", BUFFER_STEPS], "sim")
    wait_port(port)


class Recorder:
    """A SUB of its own on the simulator's publisher: every batch by sequence number."""

    def __init__(self, kv: int):
        self.sub = zmq.Context.instance().socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.connect(f"tcp://127.0.0.1:{kv}")
        self.batches: dict[int, list] = {}

    def drain(self, until_seq: int | None = None, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if until_seq is not None and until_seq in self.batches:
                return
            if self.sub.poll(100):
                _, seq, payload = self.sub.recv_multipart()
                self.batches[int.from_bytes(seq, "big")] = msgpack.unpackb(payload, raw=False)[1]
            elif until_seq is None:
                return
        raise AssertionError(f"batch {until_seq} never arrived; have {sorted(self.batches)[-5:]}")

    def last(self) -> int:
        return max(self.batches)

    def keys_from(self, first: int) -> set[int]:
        """The blocks the batches from `first` on leave cached (stores minus removals)."""
        held: dict[int, int] = {}
        for s in sorted(self.batches):
            if s < first:
                continue
            for ev in self.batches[s]:
                if ev["type"] == "BlockStored":
                    for h in ev["block_hashes"]:
                        held[h] = held.get(h, 0) + 1
                elif ev["type"] == "BlockRemoved":
                    for h in ev["block_hashes"]:
                        if held.get(h, 0) > 1:
                            held[h] -= 1
                        else:
                            held.pop(h, None)
                elif ev["type"] == "AllBlocksCleared":
                    held.clear()
        return set(held)

    def close(self):
        self.sub.close()


def replay_seqs(replay: int) -> list[int]:
    """The sequence numbers the simulator's replay buffer holds (asked from 0, over DEALER)."""
    d = zmq.Context.instance().socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(f"tcp://127.0.0.1:{replay}")
    try:
        d.send_multipart([b"", (0).to_bytes(8, "big")])
        seqs = []
        while True:
            assert d.poll(5000), "no replay answer"
            frames = d.recv_multipart()
            if frames[1] == b"" and frames[2] == b"\xff" * 8:
                return seqs
            seqs.append(int.from_bytes(frames[2], "big"))
    finally:
        d.close()


def prompt(tag: str) -> str:
    return f"{tag} " + " ".join(f"word{i}" for i in range(69))  # 4 full blocks of 16


def test_agent_started_after_the_replay_buffer_rolled_keeps_what_it_holds(procs, sim_bin, start_agent):
    port, kv, replay = free_port(), free_port(), free_port()
    start_small_buffer_sim(procs, sim_bin, port, kv, replay)
    url = f"http://127.0.0.1:{port}"
    rec = Recorder(kv)
    try:
        # PUB/SUB drops what is sent before a subscription is live: prime until the recorder hears.
        attempt = 0
        while not rec.batches:
            assert attempt < 100, "the recorder never received a batch"
            post(f"{url}/v1/completions", {"model": "m", "prompt": prompt(f"warm{attempt}"), "max_tokens": 2})
            rec.drain()
            attempt += 1
        # Early traffic, with no agent: the replay buffer rolls far past the first batches.
        for i in range(12):
            post(f"{url}/v1/completions", {"model": "m", "prompt": prompt(f"early{i}"), "max_tokens": 2})
        early = set(json.loads(get(f"{url}/sim/blocks"))["keys"])
        # Every early batch published and recorded: the recorder and the replay buffer agree.
        wait_until(lambda: (rec.drain(), rec.last() == replay_seqs(replay)[-1])[1], 10, "early batches recorded")
        last_early = rec.last()
        held = replay_seqs(replay)
        assert len(held) == BUFFER_STEPS and held[0] > 0 and held[-1] == last_early, held

        agent = start_agent([{"name": "r0", "address": f"127.0.0.1:{port}", "models": ["m"], "mode": "connect",
                              "endpoint": f"tcp://[::ffff:127.0.0.1]:{kv}", "topic": "kv-events",
                              "replay_endpoint": f"tcp://127.0.0.1:{replay}"}])
        agent.wait_for("r0", lambda r: r["connected"], "publisher connected")
        # New traffic: the first batch the agent hears makes it ask the replay socket for 0 on.
        n = 0

        def heard():
            nonlocal n
            post(f"{url}/v1/completions", {"model": "m", "prompt": prompt(f"late{n}"), "max_tokens": 2})
            n += 1
            rec.drain()
            try:
                agent.wait_for("r0", lambda r: r["last_seq"] == rec.last(), "caught up", timeout=2)
                return True
            except AssertionError:  # that batch went out before the subscription reached the sim
                return False
        wait_until(heard, 20, "the agent hears a live batch", interval=0.1)
        r = agent.replica("r0")

        first = r["incomplete_from"]
        # It kept the batches the buffer held when it asked, including ones from before it started.
        assert first is not None and 0 < first <= last_early, (r, last_early)
        want = rec.keys_from(first)
        assert set(r["block_keys"]) == want
        assert want & early, "no block from before the agent started is held"
        # Exactly the engine's cache, less what only the batches the buffer lost stored.
        cache = set(json.loads(get(f"{url}/sim/blocks"))["keys"])
        assert want <= cache and cache - want == early - want
        assert r["resets"] == {}, r["resets"]
        assert r["replays"]["incomplete"] == 1 and r["replays"]["batches"] == BUFFER_STEPS - 1
        assert r["incomplete_starts"] == 1
        m = agent.metrics()
        assert 'llmgw_agent_engine_incomplete{replica="r0",dp_rank="0"} 1' in m
        assert 'llmgw_agent_incomplete_starts_total{replica="r0",dp_rank="0"} 1' in m
        lines = [l for l in agent.log().splitlines() if "engine incomplete" in l]
        assert len(lines) == 1 and "r0" in lines[0] and f"batch {first}" in lines[0], lines
    finally:
        rec.close()


def snapshot_of(port: int) -> tuple[int, dict, bytes]:
    """A sidecar's snapshot: (status, lower-cased headers, body)."""
    status, headers, body = request("GET", f"http://127.0.0.1:{port}/snapshot?dp_rank=0", timeout=5)
    return status, {k.lower(): v for k, v in headers.items()}, body


def test_a_gateway_started_after_the_buffers_rolled_routes_every_follow_up_to_its_holder(
        procs, tmp_path, sim_bin, agent_bin, wasm_path, envoy_bin, start_agent):
    """Each replica runs `llmgw-agent publish --snapshot-listen` beside it from its start. Prefixes
    are warmed directly on the replicas, their replay buffers roll far past those batches, then
    an agent (joining from the sidecars' snapshots) and Envoy start: the agent holds exactly
    each simulator's cache, is not incomplete, and every follow-up goes to its prefix's holder
    from the first request on."""
    sims = new_sims(3)
    entries = {}
    for s in sims:
        s["snap"] = free_port()
        procs.start([sim_bin, "--port", s["port"], "--name", s["name"], "--model", "m", "--blocks", "4096",
                     "--block-size", "16", "--seed", "0", "--kv-endpoint", f"tcp://[::ffff:127.0.0.1]:{s['kv']}",
                     "--replay-endpoint", f"tcp://127.0.0.1:{s['replay']}", "--decode-ms", "1",
                     "--buffer-steps", BUFFER_STEPS], s["name"])
        entries[s["name"]] = {"name": s["name"], "address": f"127.0.0.1:{s['port']}", "models": ["m"],
                              "mode": "connect", "endpoint": f"tcp://[::ffff:127.0.0.1]:{s['kv']}",
                              "topic": "kv-events", "replay_endpoint": f"tcp://127.0.0.1:{s['replay']}"}
    wait_sims(sims)
    for s in sims:
        cfg = tmp_path / f"sidecar-{s['name']}.toml"
        cfg.write_text(toml({"hash": {"algo": "sha256_cbor", "seed": "0"}, "replicas": [entries[s["name"]]]}))
        procs.start([agent_bin, "publish", "--config", cfg, "--snapshot-listen", f"127.0.0.1:{s['snap']}"],
                    f"sidecar-{s['name']}")
        wait_port(s["snap"])

    def url(s):
        return f"http://127.0.0.1:{s['port']}"

    # The sidecars start with their replicas: the first batches they hear are still replayable.
    for s in sims:
        n = [0]

        def sidecar_heard(s=s, n=n):
            post(f"{url(s)}/v1/completions", {"model": "m", "prompt": prompt(f"prime-{s['name']}-{n[0]}"),
                                              "max_tokens": 2})
            n[0] += 1
            return snapshot_of(s["snap"])[0] == 200
        wait_until(sidecar_heard, 20, f"sidecar of {s['name']} has a snapshot", interval=0.2)
    # Two long prefixes warmed on each replica, then traffic that rolls every replay buffer past them.
    holder = {}
    for s in sims:
        for i in range(2):
            p = prompt(f"system-{s['name']}-{i}")
            post(f"{url(s)}/v1/completions", {"model": "m", "prompt": p, "max_tokens": 2})
            holder[p] = s["name"]
    warmed_at = {}
    for s in sims:
        last = replay_seqs(s["replay"])[-1]
        wait_until(lambda s=s, last=last: snapshot_of(s["snap"])[1].get("x-llmgw-snapshot-seq") == str(last), 10,
                   "the sidecar saw the warm batches")
        warmed_at[s["name"]] = last
        for i in range(3 * BUFFER_STEPS):
            post(f"{url(s)}/v1/completions", {"model": "m", "prompt": prompt(f"roll-{s['name']}-{i}"), "max_tokens": 2})
    for s in sims:
        held = replay_seqs(s["replay"])
        assert held[0] > warmed_at[s["name"]], ("the replay buffer still reaches the warm batches", held)
        status, headers, _ = snapshot_of(s["snap"])
        wait_until(lambda s=s: snapshot_of(s["snap"])[1].get("x-llmgw-snapshot-seq") == str(replay_seqs(s["replay"])[-1]),
                   10, "the sidecar caught up")
        assert status == 200 and "x-llmgw-snapshot-incomplete-from" not in headers, headers

    agent = start_agent([{**entries[s["name"]], "snapshot_url": f"http://127.0.0.1:{s['snap']}"} for s in sims])
    cache = {s["name"]: set(json.loads(get(f"{url(s)}/sim/blocks"))["keys"]) for s in sims}
    for s in sims:
        # Exactly the simulator's own cache, prefixes stored long before the agent started included.
        r = agent.wait_for(s["name"], lambda r, s=s: set(r["block_keys"]) == cache[s["name"]],
                           "the agent holds the replica's cache")
        assert r["snapshot"]["joins"] == 1 and r["incomplete_from"] is None, r
        assert r["resets"] == {} and r["incomplete_starts"] == 0, r
    m = agent.metrics()
    assert 'llmgw_agent_engine_incomplete{replica="r0",dp_rank="0"} 0' in m
    assert 'llmgw_agent_snapshot_joins_total{replica="r0",dp_rank="0"} 1' in m

    listen, admin = free_port(), free_port()
    config = kit.shipped_config(wasm_path, listen, admin, agent.feed,
                                kit.filter_config({"name": "warm"}, explain_header=True))
    _, envoy = start_router(procs, envoy_bin, tmp_path, "envoy", config, admin, feed=True, feed_timeout=90)
    total = sum(len(c) for c in cache.values())
    wait_until(lambda: envoy.index_blocks() and all(v == total for v in envoy.index_blocks()), 20,
               "every filter VM holds the agent's index")
    landed = {}
    for p, want in holder.items():
        status, headers, _ = request(
            "POST", f"http://127.0.0.1:{listen}/v1/completions",
            json.dumps({"model": "m", "prompt": p + " and a follow-up question", "max_tokens": 2}).encode(),
            {"content-type": "application/json"}, timeout=30)
        headers = {k.lower(): v for k, v in headers.items()}
        assert status == 200, (status, headers)
        landed[p] = (headers.get("x-llmgw-sim-replica"), headers.get(kit.DECISION_HEADER))
    wrong = {p[:24]: (got, holder[p]) for p, got in landed.items() if got[0] != holder[p]}
    assert not wrong, wrong


def through(listen: int, p: str) -> dict:
    """One completion through Envoy; its response headers, lower-cased."""
    status, headers, _ = request("POST", f"http://127.0.0.1:{listen}/v1/completions",
                                 json.dumps({"model": "m", "prompt": p, "max_tokens": 2}).encode(),
                                 {"content-type": "application/json"}, timeout=30)
    assert status == 200, (status, headers)
    return {k.lower(): v for k, v in headers.items()}


def test_the_filter_is_told_which_engines_are_incomplete_until_they_are_complete(
        procs, tmp_path, sim_bin, wasm_path, envoy_bin, start_agent):
    """r0's replay buffer rolled past its early batches before the agent started: the agent marks
    it incomplete in the feed's replica table, and the filter names it in the explain header and
    counts the decisions that saw it; r1, whose every batch the agent replayed, is complete. When
    r0's cache is cleared its mirror is whole again: the table says so and the filter stops
    naming it."""
    sims = new_sims(2)
    for s in sims:
        buffer = ["--buffer-steps", BUFFER_STEPS] if s["name"] == "r0" else []
        procs.start([sim_bin, "--port", s["port"], "--name", s["name"], "--model", "m", "--blocks", "4096",
                     "--block-size", "16", "--seed", "0", "--kv-endpoint", f"tcp://[::ffff:127.0.0.1]:{s['kv']}",
                     "--replay-endpoint", f"tcp://127.0.0.1:{s['replay']}", "--decode-ms", "1", *buffer], s["name"])
    wait_sims(sims)
    r0, r1 = sims
    url0 = f"http://127.0.0.1:{r0['port']}"
    # Traffic on r0 alone, with no agent, until its replay buffer no longer starts at batch 0.
    n = [0]

    def rolled():
        post(f"{url0}/v1/completions", {"model": "m", "prompt": prompt(f"early{n[0]}"), "max_tokens": 2})
        n[0] += 1
        return replay_seqs(r0["replay"])[0] > 0
    wait_until(rolled, 20, "r0's replay buffer rolled past batch 0", interval=0)

    agent = start_agent([{"name": s["name"], "address": f"127.0.0.1:{s['port']}", "models": ["m"],
                          "mode": "connect", "endpoint": f"tcp://[::ffff:127.0.0.1]:{s['kv']}", "topic": "kv-events",
                          "replay_endpoint": f"tcp://127.0.0.1:{s['replay']}"} for s in sims])
    for s in sims:
        agent.wait_for(s["name"], lambda r: r["connected"], "publisher connected")

    def heard(s):
        def once():
            post(f"http://127.0.0.1:{s['port']}/v1/completions",
                 {"model": "m", "prompt": prompt(f"late-{s['name']}-{n[0]}"), "max_tokens": 2})
            n[0] += 1
            return agent.replica(s["name"])["last_seq"] is not None
        wait_until(once, 20, f"the agent hears {s['name']}", interval=0.1)
    heard(r0)
    heard(r1)
    agent.wait_for("r0", lambda r: r["incomplete_from"] is not None, "r0 incomplete")
    assert agent.replica("r1")["incomplete_from"] is None

    listen, admin = free_port(), free_port()
    path = tmp_path / "envoy.yaml"
    path.write_text(kit.shipped_config(wasm_path, listen, admin, agent.feed,
                                       kit.filter_config({"name": "warm"}, explain_header=True)))
    # One worker: the one filter VM whose table each request's header reports.
    proc = kit.start_envoy(procs, envoy_bin, path, "envoy", concurrency=1)
    envoy = kit.EnvoyAdmin(admin)
    envoy.wait_ready(proc=proc)
    envoy.wait_feed()
    named = f"incomplete=127.0.0.1:{r0['port']};"
    for i in range(4):
        explain = through(listen, prompt(f"via-envoy{i}"))[kit.DECISION_HEADER]
        assert named in explain and f"127.0.0.1:{r1['port']}" not in explain.partition("incomplete=")[2], explain
    assert envoy.metric("llmgw_decisions_with_incomplete_engine_total") == 4

    # r0's cache cleared (vLLM's /reset_prefix_cache): its mirror holds all it holds again.
    status, _, body = request("POST", f"{url0}/reset_prefix_cache", b"", timeout=10)
    assert status == 200, body
    agent.wait_for("r0", lambda r: r["incomplete_from"] is None, "r0 complete")
    m = agent.metrics()
    assert 'llmgw_agent_engine_incomplete{replica="r0",dp_rank="0"} 0' in m
    # The table reaches the filter: its next decisions name nobody and count nothing.
    wait_until(lambda: "incomplete=" not in through(listen, prompt("after"))[kit.DECISION_HEADER], 10,
               "the filter's table says r0 is complete")
    counted = envoy.metric("llmgw_decisions_with_incomplete_engine_total")
    for i in range(3):
        assert "incomplete=" not in through(listen, prompt(f"complete{i}"))[kit.DECISION_HEADER]
    assert envoy.metric("llmgw_decisions_with_incomplete_engine_total") == counted
