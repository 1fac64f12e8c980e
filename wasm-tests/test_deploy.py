"""The deployment manifests (envoy/kubernetes, envoy/istio, envoy/envoy-gateway): every object
validates against its schema, every Envoy fragment assembles into a bootstrap the way its control
plane assembles it and passes `envoy --mode validate` with llmgw.wasm loaded, the shipped
settings agree with each other, and each assembled bootstrap routes a follow-up exactly in front
of simulated replicas and the agent while ignoring a client's destination header. Broken copies
of the manifests are refused (how each check could fail). The endpoint-picker manifests
(envoy/gaie) are validated and their wiring checked (route, pool, picker, replicas, policies),
and assembled into the Envoy configuration GAIE prescribes (envoy/llmgw-epp-local.yaml's shape)
for `envoy --mode validate`."""

from __future__ import annotations

import copy
import json
import shlex
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import jsonschema
import pytest
import yaml

import deploy_support as deploy
import network_policy
import llmgw_testkit as kit
import seed_wiring
from llmgw_testkit import wait_until
from llmgw_testkit.fleet import fleet_agent, new_sims, sim_command, wait_publishers
from llmgw_testkit.stub import StubHandler, StubServer

KINDS = list(deploy.MANIFESTS)
FILES = sorted({f for fs in [*deploy.MANIFESTS.values(), *deploy.GAIE.values()] for f in fs})
LOCAL = kit.ROOT / "envoy" / "llmgw-local.yaml"
DEST = "x-gateway-destination-endpoint"


# ---------------------------------------------------------------------------------------------
# What ships, and its schemas.


def test_every_shipped_manifest_is_one_the_tests_read():
    # The kustomizations and the overlay's files are test_kustomize.py's; the two bootstraps for one
    # machine are read by their own tests (test_epp.py: the endpoint picker's).
    shipped = {str(p.relative_to(deploy.ENVOY_DIR)) for p in deploy.ENVOY_DIR.rglob("*.yaml")
               if p.name != "kustomization.yaml" and "overlays" not in p.relative_to(deploy.ENVOY_DIR).parts}
    shipped -= {LOCAL.name, "llmgw-epp-local.yaml"}
    assert shipped == set(FILES), f"untested manifests: {sorted(shipped - set(FILES))}; missing: {sorted(set(FILES) - shipped)}"


@pytest.mark.parametrize("path", FILES)
def test_every_object_validates_against_its_schema(path):
    objs = deploy.load(path)
    assert objs, f"{path} holds no objects"
    for o in objs:
        checked = deploy.validate(o)
        assert checked, o["kind"]
        # Every container names its image (Kubernetes' schema lets it be omitted).
        for c in _containers(o):
            assert c.get("image"), f"{path}: {o['kind']} {o['metadata']['name']}: container {c['name']} names no image"


def _containers(o: dict) -> list[dict]:
    if o["kind"] == "Deployment":
        spec = o["spec"]["template"]["spec"]
        return spec.get("initContainers", []) + spec["containers"]
    if o["kind"] == "EnvoyProxy":
        dep = o["spec"]["provider"]["kubernetes"]["envoyDeployment"]
        patched = dep.get("patch", {}).get("value", {}).get("spec", {}).get("template", {}).get("spec", {})
        return dep.get("initContainers", []) + patched.get("containers", [])
    return []


def _mutated(objs, kind, change):
    o = copy.deepcopy(next(x for x in objs if x["kind"] == kind))
    change(o)
    return o


# One broken object per schema source: a misspelt field, a value outside an enum, a wrong type.
BROKEN = [
    ("vllm/vllm.yaml", "Deployment", lambda o: o["spec"].__setitem__("replica", 2)),
    ("kubernetes/llmgw-gateway.yaml", "Service", lambda o: o["spec"]["ports"][0].__setitem__("port", "eighty")),
    ("istio/llmgw-envoyfilter.yaml", "EnvoyFilter",
     lambda o: o["spec"]["configPatches"][1].__setitem__("applyTo", "HTTP_FILTERS")),
    ("istio/llmgw-gateway.yaml", "VirtualService", lambda o: o["spec"]["http"][0].__setitem__("matches", [])),
    ("envoy-gateway/llmgw-envoypatchpolicy.yaml", "EnvoyPatchPolicy",
     lambda o: o["spec"]["jsonPatches"][0]["operation"].__setitem__("op", "insert")),
    ("envoy-gateway/llmgw-gateway.yaml", "HTTPRoute",
     lambda o: o["spec"]["rules"][0]["matches"][0]["path"].__setitem__("type", "Prefix")),
    ("envoy-gateway/llmgw-gateway.yaml", "EnvoyProxy",
     lambda o: o["spec"]["provider"]["kubernetes"]["envoyDeployment"].__setitem__("sidecars", [])),
    ("gaie/base/llmgw-inferencepool.yaml", "InferencePool",
     lambda o: o["spec"]["endpointPickerRef"].__setitem__("failureMode", "FailSafe")),
    ("gaie/base/llmgw-inferencepool.yaml", "InferencePool", lambda o: o["spec"].__setitem__("targetPort", 8000)),
    ("gaie/base/llmgw-inferencepool.yaml", "HTTPRoute",
     lambda o: o["spec"]["rules"][0]["backendRefs"][0].__setitem__("kind", 7)),
    ("gaie/base/llmgw-epp.yaml", "Deployment",
     lambda o: o["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"].__setitem__("service", 1)),
]


@pytest.mark.parametrize("path,kind,change", BROKEN, ids=[f"{p}:{k}" for p, k, _ in BROKEN])
def test_a_broken_object_is_refused(path, kind, change):
    bad = _mutated(deploy.load(path), kind, change)
    with pytest.raises(Exception) as e:
        deploy.validate(bad)
    assert isinstance(e.value, jsonschema.ValidationError) or "Validation" in type(e.value).__name__, e.value


# ---------------------------------------------------------------------------------------------
# Assembled as each control plane assembles them.


@pytest.fixture(scope="module")
def assembled():
    return {k: deploy.ASSEMBLE[k]() for k in KINDS}


INFERENCE_LISTENER = {"kubernetes": "llmgw", "istio": "0.0.0.0_8080", "envoy-gateway": "tcp-80"}


@pytest.mark.parametrize("kind", KINDS)
def test_filter_sits_before_the_router_behind_the_header_removal(assembled, kind):
    b = assembled[kind]
    names = [f["name"] for f in deploy.http_filters(b, INFERENCE_LISTENER[kind])]
    i = names.index(deploy.WASM_FILTER)
    assert names[i - 1] == deploy.HEADER_MUTATION and names[-1] == deploy.ROUTER and names.count(deploy.WASM_FILTER) == 1, names
    (wasm,) = [f for f in deploy.http_filters(b) if f["name"] == deploy.WASM_FILTER]
    cfg = wasm["typed_config"]["config"]
    assert cfg["allow_on_headers_stop_iteration"] is True and cfg["failure_policy"] == "FAIL_RELOAD"
    # A crashed VM is reloaded with the next request, not after Envoy's default 1 s (test_faults.py).
    assert cfg["reload_config"] == {"backoff": {"base_interval": "0.01s"}}, cfg.get("reload_config")
    (hm,) = [f for f in deploy.http_filters(b, INFERENCE_LISTENER[kind]) if f["name"] == deploy.HEADER_MUTATION]
    assert hm["typed_config"]["mutations"]["request_mutations"] == [
        {"remove": DEST}, {"remove_on_match": {"key_matcher": {"prefix": "x-envoy-"}}}]
    lst = next(x for x in b["static_resources"]["listeners"] if x["name"] == INFERENCE_LISTENER[kind])
    (filter_cfg,) = deploy.wasm_configs(b)
    assert lst["per_connection_buffer_limit_bytes"] >= filter_cfg["max_body_bytes"]
    for name in ("llmgw_replicas", "llmgw_tokenizer", "llmgw_agent"):
        deploy.cluster(b, name)
    # The inference paths, and only they, go to the replica the filter names.
    to_replicas = {r["match"].get("path") for r in deploy.routes(b, INFERENCE_LISTENER[kind])
                   if r.get("route", {}).get("cluster") == "llmgw_replicas"}
    assert to_replicas == {"/v1/chat/completions", "/v1/completions"}
    first = deploy.routes(b, INFERENCE_LISTENER[kind])[:2]
    assert all(r["route"]["cluster"] == "llmgw_replicas" for r in first), first


