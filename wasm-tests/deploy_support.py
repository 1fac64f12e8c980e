"""The deployment manifests (envoy/kubernetes, envoy/istio, envoy/envoy-gateway) as the tests
see them: loaded, validated against their schemas, and each one's Envoy fragments assembled into
a bootstrap the way its control plane assembles them.

- Istio: istiod turns the Gateway and VirtualService into a gateway listener and route
  configuration, then applies the EnvoyFilter patches (match by context, port, filter and route
  names; MERGE, INSERT_BEFORE, ADD). `istio_bootstrap` builds that listener in the shape istiod
  generates for a gateway (only filters upstream Envoy has) and applies the patches with those
  semantics; a patch that matches nothing is an error here, where Istio would skip it silently.
- Envoy Gateway: its translator turns the Gateway and HTTPRoute into xDS, then applies the
  EnvoyPatchPolicy's JSONPatches to the resources named in it. `envoy_gateway_bootstrap` starts
  from the listener, route, cluster and endpoints Envoy Gateway 1.9's own translator test
  generates (schemas/envoy-gateway-v1.9.0/xds-ir-http-route), renamed as name scheme V2 names
  them for our Gateway, the routes rebuilt for our HTTPRoute in the generated shape, and applies
  the patches to the proto-named JSON as Envoy Gateway does (RFC 6902, the `jsonpatch` package).
- Plain Kubernetes: the bootstrap in the gateway's ConfigMap, as Envoy reads it.

All three become static bootstraps (RDS and EDS inlined), so `envoy --mode validate` and an
end-to-end run can load them; `localize` moves their addresses onto loopback test ports.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from functools import lru_cache
from pathlib import Path

import jsonpatch
import jsonschema
import kubernetes_validate
import yaml

from llmgw_testkit.paths import ROOT

ENVOY_DIR = ROOT / "envoy"
SCHEMAS = Path(__file__).resolve().parent / "deploy" / "schemas"
EG_XDS = SCHEMAS / "envoy-gateway-v1.9.0" / "xds-ir-http-route"
KUBERNETES_VERSION = "1.34.0"

# Every manifest the project ships, by deployment kind. test_deploy checks that this is exactly
# what envoy/ holds: a manifest no test reads does not ship.
MANIFESTS = {
    "kubernetes": ["vllm/vllm.yaml", "kubernetes/llmgw-gateway.yaml"],
    "istio": ["istio/llmgw-gateway.yaml", "istio/llmgw-envoyfilter.yaml"],
    "envoy-gateway": ["envoy-gateway/envoy-gateway-config.yaml", "envoy-gateway/llmgw-gateway.yaml",
                      "envoy-gateway/llmgw-envoypatchpolicy.yaml"],
}
# The endpoint-picker path (Gateway API Inference Extension; envoy/gaie/), by gateway: the base's
# files (the picker, the InferencePool, the HTTPRoute) and the variant's Gateway. Validated and
# their wiring checked by test_deploy; nothing here is Envoy configuration to assemble (the
# gateways generate it from the InferencePool).
GAIE_BASE = ["gaie/base/llmgw-epp.yaml", "gaie/base/llmgw-inferencepool.yaml"]
GAIE = {
    "istio": GAIE_BASE + ["gaie/istio/llmgw-inference-gateway.yaml"],
    "envoy-gateway": GAIE_BASE + ["gaie/envoy-gateway/llmgw-inference-gateway.yaml"],
}
# What each kind deploys beside its own files.
SHARED = {"kubernetes": [], "istio": ["vllm/vllm.yaml"], "envoy-gateway": ["vllm/vllm.yaml"]}

WASM_FILTER = "envoy.filters.http.wasm"
HCM = "envoy.filters.network.http_connection_manager"
ROUTER = "envoy.filters.http.router"
HEADER_MUTATION = "envoy.filters.http.header_mutation"


class AssemblyError(Exception):
    """A manifest's Envoy fragments do not apply the way its control plane applies them."""


# ---------------------------------------------------------------------------------------------
# Loading and schema validation.


def envoy_copy(tmp_path: Path) -> Path:
    """A copy of envoy/ under `tmp_path`, for a test to break on purpose."""
    root = tmp_path / "envoy"
    shutil.copytree(ENVOY_DIR, root)
    return root


def edit(root: Path, rel: str, old: str, new: str, once: bool = False) -> None:
    """Replaces `old` by `new` in `root`/`rel`: `old` must be there (exactly once with `once`)."""
    p = root / rel
    text = p.read_text()
    n = text.count(old)
    assert n == 1 if once else n >= 1, f"{old!r} is in {rel} {n} times"
    p.write_text(text.replace(old, new))


