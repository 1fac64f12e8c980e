"""The agent's feed (llmgw.feed.v1 over gRPC) in Python: code generated from
proto/llmgw/feed/v1/feed.proto at test time, a stub feed server (what the filter subscribes
to) and a subscriber (what a filter would know). Needs grpcio and grpcio-tools."""

from __future__ import annotations

import importlib
import queue
import sys
import threading
from concurrent import futures
from pathlib import Path

from .paths import ROOT

PROTO_DIR = ROOT / "proto"


def load_feed_proto(out_dir: Path):
    """(feed_pb2, feed_pb2_grpc), generated into out_dir on first use in this interpreter."""
    if "llmgw.feed.v1.feed_pb2_grpc" not in sys.modules:
        import grpc_tools
        from grpc_tools import protoc

        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        include = Path(grpc_tools.__file__).parent / "_proto"
        rc = protoc.main(["protoc", f"-I{PROTO_DIR}", f"-I{include}", f"--python_out={out_dir}",
                          f"--grpc_python_out={out_dir}", str(PROTO_DIR / "llmgw/feed/v1/feed.proto")])
        if rc != 0:
            raise RuntimeError(f"protoc failed ({rc}) on {PROTO_DIR / 'llmgw/feed/v1/feed.proto'}")
        for d in (out_dir / "llmgw", out_dir / "llmgw/feed", out_dir / "llmgw/feed/v1"):
            (d / "__init__.py").touch()
        sys.path.insert(0, str(out_dir))
    return importlib.import_module("llmgw.feed.v1.feed_pb2"), importlib.import_module("llmgw.feed.v1.feed_pb2_grpc")


class FeedStub:
    """Serves every subscriber the replica table, a snapshot and SnapshotComplete, then the
    messages pushed with `publish`, with heartbeats in between."""

    def __init__(self, pb, pb_grpc, port: int, replicas: list[dict], blocks: dict[int, list[int]],
                 heartbeats: bool = True):
        import grpc

        self.pb = pb
        self.port = port
        self.replicas = replicas
        self.blocks = blocks
        self.subscriptions = 0
        self.snapshots_sent = 0
        self.tokens: list[str] = []
        self._queues: list[queue.Queue] = []
        self._lock = threading.Lock()
        stub = self

        class Servicer(pb_grpc.FeedServicer):
            def Subscribe(self, request, context):
                q: queue.Queue = queue.Queue()
                with stub._lock:
                    stub.subscriptions += 1
                    stub.tokens.append(request.token)
                    stub._queues.append(q)
                seq = 0
                for body in stub.initial_messages():
                    yield pb.FeedMessage(seq=seq, **body)
                    seq += 1
                with stub._lock:
                    stub.snapshots_sent += 1
                while context.is_active():
                    try:
                        body = q.get(timeout=0.5)
                    except queue.Empty:
                        if not heartbeats:
                            continue
                        body = {"heartbeat": pb.Heartbeat()}
                    yield pb.FeedMessage(seq=seq, **body)
                    seq += 1

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
        pb_grpc.add_FeedServicer_to_server(Servicer(), self.server)
        self.server.add_insecure_port(f"127.0.0.1:{port}")
        self.server.start()

    def initial_messages(self) -> list[dict]:
        pb = self.pb
        msgs = [{"replicas": pb.ReplicaTable(replicas=[pb.Replica(**r) for r in self.replicas])}]
        for rid, keys in self.blocks.items():
            msgs.append({"snapshot": pb.SnapshotChunk(replica=rid, first=True, blocks=keys)})
        msgs.append({"snapshot_complete": pb.SnapshotComplete()})
        return msgs

    def publish(self, body: dict):
        with self._lock:
            for q in self._queues:
                q.put(body)

    def stop(self):
        self.server.stop(grace=None).wait(5)


class FeedSubscriber:
    """Subscribes to an agent's feed in a thread and keeps what a filter would know."""

    def __init__(self, pb, pb_grpc, port: int, name: str, token: str = "", batches: bool = False):
        import grpc

        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        stub = pb_grpc.FeedStub(self.channel)
        self.call = stub.Subscribe(pb.SubscribeRequest(subscriber=name, token=token, batches=batches))
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
        """(seqs, replicas {id: (name, rank, up)}, blocks {id: set}, synced, loads {id: running}, kinds)."""
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
            elif kind in ("delta", "deltas"):
                for d in [m.delta] if kind == "delta" else m.deltas.deltas:
                    b = blocks.setdefault(d.replica, set())
                    b.difference_update(d.removed)
                    b.update(d.added)
            elif kind == "reset":
                blocks[m.reset.replica] = set()
            elif kind == "load":
                for ld in m.load.loads:
                    loads[ld.replica] = ld.running
        return [m.seq for m in msgs], replicas, blocks, synced, loads, [m.WhichOneof("body") for m in msgs]

    def close(self):
        self.call.cancel()
        self.thread.join(timeout=5)
        self.channel.close()
