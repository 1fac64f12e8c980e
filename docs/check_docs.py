#!/usr/bin/env python3
"""Checks the manual (docs/src/, an mdBook) and the top-level README.md: every link resolves
(the file exists, and a `#anchor` names a heading of it), the book links only inside itself,
every repository path named in a code span exists (and a `path::name` names something in that
file), every chapter is in SUMMARY.md, every included file exists, the project layout lists
every Rust source file, and no text names an issue number or a path of a developer's machine.

Run from anywhere: `python3 docs/check_docs.py`. Exits 1 listing each problem as
`file:line: what`, 0 with a one-line summary. Python 3 standard library only.
"""

import fnmatch
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BOOK = ROOT / "docs" / "src"
LAYOUT = BOOK / "layout.md"

# Extensions that mark a code span as a file path even when its first directory is not a
# top-level entry of the repository (then it must exist relative to the file naming it).
FILE_EXTENSIONS = {
    ".rs", ".py", ".md", ".toml", ".yaml", ".yml", ".json", ".jsonl", ".sh", ".png",
    ".proto", ".txt", ".ini", ".lock",
}
# Rust sources the project layout must list, as globs from the repository root.
LAYOUT_GLOBS = [
    "src/*.rs",
    "crates/*/src/**/*.rs",
    "crates/*/build.rs",
    "crates/*/examples/*.rs",
    "crates/*/tests/*.rs",
    "crates/*/benches/*.rs",
    "fuzz/src/*.rs",
    "fuzz/examples/*.rs",
    "bench/*.py",
    "demo/*.py",
]

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
CODE_SPAN = re.compile(r"(`+)(?!`)((?:(?!\n\s*\n).)+?)(?<!`)\1(?!`)", re.S)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(\S+)", re.M)
INCLUDE = re.compile(r"\{\{#(?:include|rustdoc_include)\s+([^}\s]+)\s*\}\}")
PATH_LIKE = re.compile(r"^[A-Za-z0-9_.][A-Za-z0-9_.\-]*(?:/[A-Za-z0-9_.\-]+)*/?$")
ISSUE_NUMBER = re.compile(r"\b[Ii]ssues?\s+#?\d+|(?<![\w&/])#\d+\b")
MACHINE_PATH = re.compile(r"(?<![\w.])/(?:work|home|root|tmp|Users)/\w")


class Problems:
    def __init__(self):
        self.items = []

    def add(self, path, line, what):
        self.items.append(f"{rel(path)}:{line}: {what}")


def rel(path):
    try:
        return str(Path(path).relative_to(ROOT))
    except ValueError:
        return str(path)


def ignored_patterns():
    """The .gitignore patterns: paths under them are built, not committed, so not checked."""
    pats = []
    gi = ROOT / ".gitignore"
    if gi.exists():
        for line in gi.read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#") and not line.startswith("!"):
                pats.append(line)
    return pats


IGNORED = ignored_patterns()


def is_ignored(relpath):
    parts = relpath.strip("/").split("/")
    for i in range(1, len(parts) + 1):
        prefix = "/".join(parts[:i])
        name = parts[i - 1]
        for pat in IGNORED:
            p = pat.rstrip("/")
            if p.startswith("/"):
                if fnmatch.fnmatchcase(prefix, p[1:]):
                    return True
            elif "/" in p:
                if fnmatch.fnmatchcase(prefix, p):
                    return True
            elif fnmatch.fnmatchcase(name, p):
                return True
    return False


def anchor_of(text):
    """mdBook's (and GitHub's) heading id: formatting dropped, lower case, spaces to '-',
    only letters, digits, '-' and '_' kept."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = text.replace("`", "").replace("*", "")
    out = []
    for ch in text.strip():
        if ch.isalnum() or ch in "-_":
            out.append(ch.lower())
        elif ch.isspace():
            out.append("-")
    return "".join(out)


def prose_of(text):
    """The text with fenced blocks blanked (line numbers kept)."""
    lines, inside = [], False
    for line in text.split("\n"):
        if FENCE.match(line):
            inside = not inside
            lines.append("")
        else:
            lines.append("" if inside else line)
    return "\n".join(lines)


def expanded(path, seen=()):
    """The file's text with its mdBook includes expanded, for its headings."""
    text = path.read_text()

    def sub(m):
        target = (path.parent / m.group(1).split(":")[0]).resolve()
        if target in seen or not target.is_file():
            return ""
        return expanded(target, seen + (target,))

    return INCLUDE.sub(sub, text)


_anchor_cache = {}


def anchors(path):
    path = Path(path).resolve()
    if path not in _anchor_cache:
        ids, counts = set(), {}
        for line in prose_of(expanded(path)).split("\n"):
            m = HEADING.match(line)
            if not m:
                continue
            base = anchor_of(m.group(2))
            n = counts.get(base, 0)
            counts[base] = n + 1
            ids.add(base if n == 0 else f"{base}-{n}")
        _anchor_cache[path] = ids
    return _anchor_cache[path]


def line_at(text, offset):
    return text.count("\n", 0, offset) + 1


def in_book(path):
    return os.path.normpath(path).startswith(str(BOOK) + os.sep)


