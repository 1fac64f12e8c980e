"""Small HTTP helpers over urllib (loopback servers: the agent, Envoy's admin, replicas)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request


def request(method: str, url: str, body: bytes | None = None, headers: dict | None = None,
            timeout: float = 10.0) -> tuple[int, dict, bytes]:
    """(status, headers, body) without raising on HTTP error statuses (connection errors raise OSError)."""
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers.items()), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers.items()), e.read()


def get_text(url: str, timeout: float = 5.0) -> str:
    """The body of a GET as text; raises on an HTTP error status."""
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def post_json(url: str, body: dict | None = None, timeout: float = 20.0):
    """POSTs JSON; returns the parsed answer (None when empty). Raises on an HTTP error status."""
    req = urllib.request.Request(url, data=json.dumps(body or {}).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        data = r.read()
        return json.loads(data) if data else None


def http_json(url: str, body: dict | None = None, timeout: float = 30.0, headers: dict | None = None):
    """GET (body None) or POST JSON; returns (status, response headers, parsed JSON or text),
    without raising on HTTP error statuses."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw, status, hdrs = r.read(), r.status, r.headers
    except urllib.error.HTTPError as e:
        raw, status, hdrs = e.read(), e.code, e.headers
    try:
        return status, hdrs, json.loads(raw)
    except ValueError:
        return status, hdrs, raw.decode(errors="replace")
