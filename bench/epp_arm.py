"""The endpoint-picker arm of bench/filter_perf.py: the same requests through the front Envoy's
ext_proc filter to the agent's endpoint picker ([epp]), configured as envoy/llmgw-epp-local.yaml
configures it (the body streamed in full-duplex mode, the pool's override_host cluster).

The picker holds what the filter arm's feed stub serves: the agent mirrors each replica from a
vLLM-framed ZMQ publisher (XPUB, [topic, seq, msgpack KVEventBatch]) that publishes the same
blocks (replica 0 the whole prompt, replica 1 its first half, every replica the filler). It
tokenizes as the filter does, through the least-loaded replica's /tokenize (the backend Envoy's
fixed answer); the agent's tokenizer client speaks HTTP/1.0 with a connection per call.

The agent runs pinned to the CPU of the load generator and the backend (as the script pins
them), and its CPU seconds are read from /proc around each run: the requests/s at which the
picker saturates one core is derived from its CPU time per request, less its idle rate.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import msgpack
import yaml
import zmq

import llmgw_testkit as kit
from llmgw_testkit import free_port, request, wait_until
from llmgw_testkit.procs import process_cpu_seconds

SHIPPED = kit.ROOT / "envoy" / "llmgw-epp-local.yaml"
TOPIC = b"kv-events"
# Blocks per published batch (16 token ids each): far below the agent's 4 MiB message limit.
BATCH_BLOCKS = 2000


class EventPublisher:
    """One replica's KV events as vLLM frames them, on an XPUB it binds (the agent connects); the
    XPUB shows when the agent's subscription arrived, so nothing is sent before it listens."""

    def __init__(self, ctx: zmq.Context):
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.SNDHWM, 100000)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.seq = 0

    def wait_subscribed(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.pub.poll(int(left * 1000)):
                raise TimeoutError("the agent did not subscribe to the event publisher")
            if self.pub.recv()[:1] == b"\x01":
                return

    def stored(self, keys: list[int], tokens: list[int] | None, block: int) -> None:
        """BlockStored events for `keys` (a chain from the first), `tokens` their token ids when
        known (the agent then checks their hashes), else filler ids."""
        for i in range(0, len(keys), BATCH_BLOCKS):
            chunk = keys[i:i + BATCH_BLOCKS]
            ids = tokens[i * block:(i + len(chunk)) * block] if tokens else [1] * (block * len(chunk))
            parent = keys[i - 1] if tokens and i > 0 else None
            ev = {"type": "BlockStored", "block_hashes": chunk, "parent_block_hash": parent, "token_ids": ids,
                  "block_size": block, "lora_id": None, "medium": "GPU", "lora_name": None}
            self.pub.send_multipart([TOPIC, self.seq.to_bytes(8, "big"), msgpack.packb([time.time(), [ev], 0])])
            self.seq += 1

    def close(self) -> None:
        self.pub.close(0)


def epp_pieces(listen: int, epp_port: int, pool_ports: list[int]) -> tuple[list[dict], list[dict]]:
    """The shipped EPP bootstrap's listener (on `listen`) and clusters (the pool at `pool_ports`,
    the picker at `epp_port`), as Envoy configuration objects."""
    doc = yaml.safe_load(SHIPPED.read_text())
    listeners, clusters = doc["static_resources"]["listeners"], doc["static_resources"]["clusters"]
    if len(listeners) != 1 or {c["name"] for c in clusters} != {"llmgw_pool", "llmgw_epp"}:
        raise RuntimeError(f"{SHIPPED.name}: expected one listener and the clusters llmgw_pool, llmgw_epp")
    listeners[0]["address"]["socket_address"]["port_value"] = listen
    for c in clusters:
        ports = pool_ports if c["name"] == "llmgw_pool" else [epp_port]
        c["load_assignment"]["endpoints"] = [{"lb_endpoints": [
            {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": p}}}} for p in ports]}]
    return listeners, clusters


def with_epp(front_yaml: str, listeners: list[dict], clusters: list[dict]) -> str:
    """A front Envoy bootstrap (YAML text) with the EPP listener and clusters added, as JSON."""
    doc = yaml.safe_load(front_yaml)
    doc["static_resources"]["listeners"] += listeners
    doc["static_resources"]["clusters"] += clusters
    return json.dumps(doc)


class EppArm:
    """The agent with [epp] mirroring the benchmark's replicas from ZMQ publishers."""

    def __init__(self, procs, tmp: Path, agent_bin, model: str, routing: dict, block: int, seed: str,
                 cpu: int | None):
        self.procs, self.tmp, self.agent_bin, self.model = procs, tmp, agent_bin, model
        self.routing, self.block, self.seed, self.cpu = routing, block, seed, cpu
        self.ctx = zmq.Context()
        self.pubs: list[EventPublisher] = []
        self.proc = None
        self.port = free_port()
        self.http = free_port()

    def start(self, ports: list[int], blocks: dict[int, list[int]], own: dict[int, int], tokens: list[int],
              filler_tokens: dict[int, list[int]]) -> None:
        """Starts the agent over replicas at `ports`, publishes `blocks[r]` for each (its first
        `own[r]` are the prompt's, published with `tokens`; the rest a chain of their own, with
        `filler_tokens[r]`: the agent credits a block only where its ids hash to its key), and
        waits until it mirrors them."""
        self.pubs = [EventPublisher(self.ctx) for _ in ports]
        replicas = [{"name": f"r{i}", "address": f"127.0.0.1:{p}", "models": [self.model],
                     "endpoint": f"tcp://127.0.0.1:{pub.port}", "mode": "connect", "topic": TOPIC.decode()}
                    for i, (p, pub) in enumerate(zip(ports, self.pubs))]
        routing = self.tmp / "epp-routing.json"
        routing.write_text(json.dumps(self.routing))
        config = self.tmp / "epp-agent.toml"
        config.write_text(kit.agent_config(
            free_port(), self.http, replicas, hash={"algo": "sha256_cbor", "seed": self.seed, "block_size": self.block},
            load={"enabled": False, "models_interval_ms": 0},
            epp={"listen": f"127.0.0.1:{self.port}", "routing": str(routing)}))
        self.proc = self.procs.start([self.agent_bin, "run", "--config", config], "epp-agent", cpu=self.cpu)
        for r, pub in enumerate(self.pubs):
            pub.wait_subscribed()
            n = own.get(r, 0)
            pub.stored(blocks[r][:n], tokens[:n * self.block], self.block)
            pub.stored(blocks[r][n:], filler_tokens.get(r), self.block)
        want = {f"r{r}": len(set(blocks[r])) for r in blocks}

        def mirrored():
            if self.proc.poll() is not None:
                raise RuntimeError(f"the agent exited with {self.proc.returncode}:\n{kit.tail(self.proc.log_path)}")
            _, _, raw = request("GET", f"http://127.0.0.1:{self.http}/debug/replicas", timeout=10)
            got = {r["replica"]: r["blocks"] for r in json.loads(raw)["replicas"]}
            return got == want
        wait_until(mirrored, 120, "the agent to mirror every replica's blocks", interval=0.5)

    def wait_healthy(self, admin: int) -> None:
        """Until the front Envoy's gRPC health check finds the picker serving (its index synced)."""
        flag = f"llmgw_epp::127.0.0.1:{self.port}::health_flags::healthy"
        wait_until(lambda: flag in kit.EnvoyAdmin(admin).get("/clusters"), 60, "the picker's gRPC health check")

    def cpu_seconds(self) -> float:
        """The agent's user + system CPU time (Linux /proc)."""
        return process_cpu_seconds(self.proc.pid)

    def metrics(self) -> dict[str, float]:
        """The picker's counters: decisions by outcome, decision time sum and count, tokenizer calls."""
        _, _, raw = request("GET", f"http://127.0.0.1:{self.http}/metrics", timeout=10)
        out: dict[str, float] = {}
        for line in raw.decode().splitlines():
            m = re.match(r'^(llmgw_epp_(?:decisions_total\{outcome="\w+"\}|decision_us_sum|decision_us_count|'
                         r'tokenizer_calls_total|tokenizer_failures_total|rejected_total)) (\S+)$', line)
            if m:
                out[m.group(1)] = float(m.group(2))
        return out

    def close(self) -> None:
        if self.proc is not None:
            self.procs.stop(self.proc)
        for p in self.pubs:
            p.close()
        self.ctx.term()