def check_links(path, prose, problems, counts):
    masked = CODE_SPAN.sub(lambda m: " " * len(m.group(0)), prose)
    targets = [(m.group(1), m.start()) for m in LINK.finditer(masked)]
    targets += [(m.group(1), m.start()) for m in REF_DEF.finditer(masked)]
    for target, at in targets:
        line = line_at(prose, at)
        if not target or re.match(r"^[a-z][a-z0-9+.-]*:", target):
            continue  # an external URL (or mailto:): not checked here
        counts["links"] += 1
        file_part, _, frag = target.partition("#")
        dest = Path(os.path.normpath(path.parent / file_part)) if file_part else path
        if file_part and in_book(path) and not in_book(dest):
            problems.add(path, line, f"link to {target}: outside the book (docs/src/); the built "
                         f"book would not contain it: name the file as `{rel(dest)}` instead")
            continue
        if not dest.exists():
            problems.add(path, line, f"broken link: {target} ({rel(dest)} does not exist)")
            continue
        if frag:
            if dest.suffix != ".md":
                problems.add(path, line, f"link to {target}: an anchor into a file that is not Markdown")
            elif frag not in anchors(dest):
                problems.add(path, line, f"broken link: {target} (no heading #{frag} in {rel(dest)}; "
                             f"it has: {', '.join(sorted(anchors(dest))) or 'none'})")


def check_paths(path, prose, problems, counts):
    top = {p.name for p in ROOT.iterdir()}
    for m in CODE_SPAN.finditer(prose):
        span = m.group(2).strip()
        name = None
        if "::" in span:
            span, _, name = span.partition("::")
            name = name.split("::")[-1]
        if "/" not in span or not PATH_LIKE.match(span):
            continue
        first = span.split("/")[0]
        looks_like_file = Path(span.rstrip("/")).suffix in FILE_EXTENSIONS or span.endswith("/")
        if first not in top and not looks_like_file and not is_ignored(span):
            continue  # a URL path, a MIME type, a network: not a file of this repository
        if is_ignored(span):
            continue  # built, not committed
        counts["paths"] += 1
        line = line_at(prose, m.start())
        candidates = [ROOT / span, path.parent / span]
        found = next((c for c in candidates if c.exists()), None)
        if found is None:
            problems.add(path, line, f"path `{span}` does not exist")
            continue
        if name and found.is_file():
            if not re.search(r"\b" + re.escape(name) + r"\b", found.read_text(errors="replace")):
                problems.add(path, line, f"`{span}::{name}`: {name} not found in {span}")


def check_text(path, text, problems):
    for i, line in enumerate(text.split("\n"), 1):
        if ISSUE_NUMBER.search(line):
            problems.add(path, i, f"names an issue number ({ISSUE_NUMBER.search(line).group(0)}): "
                         "say what it is instead")
        if MACHINE_PATH.search(line):
            problems.add(path, i, f"names a path of a developer's machine ({MACHINE_PATH.search(line).group(0)}…)")


def check_file(path, problems, counts, seen):
    path = Path(os.path.normpath(path))
    if path in seen:
        return
    seen.add(path)
    counts["files"] += 1
    text = path.read_text()
    prose = prose_of(text)
    check_text(path, text, problems)
    check_links(path, prose, problems, counts)
    check_paths(path, prose, problems, counts)
    for m in INCLUDE.finditer(text):
        target = Path(os.path.normpath(path.parent / m.group(1).split(":")[0]))
        if not target.is_file():
            problems.add(path, line_at(text, m.start()), f"included file {m.group(1)} does not exist")
        elif target.suffix == ".md":
            check_file(target, problems, counts, seen)


def check_summary(problems):
    summary = BOOK / "SUMMARY.md"
    if not summary.is_file():
        problems.add(summary, 1, "missing: the book's table of contents")
        return
    listed = {Path(os.path.normpath(BOOK / m.group(1).partition("#")[0]))
              for m in LINK.finditer(summary.read_text()) if m.group(1)}
    for chapter in sorted(BOOK.rglob("*.md")):
        if chapter.name != "SUMMARY.md" and Path(os.path.normpath(chapter)) not in listed:
            problems.add(chapter, 1, "chapter not listed in docs/src/SUMMARY.md")


def check_layout(problems):
    if not LAYOUT.is_file():
        problems.add(LAYOUT, 1, "missing: the project layout")
        return
    named = {m.group(2).strip() for m in CODE_SPAN.finditer(prose_of(LAYOUT.read_text()))}
    for pattern in LAYOUT_GLOBS:
        for f in sorted(ROOT.glob(pattern)):
            r = rel(f)
            if r not in named and not is_ignored(r):
                problems.add(LAYOUT, 1, f"`{r}` is in the tree but not in the project layout")


def main():
    problems = Problems()
    counts = {"files": 0, "links": 0, "paths": 0}
    seen = set()
    files = [ROOT / "README.md"] + sorted(BOOK.rglob("*.md"))
    for f in files:
        check_file(f, problems, counts, seen)
    check_summary(problems)
    check_layout(problems)
    if problems.items:
        print(f"docs: {len(problems.items)} problem(s) in README.md and the manual (docs/src/):",
              file=sys.stderr)
        for item in problems.items:
            print(f"  {item}", file=sys.stderr)
        return 1
    print(f"docs: {counts['files']} files, {counts['links']} links and {counts['paths']} paths checked: "
          "every one resolves")
    return 0


if __name__ == "__main__":
    sys.exit(main())
