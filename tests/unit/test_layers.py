"""The dependency direction of docs/design.md, enforced by import-linter's contracts in pyproject.toml, and no
import circle anywhere in the package: imports inside functions and under TYPE_CHECKING count too (grimp, the
graph import-linter builds, reads every import statement of a module)."""

from __future__ import annotations

import ast
import importlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"


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


def unresolved(path: Path, package: list[str] | None = None) -> list[str]:
    """Every import of a difftrain module in ``path`` (module level, inside functions, under TYPE_CHECKING) whose
    module or imported name does not exist. ``package``: the file's package, for its relative imports (a file
    under src/ has one). mypy does not see these (the config ignores missing imports, for the field's libraries),
    and an import inside a function fails only when that code runs."""
    bad = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                if package is None:
                    continue
                base = package[: len(package) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names = [a.name for a in node.names if a.name != "*"]
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "difftrain":
                    try:
                        importlib.import_module(a.name)
                    except ImportError as e:
                        bad.append(f"{path.name}:{node.lineno}: {e}")
            continue
        else:
            continue
        if module.split(".")[0] != "difftrain":
            continue
        try:
            found = importlib.import_module(module)
        except ImportError as e:
            bad.append(f"{path.name}:{node.lineno}: {e}")
            continue
        for name in names:
            if hasattr(found, name):
                continue
            try:  # a submodule not imported yet
                importlib.import_module(f"{module}.{name}")
            except ImportError:
                bad.append(f"{path.name}:{node.lineno}: {module} has no {name}")
    return bad


def _package_of(path: Path) -> list[str]:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return parts[:-1]


def all_unresolved() -> list[str]:
    bad = [b for f in sorted((SRC / "difftrain").rglob("*.py")) for b in unresolved(f, _package_of(f))]
    for folder in ("tests", "benchmarks"):
        bad += [b for f in sorted((ROOT / folder).rglob("*.py")) if "cache-v1" not in f.parts for b in unresolved(f)]
    return bad


def test_every_import_of_a_difftrain_module_resolves():
    """Run in a subprocess: importing every module here would make conftest's guard (the fast tier reaches every
    module in-process) pass whatever the other tests import."""
    code = "import json, sys; sys.path.insert(0, sys.argv[1]); import test_layers; print(json.dumps(test_layers.all_unresolved()))"
    r = subprocess.run(
        [sys.executable, "-c", code, str(Path(__file__).parent)], capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == []


def test_the_import_check_sees_a_moved_module_and_a_missing_name(tmp_path):
    f = tmp_path / "moved.py"
    f.write_text(
        "def late():\n    from difftrain import no_such_module\n    from difftrain.errors import NoSuchError\n"
        "    import difftrain.nowhere\n",
        encoding="utf-8",
    )
    found = unresolved(f)
    assert len(found) == 3 and "NoSuchError" in found[1] and "nowhere" in found[2], found
    rel = SRC / "difftrain" / "planning" / "engines.py"  # a relative import one level too shallow is seen
    g = tmp_path / "rel.py"
    g.write_text("def f():\n    from .errors import ConfigError\n", encoding="utf-8")
    assert unresolved(g, _package_of(rel)) == ["rel.py:2: No module named 'difftrain.planning.errors'"]