def test_envoy_gateway_patches_address_the_generated_names(assembled):
    b = assembled["envoy-gateway"]
    (lst,) = b["static_resources"]["listeners"]
    assert lst["name"] == "tcp-80" and lst["default_filter_chain"]["name"] == "http-80"
    assert lst["address"]["socket_address"]["port_value"] == 10080
    (hcm,) = deploy.hcm_of(lst)
    assert hcm["route_config"]["name"] == "http-80" and hcm["stat_prefix"] == "http-80"
    # What Envoy Gateway generated stays: its own route to the Service is behind llmgw's.
    assert [r["route"]["cluster"] for r in deploy.routes(b, "tcp-80")][2:] == ["httproute/llmgw/llmgw/rule/0"] * 2


BROKEN_ASSEMBLY = [
    # A patch aimed at a port the Gateway does not have matches nothing.
    ("istio", "istio/llmgw-envoyfilter.yaml", "portNumber: 8080", "portNumber: 8081", "matches nothing"),
    # The pods must carry the label the EnvoyFilter selects.
    ("istio", "istio/llmgw-envoyfilter.yaml", "labels: {istio: llmgw-gateway}", "labels: {istio: ingressgateway}",
     "workloadSelector"),
    # The old (pre-V2) listener name is not what 1.9 with scheme V2 generates.
    ("envoy-gateway", "envoy-gateway/llmgw-envoypatchpolicy.yaml", "name: tcp-80", "name: llmgw/llmgw/http",
     "no Listener named"),
    ("envoy-gateway", "envoy-gateway/envoy-gateway-config.yaml", "enabled: [XDSNameSchemeV2]", "enabled: []",
     "scheme V2"),
    ("envoy-gateway", "envoy-gateway/envoy-gateway-config.yaml", "enableEnvoyPatchPolicy: true",
     "enableEnvoyPatchPolicy: false", "not enabled"),
]


@pytest.mark.parametrize("kind,rel,old,new,message", BROKEN_ASSEMBLY, ids=[f"{k}:{n}" for k, _, n, _, _ in BROKEN_ASSEMBLY])
def test_a_patch_that_would_not_apply_is_refused(tmp_path, kind, rel, old, new, message):
    root = deploy.envoy_copy(tmp_path)
    deploy.ASSEMBLE[kind](root)  # the copy assembles before the edit
    deploy.edit(root, rel, old, new)
    with pytest.raises(deploy.AssemblyError, match=message):
        deploy.ASSEMBLE[kind](root)


@pytest.mark.parametrize("kind", KINDS)
def test_assembled_config_passes_envoy_validation(assembled, kind, tmp_path, envoy_bin, wasm_path):
    path = deploy.write(deploy.with_wasm(assembled[kind], wasm_path), tmp_path / f"{kind}.json")
    r = deploy.envoy_validate(envoy_bin, path)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr


def test_envoy_validation_runs_the_filters_configure_step(assembled, tmp_path, envoy_bin, wasm_path):
    """The validation above is worth something: a bad filter configuration in an assembled
    bootstrap fails it, naming the field."""
    b = deploy.with_wasm(assembled["istio"], wasm_path)
    (wasm,) = [f for f in deploy.http_filters(b) if f["name"] == deploy.WASM_FILTER]
    value = wasm["typed_config"]["config"]["configuration"]
    value["value"] = value["value"].replace('"block_size": 16', '"block_size": 0')
    r = deploy.envoy_validate(envoy_bin, deploy.write(b, tmp_path / "bad.json"))
    assert r.returncode != 0 and "profiles[0].block_size" in r.stdout + r.stderr, r.stdout + r.stderr


# ---------------------------------------------------------------------------------------------
# The shipped settings agree with each other.


def _agent_tomls() -> dict[str, str]:
    out = {}
    for kind in KINDS:
        for o in deploy.load_kind(kind):
            if o["kind"] == "ConfigMap" and "agent.toml" in o.get("data", {}):
                out[kind] = o["data"]["agent.toml"]
    return out


def test_shipped_settings_agree(assembled):
    import tomllib

    local = yaml.safe_load(LOCAL.read_text())
    (reference,) = deploy.wasm_configs(local)
    agents = {k: tomllib.loads(t) for k, t in _agent_tomls().items()}
    # In the pods the filter's tokenizer calls go to the agent's native tokenizer beside it;
    # otherwise their filter configuration is the local one.
    tokenizer = agents["kubernetes"]["tokenizer"]["listen"]
    assert tokenizer.startswith("127.0.0.1:"), "the native tokenizer stays on loopback"
    assert "tokenizer_address" not in reference["profiles"][0]
    in_pods = copy.deepcopy(reference)
    in_pods["profiles"][0]["tokenizer_address"] = tokenizer
    for where, b in assembled.items():
        assert deploy.wasm_configs(b) == [in_pods], \
            f"{where}'s filter configuration is not envoy/llmgw-local.yaml's with tokenizer_address {tokenizer}"
    header = reference["destination_header"]
    for where, b in {"local": local, **assembled}.items():
        # Every ORIGINAL_DST cluster reads the header the filter sets, and Envoy removes exactly it.
        for c in b["static_resources"]["clusters"]:
            if c.get("type") == "ORIGINAL_DST":
                assert c["original_dst_lb_config"]["http_header_name"] == header, (where, c["name"])
        removed = [m["remove"] for f in deploy.http_filters(b) if f["name"] == deploy.HEADER_MUTATION
                   for m in f["typed_config"]["mutations"]["request_mutations"] if "remove" in m]
        assert removed == [header], where
    assert set(agents) == set(KINDS), agents.keys()
    agent = agents["kubernetes"]
    assert all(a == agent for a in agents.values()), "the agent configurations differ"
    (profile,) = reference["profiles"]
    # The seed is not the filter's to name: it comes with the agent's feed (see the seed tests).
    assert (agent["hash"]["algo"], agent["hash"]["block_size"]) == (profile["hash_algo"], profile["block_size"])
    assert "seed" not in profile and agent["hash"]["seed_env"] == seed_wiring.SEED_ENV
    feed_port = int(agent["feed"]["listen"].rsplit(":", 1)[1])
    assert agent["feed"]["listen"].startswith("127.0.0.1:"), "the sidecar agent's feed stays on loopback"
    for where, b in assembled.items():
        (ep,) = deploy.cluster(b, "llmgw_agent")["load_assignment"]["endpoints"][0]["lb_endpoints"]
        assert ep["endpoint"]["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": feed_port}, where
    # The agents find the replicas through the headless Service of vllm.yaml.
    vllm = deploy.load("vllm/vllm.yaml")
    svc = deploy.find(vllm, "Service", "vllm")
    (disc,) = agent["discovery"]
    assert svc["spec"]["clusterIP"] == "None"
    assert disc["dns"] == f"{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc.cluster.local"
    assert disc["port"] in [p["port"] for p in svc["spec"]["ports"]]
    # The native tokenizer serves the model the replicas serve, under the same name.
    (model,) = agent["tokenizer"]["models"]
    assert model["names"] == disc["models"] == [deploy.find(vllm, "Deployment", "vllm")["spec"]["template"]["spec"]
                                                ["containers"][0]["args"][0]]


