"""The agent killed with SIGKILL and started again while traffic flows through Envoy, checked
against the engines' own caches rather than against the agent: simulated replicas with small
replay buffers (as vLLM's `buffer_steps`) and caches small enough that traffic evicts, each with
the `publish` sidecar beside it serving snapshots. While the agent is away prefixes are stored
directly on the replicas and their replay buffers roll past those batches; after the agent's
return its mirror of each replica equals that replica's cache (`/sim/blocks`), and a follow-up
of each prefix goes to the replica holding it."""

import json
import signal

import llmgw_testkit as kit
from llmgw_testkit import free_port, request, toml, wait_port, wait_until
from llmgw_testkit.fleet import new_sims, start_router, wait_sims
from llmgw_testkit.load_faults import COMPLETIONS, ClientLoad, failed
from llmgw_testkit.vllm_hash import block_keys
from test_warm_start import prompt, replay_seqs, snapshot_of

BUFFER_STEPS = 8
# Blocks of KV cache per replica: the load's prompts (5 blocks each) evict within a few hundred
# requests, and the prefixes stored during the outage outlive what follows it.
BLOCKS = 1024
CONCURRENCY = 3


class Unique(ClientLoad):
    """Completions whose every prompt is new: each one stores blocks, and the oldest are evicted."""

    def __init__(self, port: int):
        self.n = 0
        super().__init__(port, CONCURRENCY)

    def request(self, i: int) -> tuple[str, bytes]:
        with self.lock:
            k = self.n
            self.n += 1
        return COMPLETIONS, json.dumps({"model": "m", "prompt": prompt(f"load{k}"), "max_tokens": 2}).encode()


def sim_keys(s: dict) -> set[int]:
    _, _, body = request("GET", f"http://127.0.0.1:{s['port']}/sim/blocks", timeout=5)
    return set(json.loads(body)["keys"])


def leading(keys: list[int], held: set[int]) -> int:
    n = 0
    while n < len(keys) and keys[n] in held:
        n += 1
    return n


