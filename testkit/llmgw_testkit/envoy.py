"""Envoy: the shipped bootstrap (envoy/llmgw-local.yaml) filled in with test ports and a filter
configuration, a plain load-balancing bootstrap, starting Envoy, and its admin API."""

from __future__ import annotations

import json
import re
from pathlib import Path

from .http import request
from .paths import ROOT
from .procs import wait_until

SHIPPED = ROOT / "envoy" / "llmgw-local.yaml"
SHIPPED_EPP = ROOT / "envoy" / "llmgw-epp-local.yaml"


def filter_config(profile: dict | None = None, **top) -> dict:
    """A filter configuration with one profile: sha256_cbor, seed "0", block size 16, KV events
    on, every model, the tokenize endpoint; `profile` and `top` add or override fields."""
    p = {"name": "default", "models": ["*"], "kv_events": True, "block_size": 16, "hash_algo": "sha256_cbor",
         "seed": "0", "tokenizer": "tokenize", "tokenizer_timeout_ms": 500, **(profile or {})}
    return {"agent_cluster": "llmgw_agent", "tokenizer_cluster": "llmgw_tokenizer", **top, "profiles": [p]}


def shipped_config(wasm: Path, listen: int, admin: int, agent: int, filter_cfg: dict,
                   stats_flush_interval: str | None = None, stats_flush_on_admin: bool = False) -> str:
    """envoy/llmgw-local.yaml with these ports (listener, admin, the agent's feed), an absolute
    wasm path and the given filter configuration; `stats_flush_interval` (e.g. "0.2s") makes
    histograms reach /stats/prometheus sooner; `stats_flush_on_admin` makes every read of the
    admin's stats flush them, and nothing else (no timer: what a benchmark reads is current, and
    Envoy does no flushing work between its reads)."""
    text = SHIPPED.read_text()
    for old, new in (("port_value: 9901", f"port_value: {admin}"), ("port_value: 10000", f"port_value: {listen}"),
                     ("port_value: 9090", f"port_value: {agent}"),
                     ("filename: dist/llmgw.wasm", f"filename: {Path(wasm).resolve()}")):
        if text.count(old) != 1:
            raise RuntimeError(f"{SHIPPED.relative_to(ROOT)}: expected `{old}` once, found it {text.count(old)} times")
        text = text.replace(old, new)
    # A YAML double-quoted scalar is a JSON string.
    text, n = re.subn(r"value: \|\n(?:\s{20}.*\n)+", f"value: {json.dumps(json.dumps(filter_cfg))}\n", text)
    if n != 1:
        raise RuntimeError(f"filter configuration block not found in {SHIPPED.relative_to(ROOT)}")
    if stats_flush_interval and stats_flush_on_admin:
        raise ValueError("stats_flush_interval and stats_flush_on_admin exclude each other")
    flush = f"stats_flush_interval: {stats_flush_interval}" if stats_flush_interval else None
    if stats_flush_on_admin:
        flush = "stats_flush_on_admin: true"
    if flush:
        if "\nstats_config:" not in text:
            raise RuntimeError(f"no stats_config in {SHIPPED.relative_to(ROOT)}")
        text = text.replace("\nstats_config:", f"\n{flush}\nstats_config:", 1)
    return text


def epp_bootstrap(listen: int, admin: int, epp: int, pool: list[int], fail_open: bool = False,
                  buffered: bool = False, served_by_header: str | None = None) -> str:
    """envoy/llmgw-epp-local.yaml with these ports (listener, admin, the endpoint picker), the
    pool's endpoints at 127.0.0.1:`pool`, FailOpen or FailClose, the request body streamed in
    full-duplex mode or buffered (FailOpen needs the latter in Envoy 1.40: in full-duplex mode an
    unreachable picker fails the request whatever failure_mode_allow says), and with
    `served_by_header` every answer naming the upstream address that served it in that header.
    Buffered (or FailOpen), the answer's body is not sent to the picker either."""
    text = SHIPPED_EPP.read_text()
    if buffered or fail_open:
        text = text.replace("request_body_mode: FULL_DUPLEX_STREAMED", "request_body_mode: BUFFERED")
        text = text.replace("request_trailer_mode: SEND", "request_trailer_mode: SKIP")
        text = text.replace("response_body_mode: FULL_DUPLEX_STREAMED", "response_body_mode: NONE")
        text = text.replace("response_trailer_mode: SEND", "response_trailer_mode: SKIP")
    pool_eps = "\n".join(f"        - endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {p}}}}}}}"
                         for p in pool)
    subs = [("port_value: 9901", f"port_value: {admin}"), ("port_value: 10000", f"port_value: {listen}"),
            ("port_value: 9002", f"port_value: {epp}"),
            ("        - endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: 8000}}}", pool_eps),
            ("failure_mode_allow: false", f"failure_mode_allow: {'true' if fail_open else 'false'}")]
    if served_by_header:
        subs.append(("          route_config:\n",
                     "          route_config:\n            response_headers_to_add:\n"
                     f"            - header: {{key: {served_by_header}, value: \"%UPSTREAM_HOST%\"}}\n"))
    for old, new in subs:
        if text.count(old) != 1:
            raise RuntimeError(f"{SHIPPED_EPP.name}: expected `{old}` once, found it {text.count(old)} times")
        text = text.replace(old, new)
    return text


def listener_yaml(name: str, port: int, cluster: str, buffer_limit: int | None = None) -> str:
    """One item of static_resources.listeners: HTTP on 127.0.0.1:port, every request to `cluster`."""
    limit = f"\n    per_connection_buffer_limit_bytes: {buffer_limit}" if buffer_limit else ""
    return f"""  - name: {name}
    address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}{limit}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: {name}
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{prefix: /}}
                route: {{cluster: {cluster}, timeout: 300s}}
          http_filters:
          - name: envoy.filters.http.router
            typed_config: {{"@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}}
"""