def load(path: str | Path, root: Path = ENVOY_DIR) -> list[dict]:
    """The YAML documents of a manifest (a path relative to envoy/, or absolute)."""
    p = Path(path) if Path(path).is_absolute() else root / path
    return [d for d in yaml.safe_load_all(p.read_text()) if d is not None]


def load_kind(kind: str, root: Path = ENVOY_DIR) -> list[dict]:
    """Every object a deployment kind applies (its own files and the shared ones)."""
    return [o for f in SHARED[kind] + MANIFESTS[kind] for o in load(f, root)]


def find(objs: list[dict], kind: str, name: str | None = None) -> dict:
    hits = [o for o in objs if o.get("kind") == kind and (name is None or o["metadata"]["name"] == name)]
    if len(hits) != 1:
        raise AssemblyError(f"expected one {kind} {name or ''}, found {len(hits)}")
    return hits[0]


@lru_cache(maxsize=None)
def crd_schemas() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> openAPIV3Schema of every CRD version in schemas/."""
    out = {}
    for f in sorted(SCHEMAS.rglob("*.yaml")):
        for doc in yaml.safe_load_all(f.read_text()):
            if not isinstance(doc, dict) or doc.get("kind") != "CustomResourceDefinition":
                continue
            group, kind = doc["spec"]["group"], doc["spec"]["names"]["kind"]
            for v in doc["spec"]["versions"]:
                if v.get("served", True):
                    out[(f"{group}/{v['name']}", kind)] = v["schema"]["openAPIV3Schema"]
    return out


def _no_unknown_fields(schema: dict) -> dict:
    """A CRD schema as the API server prunes it, made strict: an object schema with properties
    and no x-kubernetes-preserve-unknown-fields rejects fields it does not list (a misspelt
    field would otherwise be dropped silently on apply)."""
    s = dict(schema)
    if "properties" in s:
        s["properties"] = {k: _no_unknown_fields(v) for k, v in s["properties"].items()}
        if not s.get("x-kubernetes-preserve-unknown-fields") and "additionalProperties" not in s:
            s["additionalProperties"] = False
    for key in ("items", "additionalProperties"):
        if isinstance(s.get(key), dict):
            s[key] = _no_unknown_fields(s[key])
    for key in ("allOf", "anyOf", "oneOf"):
        if key in s:
            s[key] = [_no_unknown_fields(x) for x in s[key]]
    return s


def validate(obj: dict) -> str:
    """Validates one object: a CRD kind against its CRD's schema (strict about unknown fields;
    CEL rules are not evaluated), a built-in kind with kubernetes-validate (strict). Returns what
    it was checked against; raises jsonschema.ValidationError or kubernetes_validate's errors."""
    key = (obj.get("apiVersion"), obj.get("kind"))
    schemas = crd_schemas()
    if key in schemas:
        body = {k: v for k, v in obj.items() if k not in ("apiVersion", "kind", "metadata")}
        schema = _no_unknown_fields(schemas[key])
        schema = {**schema, "properties": {k: v for k, v in schema["properties"].items()
                                           if k not in ("apiVersion", "kind", "metadata")}}
        jsonschema.Draft7Validator(schema).validate(body)
        if not obj.get("metadata", {}).get("name"):
            raise jsonschema.ValidationError("metadata.name is required")
        return f"CRD {key[1]}.{key[0]}"
    # Anything else must be a built-in kind: kubernetes-validate raises SchemaNotFoundError for
    # a kind it does not know (e.g. a CRD whose schema is missing from schemas/).
    kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    return f"Kubernetes {KUBERNETES_VERSION} {key[1]}"


# ---------------------------------------------------------------------------------------------
# Proto-JSON helpers.


def snake(key: str) -> str:
    return key if key.startswith("@") else re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", key).lower()


def proto_names(v, parent: str = ""):
    """Envoy Gateway's generated YAML uses JSON names (camelCase); its patches use proto names.
    Map keys (typed_extension_protocol_options, filter_metadata) are kept as they are."""
    if isinstance(v, list):
        return [proto_names(x, parent) for x in v]
    if isinstance(v, dict):
        keep = parent in ("typed_extension_protocol_options", "filter_metadata", "typed_filter_metadata")
        return {(k if keep else snake(k)): proto_names(x, k if keep else snake(k)) for k, x in v.items()}
    return v


