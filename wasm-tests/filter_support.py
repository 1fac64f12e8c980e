"""Helpers for the filter's end-to-end tests: vLLM block hashing (sha256_cbor) in Python, a
stub feed server speaking llmgw.feed.v1 over gRPC (code generated from the .proto at test
time), stub vLLM replicas, and an Envoy bootstrap generator."""

from __future__ import annotations

import hashlib
import importlib
import json
import queue
import re
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
sys.path.insert(0, str(ROOT / "demo"))
import demo  # noqa: E402  (the shipped Envoy bootstrap, filled in)

# ---------------------------------------------------------------------------------------------
# vLLM's sha256_cbor block hash (canonical CBOR of (parent, tuple(tokens), extra_keys or None)).


def _head(major: int, arg: int) -> bytes:
    m = major << 5
    if arg < 24:
        return bytes([m | arg])
    for code, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if arg < (1 << (8 * size)):
            return bytes([m | code]) + arg.to_bytes(size, "big")
    raise ValueError(arg)


def _cbor(v) -> bytes:
    if v is None:
        return b"\xf6"
    if isinstance(v, bool):
        raise TypeError("bool")
    if isinstance(v, int):
        return _head(0, v) if v >= 0 else _head(1, -1 - v)
    if isinstance(v, bytes):
        return _head(2, len(v)) + v
    if isinstance(v, str):
        b = v.encode()
        return _head(3, len(b)) + b
    if isinstance(v, (list, tuple)):
        return _head(4, len(v)) + b"".join(_cbor(x) for x in v)
    raise TypeError(type(v))


