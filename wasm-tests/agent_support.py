"""Helpers for the agent's interop tests: publishers that copy vLLM's ZMQ framing (live PUB frames
[topic, seq u64 BE, msgpack payload]; replay ROUTER answering [id, "", seq8] with
[id, "", topic, seq8, payload] per buffered batch and [id, "", "", ff*8, ""] at the end), vLLM 0.33.0
captured payloads, a Python model of the mirror, and an agent runner observed through its HTTP API."""

import json
import threading
import time
import urllib.request
from pathlib import Path

import msgpack
import zmq

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "crates" / "llmgw-core" / "tests" / "data" / "vllm-0.33.0"
END_SEQ = b"\xff" * 8


def capture(name: str = "batches_native_seed0.jsonl"):
    """[(seq, payload bytes, decoded events)] of a real vLLM 0.33.0 capture (events decoded from
    the native file, whose events the legacy file re-encodes)."""
    native = [json.loads(line) for line in (DATA / "batches_native_seed0.jsonl").read_text().splitlines()]
    rows = [json.loads(line) for line in (DATA / name).read_text().splitlines()]
    return [(r["seq"], bytes.fromhex(r["payload_hex"]), n["decoded"][1]) for r, n in zip(rows, native)]


def stored(hashes, ts=1.0, rank=0) -> bytes:
    ev = {"type": "BlockStored", "block_hashes": list(hashes), "parent_block_hash": None,
          "token_ids": [1] * (16 * len(hashes)), "block_size": 16, "lora_id": None, "medium": "GPU",
          "lora_name": None}
    return msgpack.packb([ts, [ev], rank])


def removed(hashes, ts=1.0, rank=0) -> bytes:
    ev = {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": "GPU"}
    return msgpack.packb([ts, [ev], rank])


def cleared(ts=1.0, rank=0) -> bytes:
    return msgpack.packb([ts, [{"type": "AllBlocksCleared"}], rank])


class Model:
    """What a mirror should hold: a refcounted multiset of GPU, group-0 block keys."""

    def __init__(self):
        self.count: dict[int, int] = {}

    def apply(self, events):
        for ev in events:
            kind = ev["type"] if isinstance(ev, dict) else ev[0]
            if kind == "BlockStored":
                for h in ev["block_hashes"]:
                    self.count[h] = self.count.get(h, 0) + 1
            elif kind == "BlockRemoved":
                for h in ev["block_hashes"]:
                    if h in self.count:
                        self.count[h] -= 1
                        if self.count[h] == 0:
                            del self.count[h]
            elif kind == "AllBlocksCleared":
                self.count.clear()

    def apply_payload(self, payload: bytes):
        self.apply(msgpack.unpackb(payload, strict_map_key=False)[1])

    def keys(self):
        return sorted(self.count)


class Publisher:
    """A vLLM-like publisher. The live socket is an XPUB (same wire behaviour as vLLM's PUB) so the
    test can wait until the agent's subscription arrived instead of sleeping; the replay socket is
    a ROUTER served from a thread, like vLLM's."""

    def __init__(self, endpoint: str, bind: bool, topic: bytes = b"", replay_endpoint: str | None = None,
                 legacy_replay: bool = False, buffer: list | None = None):
        self.ctx = zmq.Context()
        self.topic = topic
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.SNDHWM, 100000)
        self.pub.setsockopt(zmq.LINGER, 2000)
        (self.pub.bind if bind else self.pub.connect)(endpoint)
        self.buffer: list[tuple[int, bytes]] = list(buffer or [])
        self.replay_requests: list[int] = []
        # vLLM before 0.29 replied without the topic frame.
        self.legacy_replay = legacy_replay
        self._stop = threading.Event()
        self._thread = None
        if replay_endpoint:
            self.router = self.ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.router.bind(replay_endpoint)
            self._thread = threading.Thread(target=self._serve_replay, daemon=True)
            self._thread.start()

    def wait_subscribed(self, timeout: float = 20.0):
        """Blocks until a subscriber's subscription reached the publisher."""
        if not self.pub.poll(int(timeout * 1000)):
            raise TimeoutError("no subscriber subscribed")
        msg = self.pub.recv()
        assert msg[:1] == b"\x01", msg

    def send(self, seq: int, payload: bytes, live: bool = True, buffered: bool = True):
        """Publishes batch `seq`; `live=False` keeps it only in the replay buffer (a lost message)."""
        if buffered:
            self.buffer.append((seq, payload))
        if live:
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])

    def _serve_replay(self):
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        while not self._stop.is_set():
            if not dict(poller.poll(50)):
                continue
            frames = self.router.recv_multipart()
            if len(frames) != 3:
                continue
            ident, _, start = frames
            start_seq = int.from_bytes(start, "big")
            self.replay_requests.append(start_seq)
            topic = [] if self.legacy_replay else [self.topic]
            for seq, payload in list(self.buffer):
                if seq >= start_seq:
                    self.router.send_multipart([ident, b"", *topic, seq.to_bytes(8, "big"), payload])
            end = [] if self.legacy_replay else [b""]
            self.router.send_multipart([ident, b"", *end, END_SEQ, b""])

    def close(self):
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=5)
            self.router.close(0)
        self.pub.close(0)
        self.ctx.term()


