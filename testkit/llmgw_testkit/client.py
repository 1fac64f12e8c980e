"""The clients' side: a streaming chat request timed to its first token, a plain completion, and
the parser of the filter's explain header (x-llmgw-decision)."""

from __future__ import annotations

import http.client
import json
import re
import socket
import threading
import time
from typing import NamedTuple

DECISION_HEADER = "x-llmgw-decision"
_DECISION = re.compile(r"outcome=(\w+); replica=([\w.:\[\]-]+); matched=(\d+)/(\d+)(?:; speculative=(\d+))?")

_conns = threading.local()


def stream_request(port: int, body: dict, keepalive: bool = False, path: str = "/v1/chat/completions"):
    """One streaming request to 127.0.0.1:port: (ttft seconds, total seconds, status); ttft is NaN
    when no SSE data line arrived, status 0 when the connection failed. With `keepalive`, each
    client thread reuses one connection per port, as a router's upstream pool does."""
    data = json.dumps(body).encode()
    for attempt in range(2):
        t0 = time.monotonic()
        pool = getattr(_conns, "pool", None)
        if pool is None:
            pool = _conns.pool = {}
        conn = pool.pop(port, None) if keepalive else None
        fresh = conn is None
        if fresh:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        try:
            if fresh:
                conn.connect()
                conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.request("POST", path, body=data, headers={"content-type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                resp.read()
                conn.close()
                return (float("nan"), time.monotonic() - t0, resp.status)
            ttft = None
            while True:
                line = resp.readline()
                if not line:
                    break
                if ttft is None and line.startswith(b"data: "):
                    ttft = time.monotonic() - t0
            if keepalive and not resp.will_close:
                pool[port] = conn
            else:
                conn.close()
            return (ttft if ttft is not None else float("nan"), time.monotonic() - t0, 200)
        except (OSError, http.client.HTTPException):
            conn.close()
            # A pooled connection the server closed meanwhile: try once more on a fresh one.
            if fresh or attempt:
                return (float("nan"), time.monotonic() - t0, 0)
    return (float("nan"), 0.0, 0)


def plain_request(port: int, body: dict, path: str = "/v1/completions"):
    """One non-streaming request: (latency seconds, latency seconds, status)."""
    t0 = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", path, body=json.dumps(body), headers={"content-type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        return (time.monotonic() - t0, time.monotonic() - t0, resp.status)
    except (OSError, http.client.HTTPException):
        return (float("nan"), time.monotonic() - t0, 0)
    finally:
        conn.close()


class Decision(NamedTuple):
    outcome: str
    replica: str
    matched: int
    total: int


def parse_decision(header: str | None) -> Decision:
    """The filter's x-llmgw-decision header ("outcome=exact; replica=ADDR; matched=3/4; vm=1"):
    (outcome, replica address, blocks matched, blocks in the prompt); AssertionError when it is
    missing or malformed."""
    m = _DECISION.match(header or "")
    assert m, f"no {DECISION_HEADER} header in the response: {header!r}"
    return Decision(m.group(1), m.group(2), int(m.group(3)), int(m.group(4)))


def scored_before_tokenizing(header: str | None) -> bool:
    """Whether a decision header says the request was routed before its tokenizer answered, on a
    leading part of its prompt ("scored_on=earlier_turn" or "scored_on=shared_prefix"): its
    blocks matched are then a lower bound of what the replica held of it."""
    return "; scored_on=" in (header or "")


def speculative_blocks(header: str | None) -> int:
    """Of the blocks a decision header says were matched ("matched=8/12; speculative=3"), those
    only speculative entries credit: the filter just sent them there, no KV event confirmed them."""
    m = _DECISION.match(header or "")
    assert m, f"no {DECISION_HEADER} header in the response: {header!r}"
    return int(m.group(5) or 0)
