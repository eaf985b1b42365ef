"""Code-shape figures for docs/benchmarks.md: largest file and function, functions over a length, the package's
top-level modules, its import circles, lint and type-checker findings. The architecture issues' before/after tables
are made with this script.

Usage (from the repository root, in the dev environment):

    python benchmarks/code_metrics.py [--limit 80] [--no-tools] [--json out.json] [--root CHECKOUT]

Function length counts the lines from the ``def`` to the last line of its body (decorators excluded), as
``ast`` reports them. Import circles are the strongly connected sets of modules in grimp's import graph (the one
import-linter builds: every import statement, inside functions and under TYPE_CHECKING too), found by this
checkout's ``tests/unit/test_layers.circles`` (the check the tests run) in a subprocess with ``--root``'s ``src``
first on the path, so that ``--root`` measures that checkout's code. ruff and mypy are run as configured in pyproject.toml (``ruff check src tests
benchmarks``, ``mypy``); where they are not configured the figure says so.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # --root measures another checkout (an earlier commit's worktree)


def functions(path: Path) -> list[tuple[str, int]]:
    """(qualified name, length in lines) of every function and method in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out: list[tuple[str, int]] = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                out.append((name, (child.end_lineno or child.lineno) - child.lineno + 1))
                walk(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                walk(child, f"{prefix}{child.name}.")
            else:
                walk(child, prefix)

    walk(tree, "")
    return out


def tool_count(cmd: list[str], pattern: str, root: Path = ROOT) -> int | str:
    """How many findings ``cmd`` reports (by the summary ``pattern``'s first group), or why it could not run."""
    try:
        r = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"not run ({type(e).__name__})"
    text = r.stdout + r.stderr
    m = re.search(pattern, text)
    if m:
        return int(m.group(1))
    if r.returncode == 0:
        return 0
    return f"not run (exit {r.returncode}: {text.strip().splitlines()[-1][:120] if text.strip() else ''})"


# the circle check of tests/unit/test_layers.py (this checkout's), over the code under argv[1] (first on the path)
_CIRCLES = """
import json, sys
sys.path[:0] = [sys.argv[1], sys.argv[2]]
from test_layers import circles
print(json.dumps(circles("difftrain")))
"""


def import_circles(root: Path) -> list[list[str]] | str:
    """The import circles of ``root``'s difftrain (see the module docstring), or why they could not be computed."""
    r = subprocess.run(
        [sys.executable, "-c", _CIRCLES, str(root / "src"), str(ROOT / "tests" / "unit")],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=root,
    )
    if r.returncode != 0:
        return f"not run (exit {r.returncode}: {r.stderr.strip().splitlines()[-1][:120] if r.stderr.strip() else ''})"
    return json.loads(r.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=80, help="function length (lines) counted as long")
    ap.add_argument("--no-tools", action="store_true", help="skip ruff and mypy")
    ap.add_argument("--json", type=Path, help="write the figures here too")
    ap.add_argument("--root", type=Path, default=ROOT, help="the checkout to measure (default: this one)")
    args = ap.parse_args()
    root = args.root.resolve()

    src = root / "src" / "difftrain"
    files = sorted(src.rglob("*.py"))
    sizes = {str(f.relative_to(root)): len(f.read_text(encoding="utf-8").splitlines()) for f in files}
    funcs = [(str(f.relative_to(root)), n, ln) for f in files for n, ln in functions(f)]
    long = sorted((x for x in funcs if x[2] > args.limit), key=lambda x: -x[2])
    biggest_file = max(sizes.items(), key=lambda kv: kv[1])
    biggest_fn = max(funcs, key=lambda x: x[2])
    trainers = {k: v for k, v in sizes.items() if "/trainers/" in k}
    fig: dict = {
        "files": len(files),
        "lines": sum(sizes.values()),
        "largest_file": f"{biggest_file[0]} ({biggest_file[1]} lines)",
        "largest_trainers_file": "{} ({} lines)".format(*max(trainers.items(), key=lambda kv: kv[1])),
        "largest_function": f"{biggest_fn[0]}:{biggest_fn[1]} ({biggest_fn[2]} lines)",
        f"functions_over_{args.limit}": len(long),
        f"functions_over_{args.limit}_list": [f"{p}:{n} ({ln})" for p, n, ln in long],
        "top_level_modules": sorted(f.stem for f in src.glob("*.py") if f.stem not in ("__init__", "__main__")),
        "top_level_packages": sorted(d.name for d in src.iterdir() if (d / "__init__.py").is_file()),
    }
    circles = import_circles(root)
    fig["import_circles"] = len(circles) if isinstance(circles, list) else circles
    if isinstance(circles, list):
        fig["import_circles_list"] = [" <-> ".join(c) for c in circles]
    if not args.no_tools:
        fig["ruff_findings"] = tool_count(
            [sys.executable, "-m", "ruff", "check", "--statistics", "src", "tests", "benchmarks"],
            r"Found (\d+) error",
            root,
        )
        fig["ruff_format_changes"] = tool_count(
            [sys.executable, "-m", "ruff", "format", "--check", "src", "tests", "benchmarks"],
            r"(\d+) files? would be reformatted",
            root,
        )
        fig["mypy_errors"] = tool_count([sys.executable, "-m", "mypy"], r"Found (\d+) errors?", root)
    for k, v in fig.items():
        if isinstance(v, list):
            print(f"{k}:")
            for line in v:
                print(f"  {line}")
        else:
            print(f"{k}: {v}")
    if args.json:
        args.json.write_text(json.dumps(fig, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
