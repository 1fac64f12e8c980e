"""The manifests as a user adapts them: `kubectl kustomize` renders every base in envoy/ to
exactly the objects of its files (envoy/gaie's variants: the base's and their own; the images, namespace and agent configuration are then one
overlay away), one `images:` entry renames the agent's image in every container that runs it,
and the shipped overlay for an existing vLLM (envoy/overlays/existing-vllm) renders objects that
validate against their schemas, whose agent configuration the agent accepts and points at the
overlay's own headless Service, and whose Envoy bootstrap passes `envoy --mode validate` with
llmgw.wasm loaded.

kubectl comes from the machine (its built-in kustomize); without it these tests are skipped with
the reason, unless LLMGW_REQUIRE_KUBECTL=1 makes that a failure."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

import deploy_support as deploy
import seed_wiring

# Every kustomization in envoy/, and the manifests each base holds (deploy.MANIFESTS by file).
BASES = {
    "vllm": ["vllm/vllm.yaml"],
    "kubernetes": ["kubernetes/llmgw-gateway.yaml"],
    "istio": ["istio/llmgw-gateway.yaml", "istio/llmgw-envoyfilter.yaml"],
    "envoy-gateway": ["envoy-gateway/envoy-gateway-config.yaml", "envoy-gateway/llmgw-gateway.yaml",
                      "envoy-gateway/llmgw-envoypatchpolicy.yaml"],
    "gaie/base": deploy.GAIE_BASE,
    **{f"gaie/{g}": files for g, files in deploy.GAIE.items()},
}
OVERLAY = "overlays/existing-vllm"
AGENT_IMAGE = "llmgw/llmgw-agent"


def kustomize(path: Path) -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        if os.environ.get("LLMGW_REQUIRE_KUBECTL") == "1":
            pytest.fail("kubectl not found (LLMGW_REQUIRE_KUBECTL=1)")
        pytest.skip("kubectl not found: the kustomize bases and overlays are not rendered here")
    r = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d is not None]


def _key(o: dict) -> str:
    return json.dumps(o, sort_keys=True)


def _images(o: dict) -> list[str]:
    """Every container image in an object, whatever its depth (EnvoyProxy patches included)."""
    out = []
    if isinstance(o, dict):
        for k, v in o.items():
            if k in ("containers", "initContainers") and isinstance(v, list):
                out += [c["image"] for c in v if isinstance(c, dict) and "image" in c]
            out += _images(v)
    elif isinstance(o, list):
        for v in o:
            out += _images(v)
    return out


def test_every_kustomization_is_one_the_tests_render():
    shipped = {str(p.parent.relative_to(deploy.ENVOY_DIR)) for p in deploy.ENVOY_DIR.rglob("kustomization.yaml")}
    assert shipped == set(BASES) | {OVERLAY}
    assert {f for fs in BASES.values() for f in fs} == \
        {f for fs in [*deploy.MANIFESTS.values(), *deploy.GAIE.values()] for f in fs}


@pytest.mark.parametrize("base", BASES)
def test_each_base_renders_exactly_its_files(base):
    rendered = sorted(_key(o) for o in kustomize(deploy.ENVOY_DIR / base))
    files = sorted(_key(o) for f in BASES[base] for o in deploy.load(f))
    assert rendered == files


# Each gateway base runs the agent and the init container that installs the filter; each endpoint
# picker variant runs the agent as the picker; the replicas run it as their snapshot sidecar.
AGENT_CONTAINERS = {"vllm": 1, "kubernetes": 2, "istio": 2, "envoy-gateway": 2, **{f"gaie/{g}": 1 for g in deploy.GAIE}}


@pytest.mark.parametrize("base", AGENT_CONTAINERS)
def test_one_images_entry_renames_the_agent_image_everywhere(base, tmp_path):
    root = deploy.envoy_copy(tmp_path)
    before = [i for o in kustomize(root / base) for i in _images(o)]
    shipped = [i for i in before if i.startswith(AGENT_IMAGE + ":")]
    assert len(shipped) >= AGENT_CONTAINERS[base], before
    mine = root / "mine"
    mine.mkdir()
    (mine / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": [f"../{base}"],
        "images": [{"name": AGENT_IMAGE, "newName": "registry.example.com/team/llmgw-agent", "newTag": "9.9.9"}],
    }))
    after = [i for o in kustomize(mine) for i in _images(o)]
    assert not [i for i in after if i.startswith(AGENT_IMAGE)], after
    assert after.count("registry.example.com/team/llmgw-agent:9.9.9") == len(shipped), after


@pytest.fixture(scope="module")
def overlay() -> list[dict]:
    return kustomize(deploy.ENVOY_DIR / OVERLAY)


def test_the_existing_vllm_overlay_validates_against_the_schemas(overlay):
    ns = yaml.safe_load((deploy.ENVOY_DIR / OVERLAY / "kustomization.yaml").read_text())["namespace"]
    for o in overlay:
        assert deploy.validate(o), o["kind"]
        assert o["metadata"].get("namespace") == ns, (o["kind"], o["metadata"])
        for image in _images(o):
            assert not image.startswith(AGENT_IMAGE), (o["kind"], image)
    # Only the gateway and the replicas' headless Service: the replicas are the user's.
    assert {o["kind"] for o in overlay} == {"ConfigMap", "Deployment", "Service"}
    assert not [o for o in overlay if o["kind"] == "Deployment" and o["metadata"]["name"] == "vllm"]


def test_the_overlays_agent_finds_its_replicas_through_the_overlays_service(overlay, tmp_path, agent_bin):
    cm = deploy.find(overlay, "ConfigMap", "llmgw-gateway")
    text = cm["data"]["agent.toml"]
    assert text == (deploy.ENVOY_DIR / OVERLAY / "agent.toml").read_text()
    # The rest of the base's ConfigMap is kept: Envoy's bootstrap and the fetch script.
    base_cm = deploy.find(deploy.load("kubernetes/llmgw-gateway.yaml"), "ConfigMap", "llmgw-gateway")
    assert {k: v for k, v in cm["data"].items() if k != "agent.toml"} == \
        {k: v for k, v in base_cm["data"].items() if k != "agent.toml"}
    cfg = tomllib.loads(text)
    (disc,) = cfg["discovery"]
    svc = deploy.find(overlay, "Service", "llmgw-replicas")
    assert svc["spec"]["clusterIP"] == "None"
    assert disc["dns"] == f"{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc.cluster.local"
    assert disc["port"] in [p["port"] for p in svc["spec"]["ports"]]
    # The tokenizer files fetched are the model the agent serves.
    dep = deploy.find(overlay, "Deployment", "llmgw-gateway")
    (init,) = [c for c in dep["spec"]["template"]["spec"]["initContainers"] if c["name"] == "tokenizer-files"]
    env = {e["name"]: e.get("value") for e in init["env"]}
    (model,) = cfg["tokenizer"]["models"]
    assert env["MODEL_REPO"] in model["names"] and model["dir"].endswith("/" + env["MODEL_REPO"])
    assert disc["models"] == model["names"]
    # The agent parses it and prints the flags the replicas need.
    path = tmp_path / "agent.toml"
    path.write_text(text)
    r = subprocess.run([str(agent_bin), "vllm-args", "--config", str(path)], capture_output=True, text=True)
    assert r.returncode == 0 and "vllm serve my-org/my-model --enable-prefix-caching" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("kustomization", [*BASES, OVERLAY])
def test_every_rendering_reads_the_hash_seed_from_the_secret(kustomization):
    """Rendered as users apply them, no base or overlay carries a seed: vLLM's PYTHONHASHSEED
    and the agents' seed variable come from the Secret llmgw-hash-seed (which none ships), the
    filters' profiles name none."""
    w = seed_wiring.problems(kustomize(deploy.ENVOY_DIR / kustomization))
    assert not w.problems, w.problems
    if kustomization in ("vllm", OVERLAY):
        # The replicas alone; the gateway alone, in front of replicas the user runs.
        assert (w.vllm, w.agents) == ((1, 0) if kustomization == "vllm" else (0, 1)), w
    else:
        assert w.agents >= 1 and w.agent_tomls >= 1 and w.profiles >= 1, w