def block_keys(tokens: list[int], block_size: int, seed: str = "0", cache_salt: str | None = None,
               lora: tuple[str, str] | None = None) -> list[int]:
    """The u64 keys vLLM publishes for the full blocks of `tokens`."""
    parent = hashlib.sha256(_cbor(seed)).digest()
    keys = []
    for i in range(len(tokens) // block_size):
        extra = []
        if lora:
            extra.append(("lora", lora[0], lora[1]))
        if i == 0 and cache_salt:
            extra.append(("cache_salt", cache_salt))
        chunk = tokens[i * block_size:(i + 1) * block_size]
        parent = hashlib.sha256(_cbor((parent, tuple(chunk), tuple(extra) if extra else None))).digest()
        keys.append(int.from_bytes(parent[24:], "big"))
    return keys


# ---------------------------------------------------------------------------------------------
# The stub tokenizer every stub replica runs: one token per character (BOS = 1 when special
# tokens are added), chat messages rendered as "<role>content" plus "<assistant>" when a
# generation prompt is requested.


def tokenize_text(text: str, add_special_tokens: bool) -> list[int]:
    return ([1] if add_special_tokens else []) + [ord(c) for c in text]


def render_chat(messages, add_generation_prompt: bool = True) -> str:
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        out.append(f"<{m.get('role', '')}>{content or ''}")
    if add_generation_prompt:
        out.append("<assistant>")
    return "".join(out)


def completion_tokens(prompt: str) -> list[int]:
    return tokenize_text(prompt, True)


def chat_tokens(messages) -> list[int]:
    return tokenize_text(render_chat(messages, True), False)


# ---------------------------------------------------------------------------------------------
# Stub vLLM replica.


class Replica:
    """An HTTP server on 127.0.0.1 answering /tokenize and the OpenAI endpoints with its port."""

    def __init__(self, port: int, tokenize_status: int = 200):
        self.port = port
        self.address = f"127.0.0.1:{port}"
        self.tokenize_status = tokenize_status
        self.tokenize_delay = 0.0
        self.tokenize_calls: list[dict] = []
        self.requests: list[dict] = []
        replica = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # Headers and body go out in separate writes: without this, Nagle plus delayed ACKs
            # add 40 ms to every answer.
            disable_nagle_algorithm = True

            def log_message(self, *a):
                pass

            def _reply(self, status: int, body: bytes, ctype: str = "application/json"):
                self.send_response(status)
                self.send_header("content-type", ctype)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                self._reply(200, json.dumps({"port": replica.port, "path": self.path}).encode())

            def do_POST(self):
                n = int(self.headers.get("content-length") or 0)
                raw = self.rfile.read(n)
                if self.path == "/tokenize":
                    try:
                        req = json.loads(raw)
                    except ValueError:
                        req = {"unparseable": True}
                    replica.tokenize_calls.append(req)
                    if replica.tokenize_delay:
                        time.sleep(replica.tokenize_delay)
                    if replica.tokenize_status != 200:
                        return self._reply(replica.tokenize_status, b'{"error":"tokenizer down"}')
                    if "messages" in req:
                        text = render_chat(req["messages"], req.get("add_generation_prompt", True))
                        toks = tokenize_text(text, req.get("add_special_tokens", False))
                    else:
                        toks = tokenize_text(req.get("prompt", ""), req.get("add_special_tokens", True))
                    return self._reply(200, json.dumps(
                        {"count": len(toks), "max_model_len": 1 << 20, "tokens": toks, "token_strs": None}).encode())
                if self.path.endswith("/render"):
                    # vLLM's render endpoints take the generation body and return token_ids.
                    req = json.loads(raw)
                    replica.tokenize_calls.append({"render": self.path, **req})
                    if replica.tokenize_status != 200:
                        return self._reply(replica.tokenize_status, b'{"error":"render down"}')
                    if "messages" in req:
                        toks = chat_tokens(req["messages"])
                    else:
                        toks = completion_tokens(req.get("prompt", ""))
                    return self._reply(200, json.dumps({"request_id": "r", "token_ids": toks}).encode())
                replica.requests.append({"path": self.path, "headers": dict(self.headers.items()), "size": len(raw)})
                stream = False
                try:
                    stream = bool(json.loads(raw).get("stream"))
                except (ValueError, AttributeError):
                    pass
                if stream:
                    chunk = json.dumps({"port": replica.port, "choices": [{"text": "ok"}]})
                    return self._reply(200, f"data: {chunk}\n\ndata: [DONE]\n\n".encode(), "text/event-stream")
                self._reply(200, json.dumps({"port": replica.port, "path": self.path, "bytes": len(raw)}).encode())

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


# ---------------------------------------------------------------------------------------------
# Stub feed server (llmgw.feed.v1.Feed/Subscribe).


def load_feed_proto(out_dir: Path):
    """Generates Python code for feed.proto into out_dir and imports it."""
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    import grpc_tools

    include = Path(grpc_tools.__file__).parent / "_proto"
    rc = protoc.main(["protoc", f"-I{PROTO_DIR}", f"-I{include}", f"--python_out={out_dir}",
                      f"--grpc_python_out={out_dir}", str(PROTO_DIR / "llmgw/feed/v1/feed.proto")])
    assert rc == 0, "protoc failed"
    for d in (out_dir / "llmgw", out_dir / "llmgw/feed", out_dir / "llmgw/feed/v1"):
        (d / "__init__.py").touch()
    if str(out_dir) not in sys.path:
        sys.path.insert(0, str(out_dir))
    pb = importlib.import_module("llmgw.feed.v1.feed_pb2")
    pb_grpc = importlib.import_module("llmgw.feed.v1.feed_pb2_grpc")
    return pb, pb_grpc


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


# ---------------------------------------------------------------------------------------------
# Envoy.


def envoy_config(wasm: Path, listen_port: int, admin_port: int, agent_port: int, filter_cfg: dict) -> str:
    """The shipped bootstrap with test ports, an absolute wasm path and the given filter
    configuration; stats flushed every 0.2 s (histograms reach /stats/prometheus on a flush)."""
    text = demo.shipped_envoy_config(wasm, listen_port, admin_port, agent_port, filter_cfg)
    return text.replace("\nstats_config:", "\nstats_flush_interval: 0.2s\nstats_config:", 1)


def http(method: str, url: str, body: bytes | None = None, headers: dict | None = None, timeout: float = 10.0):
    """(status, headers, body) without raising on HTTP errors."""
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers.items()), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers.items()), e.read()


def wait_ready(admin_port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            status, _, body = http("GET", f"http://127.0.0.1:{admin_port}/ready", timeout=1)
            if status == 200 and body.strip() == b"LIVE":
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise TimeoutError("envoy not ready")


def prom(admin_port: int) -> str:
    return http("GET", f"http://127.0.0.1:{admin_port}/stats/prometheus")[2].decode()


def metric(admin_port: int, name: str, labels: str = "") -> float:
    """Sum of a Prometheus series' values (e.g. name='llmgw_prefix_decisions_total',
    labels='outcome="exact"')."""
    total = 0.0
    for line in prom(admin_port).splitlines():
        if line.startswith("#"):
            continue
        m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$", line)
        if m and m.group(1) == name and (not labels or labels in (m.group(2) or "")):
            total += float(m.group(3))
    return total


def wait_until(pred, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise TimeoutError(f"timed out waiting for {what}")
