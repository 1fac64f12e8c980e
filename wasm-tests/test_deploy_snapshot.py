"""The snapshot sidecar in the shipped manifests: every vLLM replica pod (envoy/vllm/vllm.yaml)
runs `llmgw-agent publish --snapshot-listen` beside vLLM, started before it, probed, bounded in
memory, reading the replica's own publisher and replay socket on loopback; every agent that
mirrors the replicas (the wasm gateways' and the endpoint picker's) asks each replica's sidecar
for a snapshot (discovery `snapshot_port`), and the NetworkPolicies let exactly those agents reach
it. Broken copies of the manifests are refused (how each check could fail). End to end: the
sidecar run from the shipped configuration beside a simulated replica whose replay buffer rolled
past its early batches, and an agent with the shipped discovery, hold the replica's whole cache."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

import deploy_support as deploy
import network_policy
from llmgw_testkit import free_port, request, wait_port, wait_until
from llmgw_testkit import get_text as get
from llmgw_testkit import post_json as post
from llmgw_testkit.fleet import new_sims, sim_command, wait_sims

AGENT_IMAGE = "llmgw/llmgw-agent:"
# Who mirrors the replicas: each wasm gateway's agent.toml, and the endpoint picker's.
AGENT_CONFIGS = {"kubernetes": ("kubernetes/llmgw-gateway.yaml", "llmgw-gateway"),
                 "istio": ("istio/llmgw-gateway.yaml", "llmgw-gateway"),
                 "envoy-gateway": ("envoy-gateway/llmgw-gateway.yaml", "llmgw-agent"),
                 "gaie": ("gaie/base/llmgw-epp.yaml", "llmgw-epp")}
# Bytes a sidecar holds per ledger block at most: its index's hash-table entry (24 bytes and a
# control byte) at the table's lowest load (half), its 16-byte entry in a vector at most half
# full, and while a snapshot is built, its 16-byte copy and about 9 bytes encoded (twice, as the
# buffer grows).
LEDGER_BYTES_PER_BLOCK = 2 * 25 + 2 * 16 + 16 + 2 * 9


def _sidecar(dep: dict) -> dict:
    sidecars = [c for c in dep["spec"]["template"]["spec"].get("initContainers", [])
                if c.get("command", [])[1:2] == ["publish"]]
    if len(sidecars) != 1:
        raise AssertionError(f"expected one snapshot sidecar (llmgw-agent publish) in the replica pod, found {len(sidecars)}")
    return sidecars[0]


def _port_number(container: dict, port) -> int:
    if isinstance(port, int):
        return port
    (n,) = [p["containerPort"] for p in container.get("ports", []) if p["name"] == port]
    return n


def wiring(root: Path = deploy.ENVOY_DIR) -> dict:
    """Checks the sidecar's wiring in the manifests under `root`; returns what it found."""
    vllm = deploy.load("vllm/vllm.yaml", root)
    dep = deploy.find(vllm, "Deployment", "vllm")
    spec = dep["spec"]["template"]["spec"]
    (engine,) = spec["containers"]
    side = _sidecar(dep)
    cmd = side["command"]
    assert cmd[0] == "/usr/local/bin/llmgw-agent" and side["image"].startswith(AGENT_IMAGE), side
    # Started (its probe passed) before vLLM, and stopped after it: it hears the first batch.
    assert side.get("restartPolicy") == "Always", "the sidecar is not a native sidecar (restartPolicy: Always)"
    assert "--snapshot-listen" in cmd, cmd
    host, port = cmd[cmd.index("--snapshot-listen") + 1].rsplit(":", 1)
    port = int(port)
    assert host == "0.0.0.0", "the gateways' agents reach the sidecar at the pod's address"
    assert port in [p["containerPort"] for p in side.get("ports") or []], f"the sidecar's port {port} is not declared"
    for probe in ("startupProbe", "livenessProbe"):
        get_ = side.get(probe, {}).get("httpGet", {})
        assert get_.get("path") == "/healthz" and _port_number(side, get_.get("port")) == port, \
            f"the sidecar's {probe} does not ask its /healthz on {port}"
    assert "readinessProbe" not in side, "the sidecar's readiness would take the replica out of service"
    res = side.get("resources", {})
    assert {"cpu", "memory"} <= set(res.get("requests", {})) and "memory" in res.get("limits", {}), \
        f"the sidecar's resources: {res}"

    # Its configuration: the replica in its own pod, on loopback, as vLLM publishes.
    conf = cmd[cmd.index("--config") + 1]
    mounts = [m for m in side.get("volumeMounts", []) if conf.startswith(m["mountPath"].rstrip("/") + "/")]
    assert len(mounts) == 1, f"the sidecar's --config {conf} is on no mounted volume"
    (vol,) = [v for v in spec.get("volumes", []) if v["name"] == mounts[0]["name"]]
    cm = deploy.find(vllm, "ConfigMap", vol["configMap"]["name"])
    text = cm["data"][conf.rsplit("/", 1)[1]]
    publish = tomllib.loads(text)
    assert "jetstream" not in publish, "snapshots only: no broker"
    (replica,) = publish["replicas"]
    kv = json.loads(engine["args"][engine["args"].index("--kv-events-config") + 1])
    for key in ("endpoint", "replay_endpoint"):
        assert replica[key] == "tcp://127.0.0.1:" + kv[key].rsplit(":", 1)[1], \
            f"the sidecar's {key} {replica[key]} is not vLLM's {kv[key]} on loopback"
    blocks = publish["zmq"]["max_blocks_per_engine"]
    queued = publish["zmq"]["max_queued_bytes"]
    limit = _bytes(res["limits"]["memory"])
    assert blocks * LEDGER_BYTES_PER_BLOCK + queued <= limit, \
        f"{blocks} ledger blocks and {queued} queued bytes do not fit the sidecar's memory limit {limit}"

    # Every agent mirroring the replicas asks each one's sidecar.
    svc = deploy.find(vllm, "Service", "vllm")
    for where, (path, name) in AGENT_CONFIGS.items():
        agent = tomllib.loads(deploy.find(deploy.load(path, root), "ConfigMap", name)["data"]["agent.toml"])
        (disc,) = agent["discovery"]
        assert disc["dns"].startswith(f"{svc['metadata']['name']}.{svc['metadata']['namespace']}."), where
        assert disc.get("snapshot_port") == port, f"{where}'s agent asks snapshots on {disc.get('snapshot_port')}, the sidecars listen on {port}"

    # Only those agents reach it: the wasm gateways' pods and the pickers.
    policies = [o for f in ("vllm/vllm.yaml", *deploy.GAIE_BASE) for o in deploy.load(f, root)
                if o["kind"] == "NetworkPolicy"]
    pod = dep["spec"]["template"]["metadata"]["labels"]
    ns = dep["metadata"]["namespace"]
    gw = deploy.find(deploy.load("kubernetes/llmgw-gateway.yaml", root), "Deployment", "llmgw-gateway")
    epp = deploy.find(deploy.load(deploy.GAIE_BASE[0], root), "Deployment", "llmgw-epp")
    for who in (gw, epp):
        assert network_policy.admitted(policies, pod, who["metadata"]["namespace"],
                                       who["spec"]["template"]["metadata"]["labels"], port), \
            f"{who['metadata']['name']} may not reach the sidecar's port {port}"
    assert not network_policy.admitted(policies, pod, ns, {"app.kubernetes.io/name": "client"}, port), \
        "any pod reaches the sidecar"
    return {"port": port, "sidecar": side, "publish": text}