def _pod(kind: str) -> tuple[list[dict], dict]:
    """The gateway pod's init containers and containers (Envoy Gateway: the EnvoyProxy's
    additions), and its volumes by name."""
    objs = deploy.load_kind(kind)
    if kind == "envoy-gateway":
        dep = deploy.find(objs, "EnvoyProxy")["spec"]["provider"]["kubernetes"]["envoyDeployment"]
        spec = dep["patch"]["value"]["spec"]["template"]["spec"]
        containers = dep["initContainers"] + spec["containers"]
        volumes = dep["pod"]["volumes"]
    else:
        spec = deploy.find(objs, "Deployment", "llmgw-gateway")["spec"]["template"]["spec"]
        containers = spec["initContainers"] + spec["containers"]
        volumes = spec["volumes"]
    return containers, {v["name"]: v for v in volumes}


def _mount(container: dict, path: str) -> dict | None:
    """The volume mount of `container` that holds `path`."""
    for m in container.get("volumeMounts", []):
        if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/"):
            return m
    return None


@pytest.mark.parametrize("kind", KINDS)
def test_the_tokenizer_files_reach_the_agent_read_only(kind):
    """Each gateway pod: an init container fetches the model's tokenizer files into a volume the
    agent mounts read-only where its [tokenizer] section reads them, with the fetch script and
    the model named the same in every kind."""
    import tomllib

    containers, volumes = _pod(kind)
    by_name = {c["name"]: c for c in containers}
    text = _agent_tomls()[kind]
    (model,) = tomllib.loads(text)["tokenizer"]["models"]
    agent_mount = _mount(by_name["llmgw-agent"], model["dir"])
    assert agent_mount and agent_mount.get("readOnly") is True, (kind, by_name["llmgw-agent"]["volumeMounts"])
    assert "emptyDir" in volumes[agent_mount["name"]], volumes[agent_mount["name"]]
    fetch = by_name["tokenizer-files"]
    fill = _mount(fetch, model["dir"])
    assert fill and fill["name"] == agent_mount["name"] and not fill.get("readOnly"), fetch["volumeMounts"]
    env = {e["name"]: e.get("value") for e in fetch["env"]}
    assert env["MODEL_REPO"] == model["names"][0]
    assert model["dir"] == f"{fill['mountPath'].rstrip('/')}/{env['MODEL_REPO']}"
    # The script it runs is the ConfigMap's fetch-tokenizer.sh, the same in every kind.
    (script_path,) = [a for a in fetch["command"] if a.endswith(".sh")]
    config_mount = _mount(fetch, script_path)
    cm = next(o for o in deploy.load_kind(kind) if o["kind"] == "ConfigMap"
              and o["metadata"]["name"] == volumes[config_mount["name"]]["configMap"]["name"])
    script = cm["data"][script_path[len(config_mount["mountPath"].rstrip("/")) + 1:]]
    reference = deploy.find(deploy.load_kind("kubernetes"), "ConfigMap", "llmgw-gateway")["data"]["fetch-tokenizer.sh"]
    assert script == reference


FAKE_CURL = """#!/bin/sh
# curl as fetch-tokenizer.sh calls it, serving files from $HUB/<path after huggingface.co/>.
out=""; url=""
while [ $# -gt 0 ]; do
  case "$1" in
    -o) out=$2; shift 2 ;;
    -H|--retry|--max-time) shift 2 ;;
    -*) shift ;;
    *) url=$1; shift ;;
  esac
done
echo "$url" >> "$HUB/requests"
src="$HUB/${url#https://huggingface.co/}"
[ -f "$src" ] || exit 22
cp "$src" "$out"
"""


def test_the_fetch_script_fills_the_volume_or_leaves_it_empty(tmp_path):
    """fetch-tokenizer.sh (with a stand-in curl): the files of the repository and revision named,
    the optional chat template only when the repository has one, and on a failed download no
    directory at all (the agent then declines the model) and still exit 0 (the pod starts)."""
    script = deploy.find(deploy.load_kind("kubernetes"), "ConfigMap", "llmgw-gateway")["data"]["fetch-tokenizer.sh"]
    (tmp_path / "fetch.sh").write_text(script)
    bin_dir, hub, vol = tmp_path / "bin", tmp_path / "hub", tmp_path / "vol"
    bin_dir.mkdir()
    (bin_dir / "curl").write_text(FAKE_CURL)
    (bin_dir / "curl").chmod(0o755)
    repo = hub / "org/model/resolve/rev1"
    repo.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (repo / name).write_text(f"{name} of rev1")

    def run(model: str) -> subprocess.CompletedProcess:
        vol.mkdir(exist_ok=True)
        env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HUB": str(hub), "TOKENIZERS_DIR": str(vol),
               "MODEL_REPO": model, "MODEL_REVISION": "rev1"}
        return subprocess.run(["sh", str(tmp_path / "fetch.sh")], env=env, capture_output=True, text=True, timeout=30)

    r = run("org/model")
    assert r.returncode == 0, r.stderr
    got = vol / "org/model"
    assert sorted(p.name for p in got.iterdir()) == ["tokenizer.json", "tokenizer_config.json"], r.stdout + r.stderr
    assert (got / "tokenizer.json").read_text() == "tokenizer.json of rev1"
    assert [p.name for p in vol.iterdir()] == ["org"], "no temporary directory left behind"
    # Filled already (a restarted container): nothing fetched again.
    before = (hub / "requests").read_text()
    assert run("org/model").returncode == 0 and (hub / "requests").read_text() == before
    # A repository with its template in a file of its own.
    (hub / "org/other/resolve/rev1").mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (hub / "org/other/resolve/rev1" / name).write_text(name)
    assert run("org/other").returncode == 0
    assert (vol / "org/other/chat_template.jinja").read_text() == "chat_template.jinja"
    # Nothing to fetch: no directory, exit 0, and it says why.
    r = run("org/missing")
    assert r.returncode == 0 and not (vol / "org/missing").exists(), r
    assert "not fetched" in r.stderr
    assert sorted(p.name for p in vol.iterdir()) == ["org"]


# A tokenizer the native tokenizer loads, standing in for the model's files in the pods' volume.
STAND_IN_TOKENIZER = {
    "version": "1.0", "truncation": None, "padding": None,
    "added_tokens": [{"id": 0, "content": "<unk>", "single_word": False, "lstrip": False, "rstrip": False,
                      "normalized": False, "special": True}],
    "normalizer": None, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None, "decoder": None,
    "model": {"type": "WordLevel", "vocab": {"<unk>": 0, "hello": 1}, "unk_token": "<unk>"}}


def _inference_listener(b: dict) -> dict:
    (lst,) = [x for x in b["static_resources"]["listeners"]
              if any(f["name"] == deploy.WASM_FILTER for hcm in deploy.hcm_of(x) for f in hcm.get("http_filters", []))]
    return lst


