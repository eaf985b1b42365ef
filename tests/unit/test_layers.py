"""The dependency direction of docs/design.md, enforced by import-linter's contracts in pyproject.toml, and no
import circle anywhere in the package: imports inside functions and under TYPE_CHECKING count too (grimp, the
graph import-linter builds, reads every import statement of a module)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _lint_imports() -> str | None:
    """import-linter's command: beside this interpreter first (a venv's python run without activating the venv
    has its scripts there, not on PATH), then on PATH."""
    here = Path(sys.executable).parent
    for name in ("lint-imports", "lint-imports.exe"):
        if (here / name).is_file():
            return str(here / name)
    return shutil.which("lint-imports")


def circles(package: str) -> list[list[str]]:
    """The import circles of ``package``: every strongly connected set of two or more of its modules (Tarjan's
    algorithm over grimp's module graph, iteratively: the package is deep enough for Python's recursion limit)."""
    graph = grimp.build_graph(package)
    modules = sorted(m for m in graph.modules if m == package or m.startswith(package + "."))
    edges = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in modules:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = len(index)
                stack.append(v)
                on_stack.add(v)
            children = edges.get(v, [])
            if i < len(children):
                work.append((v, i + 1))
                w = children[i]
                if w not in index:
                    work.append((w, 0))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            if low[v] == index[v]:
                scc = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    scc.append(w)
                    if w == v:
                        break
                if len(scc) > 1:
                    found.append(sorted(scc))
            if work:  # v is done: its parent takes its low link
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
    return found


def test_import_contracts_hold():
    exe = _lint_imports()
    if exe is None:
        pytest.fail("lint-imports is missing: install the test extra (pip install -e '.[test]')")
    p = subprocess.run([exe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    assert "0 broken" in p.stdout


def test_no_import_circle_in_the_package():
    assert circles("difftrain") == []


def test_the_circle_check_sees_a_circle_through_function_and_type_checking_imports(tmp_path, monkeypatch):
    pkg = tmp_path / "circled"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from . import b\n    return b\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from .c import C\n")
    (pkg / "c.py").write_text("from .a import f\n\nclass C:\n    pass\n")
    (pkg / "d.py").write_text("from .a import f\n")  # imports into the circle, not part of it
    monkeypatch.syspath_prepend(str(tmp_path))
    assert circles("circled") == [["circled.a", "circled.b", "circled.c"]]


def test_lint_imports_is_found_beside_the_interpreter(tmp_path, monkeypatch):
    """A venv's python run by its path (venv/bin/python -m pytest, the venv not activated) finds the venv's
    lint-imports though PATH has none."""
    fake = tmp_path / "python3"
    fake.write_text("")
    (tmp_path / "lint-imports").write_text("")
    monkeypatch.setattr(sys, "executable", str(fake))
    monkeypatch.setenv("PATH", "")
    assert _lint_imports() == str(tmp_path / "lint-imports")
