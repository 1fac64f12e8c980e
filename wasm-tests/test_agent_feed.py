"""llmgw-agent's gRPC feed, end to end: pyzmq publishers emit a random stream for two replicas while
a subscriber generated from feed.proto listens from the start and another joins midway, and one that
batches (as the filter does) listens from the start; all must end with exactly the blocks the agent
reports in /debug/replicas, with gap-free sequence numbers, the batching one in fewer messages."""

import random
import re
import time

from agent_support import Publisher, cleared, removed, stored
from llmgw_testkit import free_port
from llmgw_testkit.feed import FeedSubscriber, load_feed_proto


def test_agent_feed_early_and_late_subscribers_match_agent_state(start_agent, tmp_path):
    pb, pb_grpc = load_feed_proto(tmp_path / "gen")
    ports = [free_port(), free_port()]
    pubs = [Publisher(f"tcp://127.0.0.1:{p}", bind=True) for p in ports]
    subs = []
    try:
        agent = start_agent([
            {"name": f"r{i}", "address": f"127.0.0.1:{18000 + i}", "models": ["m"],
             "endpoint": f"tcp://127.0.0.1:{p}"} for i, p in enumerate(ports)])
        for p in pubs:
            p.wait_subscribed()
        subs.append(FeedSubscriber(pb, pb_grpc, agent.feed, "early"))
        subs.append(FeedSubscriber(pb, pb_grpc, agent.feed, "batching", batches=True))
        rng = random.Random(1234)
        seqs = [0, 0]
        for step in range(600):
            i = rng.randrange(2)
            keys = [rng.randrange(1, 120) for _ in range(rng.randrange(1, 6))]
            roll = rng.randrange(40)
            payload = cleared() if roll == 0 else removed(keys) if roll < 18 else stored(keys)
            pubs[i].send(seqs[i], payload)
            seqs[i] += 1
            if step == 300:
                subs.append(FeedSubscriber(pb, pb_grpc, agent.feed, "late"))
        truth = {}
        for i in range(2):
            r = agent.wait_for(f"r{i}", lambda r, i=i: r["last_seq"] == seqs[i] - 1, f"r{i} caught up")
            truth[r["id"]] = set(r["block_keys"])
            assert r["gaps"] == 0 and r["resets"] == {}
        assert any(truth.values())
        for s in subs:
            deadline = time.monotonic() + 20
            while True:
                got_seqs, replicas, blocks, synced, _, kinds = s.state()
                if synced and {k: blocks.get(k, set()) for k in truth} == truth:
                    break
                assert time.monotonic() < deadline, f"subscriber never matched the agent ({s.error})"
                time.sleep(0.05)
            assert got_seqs == list(range(len(got_seqs))), "feed sequence must increase by one"
            assert kinds[0] == "replicas" and kinds[1:3] == ["snapshot", "snapshot"] and kinds[3] == "snapshot_complete"
            assert sorted(v[0] for v in replicas.values()) == ["r0", "r1"]
        early, batching = (s.state()[5] for s in subs[:2])
        assert "deltas" in batching and "deltas" not in early
        assert len(batching) < len(early), (len(batching), len(early))
        metrics = agent.metrics()
        assert 'llmgw_agent_subscribers 3' in metrics
        gathered = re.search(r"^llmgw_agent_feed_gathered_total (\S+)$", metrics, re.M)
        assert gathered and float(gathered.group(1)) > 0, metrics
    finally:
        for s in subs:
            s.close()
        for p in pubs:
            p.close()


def test_agent_feed_rejects_a_wrong_token(start_agent, tmp_path):
    pb, pb_grpc = load_feed_proto(tmp_path / "gen")
    import grpc

    port = free_port()
    pub = Publisher(f"tcp://127.0.0.1:{port}", bind=True)
    subs = []
    try:
        # A token-protected feed (bound to loopback here; off loopback the token is mandatory).
        agent = start_agent([
            {"name": "r0", "address": "127.0.0.1:18000", "endpoint": f"tcp://127.0.0.1:{port}"}],
            feed={"token": "sesame"})
        bad = FeedSubscriber(pb, pb_grpc, agent.feed, "intruder", token="wrong")
        subs.append(bad)
        bad.thread.join(timeout=10)
        assert isinstance(bad.error, grpc.RpcError) and bad.error.code() == grpc.StatusCode.UNAUTHENTICATED
        good = FeedSubscriber(pb, pb_grpc, agent.feed, "filter", token="sesame")
        subs.append(good)
        deadline = time.monotonic() + 10
        while not good.state()[3]:
            assert time.monotonic() < deadline and good.error is None, good.error
            time.sleep(0.05)
        assert "llmgw_agent_feed_rejected_total 1" in agent.metrics()
    finally:
        for s in subs:
            s.close()
        pub.close()