def test_every_config_bounds_what_clients_can_hold(assembled):
    """Gateway memory is bounded by configuration in every shipped config, whatever clients open:
    HTTP/2 streams and windows, header and whole-request timeouts, a connection cap in front of
    the inference listener, the overload manager resetting the largest streams and refusing
    requests on heap pressure, explicit circuit breakers on the replicas' and the tokenizers'
    clusters, and the filter's max_body_bytes below the listener's buffer (so that its own path
    for a larger body runs instead of Envoy's 413)."""
    local = yaml.safe_load(LOCAL.read_text())
    for where, b in {"local": local, **assembled}.items():
        lst = _inference_listener(b)
        chains = lst.get("filter_chains", []) + ([lst["default_filter_chain"]] if "default_filter_chain" in lst else [])
        for chain in chains:
            first = chain["filters"][0]
            assert first["name"] == "envoy.filters.network.connection_limit", (where, first["name"])
            assert 0 < first["typed_config"]["max_connections"] <= 10000, where
        (hcm,) = deploy.hcm_of(lst)
        h2 = hcm.get("http2_protocol_options", {})
        assert 0 < h2.get("max_concurrent_streams", 0) <= 100, (where, h2)
        assert 0 < h2.get("initial_stream_window_size", 0) <= 65536, (where, h2)
        assert 0 < h2.get("initial_connection_window_size", 0) <= 1 << 20, (where, h2)
        assert hcm.get("request_headers_timeout") == "10s" and hcm.get("request_timeout") == "60s", where
        om = b.get("overload_manager", {})
        (heap,) = [m for m in om.get("resource_monitors", []) if m["name"] == "envoy.resource_monitors.fixed_heap"]
        assert heap["typed_config"]["max_heap_size_bytes"] > 0, where
        on_heap = {a["name"] for a in om.get("actions", [])
                   if any(t["name"] == "envoy.resource_monitors.fixed_heap" for t in a["triggers"])}
        assert {"envoy.overload_actions.reset_high_memory_stream",
                "envoy.overload_actions.stop_accepting_requests"} <= on_heap, (where, on_heap)
        assert om.get("buffer_factory_config", {}).get("minimum_account_to_track_power_of_two"), where
        for cluster in ("llmgw_replicas", "llmgw_tokenizer"):
            cb = deploy.cluster(b, cluster).get("circuit_breakers", {})
            (t,) = cb.get("thresholds", [])
            limits = ("max_connections", "max_pending_requests", "max_requests")
            assert all(t.get(k, 0) > 1024 for k in limits), (where, cluster, t)
            (per_host,) = cb.get("per_host_thresholds", [])
            assert per_host.get("max_connections", 0) > 0, (where, cluster)
        (cfg,) = deploy.wasm_configs(b)
        assert cfg["max_body_bytes"] < lst["per_connection_buffer_limit_bytes"], where


# vLLM's API server closes a connection idle this long (VLLM_HTTP_TIMEOUT_KEEP_ALIVE's default,
# vllm/envs.py in vLLM 0.33.0).
VLLM_KEEP_ALIVE_S = 5.0


def _idle_timeout_s(cluster: dict) -> float | None:
    opts = cluster.get("typed_extension_protocol_options", {})
    http = opts.get("envoy.extensions.upstreams.http.v3.HttpProtocolOptions", {})
    idle = http.get("common_http_protocol_options", {}).get("idle_timeout")
    return float(idle.removesuffix("s")) if isinstance(idle, str) and idle.endswith("s") else None


def test_every_config_closes_idle_replica_connections_before_vllm_does(assembled):
    """Each cluster that sends requests to vLLM's API servers (the replicas, the tokenizers, the
    endpoint picker's pool) closes a pooled connection idle for less than vLLM's keep-alive.
    Envoy's default keeps it an hour; a request sent on it as the replica closes it is answered
    503 (flag UC). Seen once in about 1,700 requests on the real-vLLM benchmark."""
    local = yaml.safe_load(LOCAL.read_text())
    epp_local = yaml.safe_load((LOCAL.parent / "llmgw-epp-local.yaml").read_text())
    checked = [("epp-local", "llmgw_pool", deploy.cluster(epp_local, "llmgw_pool"))]
    for where, b in {"local": local, **assembled}.items():
        checked += [(where, name, deploy.cluster(b, name)) for name in ("llmgw_replicas", "llmgw_tokenizer")]
    for where, name, cluster in checked:
        idle = _idle_timeout_s(cluster)
        assert idle is not None and 0 < idle < VLLM_KEEP_ALIVE_S, (where, name, idle)


def test_agent_configurations_are_accepted_by_the_agent(tmp_path, agent_bin):
    import tomllib

    stand_in = tmp_path / "tokenizer"
    stand_in.mkdir()
    (stand_in / "tokenizer.json").write_text(json.dumps(STAND_IN_TOKENIZER))
    (stand_in / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                                "unk_token": "<unk>"}))
    for kind, text in _agent_tomls().items():
        (model,) = tomllib.loads(text)["tokenizer"]["models"]
        path = tmp_path / f"{kind}.toml"
        # As shipped, the model directory is the pod's volume: not here, so refused.
        path.write_text(text)
        r = subprocess.run([str(agent_bin), "check-config", "--config", str(path)], capture_output=True, text=True,
                           env=_seed_env(agent_bin))
        assert r.returncode != 0 and f"tokenizer {model['names'][0]}: refused" in r.stdout, f"{kind}: {r.stdout}{r.stderr}"
        assert text.count(json.dumps(model["dir"])) == 1
        path.write_text(text.replace(json.dumps(model["dir"]), json.dumps(str(stand_in))))
        r = subprocess.run([str(agent_bin), "check-config", "--config", str(path)], capture_output=True, text=True,
                           env=_seed_env(agent_bin))
        assert r.returncode == 0 and f"tokenizer {model['names'][0]}: loaded" in r.stdout, f"{kind}: {r.stdout}{r.stderr}"
        # Without the Secret's variable the agent refuses to start, naming it.
        r = subprocess.run([str(agent_bin), "check-config", "--config", str(path)], capture_output=True, text=True,
                           env=_seed_env(agent_bin, None))
        assert r.returncode != 0 and f"hash.seed_env: the environment variable {seed_wiring.SEED_ENV} is not set" \
            in r.stderr, f"{kind}: {r.stdout}{r.stderr}"


def test_vllm_is_started_with_the_flags_the_agent_prints(tmp_path, agent_bin):
    """vllm.yaml's command line holds exactly what `llmgw-agent vllm-args` prints for the
    shipped agent configuration: prefix caching, algorithm, block size, the KV-events config
    with the publisher and replay bound on all interfaces, and PYTHONHASHSEED (printed as the
    agent's seed variable, read by vLLM from the Secret the agent reads it from); and it narrows
    the hosts the replicas fetch media from."""
    path = tmp_path / "agent.toml"
    path.write_text(_agent_tomls()["kubernetes"])
    # vllm-args reads no secret: it runs without the variable and prints a reference to it.
    out = subprocess.run([str(agent_bin), "vllm-args", "--config", str(path)], capture_output=True, text=True, check=True,
                         env=_seed_env(agent_bin, None))
    (line,) = [x for x in out.stdout.splitlines() if x and not x.startswith("#")]
    words = shlex.split(line)
    serve = words.index("vllm")
    env = dict(w.split("=", 1) for w in words[:serve])
    model, printed = words[serve + 2], words[serve + 3:]
    dep = deploy.find(deploy.load("vllm/vllm.yaml"), "Deployment", "vllm")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["vllm", "serve"] and c["args"][0] == model
    args = c["args"][1:]
    # Listening address and the media allowlist are deployment policy, not the agent's to print.
    flags = [a for a in args if not a.startswith(("--host=", "--port=", "--allowed-media-domains="))]
    media = [a.split("=", 1)[1] for a in args if a.startswith("--allowed-media-domains=")]
    assert len(media) == 1 and media[0], f"vllm.yaml: replicas fetch media from any host: {args}"
    assert flags == printed, f"vllm.yaml: {flags}\nvllm-args: {printed}"
    seed_env = seed_wiring.SEED_ENV
    assert env == {"PYTHONHASHSEED": f"${seed_env}"}, env
    (agent,) = [a for a in _pod("kubernetes")[0] if a["name"] == "llmgw-agent"]
    from_secret = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in c["env"]}
    assert from_secret == {"PYTHONHASHSEED": {e["name"]: e["valueFrom"]["secretKeyRef"] for e in agent["env"]}[seed_env]}
    kv = json.loads(printed[printed.index("--kv-events-config") + 1])
    ports = {p["containerPort"] for p in c["ports"]}
    assert {int(kv["endpoint"].rsplit(":", 1)[1]), int(kv["replay_endpoint"].rsplit(":", 1)[1])} <= ports