def test_an_overlay_that_writes_a_seed_is_refused(tmp_path):
    root = deploy.envoy_copy(tmp_path)
    toml = root / OVERLAY / "agent.toml"
    text = toml.read_text()
    assert text.count('seed_env = "LLMGW_HASH_SEED"') == 1
    toml.write_text(text.replace('seed_env = "LLMGW_HASH_SEED"', 'seed = "0"'))
    w = seed_wiring.problems(kustomize(root / OVERLAY))
    assert any("[hash] seed = '0'" in p for p in w.problems), w.problems


def test_the_overlays_bootstrap_passes_envoy_validation(overlay, tmp_path, envoy_bin, wasm_path):
    cm = deploy.find(overlay, "ConfigMap", "llmgw-gateway")
    bootstrap = yaml.safe_load(cm["data"]["envoy.yaml"])
    path = deploy.write(deploy.with_wasm(bootstrap, wasm_path), tmp_path / "overlay.json")
    r = deploy.envoy_validate(envoy_bin, path)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr


def test_the_render_tokenizer_patch_puts_vllms_render_server_on_the_filters_tokenizer_address(tmp_path):
    root = deploy.envoy_copy(tmp_path)
    k = root / OVERLAY / "kustomization.yaml"
    text = k.read_text()
    assert "# - path: render-tokenizer.yaml" in text
    k.write_text(text.replace("# - path: render-tokenizer.yaml", "- path: render-tokenizer.yaml"))
    objs = kustomize(root / OVERLAY)
    for o in objs:
        assert deploy.validate(o), o["kind"]
    dep = deploy.find(objs, "Deployment", "llmgw-gateway")
    (render,) = [c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "tokenizer"]
    cmd = render["command"]
    addr = f"{cmd[cmd.index('--host') + 1]}:{cmd[cmd.index('--port') + 1]}"
    bootstrap = yaml.safe_load(deploy.find(objs, "ConfigMap", "llmgw-gateway")["data"]["envoy.yaml"])
    (cfg,) = deploy.wasm_configs(bootstrap)
    (profile,) = cfg["profiles"]
    assert profile["tokenizer_address"] == addr
