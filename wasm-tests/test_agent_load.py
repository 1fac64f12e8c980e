"""llmgw-agent load scraping and liveness: a stand-in vLLM /metrics page on loopback is scraped for
running / waiting / KV-cache usage; when it stops answering the replica is marked down and its
blocks leave; when it answers again the replica is up and starts clean. Also data-parallel ranks:
each rank has its own publisher (port + rank) and its own blocks."""

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from agent_support import Publisher, stored
from llmgw_testkit import free_port


class MetricsServer:
    """Serves a vLLM-like Prometheus page on 127.0.0.1:port until stopped."""

    def __init__(self, port: int, running: int, waiting: int, usage: float, extra: dict | None = None):
        page = (
            "# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{engine="0",model_name="m"}} {running}.0\n'
            f'vllm:num_requests_waiting{{engine="0",model_name="m"}} {waiting}.0\n'
            f'vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} {usage}\n'
        ).encode()
        pages = {"/metrics": page, **{k: v.encode() for k, v in (extra or {}).items()}}

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                body = pages.get(self.path, b"not found")
                self.send_response(200 if self.path in pages else 404)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        ThreadingHTTPServer.allow_reuse_address = True
        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def test_agent_scrapes_load_and_marks_unreachable_replica_down_then_up_clean(start_agent):
    http_port, zport = free_port(), free_port()
    metrics = MetricsServer(http_port, running=3, waiting=2, usage=0.25)
    pub = Publisher(f"tcp://127.0.0.1:{zport}", bind=True)
    try:
        agent = start_agent([
            {"name": "r0", "address": f"127.0.0.1:{http_port}", "endpoint": f"tcp://127.0.0.1:{zport}"}],
            load={"enabled": True, "interval_ms": 100, "down_after_ms": 1000, "timeout_ms": 300})
        pub.wait_subscribed()
        pub.send(0, stored([1, 2, 3]))
        r = agent.wait_for("r0", lambda r: r["blocks"] == 3 and r["load"] is not None, "blocks and load")
        assert r["load"] == {"running": 3, "waiting": 2, "kv_cache_usage": 0.25}
        assert r["up"]

        metrics.stop()
        r = agent.wait_for("r0", lambda r: not r["up"], "replica down", timeout=15)
        assert r["blocks"] == 0 and r["resets"] == {"unreachable": 1}
        assert 'llmgw_agent_replica_up{replica="r0",dp_rank="0"} 0' in agent.metrics()
        # Events while down do not bring blocks back.
        pub.send(1, stored([4]))
        agent.wait_for("r0", lambda r: r["last_seq"] == 1, "seq 1")
        assert agent.replica("r0")["blocks"] == 0

        metrics = MetricsServer(http_port, running=1, waiting=0, usage=0.5)
        r = agent.wait_for("r0", lambda r: r["up"] and r["load"] is not None, "replica up", timeout=15)
        assert r["blocks"] == 0, "a replica coming back starts clean"
        assert r["load"]["running"] == 1
        pub.send(2, stored([5]))
        r = agent.wait_for("r0", lambda r: r["last_seq"] == 2, "seq 2")
        assert r["block_keys"] == [5]
    finally:
        pub.close()
        metrics.stop()


def test_agent_dp_ranks_are_separate_engines_on_offset_ports(start_agent):
    # Two consecutive free ports for ranks 0 and 1 (vLLM adds the rank to the port).
    for _ in range(20):
        base = free_port()
        p0 = Publisher(f"tcp://127.0.0.1:{base}", bind=True)
        try:
            p1 = Publisher(f"tcp://127.0.0.1:{base + 1}", bind=True)
            break
        except Exception:
            p0.close()
    else:
        pytest.fail("no two consecutive free ports")
    try:
        agent = start_agent([
            {"name": "dp", "address": "127.0.0.1:18000", "endpoint": f"tcp://127.0.0.1:{base}", "dp_ranks": 2}])
        p0.wait_subscribed()
        p1.wait_subscribed()
        p0.send(0, stored([10, 11], rank=0))
        # Rank 1's publisher claims rank 0 in its payload: its blocks still go to rank 1 only.
        p1.send(0, stored([20], rank=0))
        r0 = agent.wait_for("dp", lambda r: r["blocks"] == 2, "rank 0", rank=0)
        r1 = agent.wait_for("dp", lambda r: r["blocks"] == 1, "rank 1", rank=1)
        assert r0["block_keys"] == [10, 11] and r1["block_keys"] == [20]
        assert r1["endpoint"] == f"tcp://127.0.0.1:{base + 1}"
        assert r0["id"] != r1["id"]
    finally:
        p0.close()
        p1.close()


def test_agent_discovers_replica_by_dns_and_kv_event_sources(start_agent):
    """A DNS name (here `localhost`) is resolved; each address's GET /kv_event_sources gives the
    per-rank publishers (vLLM bound them on loopback with the IPv4-mapped form)."""
    import json as _json

    http_port = free_port()
    p0 = Publisher(f"tcp://127.0.0.1:{free_port()}", bind=True, topic=b"kv-events")
    p1 = Publisher(f"tcp://127.0.0.1:{free_port()}", bind=True, topic=b"kv-events")
    ports = [int(p.pub.getsockopt(zmq_last_endpoint()).decode().rsplit(":", 1)[1]) for p in (p0, p1)]
    sources = {str(rank): {"enable_kv_cache_events": True, "publisher": "zmq",
                           "endpoint": f"tcp://[::ffff:127.0.0.1]:{port}", "replay_endpoint": None,
                           "buffer_steps": 10000, "hwm": 100000, "max_queue_size": 100000, "topic": "kv-events"}
               for rank, port in enumerate(ports)}
    server = MetricsServer(http_port, running=2, waiting=1, usage=0.5, extra={"/kv_event_sources": _json.dumps(sources)})
    try:
        agent = start_agent([], load={"enabled": True, "interval_ms": 100},
                            discovery=[{"name": "pool", "dns": "localhost", "port": http_port, "models": ["m"],
                                        "refresh_ms": 200}])
        p0.wait_subscribed()
        p1.wait_subscribed()
        p0.send(0, stored([1, 2]))
        p1.send(0, stored([3]))
        name = "pool-127.0.0.1"
        r0 = agent.wait_for(name, lambda r: r["blocks"] == 2 and r["load"] is not None, "rank 0", rank=0)
        r1 = agent.wait_for(name, lambda r: r["blocks"] == 1 and r["load"] is not None, "rank 1", rank=1)
        assert r0["address"] == f"127.0.0.1:{http_port}" and r0["models"] == ["m"]
        assert r1["endpoint"] == f"tcp://[::ffff:127.0.0.1]:{ports[1]}"
        # The page's series carry engine="0": rank 0's load; rank 1 has none.
        assert r0["load"]["running"] == 2 and r1["load"]["running"] == 0
        assert r0["block_keys"] == [1, 2] and r1["block_keys"] == [3]
    finally:
        p0.close()
        p1.close()
        server.stop()


def zmq_last_endpoint():
    import zmq

    return zmq.LAST_ENDPOINT