def _seed_env(agent_bin, seed: str | None = "") -> dict:
    """This process's environment with the agent's seed variable set to a fresh seed
    (`llmgw-agent gen-seed`), to `seed`, or removed (None)."""
    import os

    env = {k: v for k, v in os.environ.items() if k != seed_wiring.SEED_ENV}
    if seed == "":
        seed = subprocess.run([str(agent_bin), "gen-seed"], capture_output=True, text=True, check=True).stdout.strip()
    if seed is not None:
        env[seed_wiring.SEED_ENV] = seed
    return env


# ---------------------------------------------------------------------------------------------
# The hash seed: each deployment's own, in a Secret it creates; never in a manifest.

SEED_VARIANTS = {**{k: [*deploy.MANIFESTS[k], *deploy.SHARED[k]] for k in KINDS},
                 **{f"gaie/{g}": [*files, "vllm/vllm.yaml"] for g, files in deploy.GAIE.items()}}


def _seed_wiring(variant: str, root: Path = deploy.ENVOY_DIR) -> seed_wiring.Wiring:
    return seed_wiring.problems([o for f in SEED_VARIANTS[variant] for o in deploy.load(f, root)])


@pytest.mark.parametrize("variant", SEED_VARIANTS)
def test_no_variant_ships_a_hash_seed_and_each_reads_the_secret(variant):
    """vLLM reads PYTHONHASHSEED from the Secret llmgw-hash-seed, the agents read the same key
    through [hash] seed_env, the filters name no seed (the agent's feed carries it), and nothing
    ships the Secret itself."""
    w = _seed_wiring(variant)
    assert not w.problems, w.problems
    assert w.vllm >= 1 and w.agents >= 1 and w.agent_tomls >= 1 and w.profiles >= 1, w


SEED_BREAKS = [
    ("kubernetes", "kubernetes/llmgw-gateway.yaml", 'seed_env = "LLMGW_HASH_SEED"', 'seed = "0"', "[hash] seed = '0'"),
    ("kubernetes", "kubernetes/llmgw-gateway.yaml", '    seed_env = "LLMGW_HASH_SEED"', '    # no seed',
     "seed_env is not"),
    ("kubernetes", "vllm/vllm.yaml", "    [zmq]\n    max_blocks_per_engine", '    [hash]\n    seed = "0"\n    [zmq]\n    max_blocks_per_engine',
     "publish.toml: [hash] seed = '0'"),
    ("istio", "vllm/vllm.yaml", "valueFrom: {secretKeyRef: {name: llmgw-hash-seed, key: seed}}", 'value: "0"',
     "PYTHONHASHSEED is written in the manifest"),
    ("istio", "istio/llmgw-envoyfilter.yaml", '"hash_algo": "sha256_cbor",', '"hash_algo": "sha256_cbor", "seed": "0",',
     "carries a seed"),
    ("envoy-gateway", "envoy-gateway/llmgw-gateway.yaml", "{name: llmgw-hash-seed, key: seed}",
     "{name: other-seed, key: seed}", "LLMGW_HASH_SEED is not read from the Secret"),
    ("gaie/istio", "gaie/base/llmgw-epp.yaml", "- name: LLMGW_HASH_SEED\n", "- name: SOME_OTHER\n",
     "the agent has no LLMGW_HASH_SEED"),
    ("gaie/envoy-gateway", "vllm/vllm.yaml", "kind: Namespace",
     "kind: Namespace\n---\napiVersion: v1\nkind: Secret\nmetadata: {name: llmgw-hash-seed, namespace: llmgw}\n"
     "stringData: {seed: \"12345\"}\n---\napiVersion: v1\nkind: Namespace", "the seed's Secret is shipped"),
]


@pytest.mark.parametrize("variant,rel,old,new,message", SEED_BREAKS, ids=[b[4] for b in SEED_BREAKS])
def test_a_variant_with_a_seed_of_its_own_is_refused(tmp_path, variant, rel, old, new, message):
    root = deploy.envoy_copy(tmp_path)
    deploy.edit(root, rel, old, new, once=True)
    w = _seed_wiring(variant, root)
    assert any(message in p for p in w.problems), w.problems


_selected = network_policy.selected
_admitted = network_policy.admitted


def _replica_ports(dep: dict) -> list[int]:
    """Every port a replica pod's containers (its sidecars among them) declare."""
    spec = dep["spec"]["template"]["spec"]
    return sorted(p["containerPort"] for c in spec.get("initContainers", []) + spec["containers"]
                  for p in c.get("ports", []))


def _snapshot_port(dep: dict) -> int:
    """The port the replica pod's snapshot sidecar listens on (`publish --snapshot-listen`)."""
    (side,) = [c for c in dep["spec"]["template"]["spec"].get("initContainers", [])
               if "--snapshot-listen" in c.get("command", [])]
    return int(side["command"][side["command"].index("--snapshot-listen") + 1].rsplit(":", 1)[1])


def test_only_the_gateway_pods_reach_the_replicas():
    """The replicas' event sockets carry every user's prompt tokens and their API must not be
    called around the gateway: vllm.yaml's NetworkPolicy lets the gateway pods of every
    deployment kind (where the agent and Envoy run) reach the API, publisher, replay and
    snapshot sidecar ports, and nothing else (another pod of the namespace, a pod elsewhere with
    the gateway's labels, the replicas themselves); the Service advertises the API only."""
    vllm = deploy.load("vllm/vllm.yaml")
    dep = deploy.find(vllm, "Deployment", "vllm")
    ns = dep["metadata"]["namespace"]
    replica = dep["spec"]["template"]["metadata"]["labels"]
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    ports = _replica_ports(dep)
    kv = json.loads(c["args"][c["args"].index("--kv-events-config") + 1])
    assert {int(kv["endpoint"].rsplit(":", 1)[1]), int(kv["replay_endpoint"].rsplit(":", 1)[1]), 8000,
            _snapshot_port(dep)} == set(ports)
    policies = [o for o in vllm if o["kind"] == "NetworkPolicy"]
    assert [p["port"] for p in deploy.find(vllm, "Service", "vllm")["spec"]["ports"]] == [8000]
    gateways = {}
    for kind in ("kubernetes", "istio"):
        g = deploy.find(deploy.load_kind(kind), "Deployment", "llmgw-gateway")
        gateways[kind] = (g["metadata"]["namespace"], g["spec"]["template"]["metadata"]["labels"])
    eg = deploy.load_kind("envoy-gateway")
    gw = deploy.find(eg, "Gateway")
    # The labels Envoy Gateway puts on a Gateway's proxy pods, in the namespace of its agent's
    # ConfigMap (Envoy Gateway's own).
    gateways["envoy-gateway"] = (deploy.find(eg, "ConfigMap", "llmgw-agent")["metadata"]["namespace"], {
        "app.kubernetes.io/name": "envoy", "app.kubernetes.io/component": "proxy",
        "app.kubernetes.io/managed-by": "envoy-gateway",
        "gateway.envoyproxy.io/owning-gateway-name": gw["metadata"]["name"],
        "gateway.envoyproxy.io/owning-gateway-namespace": gw["metadata"]["namespace"]})
    for kind, (gns, labels) in gateways.items():
        for port in ports:
            assert _admitted(policies, replica, gns, labels, port), (kind, port)
    strangers = {"another pod": (ns, {"app.kubernetes.io/name": "client"}),
                 "the gateway's labels elsewhere": ("default", gateways["kubernetes"][1]),
                 "Envoy Gateway's labels elsewhere": ("default", gateways["envoy-gateway"][1]),
                 "a replica": (ns, replica)}
    for who, (sns, labels) in strangers.items():
        for port in ports:
            assert not _admitted(policies, replica, sns, labels, port), (who, port)


