#!/usr/bin/env python3
"""Checks the Rust sources' structure: no import circle between files, and files of a bounded
size (a shipped file at most 600 lines above its tests, a test file at most 800).

An edge A -> B is a path A names (`crate::x::Y`, `super::Y`, a `use child::` re-export in a
mod.rs) that resolves to the file defining module B; test modules are left out. Prints every
circle with its edges and every file over its limit; exits 1 if there is any.

Usage: python3 dev/check_structure.py [CRATE_SRC_DIR ...]   (default: every crate of the repo)
"""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHIPPED_MAX = 600
TEST_MAX = 800
TEST_MOD = re.compile(r"#\[cfg\(test\)\]\s*(?:#\[[^\]]*\]\s*)*(?:pub(?:\([^)]*\))?\s+)?mod tests\b")
PATH = re.compile(r"\b(crate|super)::((?:[a-z_][a-z0-9_]*::)*)(\{[^;]*?\}|[A-Za-z_][A-Za-z0-9_]*)")


def modules(src: Path) -> dict:
    """Module path (tuple) -> file."""
    out = {}
    for p in src.rglob("*.rs"):
        parts = list(p.relative_to(src).with_suffix("").parts)
        if parts[-1] in ("mod", "lib", "main"):
            parts = parts[:-1]
        out[tuple(parts)] = p
    return out


def shipped_text(p: Path) -> str:
    text = p.read_text()
    cut = TEST_MOD.search(text)
    if cut:
        text = text[: cut.start()]
    return re.sub(r"//[^\n]*", "", text)


def edges_of(src: Path) -> dict:
    files = modules(src)

    def resolve(path):
        for n in range(len(path), 0, -1):
            if tuple(path[:n]) in files:
                return tuple(path[:n])
        return None

    edges = {}
    for mod, p in files.items():
        if p.name == "tests.rs" or "tests" in mod:
            continue
        text = shipped_text(p)
        is_root = p.name in ("mod.rs", "lib.rs", "main.rs")
        parent = list(mod) if is_root else list(mod[:-1])
        deps = set()
        for m in PATH.finditer(text):
            base, path, last = m.group(1), m.group(2), m.group(3)
            segs = [s for s in path.split("::") if s]
            if base == "super":
                # `super::X` inside an inline module naming an item of this same file.
                if not last.startswith("{") and re.search(rf"\b(?:struct|enum|fn|const|type|trait)\s+{last}\b", text):
                    continue
                full = (parent[:-1] if is_root else parent) + segs
            else:
                full = segs
            names = re.findall(r"([a-z_][a-z0-9_]*)(?:::|\s*[,}])", last) if last.startswith("{") else [last]
            for name in names + ([] if not last.startswith("{") else [None]):
                target = resolve(full + [name] if name else full)
                if target is not None and target != mod and target != ():
                    deps.add(target)
        if is_root:
            for m in re.finditer(r"\buse\s+(?:self::)?([a-z_][a-z0-9_]*)::", text):
                child = tuple(list(mod) + [m.group(1)])
                if child in files:
                    deps.add(child)
        edges[mod] = deps
    return edges


def circles(edges: dict) -> list:
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    sys.setrecursionlimit(10000)
    for v in list(edges):
        if v not in index:
            visit(v)
    return out


def is_test_file(p: Path) -> bool:
    return p.name == "tests.rs" or "tests" in p.parts[:-1]


def main() -> int:
    srcs = [Path(a) for a in sys.argv[1:]] or [ROOT / "src"] + sorted(ROOT.glob("crates/*/src"))
    problems = []
    for src in srcs:
        name = src.relative_to(ROOT) if src.is_absolute() else src
        for comp in circles(edges_of(src)):
            shown = ", ".join(f"{name}/{'/'.join(m) or 'lib'}" for m in comp)
            problems.append(f"import circle: {shown}")
        for p in sorted(src.rglob("*.rs")):
            rel = p.relative_to(ROOT) if p.is_absolute() else p
            if is_test_file(p):
                n = len(p.read_text().splitlines())
                if n > TEST_MAX:
                    problems.append(f"{rel}: test file of {n} lines (at most {TEST_MAX})")
            else:
                text = p.read_text()
                cut = TEST_MOD.search(text)
                n = len((text[: cut.start()] if cut else text).splitlines())
                if n > SHIPPED_MAX:
                    problems.append(f"{rel}: {n} lines above its tests (at most {SHIPPED_MAX})")
    for t in sorted(ROOT.glob("crates/*/tests/*.rs")):
        n = len(t.read_text().splitlines())
        if n > TEST_MAX:
            problems.append(f"{t.relative_to(ROOT)}: test file of {n} lines (at most {TEST_MAX})")
    if problems:
        print(f"structure: {len(problems)} problem(s):")
        for line in problems:
            print(f"  {line}")
        return 1
    print(f"structure: {len(srcs)} crates: no import circle, every file within its size")
    return 0


if __name__ == "__main__":
    sys.exit(main())