def proto_merge(base: dict, over: dict) -> dict:
    """Protobuf MergeFrom on JSON: messages merge (an Any only with an Any of its type),
    repeated fields append, scalars replace (what Istio's MERGE patches and bootstrap overrides, and Envoy Gateway's bootstrap Merge do)."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict) and v.get("@type") == out[k].get("@type"):
            out[k] = proto_merge(out[k], v)
        elif isinstance(v, list) and isinstance(out.get(k), list):
            out[k] = out[k] + copy.deepcopy(v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def hcm_of(listener: dict) -> list[dict]:
    """The HTTP connection manager configs of every filter chain of a listener."""
    chains = list(listener.get("filter_chains", []))
    if "default_filter_chain" in listener:
        chains.append(listener["default_filter_chain"])
    return [f["typed_config"] for c in chains for f in c.get("filters", []) if f.get("name") == HCM]


def http_filters(bootstrap: dict, listener: str | None = None) -> list[dict]:
    out = []
    for lst in bootstrap["static_resources"]["listeners"]:
        if listener is None or lst["name"] == listener:
            for hcm in hcm_of(lst):
                out.extend(hcm.get("http_filters", []))
    return out


def wasm_configs(bootstrap: dict) -> list[dict]:
    """The JSON configuration of every llmgw filter in a bootstrap."""
    return [json.loads(f["typed_config"]["config"]["configuration"]["value"])
            for f in http_filters(bootstrap) if f["name"] == WASM_FILTER]


def cluster(bootstrap: dict, name: str) -> dict:
    hits = [c for c in bootstrap["static_resources"]["clusters"] if c["name"] == name]
    if len(hits) != 1:
        raise AssemblyError(f"expected one cluster {name}, found {len(hits)}")
    return hits[0]


def routes(bootstrap: dict, listener: str) -> list[dict]:
    lst = next(x for x in bootstrap["static_resources"]["listeners"] if x["name"] == listener)
    return [r for hcm in hcm_of(lst) for vh in hcm["route_config"]["virtual_hosts"] for r in vh["routes"]]


# ---------------------------------------------------------------------------------------------
# Plain Kubernetes.


def kubernetes_bootstrap(root: Path = ENVOY_DIR) -> dict:
    cm = find(load_kind("kubernetes", root), "ConfigMap", "llmgw-gateway")
    return yaml.safe_load(cm["data"]["envoy.yaml"])


# ---------------------------------------------------------------------------------------------
# Istio.


def _istio_routes(vs: dict, port: int) -> dict:
    """The route configuration istiod generates for a gateway port from a VirtualService: one
    route per match, named after the VirtualService's http route, to the destination's
    outbound|port||host cluster; no default route (unmatched paths: 404)."""
    routes_ = []
    for http in vs["spec"]["http"]:
        (dest,) = http["route"]
        d = dest["destination"]
        cluster_name = f"outbound|{d['port']['number']}||{d['host']}"
        for m in http.get("match", [{}]):
            uri = m.get("uri", {"prefix": "/"})
            match = {"path": uri["exact"]} if "exact" in uri else {"prefix": uri["prefix"]}
            route = {"cluster": cluster_name}
            if "timeout" in http:
                route["timeout"] = http["timeout"]
            routes_.append({"name": http.get("name", ""), "match": match, "route": route})
    return {"name": f"http.{port}", "virtual_hosts": [{"name": f"*:{port}", "domains": ["*"], "routes": routes_}]}


def _istio_listener(port: int, route_config: dict) -> dict:
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": f"outbound_0.0.0.0_{port}",
        "use_remote_address": True,
        "normalize_path": True,
        "route_config": route_config,
        "http_filters": [
            {"name": "envoy.filters.http.cors",
             "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.cors.v3.Cors"}},
            {"name": "envoy.filters.http.fault",
             "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.fault.v3.HTTPFault"}},
            {"name": ROUTER,
             "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}},
        ],
    }
    return {"name": f"0.0.0.0_{port}",
            "address": {"socket_address": {"address": "0.0.0.0", "port_value": port}},
            "filter_chains": [{"filters": [{"name": HCM, "typed_config": hcm}]}]}


# The part of Istio's default stats inclusion list (its bootstrap template) that names Envoy's
# own stats; the pod's proxyStatsMatcher prefixes are appended to it, as istiod does.
ISTIO_STATS_INCLUSION = ["reporter=", "cluster_manager", "listener_manager", "server", "cluster.xds-grpc",
                         "component", "istio"]


def _selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _apply_envoyfilter(ef: dict, bootstrap: dict, pod_labels: dict) -> None:
    spec = ef["spec"]
    if not _selects(spec.get("workloadSelector", {}).get("labels", {}), pod_labels):
        raise AssemblyError(f"EnvoyFilter {ef['metadata']['name']}: workloadSelector does not select the gateway pods")
    sr = bootstrap["static_resources"]
    for i, p in enumerate(spec["configPatches"]):
        where = f"EnvoyFilter {ef['metadata']['name']} configPatches[{i}] ({p['applyTo']})"
        m, patch = p.get("match", {}), p["patch"]
        if m.get("context") != "GATEWAY":
            raise AssemblyError(f"{where}: context {m.get('context')!r}, not GATEWAY")
        op, value = patch["operation"], patch.get("value", {})
        lm = m.get("listener", {})
        listeners = [x for x in sr["listeners"]
                     if "portNumber" not in lm or x["address"]["socket_address"]["port_value"] == lm["portNumber"]]
        hit = 0
        if p["applyTo"] == "LISTENER" and op == "MERGE":
            for x in listeners:
                x.update(proto_merge(x, value))
                hit += 1
        elif p["applyTo"] == "HTTP_FILTER" and op in ("INSERT_BEFORE", "INSERT_AFTER", "INSERT_FIRST"):
            fm = lm.get("filterChain", {}).get("filter", {})
            if fm.get("name", HCM) != HCM:
                raise AssemblyError(f"{where}: HTTP filters live in {HCM}, not {fm.get('name')}")
            sub = fm.get("subFilter", {}).get("name")
            for x in listeners:
                for hcm in hcm_of(x):
                    fl = hcm["http_filters"]
                    if op == "INSERT_FIRST":
                        fl.insert(0, copy.deepcopy(value))
                        hit += 1
                        continue
                    idx = [j for j, f in enumerate(fl) if f["name"] == sub]
                    if idx:
                        fl.insert(idx[0] + (op == "INSERT_AFTER"), copy.deepcopy(value))
                        hit += 1
        elif p["applyTo"] == "NETWORK_FILTER" and op in ("MERGE", "INSERT_FIRST"):
            fm = lm.get("filterChain", {}).get("filter", {})
            for x in listeners:
                for chain in list(x.get("filter_chains", [])) + ([x["default_filter_chain"]]
                                                                  if "default_filter_chain" in x else []):
                    fl = chain.get("filters", [])
                    if op == "INSERT_FIRST":
                        fl.insert(0, copy.deepcopy(value))
                        hit += 1
                        continue
                    for j, f in enumerate(fl):
                        if f["name"] == fm.get("name"):
                            fl[j] = proto_merge(f, value)
                            hit += 1
        elif p["applyTo"] == "HTTP_ROUTE" and op == "MERGE":
            rm = m.get("routeConfiguration", {})
            name = rm.get("vhost", {}).get("route", {}).get("name")
            for x in sr["listeners"]:
                for hcm in hcm_of(x):
                    rc = hcm["route_config"]
                    if "portNumber" in rm and rc["name"] != f"http.{rm['portNumber']}":
                        continue
                    for vh in rc["virtual_hosts"]:
                        for r in vh["routes"]:
                            if name is None or r.get("name") == name:
                                r.update(proto_merge(r, value))
                                hit += 1
        elif p["applyTo"] == "CLUSTER" and op == "ADD":
            sr["clusters"].append(copy.deepcopy(value))
            hit = 1
        else:
            raise AssemblyError(f"{where}: operation {op} is not one the deployment uses")
        if not hit:
            raise AssemblyError(f"{where}: matches nothing in the gateway's configuration (Istio would skip it)")


def istio_bootstrap(root: Path = ENVOY_DIR) -> dict:
    objs = load_kind("istio", root)
    gw = find(objs, "Gateway")
    vs = find(objs, "VirtualService")
    if gw["metadata"]["name"] not in vs["spec"]["gateways"]:
        raise AssemblyError("the VirtualService is not bound to the Gateway")
    dep = find(objs, "Deployment", "llmgw-gateway")
    pod = dep["spec"]["template"]
    labels = pod["metadata"]["labels"]
    if not _selects(gw["spec"]["selector"], labels):
        raise AssemblyError("the Gateway's selector does not select the gateway pods")
    listeners, clusters = [], []
    for server in gw["spec"]["servers"]:
        port = server["port"]["number"]
        rc = _istio_routes(vs, port)
        listeners.append(_istio_listener(port, rc))
        for r in rc["virtual_hosts"][0]["routes"]:
            name = r["route"]["cluster"]
            if all(c["name"] != name for c in clusters):
                clusters.append({"name": name, "type": "STATIC", "connect_timeout": "10s",
                                 "load_assignment": {"cluster_name": name, "endpoints": []}})
    proxy_config = yaml.safe_load(pod["metadata"].get("annotations", {}).get("proxy.istio.io/config", "") or "{}")
    prefixes = ISTIO_STATS_INCLUSION + proxy_config.get("proxyStatsMatcher", {}).get("inclusionPrefixes", [])
    bootstrap = {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 15000}}},
        "stats_config": {"stats_matcher": {"inclusion_list": {"patterns": [{"prefix": p} for p in prefixes]}}},
        "static_resources": {"listeners": listeners, "clusters": clusters},
    }
    # ISTIO_BOOTSTRAP_OVERRIDE: the file the istio-proxy container names, merged into the bootstrap.
    proxy = next(c for c in pod["spec"]["containers"] if c["name"] == "istio-proxy")
    env = {e["name"]: e.get("value") for e in proxy.get("env", [])}
    override = env.get("ISTIO_BOOTSTRAP_OVERRIDE")
    if override:
        bootstrap = proto_merge(bootstrap, json.loads(_mounted_file(objs, pod, proxy, override)))
    for ef in [o for o in objs if o["kind"] == "EnvoyFilter"]:
        _apply_envoyfilter(ef, bootstrap, labels)
    return bootstrap


def _mounted_file(objs: list[dict], pod: dict, container: dict, path: str) -> str:
    """The content of a file a container sees through a ConfigMap volume."""
    for vm in container.get("volumeMounts", []):
        mount = vm["mountPath"].rstrip("/") + "/"
        if path.startswith(mount):
            vol = next(v for v in pod["spec"]["volumes"] if v["name"] == vm["name"])
            cm = find(objs, "ConfigMap", vol["configMap"]["name"])
            return cm["data"][path[len(mount):]]
    raise AssemblyError(f"{path}: not in any ConfigMap volume of container {container['name']}")


# ---------------------------------------------------------------------------------------------
# Envoy Gateway 1.9.


def container_port(port: int) -> int:
    """Envoy Gateway listens on the Gateway's port, shifted by 10000 below 1024."""
    return port + 10000 if port < 1024 else port