# ---------------------------------------------------------------------------------------------
# The endpoint-picker path (envoy/gaie/): an HTTPRoute to an InferencePool whose picker is llmgw.

GAIE_GATEWAYS = list(deploy.GAIE)
# Where each gateway runs the Gateway's proxies, and the labels it gives them: istiod deploys them
# in the Gateway's namespace, labelled with its name; Envoy Gateway in its own namespace (the
# default, envoy-gateway-system), labelled with the Gateway's name and namespace.
GAIE_CONTROLLERS = {"istio": "istio", "envoy-gateway": "gateway.envoyproxy.io/gatewayclass-controller"}


def _gaie_proxies(gateway: str, gw: dict) -> tuple[str, dict]:
    name, ns = gw["metadata"]["name"], gw["metadata"]["namespace"]
    if gateway == "istio":
        return ns, {"gateway.networking.k8s.io/gateway-name": name}
    return "envoy-gateway-system", {"app.kubernetes.io/name": "envoy", "app.kubernetes.io/component": "proxy",
                                    "app.kubernetes.io/managed-by": "envoy-gateway",
                                    "gateway.envoyproxy.io/owning-gateway-name": name,
                                    "gateway.envoyproxy.io/owning-gateway-namespace": ns}


def _gaie(gateway: str) -> list[dict]:
    return [o for f in deploy.GAIE[gateway] for o in deploy.load(f)]


def _port_number(container: dict, port) -> int:
    if isinstance(port, int):
        return port
    (n,) = [p["containerPort"] for p in container["ports"] if p["name"] == port]
    return n


