"""Issue 15, item 1: a replica started with `--data-parallel-size 2` is two engines behind one
address. The agent mirrors each rank from its own publisher (base port + rank); the filter
credits the rank holding a prompt's blocks and names it in `X-data-parallel-rank`, so vLLM
serves the request on that rank instead of the one its own balancer picks. The proof is vLLM's:
the follow-up's `cached_tokens` equals the blocks the filter credited, and the new blocks it
stores are published by that rank's publisher. (With the header-setting line removed from the
filter, both cases failed: vLLM's balancer put each follow-up on the rank without the blocks,
0 cached tokens.)

This module starts its own replica, agent and Envoy (the session fleet is not needed)."""

import random
import socket

import pytest

from conftest import (AGENT, BLOCK, Fleet, Replica, agent_hash, agent_toml, wait_healthy, wait_until,
                      words)
from llmgw_testkit import free_port, http_json


class DpReplica(Replica):
    """`vllm serve --data-parallel-size 2`: ranks 0 and 1 publish on kv and kv + 1, their
    replay sockets on replay and replay + 1."""

    def serve_args(self, with_events: bool = True) -> list[str]:
        return super().serve_args(with_events) + ["--data-parallel-size", "2"]

    def agent_entry(self) -> dict:
        return {**super().agent_entry(), "dp_ranks": 2}


def free_pair() -> int:
    """A port p with p + 1 free too (rank 1 uses base + 1)."""
    for _ in range(50):
        p = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p + 1))
            except OSError:
                continue
        return p
    raise RuntimeError("no two consecutive free ports")


@pytest.fixture(scope="module")
def dp_fleet(procs, logdir):
    d = logdir / "dp"
    d.mkdir(exist_ok=True)
    f = Fleet(procs, d)
    # vLLM binds its publishers (loopback) and the agent connects, so the replica can start
    # again on new ports when one was taken meanwhile (vLLM's own processes pick free ports
    # too while it starts), before the agent is configured.
    for attempt in range(3):
        r = DpReplica("dp", "connect", blocks=128)
        r.kv, r.replay = free_pair(), free_pair()
        f.start_replica(r)
        try:
            wait_healthy(r, r.proc)
            break
        except RuntimeError as e:
            if "Address already in use" not in str(e) or attempt == 2:
                raise
            procs.stop(r.proc)
    f.replicas = {r.name: r}
    (d / "agent.toml").write_text(agent_toml([r], f.feed, f.http))
    f.agent_proc = procs.start([AGENT, "run", "--config", d / "agent.toml", "--log-level", "info"], "agent-dp")
    wait_until(lambda: http_json(f"{f.agent.base}/healthz", timeout=2)[0] in (200, 503), 30, "the agent's HTTP")
    for rank in (0, 1):
        wait_until(lambda: (e := f.agent.replica(r.name, rank))["up"] and e["connected"], 60,
                   f"the agent to see rank {rank} of {r.name} up")
    f.start_envoy("envoy-dp")
    yield f, r


def direct(r: Replica, prompt: str, rank: int):
    """A completion sent to vLLM itself, pinned to one rank."""
    status, _, reply = http_json(f"{r.url}/v1/completions",
                                 {"model": r.model, "prompt": prompt, "max_tokens": 2},
                                 headers={"X-data-parallel-rank": str(rank)}, timeout=60)
    assert status == 200, reply
    return reply


def test_each_rank_publishes_on_its_own_port_and_is_its_own_engine(dp_fleet):
    f, r = dp_fleet
    status, _, sources = http_json(f"{r.url}/kv_event_sources", None, timeout=10)
    assert status == 200 and sorted(sources) == ["0", "1"], sources
    assert sources["1"]["endpoint"].endswith(f":{r.kv + 1}"), sources
    table = {(e["replica"], e["dp_rank"]) for e in f.agent.replicas()}
    assert table == {("dp", 0), ("dp", 1)}, table


@pytest.mark.parametrize("rank", [1, 0])
def test_a_followup_is_served_by_the_rank_holding_its_prefix(dp_fleet, rank):
    f, r = dp_fleet
    rng = random.Random(f"dp-rank-{rank}")
    prompt = words(rng, 50, f"dp{rank}")
    direct(r, prompt, rank)
    keys = agent_hash(f.tokenize(r, {"prompt": prompt}))
    wait_until(lambda: f.agent.keys(r.name, rank) >= set(keys), 30, f"rank {rank} to hold the prompt's blocks")
    assert not f.agent.keys(r.name, 1 - rank) & set(keys), "the other rank never saw the prompt"
    f.wait_index_converged()
    before = {k: f.agent.keys(r.name, k) for k in (0, 1)}
    followup = prompt + " " + words(rng, 20, f"dq{rank}")
    headers, reply = f.completion(None, followup, max_tokens=2)
    outcome, served, matched, cached = f.routed(headers, reply)
    # vLLM reports the credited blocks as cached: the request ran on the rank that holds them.
    assert (outcome, served.name, matched) == ("exact", "dp", len(keys)), headers.get("x-llmgw-decision")
    assert cached == BLOCK * len(keys), (cached, len(keys))
    # The follow-up's new blocks are published by that rank's publisher, none by the other.
    new = set(agent_hash(f.tokenize(r, {"prompt": followup}))) - set(keys)
    assert new, "the follow-up has blocks of its own"
    wait_until(lambda: f.agent.keys(r.name, rank) >= new, 30, f"rank {rank} to store the follow-up's blocks")
    assert not (f.agent.keys(r.name, 1 - rank) - before[1 - rank]) & new