def _eg_generated() -> dict:
    load_ = lambda n: proto_names(yaml.safe_load((EG_XDS / f"http-route.{n}.yaml").read_text()))  # noqa: E731
    return {"listeners": load_("listeners"), "routes": load_("routes"), "clusters": load_("clusters"),
            "endpoints": load_("endpoints")}


def _eg_resources(gateway: dict, httproute: dict) -> dict:
    """The xDS Envoy Gateway 1.9 (name scheme V2) generates for our Gateway's HTTP listener and
    HTTPRoute: the translator test's generated resources, renamed and re-routed."""
    gen = _eg_generated()
    (listener_spec,) = [x for x in gateway["spec"]["listeners"] if x["protocol"] == "HTTP"]
    ext = listener_spec["port"]
    (lst,) = copy.deepcopy(gen["listeners"])
    lst["name"] = f"tcp-{ext}"
    lst["address"]["socket_address"]["port_value"] = container_port(ext)
    chain = lst["default_filter_chain"]
    chain["name"] = f"http-{ext}"
    (hcm,) = hcm_of(lst)
    hcm["stat_prefix"] = f"http-{ext}"
    hcm["rds"]["route_config_name"] = f"http-{ext}"

    (rc,) = copy.deepcopy(gen["routes"])
    rc["name"] = f"http-{ext}"
    (vh,) = rc["virtual_hosts"]
    template = vh["routes"][0]
    host = listener_spec.get("hostname", "*")
    vh["name"] = host.replace(".", "_")
    vh["domains"] = [host]
    ns, name = httproute["metadata"]["namespace"], httproute["metadata"]["name"]
    clusters, endpoints, vh["routes"] = [], [], []
    (gen_cluster,), (gen_endpoints,) = gen["clusters"], gen["endpoints"]
    for i, rule in enumerate(httproute["spec"]["rules"]):
        dest = f"httproute/{ns}/{name}/rule/{i}"
        for j, m in enumerate(rule.get("matches", [{"path": {"type": "PathPrefix", "value": "/"}}])):
            path = m["path"]
            match = ({"path": path["value"]} if path["type"] == "Exact" else
                     {"path_separated_prefix": path["value"]} if path["value"] != "/" else {"prefix": "/"})
            r = copy.deepcopy(template)
            r.update({"name": f"{dest}/match/{j}/{host}", "match": match})
            r["route"] = {**r["route"], "cluster": dest}
            vh["routes"].append(r)
        c = copy.deepcopy(gen_cluster)
        c["name"] = c["eds_cluster_config"]["service_name"] = dest
        clusters.append(c)
        e = copy.deepcopy(gen_endpoints)
        e["cluster_name"] = dest
        endpoints.append(e)
    return {"type.googleapis.com/envoy.config.listener.v3.Listener": [lst],
            "type.googleapis.com/envoy.config.route.v3.RouteConfiguration": [rc],
            "type.googleapis.com/envoy.config.cluster.v3.Cluster": clusters,
            "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment": endpoints}