@pytest.mark.parametrize("gateway", GAIE_GATEWAYS)
def test_the_route_reaches_the_picker_through_the_inference_pool(gateway):
    """HTTPRoute -> Gateway of the gateway's class; HTTPRoute -> InferencePool; the pool's
    endpointPickerRef -> the picker's Service port -> the container port the agent's [epp] listens
    on, in cleartext HTTP/2, probed on the picker's gRPC health services; the pool's selector and
    targetPorts are vllm.yaml's replica pods and API port, and select nothing else."""
    import tomllib

    objs = _gaie(gateway)
    route = deploy.find(objs, "HTTPRoute")
    gw = deploy.find(objs, "Gateway")
    ns = route["metadata"]["namespace"]
    (parent,) = route["spec"]["parentRefs"]
    assert parent["name"] == gw["metadata"]["name"] and parent.get("namespace", ns) == gw["metadata"]["namespace"]
    if gateway == "istio":
        assert gw["spec"]["gatewayClassName"] == "istio"
    else:
        cls = deploy.find(objs, "GatewayClass", gw["spec"]["gatewayClassName"])
        assert cls["spec"]["controllerName"] == GAIE_CONTROLLERS[gateway]
    (rule,) = route["spec"]["rules"]
    assert sorted((m["path"]["type"], m["path"]["value"]) for m in rule["matches"]) == \
        [("Exact", "/v1/chat/completions"), ("Exact", "/v1/completions")]
    (ref,) = rule["backendRefs"]
    assert (ref["group"], ref["kind"]) == ("inference.networking.k8s.io", "InferencePool")
    pool = deploy.find(objs, "InferencePool", ref["name"])
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["metadata"]["namespace"] == ref.get("namespace", ns)

    # The picker: pool -> Service port -> container port == [epp] listen.
    epp_ref = pool["spec"]["endpointPickerRef"]
    assert epp_ref.get("kind", "Service") == "Service" and epp_ref.get("group", "") == ""
    svc = deploy.find(objs, "Service", epp_ref["name"])
    assert svc["metadata"]["namespace"] == pool["metadata"]["namespace"]
    (sport,) = [p for p in svc["spec"]["ports"] if p["port"] == epp_ref["port"]["number"]]
    assert sport["appProtocol"] == "http2", "the gateway speaks gRPC (h2c) to the picker"
    deps = [o for o in objs if o["kind"] == "Deployment"
            and _selected({"matchLabels": svc["spec"]["selector"]}, o["spec"]["template"]["metadata"]["labels"])]
    (dep,) = deps
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert c["command"][:2] == ["/usr/local/bin/llmgw-agent", "run"] and c["image"].startswith("llmgw/llmgw-agent:")
    epp_port = _port_number(c, sport["targetPort"])
    assert c["command"][2] == "--config"
    mount = _mount(c, c["command"][3])
    conf_dir = mount["mountPath"]
    (vol,) = [v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    cm = deploy.find(objs, "ConfigMap", vol["configMap"]["name"])
    assert c["command"][3:] == [f"{conf_dir}/agent.toml"]
    agent = tomllib.loads(cm["data"]["agent.toml"])
    listen = agent["epp"]["listen"]
    host, port = listen.rsplit(":", 1)
    assert int(port) == epp_port, f"the Service sends to {epp_port}, the picker listens on {listen}"
    assert host == "0.0.0.0" and agent["epp"]["allow_non_loopback"] is True, "reachable from the gateway's pods"
    for probe, service in (("readinessProbe", "readiness"), ("livenessProbe", "liveness")):
        assert c[probe]["grpc"] == {"port": epp_port, "service": service}, probe
    assert agent["feed"]["listen"].startswith("127.0.0.1:")
    # The routing configuration it reads is in the same ConfigMap, mounted where [epp] names it.
    assert agent["epp"]["routing"] == f"{conf_dir}/routing.json"
    routing = json.loads(cm["data"]["routing.json"])
    (reference,) = deploy.wasm_configs(yaml.safe_load(LOCAL.read_text()))
    assert routing == reference, "the picker routes with the filter's configuration"

    # The pool: vllm.yaml's replicas and their API port, nothing else.
    vllm = deploy.load("vllm/vllm.yaml")
    replicas = deploy.find(vllm, "Deployment", "vllm")
    (vc,) = replicas["spec"]["template"]["spec"]["containers"]
    assert _selected(pool["spec"]["selector"], replicas["spec"]["template"]["metadata"]["labels"])
    assert not _selected(pool["spec"]["selector"], dep["spec"]["template"]["metadata"]["labels"])
    api = _port_number(vc, "http")
    assert f"--port={api}" in vc["args"]
    assert pool["spec"]["targetPorts"] == [{"number": api}]
    # The picker mirrors the same replicas, hashed as they hash.
    (disc,) = agent["discovery"]
    svc_vllm = deploy.find(vllm, "Service", "vllm")
    assert disc["dns"] == f"vllm.{svc_vllm['metadata']['namespace']}.svc.cluster.local" and disc["port"] == api
    assert disc["models"] == [vc["args"][0]]
    (profile,) = routing["profiles"]
    assert (agent["hash"]["algo"], agent["hash"]["block_size"]) == (profile["hash_algo"], profile["block_size"])
    assert "seed" not in profile and agent["hash"]["seed_env"] == seed_wiring.SEED_ENV


@pytest.mark.parametrize("gateway", GAIE_GATEWAYS)
def test_the_pools_wiring_passes_envoy_validation(gateway, tmp_path, envoy_bin):
    """The route, pool and picker assembled into the Envoy configuration GAIE prescribes (the
    ext_proc filter towards the picker's Service, the pool's pods on its target port chosen by
    the destination header) pass `envoy --mode validate`."""
    b = deploy.gaie_bootstrap(gateway)
    objs = _gaie(gateway)
    pool = deploy.find(objs, "InferencePool")
    (ep,) = deploy.cluster(b, "llmgw_epp")["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert ep["endpoint"]["address"]["socket_address"] == {
        "address": f"{pool['spec']['endpointPickerRef']['name']}.{pool['metadata']['namespace']}.svc.cluster.local",
        "port_value": pool["spec"]["endpointPickerRef"]["port"]["number"]}
    (ep,) = deploy.cluster(b, "llmgw_pool")["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert ep["endpoint"]["address"]["socket_address"]["port_value"] == pool["spec"]["targetPorts"][0]["number"]
    (proc,) = [f for f in deploy.http_filters(b) if f["name"] == "envoy.filters.http.ext_proc"]
    assert proc["typed_config"]["failure_mode_allow"] is False, "FailClose"
    assert [r["match"] for r in deploy.routes(b, "llmgw_epp")] == \
        [{"path": "/v1/chat/completions"}, {"path": "/v1/completions"}, {"prefix": "/"}]
    r = deploy.envoy_validate(envoy_bin, deploy.write(b, tmp_path / f"{gateway}.json"))
    assert r.returncode == 0, r.stdout + r.stderr


BROKEN_GAIE = [
    ("gaie/base/llmgw-inferencepool.yaml", "kind: InferencePool, name: vllm", "kind: Service, name: vllm",
     "not an InferencePool"),
    ("gaie/base/llmgw-epp.yaml", "appProtocol: http2", "appProtocol: http", "HTTP/2"),
    ("gaie/base/llmgw-inferencepool.yaml", "port: {number: 9002}", "port: {number: 9003}", "no port 9003"),
    ("gaie/base/llmgw-inferencepool.yaml", "matchLabels: {app.kubernetes.io/name: vllm}",
     "matchLabels: {app.kubernetes.io/name: llmgw-epp}", "no headless Service"),
]


@pytest.mark.parametrize("rel,old,new,message", BROKEN_GAIE, ids=[m for *_, m in BROKEN_GAIE])
def test_a_pool_whose_wiring_breaks_is_refused(tmp_path, rel, old, new, message):
    root = deploy.envoy_copy(tmp_path)
    deploy.gaie_bootstrap("istio", root)  # the copy assembles before the edit
    deploy.edit(root, rel, old, new)
    with pytest.raises(deploy.AssemblyError, match=message):
        deploy.gaie_bootstrap("istio", root)


def test_the_pickers_configuration_is_accepted_by_the_agent(tmp_path, agent_bin):
    """The picker's agent.toml as shipped passes `check-config` ([epp] on a pod address needs
    allow_non_loopback, which it sets; without it the agent refuses to start)."""
    cm = deploy.find([o for f in deploy.GAIE_BASE for o in deploy.load(f)], "ConfigMap", "llmgw-epp")
    text = cm["data"]["agent.toml"]
    path = tmp_path / "agent.toml"
    path.write_text(text)
    env = _seed_env(agent_bin)
    r = subprocess.run([str(agent_bin), "check-config", "--config", str(path)], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert text.count("allow_non_loopback = true") == 1
    path.write_text(text.replace("allow_non_loopback = true", "allow_non_loopback = false"))
    r = subprocess.run([str(agent_bin), "check-config", "--config", str(path)], capture_output=True, text=True, env=env)
    assert r.returncode != 0 and "epp.listen" in r.stderr, r.stdout + r.stderr


def test_the_picker_needs_no_kubernetes_api():
    """The picker finds the replicas by DNS: no RBAC, no ServiceAccount token in its pods."""
    objs = [o for f in deploy.GAIE_BASE for o in deploy.load(f)]
    assert not [o for o in objs if o["kind"] in ("ServiceAccount", "Role", "ClusterRole", "RoleBinding",
                                                  "ClusterRoleBinding")]
    spec = deploy.find(objs, "Deployment", "llmgw-epp")["spec"]["template"]["spec"]
    assert spec["automountServiceAccountToken"] is False
    assert spec["securityContext"]["runAsNonRoot"] is True
    for c in spec["containers"]:
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True, c["name"]
        assert sc["capabilities"]["drop"] == ["ALL"], c["name"]


@pytest.mark.parametrize("gateway", GAIE_GATEWAYS)
def test_only_the_inference_gateway_reaches_the_picker_and_only_the_pickers_read_events(gateway):
    """With vllm.yaml's and the base's NetworkPolicies together: the Gateway's proxies reach the
    picker's gRPC port and the replicas' API; the pickers reach the replicas' API, publisher,
    replay and snapshot sidecar ports; nobody else reaches the picker's gRPC port or the
    replicas' event sockets and snapshots."""
    objs = _gaie(gateway)
    vllm = deploy.load("vllm/vllm.yaml")
    policies = [o for o in vllm + objs if o["kind"] == "NetworkPolicy"]
    replicas = deploy.find(vllm, "Deployment", "vllm")
    replica = replicas["spec"]["template"]["metadata"]["labels"]
    events = (5557, 5558, _snapshot_port(replicas))
    epp_dep = deploy.find(objs, "Deployment", "llmgw-epp")
    epp = epp_dep["spec"]["template"]["metadata"]["labels"]
    ns = epp_dep["metadata"]["namespace"]
    grpc = deploy.find(objs, "Service", "llmgw-epp")["spec"]["ports"][0]["port"]
    proxies = _gaie_proxies(gateway, deploy.find(objs, "Gateway"))
    assert _admitted(policies, epp, *proxies, grpc)
    assert _admitted(policies, replica, *proxies, 8000)
    for port in (8000, *events):
        assert _admitted(policies, replica, ns, epp, port), port
    strangers = {"another pod": (ns, {"app.kubernetes.io/name": "client"}),
                 "the proxies' labels elsewhere": ("default", proxies[1]),
                 "a replica": (ns, replica)}
    for who, (sns, labels) in strangers.items():
        assert not _admitted(policies, epp, sns, labels, grpc), who
        for port in events:
            assert not _admitted(policies, replica, sns, labels, port), (who, port)
    for port in events:
        assert not _admitted(policies, replica, *proxies, port), ("the proxies read no events", port)


# ---------------------------------------------------------------------------------------------
# End to end: each assembled bootstrap in front of simulated replicas and the agent.

MODEL = "demo-model"


class Canary:
    """An HTTP server on loopback that records every request: where a client's destination
    header points."""

    def __init__(self):
        self.hits = []
        hits = self.hits

        class Handler(StubHandler):
            def do_POST(self):
                hits.append(self.path)
                self.reply(200, b'{"canary": true}')

            do_GET = do_POST

        self.server = StubServer(0, Handler)
        self.port = self.server.port

    def stop(self):
        self.server.stop()


@pytest.fixture
def canary():
    c = Canary()
    yield c
    c.stop()


def _start(procs, tmp_path, envoy_bin, wasm_path, bootstrap, agent_port, tokenizer_port=None):
    ports = {p: kit.free_port() for p in deploy.listener_ports(bootstrap)}
    admin, closed = kit.free_port(), kit.free_port()
    local = deploy.localize(bootstrap, wasm_path, ports, admin, agent_port, closed, tokenizer_port)
    path = deploy.write(local, tmp_path / "envoy.json")
    proc = kit.start_envoy(procs, envoy_bin, path, "envoy")
    api = kit.EnvoyAdmin(admin)
    api.wait_ready(30, proc=proc)
    return ports, api


def _post(port, path, body, headers=None):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.headers.get("x-llmgw-sim-replica"), r.read()
    except urllib.error.HTTPError as e:
        return e.code, None, e.read()


@pytest.fixture
def fleet(procs, tmp_path, agent_bin, sim_bin):
    sims = new_sims(3)
    # The agent's native tokenizer (the pods' tokenizer_address) holds no model here: it declines
    # every call, and the filter asks a replica in the same request.
    agent = fleet_agent(procs, agent_bin, tmp_path, sims, MODEL, tokenizer={"listen": f"127.0.0.1:{kit.free_port()}"})
    for s in sims:
        procs.start(sim_command(sim_bin, s, MODEL, blocks=256, seed="0", decode_ms=1), s["name"])
    for s in sims:
        kit.wait_port(s["port"])
    wait_publishers(agent, len(sims))
    return sims, agent


SYSTEM = {"role": "system", "content": " ".join(f"rule{i}" for i in range(200))}


@pytest.mark.parametrize("kind", KINDS)
def test_deployed_config_routes_exactly_and_ignores_a_clients_destination_and_envoy_headers(kind, assembled, fleet, canary, procs,
                                                                          tmp_path, envoy_bin, wasm_path):
    sims, agent = fleet
    tokenizer_port = int(agent.sections["tokenizer"]["listen"].rsplit(":", 1)[1])
    ports, envoy = _start(procs, tmp_path, envoy_bin, wasm_path, assembled[kind], agent.feed, tokenizer_port)
    envoy.wait_feed(60)
    listen = ports[next(lst["address"]["socket_address"]["port_value"]
                        for lst in assembled[kind]["static_resources"]["listeners"]
                        if lst["name"] == INFERENCE_LISTENER[kind])]
    first = [SYSTEM, {"role": "user", "content": f"{kind}: tell me about deployments " * 10}]
    status, served_by, _ = _post(listen, "/v1/chat/completions", {"model": MODEL, "messages": first, "max_tokens": 4})
    assert status == 200 and served_by, status
    blocks = wait_until(lambda: agent.replica(served_by)["blocks"], 20, "the agent mirrored the first turn")
    wait_until(lambda: (v := envoy.index_blocks()) and all(x >= blocks for x in v), 20, "every filter VM's index")
    exact_before = envoy.metric("llmgw_prefix_decisions_total", 'outcome="exact"')
    followup = first + [{"role": "assistant", "content": "an answer"}, {"role": "user", "content": "and then?"}]
    # The client names the canary as the destination: Envoy drops the header, llmgw routes.
    # It also asks Envoy for a 1 ms upstream timeout, which is not honoured either.
    status, again, _ = _post(listen, "/v1/chat/completions", {"model": MODEL, "messages": followup, "max_tokens": 4},
                             {DEST: f"127.0.0.1:{canary.port}", "x-envoy-upstream-rq-timeout-ms": "1"})
    assert status == 200 and again == served_by, f"follow-up went to {again}, its prefix is on {served_by}"
    # The decision is exact, and Prometheus sees it with its label.
    assert envoy.metric("llmgw_prefix_decisions_total", 'outcome="exact"') == exact_before + 1
    # Both calls went to the agent's native tokenizer first (declined), then to a replica.
    assert envoy.metric("llmgw_tokenizer_failures_total", 'reason="declined"') == 2
    assert envoy.metric("llmgw_fallbacks_total", 'reason="tokenizer"') == 0
    # Each VM's linear memory reaches Prometheus as a gauge with its vm label.
    assert envoy.metric("llmgw_vm_memory_bytes", 'vm="') > 0
    assert canary.hits == []
    # Other paths are not passed to the replicas.
    status, _, _ = _post(listen, "/kv_event_sources", {})
    assert status == 404
    assert canary.hits == []


def test_without_the_filter_a_clients_destination_reaches_nobody(assembled, canary, procs, tmp_path, envoy_bin,
                                                                   wasm_path):
    """Fail closed: with llmgw removed from the chain (as if it failed to start on a worker), a
    request naming the canary gets 503, because Envoy itself dropped the header."""
    b = copy.deepcopy(assembled["kubernetes"])
    for hcm in deploy.hcm_of(b["static_resources"]["listeners"][0]):
        hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] != deploy.WASM_FILTER]
    ports, _ = _start(procs, tmp_path, envoy_bin, wasm_path, b, kit.free_port())
    status, _, _ = _post(ports[8080], "/v1/completions", {"model": MODEL, "prompt": "hi"},
                         {DEST: f"127.0.0.1:{canary.port}"})
    assert status == 503 and canary.hits == [], (status, canary.hits)


def test_a_clients_envoy_headers_are_not_honoured(procs, tmp_path, agent_bin, sim_bin, envoy_bin, wasm_path):
    """The local bootstrap routes only the inference API (other paths 404), and a client asking Envoy for a 20 ms upstream timeout (x-envoy-upstream-rq-timeout-ms) of a
    request that takes longer still gets its answer: header_mutation drops the client's x-envoy-*
    headers before the router reads them, even from a client Envoy deems internal (without the
    removal: 504)."""
    sims = new_sims(1)
    agent = fleet_agent(procs, agent_bin, tmp_path, sims, MODEL)
    procs.start(sim_command(sim_bin, sims[0], MODEL, seed="0", decode_ms=100), sims[0]["name"])
    kit.wait_port(sims[0]["port"])
    wait_publishers(agent, 1)
    listen, admin = kit.free_port(), kit.free_port()
    config = yaml.safe_load(kit.shipped_config(wasm_path, listen, admin, agent.feed, kit.filter_config()))
    # Envoy honours x-envoy-* request headers from clients it deems internal: say loopback is,
    # as an operator marking the cluster's network internal would.
    (hcm,) = deploy.hcm_of(config["static_resources"]["listeners"][0])
    hcm["use_remote_address"] = True
    hcm["internal_address_config"] = {"cidr_ranges": [{"address_prefix": "127.0.0.1", "prefix_len": 32}]}
    path = deploy.write(config, tmp_path / "local.json")
    proc = kit.start_envoy(procs, envoy_bin, path, "envoy")
    envoy = kit.EnvoyAdmin(admin)
    envoy.wait_ready(30, proc=proc)
    envoy.wait_feed(30)
    status, served_by, _ = _post(listen, "/v1/completions", {"model": MODEL, "prompt": "slow " * 20, "max_tokens": 3},
                                 {"x-envoy-upstream-rq-timeout-ms": "20", "x-envoy-max-retries": "5"})
    assert status == 200 and served_by == sims[0]["name"], status
    # The local bootstrap, like the manifests, passes only the inference API to the replicas.
    for path in ("/metrics", "/kv_event_sources", "/tokenize", "/v1/completions/../../metrics"):
        status, _, _ = _post(listen, path, {"model": MODEL, "prompt": "hi"})
        assert status == 404, (path, status)