def _bytes(q: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}
    for u, m in units.items():
        if q.endswith(u):
            return int(q[:-2]) * m
    return int(q)


def test_every_replica_runs_the_snapshot_sidecar_and_every_agent_asks_it():
    w = wiring()
    # One image for the sidecar and the gateways' agent: they speak one snapshot protocol.
    gw = deploy.find(deploy.load("kubernetes/llmgw-gateway.yaml"), "Deployment", "llmgw-gateway")
    (agent,) = [c for c in gw["spec"]["template"]["spec"]["containers"] if c["name"] == "llmgw-agent"]
    assert w["sidecar"]["image"] == agent["image"]


def test_the_sidecars_configuration_is_accepted_by_the_agent(tmp_path, agent_bin):
    import subprocess

    path = tmp_path / "publish.toml"
    path.write_text(wiring()["publish"])
    r = subprocess.run([str(agent_bin), "check-config", "--config", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


BROKEN = [
    ("vllm/vllm.yaml", "      - name: llmgw-snapshot\n        image: llmgw/llmgw-agent:0.1.0\n        restartPolicy: Always\n",
     "      - name: llmgw-snapshot\n        image: llmgw/llmgw-agent:0.1.0\n", "not a native sidecar"),
    ("vllm/vllm.yaml", '"--snapshot-listen", "0.0.0.0:9100"', '"--snapshot-listen", "127.0.0.1:9100"',
     "reach the sidecar at the pod's address"),
    ("vllm/vllm.yaml", "        - {name: kv-snapshot, containerPort: 9100}\n", "", "not declared"),
    ("vllm/vllm.yaml", "          limits: {memory: 512Mi}\n", "          limits: {memory: 64Mi}\n",
     "do not fit the sidecar's memory limit"),
    ("vllm/vllm.yaml", 'endpoint = "tcp://127.0.0.1:5557"', 'endpoint = "tcp://127.0.0.1:5559"',
     "is not vLLM's"),
    ("vllm/vllm.yaml", "    - {protocol: TCP, port: 9100}\n", "", "llmgw-gateway may not reach"),
    ("gaie/base/llmgw-epp.yaml", "    - {protocol: TCP, port: 9100}\n", "", "llmgw-epp may not reach"),
    ("istio/llmgw-gateway.yaml", "    snapshot_port = 9100", "    snapshot_port = 9101", "istio's agent asks snapshots on 9101"),
    ("gaie/base/llmgw-epp.yaml", "    snapshot_port = 9100", "    # snapshot_port = 9100", "gaie's agent asks snapshots on None"),
]


@pytest.mark.parametrize("rel,old,new,message", BROKEN, ids=[m for *_, m in BROKEN])
def test_a_miswired_sidecar_is_refused(tmp_path, rel, old, new, message):
    root = deploy.envoy_copy(tmp_path)
    wiring(root)  # the copy passes before the edit
    deploy.edit(root, rel, old, new, once=True)
    with pytest.raises(AssertionError, match=message):
        wiring(root)


BUFFER_STEPS = 4


def _prompt(tag: str) -> str:
    return f"{tag} " + " ".join(f"word{i}" for i in range(69))  # 4 full blocks of 16


def test_the_shipped_sidecar_lets_an_agent_with_the_shipped_discovery_join_late(procs, tmp_path, sim_bin, agent_bin,
                                                                                start_agent):
    """The sidecar as vllm.yaml runs it (its command and publish.toml, the ports made the
    simulator's and loopback's) beside a replica whose replay buffer holds 4 batches; once its
    startup probe's /healthz answers, prefixes are warmed and rolled past the buffer. An agent
    started then with the shipped gateway's discovery entry (snapshot_port the sidecar's) holds
    the replica's whole cache and does not mark it incomplete."""
    w = wiring()
    (sim,) = new_sims(1)
    # The simulator binds its publisher as vLLM does with tcp://*:PORT (an IPv6 address makes it
    # bind, on loopback here), and the sidecar connects to it at 127.0.0.1.
    procs.start(sim_command(sim_bin, sim, "m", host="[::ffff:127.0.0.1]", blocks=4096, block_size=16, seed="0",
                            decode_ms=1, buffer_steps=BUFFER_STEPS), sim["name"])
    wait_sims([sim])
    snap = free_port()
    text = w["publish"].replace(":5557", f":{sim['kv']}").replace(":5558", f":{sim['replay']}") \
        .replace('"127.0.0.1:8000"', f'"127.0.0.1:{sim["port"]}"')
    conf = tmp_path / "publish.toml"
    conf.write_text(text)
    cmd = [str(agent_bin) if a == "/usr/local/bin/llmgw-agent" else a for a in w["sidecar"]["command"]]
    cmd[cmd.index("--config") + 1] = str(conf)
    cmd[cmd.index("--snapshot-listen") + 1] = f"127.0.0.1:{snap}"
    procs.start(cmd, "sidecar")
    wait_port(snap)
    assert request("GET", f"http://127.0.0.1:{snap}/healthz", timeout=5)[0] == 200
    url = f"http://127.0.0.1:{sim['port']}"
    n = [0]

    def heard():
        post(f"{url}/v1/completions", {"model": "m", "prompt": _prompt(f"prime-{n[0]}"), "max_tokens": 2})
        n[0] += 1
        return request("GET", f"http://127.0.0.1:{snap}/snapshot?dp_rank=0", timeout=5)[0] == 200
    wait_until(heard, 20, "the sidecar has a snapshot", interval=0.2)
    for i in range(3 * BUFFER_STEPS):
        post(f"{url}/v1/completions", {"model": "m", "prompt": _prompt(f"warm-{i}"), "max_tokens": 2})

    gw = tomllib.loads(deploy.find(deploy.load("kubernetes/llmgw-gateway.yaml"), "ConfigMap",
                                   "llmgw-gateway")["data"]["agent.toml"])
    (disc,) = gw["discovery"]
    assert disc["snapshot_port"] == w["port"]
    disc = {**disc, "dns": "127.0.0.1", "port": int(sim["port"]), "models": ["m"], "refresh_ms": 200,
            "snapshot_port": snap}
    agent = start_agent([], discovery=[disc])
    name = f"{disc['name']}-127.0.0.1"
    cache = set(json.loads(get(f"{url}/sim/blocks"))["keys"])
    r = agent.wait_for(name, lambda r: set(r["block_keys"]) == cache, "the agent holds the replica's whole cache")
    assert r["snapshot"]["joins"] == 1 and r["incomplete_from"] is None, r