def _apply_patch_policy(epp: dict, resources: dict) -> None:
    where = f"EnvoyPatchPolicy {epp['metadata']['name']}"
    if epp["spec"]["type"] != "JSONPatch":
        raise AssemblyError(f"{where}: type {epp['spec']['type']}")
    for i, p in enumerate(epp["spec"]["jsonPatches"]):
        of_type = resources.setdefault(p["type"], [])
        op = p["operation"]
        if op["op"] == "add" and not op.get("path") and not op.get("jsonPath"):
            of_type.append(copy.deepcopy(op["value"]))
            continue
        hits = [j for j, r in enumerate(of_type) if r.get("name", r.get("cluster_name")) == p["name"]]
        if not hits:
            raise AssemblyError(f"{where} jsonPatches[{i}]: no {p['type'].rsplit('.', 1)[-1]} named {p['name']!r} "
                                f"(Envoy Gateway generates {[r.get('name') for r in of_type]})")
        try:
            of_type[hits[0]] = jsonpatch.apply_patch(of_type[hits[0]], [op])
        except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as e:
            raise AssemblyError(f"{where} jsonPatches[{i}]: {e}") from e


def envoy_gateway_bootstrap(root: Path = ENVOY_DIR) -> dict:
    objs = load_kind("envoy-gateway", root)
    eg_config = yaml.safe_load(find(objs, "ConfigMap", "envoy-gateway-config")["data"]["envoy-gateway.yaml"])
    if not eg_config.get("extensionApis", {}).get("enableEnvoyPatchPolicy"):
        raise AssemblyError("EnvoyPatchPolicy is not enabled in the EnvoyGateway configuration")
    if "XDSNameSchemeV2" not in eg_config.get("runtimeFlags", {}).get("enabled", []):
        raise AssemblyError("the patches name xDS resources by scheme V2, which 1.9.0 leaves off by default")
    gateway, route = find(objs, "Gateway"), find(objs, "HTTPRoute")
    gclass = find(objs, "GatewayClass", gateway["spec"]["gatewayClassName"])
    if not any(p["name"] == gateway["metadata"]["name"] for p in route["spec"]["parentRefs"]):
        raise AssemblyError("the HTTPRoute is not attached to the Gateway")
    proxy = find(objs, "EnvoyProxy", gclass["spec"]["parametersRef"]["name"])
    resources = _eg_resources(gateway, route)
    for epp in [o for o in objs if o["kind"] == "EnvoyPatchPolicy"]:
        t = epp["spec"]["targetRef"]
        if (t["kind"], t["name"]) != ("Gateway", gateway["metadata"]["name"]) or \
                epp["metadata"]["namespace"] != gateway["metadata"]["namespace"]:
            raise AssemblyError(f"EnvoyPatchPolicy {epp['metadata']['name']} does not target the Gateway")
        _apply_patch_policy(epp, resources)
    # Static form: RDS and EDS inlined.
    by_name = {rc["name"]: rc for rc in resources["type.googleapis.com/envoy.config.route.v3.RouteConfiguration"]}
    listeners = resources["type.googleapis.com/envoy.config.listener.v3.Listener"]
    for lst in listeners:
        for hcm in hcm_of(lst):
            rds = hcm.pop("rds", None)
            if rds:
                hcm["route_config"] = by_name[rds["route_config_name"]]
    cla = {e["cluster_name"]: e for e in resources["type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"]}
    clusters = resources["type.googleapis.com/envoy.config.cluster.v3.Cluster"]
    for c in clusters:
        if c.get("type") == "EDS":
            c["type"] = "STATIC"
            c.pop("eds_cluster_config")
            c["load_assignment"] = cla[c["name"]]
    bootstrap = {"admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 19000}}},
                 "static_resources": {"listeners": listeners, "clusters": clusters}}
    boot = proxy["spec"].get("bootstrap")
    if boot:
        if boot.get("type") != "Merge":
            raise AssemblyError("the EnvoyProxy bootstrap is expected to be merged into Envoy Gateway's")
        bootstrap = proto_merge(bootstrap, yaml.safe_load(boot["value"]))
    return bootstrap


