"""A restarted agent (the replicas keep running with their caches) rebuilds every replica's mirror
from vLLM's replay ROUTER once it sees a batch past sequence 0, in both agent modes, and the
filters route on the rebuilt state: nothing cached before the restart is lost."""

import random

from conftest import agent_hash, http_json, wait_until, words


def test_restarted_agent_rebuilds_mirrors_through_replay(fleet, procs):
    rng = random.Random("agent-restart")
    before = {}
    for name in ("a", "b"):
        r = fleet.replicas[name]
        prompt = words(rng, 40, f"ar{name}")
        fleet.completion(r, prompt, max_tokens=2)
        before[name] = (prompt, set(agent_hash(fleet.tokenize(r, {"prompt": prompt}))))
        fleet.wait_mirrored(r, before[name][1])

    args = fleet.agent_proc.args
    procs.stop(fleet.agent_proc)
    fleet.agent_proc = procs.start(args, "agent")
    wait_until(lambda: http_json(f"{fleet.agent.base}/healthz", timeout=2)[0] in (200, 503), 30, "the agent's HTTP")
    for name in ("a", "b"):
        fleet.agent.wait_up(name)
    fleet.envoy.wait_feed()
    # vLLM 0.33 sends no heartbeat: the new agent learns how far each publisher is with its next
    # batch, then fetches everything before it from the replay socket.
    for name in ("a", "b"):
        r = fleet.replicas[name]
        prompt = words(rng, 20, f"as{name}")
        fleet.completion(r, prompt, max_tokens=2)
        new = set(agent_hash(fleet.tokenize(r, {"prompt": prompt})))
        # The blocks stored before the restart can only come back through replay (B's small
        # pool may evict older ones meanwhile, but not the most recently used prompt's).
        wait_until(lambda: fleet.agent.keys(name) >= before[name][1] | new, 30,
                   f"the restarted agent to rebuild {name}'s mirror through replay")
        assert len(fleet.agent.keys(name)) <= r.blocks
        st = fleet.agent.replica(name)
        assert st["replays"]["complete"] >= 1 and st["replays"]["batches"] > 0, st["replays"]
    fleet.wait_index_converged()
    for name in ("a", "b"):
        prompt, keys = before[name]
        headers, reply = fleet.completion(None, prompt + " " + words(rng, 10, f"at{name}"), max_tokens=2)
        outcome, served, matched, cached = fleet.routed(headers, reply)
        assert (outcome, served.name) == ("exact", name), headers.get("x-llmgw-decision")
        assert matched == len(keys)
