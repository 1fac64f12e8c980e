"""Where the project's files are: the repository root, cargo's target directory (CARGO_TARGET_DIR,
else what `cargo metadata` reports, so a `build.target-dir` in a cargo config counts too), the
binaries built there, the published filter (dist/llmgw.wasm) and the Envoy binary."""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
# vLLM 0.33.0 captures and fixtures the Rust tests read too.
VLLM_DATA = ROOT / "crates" / "llmgw-core" / "tests" / "data" / "vllm-0.33.0"
WASM_TARGET = "wasm32-wasip1"


@functools.lru_cache(maxsize=None)
def _metadata_target_dir(root: Path) -> Path:
    try:
        out = subprocess.run(["cargo", "metadata", "--format-version", "1", "--no-deps"], cwd=root,
                             capture_output=True, text=True, check=True, timeout=120)
    except FileNotFoundError:
        raise FileNotFoundError("cargo not found, so its target directory is unknown: install Rust "
                                "(https://rustup.rs) or set CARGO_TARGET_DIR") from None
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"`cargo metadata` failed in {root}:\n{e.stderr.strip()}") from None
    return Path(json.loads(out.stdout)["target_directory"])


def target_dir() -> Path:
    """Cargo's target directory for this workspace: $CARGO_TARGET_DIR (relative to the current
    directory, as cargo reads it) or `cargo metadata`'s target_directory."""
    env = os.environ.get("CARGO_TARGET_DIR")
    if env:
        return Path(env).resolve()
    return _metadata_target_dir(ROOT)


def binary_path(name: str, profile: str = "release") -> Path:
    """Where cargo puts `name` for `profile` (a profile, or a target triple and profile such as
    "wasm32-wasip1/release"), built or not."""
    return target_dir() / profile / name


def built(name: str, profile: str | None = None) -> Path:
    """A built file of the workspace. With no profile: the newer of the release and debug builds,
    so a stale build is never used. Raises FileNotFoundError naming the build to run."""
    profiles = [profile] if profile else ["release", "debug"]
    found = [p for p in (binary_path(name, prof) for prof in profiles) if p.exists()]
    if not found:
        where = " or ".join(str(binary_path(name, prof)) for prof in profiles)
        raise FileNotFoundError(f"{name} not built (looked for {where}): run ./build.sh build")
    return max(found, key=lambda p: p.stat().st_mtime)


def wasm() -> Path:
    """The published filter, dist/llmgw.wasm (build.sh copies it there from cargo's target dir)."""
    p = ROOT / "dist" / "llmgw.wasm"
    if not p.exists():
        raise FileNotFoundError(f"{p} missing: run ./build.sh build")
    return p


def envoy_bin() -> Path:
    """The Envoy binary: $LLMGW_ENVOY, else `envoy` on PATH, else the one ./build.sh installs in .venv."""
    for cand in (os.environ.get("LLMGW_ENVOY"), shutil.which("envoy"), str(ROOT / ".venv" / "bin" / "envoy")):
        if cand and Path(cand).exists():
            return Path(cand)
    raise FileNotFoundError("envoy not found (set LLMGW_ENVOY, or run ./build.sh setup to install it into .venv)")
