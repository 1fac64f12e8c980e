"""Where the shipped manifests take the block hashes' seed from. The seed is the replicas'
PYTHONHASHSEED: whoever knows it can compute the block hashes of any prompt they guess, so no
manifest may carry one. Every vLLM container reads it from the deployment's Secret
(`llmgw-hash-seed`, key `seed`), every agent reads the same Secret through the variable its
`[hash] seed_env` names, and the filters' profiles name no seed (they take the agent's, from its
feed). `problems` lists what breaks that in a set of objects, whatever their kind or depth
(ConfigMaps' agent.toml and embedded Envoy configuration, EnvoyFilter and EnvoyPatchPolicy
values, the EnvoyProxy's container patch)."""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass, field

import yaml

SECRET_REF = {"name": "llmgw-hash-seed", "key": "seed"}
SEED_ENV = "LLMGW_HASH_SEED"


@dataclass
class Wiring:
    problems: list[str] = field(default_factory=list)
    vllm: int = 0
    agents: int = 0
    agent_tomls: int = 0
    profiles: int = 0


def _embedded(text: str):
    """A filter configuration or Envoy bootstrap held in a string, parsed; None otherwise."""
    if "profiles" not in text:
        return None
    for parse in (json.loads, yaml.safe_load):
        try:
            v = parse(text)
        except (ValueError, yaml.YAMLError):
            continue
        if isinstance(v, (dict, list)):
            return v
    return None


def _walk(v, where: str, out: Wiring, containers: list[tuple[str, dict]]):
    if isinstance(v, dict):
        if isinstance(v.get("profiles"), list):
            for i, p in enumerate(v["profiles"]):
                out.profiles += 1
                if isinstance(p, dict) and "seed" in p:
                    out.problems.append(f"{where}: filter profile {i} carries a seed ({p['seed']!r})")
        for k, x in v.items():
            if k in ("containers", "initContainers") and isinstance(x, list):
                containers += [(f"{where}.{k}", c) for c in x if isinstance(c, dict)]
            _walk(x, f"{where}.{k}", out, containers)
    elif isinstance(v, list):
        for i, x in enumerate(v):
            _walk(x, f"{where}[{i}]", out, containers)
    elif isinstance(v, str):
        parsed = _embedded(v)
        if parsed is not None:
            _walk(parsed, where, out, containers)


def _check_agent_toml(text: str, where: str, out: Wiring) -> None:
    out.agent_tomls += 1
    cfg = tomllib.loads(text)
    sections = [("hash", cfg.get("hash", {}))]
    for key in ("replicas", "discovery"):
        sections += [(f"{key}[{i}].hash", r["hash"]) for i, r in enumerate(cfg.get(key, [])) if "hash" in r]
    for name, h in sections:
        for literal in ("seed", "seed_file"):
            if literal in h:
                out.problems.append(f"{where}: [{name}] {literal} = {h[literal]!r}: the seed must come from the Secret")
    # A configuration that hashes or feeds filters (a gateway's agent, a picker) reads the seed
    # from the Secret's variable; the snapshot sidecar's (`publish`: no [hash], [feed] or [epp])
    # hashes nothing and needs none, but may not name one either.
    hashes = any(k in cfg for k in ("hash", "feed", "epp"))
    if hashes and cfg.get("hash", {}).get("seed_env") != SEED_ENV:
        out.problems.append(f"{where}: [hash] seed_env is not {SEED_ENV!r}")


def _env(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", []) if isinstance(e, dict) and "name" in e}


def _check_container(where: str, c: dict, out: Wiring) -> None:
    cmd = [str(x) for x in c.get("command", []) + c.get("args", [])]
    env = _env(c)
    label = f"{where} {c.get('name')}"
    for name in ("PYTHONHASHSEED", SEED_ENV):
        e = env.get(name)
        if e is None:
            continue
        if "value" in e:
            out.problems.append(f"{label}: {name} is written in the manifest ({e['value']!r})")
        elif e.get("valueFrom", {}).get("secretKeyRef") != SECRET_REF:
            out.problems.append(f"{label}: {name} is not read from the Secret {SECRET_REF}: {e.get('valueFrom')}")
    if cmd[:2] == ["vllm", "serve"]:
        out.vllm += 1
        if "PYTHONHASHSEED" not in env:
            out.problems.append(f"{label}: vLLM runs without PYTHONHASHSEED")
    if any(x.endswith("llmgw-agent") for x in cmd) and "run" in cmd:
        out.agents += 1
        if SEED_ENV not in env:
            out.problems.append(f"{label}: the agent has no {SEED_ENV}")


def problems(objs: list[dict], extra_agent_tomls: dict[str, str] | None = None) -> Wiring:
    """The seed wiring of `objs` (and of agent configurations kept beside them as files)."""
    out = Wiring()
    for o in objs:
        where = f"{o.get('kind')}/{o.get('metadata', {}).get('name')}"
        if o.get("kind") == "Secret" and o.get("metadata", {}).get("name") == SECRET_REF["name"]:
            out.problems.append(f"{where}: the seed's Secret is shipped (each deployment creates its own)")
        if o.get("kind") == "ConfigMap":
            for key, text in (o.get("data") or {}).items():
                if key.endswith(".toml"):
                    _check_agent_toml(text, f"{where} {key}", out)
        containers: list[tuple[str, dict]] = []
        _walk(o, where, out, containers)
        for path, c in containers:
            _check_container(path, c, out)
    for where, text in (extra_agent_tomls or {}).items():
        _check_agent_toml(text, where, out)
    return out