def test_agent_sigkill_under_load_comes_back_with_every_engines_own_cache(
        procs, tmp_path, sim_bin, agent_bin, wasm_path, envoy_bin, start_agent):
    sims = new_sims(3)
    entries = []
    for s in sims:
        s["snap"] = free_port()
        procs.start([sim_bin, "--port", s["port"], "--name", s["name"], "--model", "m", "--blocks", BLOCKS,
                     "--block-size", "16", "--seed", "0", "--kv-endpoint", f"tcp://[::ffff:127.0.0.1]:{s['kv']}",
                     "--replay-endpoint", f"tcp://127.0.0.1:{s['replay']}", "--decode-ms", "1",
                     "--buffer-steps", BUFFER_STEPS], s["name"])
        entries.append({"name": s["name"], "address": f"127.0.0.1:{s['port']}", "models": ["m"], "mode": "connect",
                        "endpoint": f"tcp://[::ffff:127.0.0.1]:{s['kv']}", "topic": "kv-events",
                        "replay_endpoint": f"tcp://127.0.0.1:{s['replay']}"})
    wait_sims(sims)
    for s, e in zip(sims, entries):
        cfg = tmp_path / f"sidecar-{s['name']}.toml"
        cfg.write_text(toml({"hash": {"algo": "sha256_cbor", "seed": "0"}, "replicas": [e]}))
        procs.start([agent_bin, "publish", "--config", cfg, "--snapshot-listen", f"127.0.0.1:{s['snap']}"],
                    f"sidecar-{s['name']}")
        wait_port(s["snap"])

    def url(s):
        return f"http://127.0.0.1:{s['port']}"

    def post(s, p):
        status, _, body = request("POST", f"{url(s)}/v1/completions",
                                  json.dumps({"model": "m", "prompt": p, "max_tokens": 2}).encode(),
                                  {"content-type": "application/json"}, timeout=30)
        assert status == 200, body

    # Each sidecar hears its replica from its first batch on (PUB/SUB drops what precedes a
    # live subscription: prime until the sidecar has a snapshot).
    for s in sims:
        n = [0]

        def sidecar_heard(s=s, n=n):
            post(s, prompt(f"prime-{s['name']}-{n[0]}"))
            n[0] += 1
            return snapshot_of(s["snap"])[0] == 200
        wait_until(sidecar_heard, 20, f"sidecar of {s['name']} has a snapshot", interval=0.2)

    agent = start_agent([{**e, "snapshot_url": f"http://127.0.0.1:{s['snap']}"} for s, e in zip(sims, entries)])
    listen, admin = free_port(), free_port()
    config = kit.shipped_config(wasm_path, listen, admin, agent.feed,
                                kit.filter_config({"name": "kill"}, explain_header=True))
    _, envoy = start_router(procs, envoy_bin, tmp_path, "envoy", config, admin, feed=True, feed_timeout=60)

    load = Unique(listen)
    try:
        # Steady traffic until every replica has evicted blocks it held under it.
        load.wait_answered(30, what="before the kill")
        before = {s["name"]: sim_keys(s) for s in sims}
        wait_until(lambda: all(before[s["name"]] - sim_keys(s) for s in sims), 60, "every replica evicted",
                   interval=0.2)

        applied = envoy.metric("llmgw_feed_snapshots_applied_total")
        procs.stop(agent.proc, signal.SIGKILL)
        wait_until(lambda: not any(v for v in envoy.stats("llmgw_feed_connected").values()), 10,
                   "every filter VM noticed the agent is gone")
        # While it is away: prefixes stored directly on each replica, and traffic that rolls every
        # replay buffer past those batches.
        holder, stored_at = {}, {}
        for s in sims:
            for i in range(2):
                p = prompt(f"outage-{s['name']}-{i}")
                post(s, p)
                holder[p] = s["name"]
            stored_at[s["name"]] = replay_seqs(s["replay"])[-1]
        wait_until(lambda: all(replay_seqs(s["replay"])[0] > stored_at[s["name"]] for s in sims), 30,
                   "every replay buffer rolled past the outage's prefixes", interval=0.1)

        # Back, with traffic still flowing.
        a = agent
        a.attempts += 1
        a.proc = procs.start([agent_bin, "run", "--config", a.config], f"{a.name}-{a.attempts}")
        a.log_path = a.proc.log_path
        a.wait_ready()
        load.wait_answered(30, what="after the agent's return")
    finally:
        recs = load.stop()
    assert not failed(recs), failed(recs)[:5]

    # Traffic stopped: each replica's cache stays as it is; the agent's mirror must equal it.
    for s in sims:
        cache = sim_keys(s)
        r = agent.wait_for(s["name"], lambda r, cache=cache: set(r["block_keys"]) == cache,
                           "the agent's mirror equals the replica's own cache")
        assert r["incomplete_from"] is None and r["snapshot"]["joins"] >= 1, r
    # Full caches hold as many blocks before the outage as after: the count alone could be the
    # stale index's. Every VM first swaps in the index of its new subscription's snapshot.
    vms = len(envoy.index_blocks())
    wait_until(lambda: envoy.metric("llmgw_feed_snapshots_applied_total") >= applied + vms, 20,
               "every filter VM serves the returned agent's snapshot")
    total = sum(len(sim_keys(s)) for s in sims)
    wait_until(lambda: envoy.index_blocks() and all(v == total for v in envoy.index_blocks()), 20,
               "every filter VM holds the agent's index")

    # Every prefix stored while the agent was away: its follow-up goes to its holder.
    caches = {s["name"]: sim_keys(s) for s in sims}
    wrong = {}
    for p, want in holder.items():
        _, _, body = request("POST", f"{url(sims[0])}/tokenize", json.dumps({"model": "m", "prompt": p}).encode(),
                             {"content-type": "application/json"}, timeout=10)
        keys = block_keys(json.loads(body)["tokens"], 16, "0")
        runs = {name: leading(keys, held) for name, held in caches.items()}
        assert runs[want] == len(keys) and max(v for k, v in runs.items() if k != want) < len(keys), (p[:24], runs)
        status, headers, _ = request("POST", f"http://127.0.0.1:{listen}/v1/completions",
                                     json.dumps({"model": "m", "prompt": p + " and a follow-up question",
                                                 "max_tokens": 2}).encode(),
                                     {"content-type": "application/json"}, timeout=30)
        headers = {k.lower(): v for k, v in headers.items()}
        assert status == 200, headers
        if headers.get("x-llmgw-sim-replica") != want:
            wrong[p[:24]] = (headers.get("x-llmgw-sim-replica"), want, headers.get(kit.DECISION_HEADER))
    assert not wrong, wrong