def shipped_idle_timeout() -> str:
    """The upstream idle timeout the shipped bootstrap gives the clusters that talk to vLLM."""
    m = re.search(r"common_http_protocol_options: \{idle_timeout: (\w+)\}", SHIPPED.read_text())
    if m is None:
        raise RuntimeError(f"{SHIPPED.relative_to(ROOT)}: no upstream idle_timeout")
    return m.group(1)


def cluster_yaml(name: str, ports: list[int], lb: str = "ROUND_ROBIN") -> str:
    """One item of static_resources.clusters: 127.0.0.1 at `ports`, balanced by `lb` (an Envoy lb_policy).
    Idle connections close after the shipped bootstrap's idle timeout (below vLLM's keep-alive)."""
    idle = shipped_idle_timeout()
    eps = "".join(f"        - endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {p}}}}}}}\n"
                  for p in ports)
    return f"""  - name: {name}
    type: STATIC
    lb_policy: {lb}
    connect_timeout: 1s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        common_http_protocol_options: {{idle_timeout: {idle}}}
        explicit_http_config: {{http_protocol_options: {{}}}}
    load_assignment:
      cluster_name: {name}
      endpoints:
      - lb_endpoints:
{eps}"""


def lb_config(listen: int, admin: int, ports: list[int], lb: str = "ROUND_ROBIN") -> str:
    """A bootstrap without the filter: one listener load-balancing (`lb`: an Envoy lb_policy)
    over 127.0.0.1 at `ports`."""
    return (f"admin:\n  address: {{socket_address: {{address: 127.0.0.1, port_value: {admin}}}}}\n"
            f"static_resources:\n  listeners:\n{listener_yaml('lb', listen, 'replicas')}"
            f"  clusters:\n{cluster_yaml('replicas', ports, lb)}")


def start_envoy(procs, envoy_bin, config: Path, name: str = "envoy", concurrency: int = 2, log_level: str = "warn",
          cpu: int | None = None, args=()):
    """Starts Envoy on `config` (hot restart off) in `procs`; returns the process."""
    return procs.start([envoy_bin, "-c", config, "--concurrency", concurrency, "--log-level", log_level,
                        "--disable-hot-restart", *args], name, cpu=cpu)


_PROM = re.compile(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$")


def prom_sum(text: str, name: str, labels: str = "") -> float:
    """Sum of the values of series `name` in Prometheus text, over the label sets containing
    `labels` (all of them when empty)."""
    total = 0.0
    for line in text.splitlines():
        m = _PROM.match(line)
        if m and not line.startswith("#") and m.group(1) == name and (not labels or labels in (m.group(2) or "")):
            total += float(m.group(3))
    return total


class EnvoyAdmin:
    """Envoy's admin API at 127.0.0.1:port."""

    def __init__(self, port: int):
        self.port = port
        self.base = f"http://127.0.0.1:{port}"

    def get(self, path: str, timeout: float = 5.0) -> str:
        status, _, body = request("GET", f"{self.base}{path}", timeout=timeout)
        if status != 200:
            raise OSError(f"Envoy admin {path}: HTTP {status}: {body[:200]!r}")
        return body.decode()

    def ready(self) -> bool:
        status, _, body = request("GET", f"{self.base}/ready", timeout=2)
        return status == 200 and body.strip() == b"LIVE"

    def wait_ready(self, timeout: float = 30.0, proc=None) -> None:
        """Waits for /ready to say LIVE; raises with the log when `proc` (Envoy) exits first."""
        def ok():
            if proc is not None and proc.poll() is not None:
                log = Path(proc.log_path).read_text(errors="replace")[-4000:]
                raise RuntimeError(f"Envoy exited with {proc.returncode}:\n{log}")
            return self.ready()
        wait_until(ok, timeout, f"Envoy /ready on admin port {self.port}")

    def stats(self, flt: str) -> dict[str, float]:
        """/stats?filter=flt as {name: value} (numeric values only)."""
        out: dict[str, float] = {}
        for line in self.get(f"/stats?filter={flt}").splitlines():
            name, _, value = line.partition(": ")
            try:
                out[name.strip()] = int(value) if value.strip().lstrip("-").isdigit() else float(value)
            except ValueError:
                pass
        return out

    def prom(self) -> str:
        return self.get("/stats/prometheus")

    def metric(self, name: str, labels: str = "") -> float:
        """Sum of a Prometheus series' values (e.g. name='llmgw_prefix_decisions_total',
        labels='outcome="exact"')."""
        return prom_sum(self.prom(), name, labels)

    def feed_connected(self) -> bool:
        """True when every filter VM reports its feed subscription up."""
        vals = list(self.stats("llmgw_feed_connected").values())
        return bool(vals) and all(v == 1 for v in vals)

    def wait_feed(self, timeout: float = 30.0) -> None:
        wait_until(self.feed_connected, timeout, "every filter VM subscribed to the agent's feed")

    def index_blocks(self) -> list[int]:
        """Each filter VM's llmgw_index_blocks gauge."""
        return [int(v) for v in self.stats("llmgw_index_blocks").values()]

    def decisions(self) -> dict[str, int]:
        """llmgw_prefix_decisions_total by outcome, summed over VMs."""
        out: dict[str, int] = {}
        for k, v in self.stats("llmgw_prefix_decisions_total").items():
            m = re.search(r"llmgw_prefix_decisions_total\.outcome\.(\w+)", k)
            if m:
                out[m.group(1)] = out.get(m.group(1), 0) + int(v)
        return out