def _gateway_api_seconds(duration: str) -> float:
    """A Gateway API duration (GEP-2257: "1h", "5m", "300s", "500ms", "1h30m") in seconds."""
    parts = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m(?!s))?(?:(\d+)s)?(?:(\d+)ms)?", duration)
    if not duration or parts is None:
        raise AssemblyError(f"not a Gateway API duration: {duration!r}")
    h, m, s, ms = (int(x or 0) for x in parts.groups())
    return h * 3600 + m * 60 + s + ms / 1000


def gaie_bootstrap(gateway: str, root: Path = ENVOY_DIR) -> dict:
    """What a GAIE gateway makes of the variant's Gateway, HTTPRoute and InferencePool, in the
    shape of envoy/llmgw-epp-local.yaml (its ext_proc filter towards the picker, its pool cluster
    choosing by the destination header, its picker cluster over HTTP/2 with the gRPC health check),
    filled in from the manifests: the Gateway's port, the route's paths and timeout, FailOpen or
    FailClose from the pool, the pool's pods (through vllm.yaml's headless Service selecting the
    same pods) on its target port, the picker's Service and port. Not captured from istiod or Envoy
    AI Gateway: the wiring GAIE prescribes, which the gateways' own generated names and extras
    would surround."""
    objs = [o for f in GAIE[gateway] for o in load(f, root)]
    vllm = load("vllm/vllm.yaml", root)
    b = yaml.safe_load((root / "llmgw-epp-local.yaml").read_text())
    gw, route = find(objs, "Gateway"), find(objs, "HTTPRoute")
    (rule,) = route["spec"]["rules"]
    (ref,) = rule["backendRefs"]
    if (ref.get("group"), ref.get("kind")) != ("inference.networking.k8s.io", "InferencePool"):
        raise AssemblyError(f"the HTTPRoute's backend is a {ref.get('kind', 'Service')}, not an InferencePool")
    pool = find(objs, "InferencePool", ref["name"])
    ns = pool["metadata"]["namespace"]
    picker = pool["spec"]["endpointPickerRef"]
    if picker.get("kind", "Service") != "Service":
        raise AssemblyError("the picker is not a Service")
    svc = find(objs, "Service", picker["name"])
    ports = [p for p in svc["spec"]["ports"] if p["port"] == picker["port"]["number"]]
    if len(ports) != 1:
        raise AssemblyError(f"the picker's Service has no port {picker['port']['number']}")
    if ports[0].get("appProtocol") not in ("http2", "kubernetes.io/h2c", "grpc"):
        raise AssemblyError("the picker's Service port does not declare HTTP/2 (appProtocol)")
    headless = [s for s in vllm if s["kind"] == "Service" and s["spec"].get("clusterIP") == "None"
                and s["spec"]["selector"] == pool["spec"]["selector"]["matchLabels"]]
    if len(headless) != 1:
        raise AssemblyError("no headless Service selects the pool's pods")
    (target,) = pool["spec"]["targetPorts"]

    (listener,) = b["static_resources"]["listeners"]
    (glistener,) = gw["spec"]["listeners"]
    # Envoy Gateway shifts a privileged port by 10000; istiod's gateway binds the Gateway's port.
    port = container_port(glistener["port"]) if gateway == "envoy-gateway" else glistener["port"]
    listener["address"]["socket_address"] = {"address": "0.0.0.0", "port_value": port}
    (hcm,) = hcm_of(listener)
    vhost = hcm["route_config"]["virtual_hosts"][0]
    template = copy.deepcopy(vhost["routes"][0]["route"])
    if "request" in rule.get("timeouts", {}):
        template["timeout"] = f"{_gateway_api_seconds(rule['timeouts']['request'])}s"
    routes = []
    for m in rule["matches"]:
        kind, value = m["path"]["type"], m["path"]["value"]
        if kind not in ("Exact", "PathPrefix"):
            raise AssemblyError(f"path match {kind} is not assembled here")
        routes.append({"match": {"path" if kind == "Exact" else "prefix": value}, "route": copy.deepcopy(template)})
    vhost["routes"] = routes + [{"match": {"prefix": "/"}, "direct_response": {"status": 404}}]
    for f in hcm["http_filters"]:
        if f["name"] == "envoy.filters.http.ext_proc":
            f["typed_config"]["failure_mode_allow"] = pool["spec"]["endpointPickerRef"].get("failureMode") == "FailOpen"

    def dns(name: str, host: str, port: int) -> None:
        c = cluster(b, name)
        c["type"] = "STRICT_DNS"
        c["load_assignment"]["endpoints"] = [{"lb_endpoints": [
            {"endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}}}]}]

    dns("llmgw_pool", f"{headless[0]['metadata']['name']}.{headless[0]['metadata']['namespace']}.svc.cluster.local",
        target["number"])
    dns("llmgw_epp", f"{svc['metadata']['name']}.{ns}.svc.cluster.local", ports[0]["port"])
    return b


ASSEMBLE = {"kubernetes": kubernetes_bootstrap, "istio": istio_bootstrap, "envoy-gateway": envoy_gateway_bootstrap}

# The ports the agent's feed and Envoy's admin API have in the shipped bootstraps.
AGENT_FEED_PORT = 7070


# ---------------------------------------------------------------------------------------------
# Onto loopback.


def localize(bootstrap: dict, wasm: Path, ports: dict[int, int], admin: int, agent: int, closed: int,
             tokenizer: int | None = None) -> dict:
    """The bootstrap with every listener on 127.0.0.1 (its port mapped through `ports`, which
    must name each), the admin API on `admin`, the agent's cluster on `agent`, Envoy's own admin
    cluster (if any) on `admin`, every other static endpoint on the closed port `closed` (nothing
    leaves loopback), the filter profiles' `tokenizer_address` on `tokenizer` (None: `closed`),
    and llmgw.wasm read from `wasm`."""
    b = copy.deepcopy(bootstrap)
    for f in http_filters(b):
        if f["name"] == WASM_FILTER:
            value = f["typed_config"]["config"]["configuration"]
            cfg = json.loads(value["value"])
            for p in cfg["profiles"]:
                if "tokenizer_address" in p:
                    p["tokenizer_address"] = f"127.0.0.1:{closed if tokenizer is None else tokenizer}"
            value["value"] = json.dumps(cfg)
    old_admin = b["admin"]["address"]["socket_address"]["port_value"]
    b["admin"]["address"]["socket_address"] = {"address": "127.0.0.1", "port_value": admin}
    for lst in b["static_resources"]["listeners"]:
        sa = lst["address"]["socket_address"]
        if sa["port_value"] not in ports:
            raise KeyError(f"listener {lst['name']} on port {sa['port_value']}: no test port given")
        lst["address"]["socket_address"] = {"address": "127.0.0.1", "port_value": ports[sa["port_value"]]}
    for c in b["static_resources"]["clusters"]:
        for group in c.get("load_assignment", {}).get("endpoints", []):
            for ep in group.get("lb_endpoints", []):
                sa = ep["endpoint"]["address"]["socket_address"]
                port = (agent if c["name"] == "llmgw_agent" else
                        admin if sa["address"] == "127.0.0.1" and sa["port_value"] == old_admin else closed)
                ep["endpoint"]["address"]["socket_address"] = {"address": "127.0.0.1", "port_value": port}
    return with_wasm(b, wasm)


def with_wasm(bootstrap: dict, wasm: Path) -> dict:
    """The bootstrap with every llmgw filter loading `wasm` (the pods' volume path replaced)."""
    b = copy.deepcopy(bootstrap)
    for f in http_filters(b):
        if f["name"] == WASM_FILTER:
            f["typed_config"]["config"]["vm_config"]["code"]["local"]["filename"] = str(Path(wasm).resolve())
    return b


def write(bootstrap: dict, path: Path) -> Path:
    path.write_text(json.dumps(bootstrap, indent=1))
    return path


def envoy_validate(envoy_bin, path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(envoy_bin), "--mode", "validate", "-c", str(path), "--log-level", "warn",
                           "--disable-hot-restart"], capture_output=True, text=True, timeout=120)


def listener_ports(bootstrap: dict) -> list[int]:
    return [lst["address"]["socket_address"]["port_value"] for lst in bootstrap["static_resources"]["listeners"]]