class Agent:
    """An llmgw-agent process with a generated config, observed over its HTTP endpoints."""

    def __init__(self, procs, agent_bin, tmp: Path, free_port, replicas: list[dict], extra: str = "",
                 name: str = "agent", feed_extra: str = "", zmq_extra: str = "", launch: list | None = None,
                 env: dict | None = None):
        self.procs, self.agent_bin, self.free_port, self.name = procs, agent_bin, free_port, name
        self.launch, self.env = launch, env
        self.body = [f'[zmq]\nreplay_timeout_ms = 2000\n{zmq_extra}', extra]
        if "[load]" not in extra:
            self.body.append("[load]\nenabled = false\n")
        if "[hash]" not in extra:
            self.body.append('[hash]\nalgo = "sha256_cbor"\nseed = "0"\n')
        for r in replicas:
            self.body.append("[[replicas]]\n")
            for k, v in r.items():
                self.body.append(f"{k} = {json.dumps(v)}\n")
        self.feed_extra = feed_extra
        self.config = tmp / f"{name}.toml"
        self.attempts = 0
        self._start()

    def _start(self):
        """Writes the config with fresh loopback ports and starts the agent."""
        self.attempts += 1
        self.http = self.free_port()
        self.feed = self.free_port()
        head = [f'[feed]\nlisten = "127.0.0.1:{self.feed}"\n{self.feed_extra}', f'[http]\nlisten = "127.0.0.1:{self.http}"\n']
        self.config.write_text("".join(head + self.body))
        cmd = ([self.agent_bin, "launch", "--config", self.config, *self.launch] if self.launch
               else [self.agent_bin, "run", "--config", self.config])
        self.proc = self.procs.start(cmd, f"{self.name}-{self.attempts}", **({"env": self.env} if self.env else {}))
        self.log_path = self.proc.log_path

    def get(self, path: str) -> bytes:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http}{path}", timeout=5) as r:
            return r.read()

    def replicas(self) -> list[dict]:
        return json.loads(self.get("/debug/replicas"))["replicas"]

    def replica(self, name: str, rank: int = 0) -> dict:
        return next(r for r in self.replicas() if r["replica"] == name and r["dp_rank"] == rank)

    def metrics(self) -> str:
        return self.get("/metrics").decode()

    def log(self) -> str:
        return Path(self.log_path).read_text(errors="replace")

    def wait_ready(self, timeout: float = 30.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                # A port picked as free was taken in the meantime by another process: retry.
                if "Address already in use" in self.log() and self.attempts < 4:
                    self._start()
                    continue
                raise RuntimeError(f"agent exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if self.get("/healthz").strip() == b"ok" and self.proc.poll() is None:
                    return
            except OSError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"agent not ready:\n{self.log()}")

    def wait_for(self, name: str, cond, what: str, timeout: float = 20.0, rank: int = 0) -> dict:
        """Polls /debug/replicas until cond(replica) holds; returns that replica's entry."""
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            last = self.replica(name, rank)
            if cond(last):
                return last
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}; last state: {json.dumps(last)[:3000]}\n{self.log()[-4000:]}")


