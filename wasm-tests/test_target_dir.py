"""Built files are found where cargo puts them. In a copy of the sources (so that this checkout's
dist/ is left alone), `./build.sh wasm` builds into a separate target directory given as
CARGO_TARGET_DIR (absolute, then relative to where build.sh is run from) and publishes
dist/llmgw.wasm from it; then, without the variable, into the one a cargo config's
`build.target-dir` names, which build.sh and the test kit learn from `cargo metadata`. The test
kit of the copy finds the same files each time. Costs one release build of the filter from an
empty target directory (about a minute on a free core)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import llmgw_testkit as kit

# Not copied: build outputs, virtualenvs, caches, the fuzz crate (outside the workspace).
SKIP_AT_ROOT = {".git", "target", "dist", "results", ".cache", ".venv", ".venv-peers", ".venv-vllm", "fuzz"}

pytestmark = pytest.mark.build


def copy_sources(dest: Path) -> Path:
    own_target = kit.target_dir().resolve()

    def ignore(d, names):
        skip = {n for n in names if n == "__pycache__" or (Path(d, n).resolve() == own_target)}
        return skip | (SKIP_AT_ROOT & set(names) if Path(d).resolve() == kit.ROOT else set())

    shutil.copytree(kit.ROOT, dest, ignore=ignore, symlinks=True)
    return dest


def run(cmd, cwd: Path, env: dict) -> str:
    p = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, f"{cmd} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p.stdout + p.stderr


def kit_sees(src: Path, env: dict) -> tuple[Path, Path]:
    """(target_dir(), the built filter) as the copy's test kit finds them."""
    code = ("import llmgw_testkit as k; print(k.target_dir()); "
            "print(k.built('llmgw.wasm', k.WASM_TARGET + '/release'))")
    out = run([sys.executable, "-c", code], src, {**env, "PYTHONPATH": str(src / "testkit")}).split()
    return Path(out[0]), Path(out[1])


def test_build_sh_and_kit_use_cargo_target_dir_and_cargo_config(tmp_path):
    src = copy_sources(tmp_path / "src")
    target = tmp_path / "target"
    env = {k: v for k, v in os.environ.items() if k != "CARGO_TARGET_DIR"}
    built = target / kit.WASM_TARGET / "release" / "llmgw.wasm"
    dist = src / "dist" / "llmgw.wasm"

    # CARGO_TARGET_DIR, absolute.
    log = run([src / "build.sh", "wasm"], src, {**env, "CARGO_TARGET_DIR": str(target)})
    assert built.exists(), log
    assert dist.read_bytes() == built.read_bytes()
    assert not (src / "target").exists(), "cargo wrote into the copy's ./target"
    assert kit_sees(src, {**env, "CARGO_TARGET_DIR": str(target)}) == (target, built)

    # CARGO_TARGET_DIR, relative to where build.sh is run from (nothing to rebuild).
    dist.unlink()
    run([src / "build.sh", "wasm"], tmp_path, {**env, "CARGO_TARGET_DIR": "target"})
    assert dist.read_bytes() == built.read_bytes()
    assert not (src / "target").exists()

    # No variable: the cargo config's target-dir, read through `cargo metadata`.
    (src / ".cargo").mkdir(exist_ok=True)
    (src / ".cargo" / "config.toml").write_text(f"[build]\ntarget-dir = {str(target)!r}\n")
    dist.unlink()
    run([src / "build.sh", "wasm"], src, env)
    assert dist.read_bytes() == built.read_bytes()
    assert not (src / "target").exists()
    assert kit_sees(src, env) == (target, built)
