"""The code's structure: no import circles, in the Python package or the native crate.

``lint-imports`` (import-linter, configured in pyproject.toml and run by ``make lint``) checks
``pushtable/``; the crate has no such tool at hand, so this test reads each module's
``use crate::``/``use super::`` paths (and inline ``crate::x::`` paths) and looks for a cycle
among the modules they name.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NATIVE = ROOT / "native" / "src"
PATH = re.compile(r"\b((?:crate|super)(?:::\w+)+)")


def _module(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] in ("mod", "lib"):
        parts = parts[:-1]
    return "::".join(["crate", *parts])


def crate_graph(root: Path = NATIVE) -> dict[str, set[str]]:
    """Module -> the crate modules it names (a module naming its own parent is not counted:
    that is how Rust reaches a sibling through ``super``)."""
    files = {_module(p, root): p for p in root.rglob("*.rs")}
    edges: dict[str, set[str]] = {m: set() for m in files}
    for module, path in files.items():
        is_root = path.name in ("mod.rs", "lib.rs")
        here = module if is_root else module.rsplit("::", 1)[0]
        for found in PATH.findall(path.read_text()):
            segments = found.split("::")
            target = "crate" if segments[0] == "crate" else here
            rest = segments[1:]
            while rest and rest[0] == "super":
                target, rest = target.rsplit("::", 1)[0], rest[1:]
            for segment in rest:
                if f"{target}::{segment}" not in files:
                    break
                target = f"{target}::{segment}"
            if target != module and not module.startswith(target + "::"):
                edges[module].add(target)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_native_crate_has_no_module_cycle() -> None:
    assert cycles(crate_graph()) == []


def test_the_cycle_finder_finds_a_cycle(tmp_path: Path) -> None:
    """The check can fail: two modules that name each other are one cycle."""
    (tmp_path / "lib.rs").write_text("mod a;\nmod b;\nmod c;\n")
    (tmp_path / "a.rs").write_text("use crate::b::B;\n")
    (tmp_path / "b.rs").write_text("fn f() { crate::a::g(); }\n")
    (tmp_path / "c.rs").write_text("use super::a;\n")
    assert cycles(crate_graph(tmp_path)) == [["crate::a", "crate::b"]]


def test_the_python_package_has_no_import_circle() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    if not lint.exists():
        pytest.skip("import-linter is not installed (pip install -e '.[dev]')")
    done = subprocess.run([str(lint)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:]