def newest_agent_bin() -> Path:
    """The most recently built llmgw-agent (release or debug), so a stale build is never tested."""
    found = [p for p in (ROOT / "target" / prof / "llmgw-agent" for prof in ("release", "debug")) if p.exists()]
    if not found:
        raise FileNotFoundError("llmgw-agent not built (run ./build.sh build)")
    return max(found, key=lambda p: p.stat().st_mtime)


def feed_proto(out_dir: Path):
    """Python messages and gRPC stubs generated from proto/llmgw/feed/v1/feed.proto."""
    import importlib
    import sys

    import grpc_tools
    from grpc_tools import protoc

    if "llmgw.feed.v1.feed_pb2_grpc" not in sys.modules:
        out_dir.mkdir(parents=True, exist_ok=True)
        include = Path(grpc_tools.__file__).parent / "_proto"
        proto_dir = ROOT / "proto"
        rc = protoc.main(["protoc", f"-I{proto_dir}", f"-I{include}", f"--python_out={out_dir}",
                          f"--grpc_python_out={out_dir}", str(proto_dir / "llmgw/feed/v1/feed.proto")])
        assert rc == 0, "protoc failed"
        for d in (out_dir / "llmgw", out_dir / "llmgw/feed", out_dir / "llmgw/feed/v1"):
            (d / "__init__.py").touch()
        sys.path.insert(0, str(out_dir))
    return importlib.import_module("llmgw.feed.v1.feed_pb2"), importlib.import_module("llmgw.feed.v1.feed_pb2_grpc")


class FeedSubscriber:
    """Subscribes to the agent's feed in a thread and keeps what a filter would know."""

    def __init__(self, pb, pb_grpc, port: int, name: str, token: str = ""):
        import grpc

        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        stub = pb_grpc.FeedStub(self.channel)
        self.call = stub.Subscribe(pb.SubscribeRequest(subscriber=name, token=token))
        self.lock = threading.Lock()
        self.messages = []
        self.error = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        try:
            for m in self.call:
                with self.lock:
                    self.messages.append(m)
        except Exception as e:  # cancelled at close, or an RPC error the test inspects
            self.error = e

    def state(self):
        """(seqs, replicas {id: (name, rank, up)}, blocks {id: set}, synced, loads {id: running})."""
        with self.lock:
            msgs = list(self.messages)
        replicas, blocks, loads, synced = {}, {}, {}, False
        for m in msgs:
            kind = m.WhichOneof("body")
            if kind == "replicas":
                replicas = {r.id: (r.name, r.dp_rank, r.up) for r in m.replicas.replicas}
                blocks = {k: v for k, v in blocks.items() if k in replicas}
            elif kind == "snapshot":
                if m.snapshot.first:
                    blocks[m.snapshot.replica] = set()
                blocks.setdefault(m.snapshot.replica, set()).update(m.snapshot.blocks)
            elif kind == "snapshot_complete":
                synced = True
            elif kind == "delta":
                b = blocks.setdefault(m.delta.replica, set())
                b.difference_update(m.delta.removed)
                b.update(m.delta.added)
            elif kind == "reset":
                blocks[m.reset.replica] = set()
            elif kind == "load":
                for l in m.load.loads:
                    loads[l.replica] = l.running
        return [m.seq for m in msgs], replicas, blocks, synced, loads, [m.WhichOneof("body") for m in msgs]

    def close(self):
        self.call.cancel()
        self.thread.join(timeout=5)
        self.channel.close()
