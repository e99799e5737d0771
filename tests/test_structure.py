"""The shape of the code, measured: no import circles, no very long modules, a thin Trainer,
and the import-linter contract in pyproject.toml (the layers import one way).

`python tests/test_structure.py` prints the same figures as a report.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAX_MODULE_LINES = 400
MAX_TRAINER_LINES = 250
MAX_ROOT_MODULES = 15  # folders are the concerns (issue 46): entry points and primitives only


def circles() -> list[list[str]]:
    """Strongly connected groups of fiddlejax modules (imports anywhere in a module count,
    function-level and TYPE_CHECKING ones too), by Tarjan's algorithm over grimp's graph."""
    import grimp

    graph = grimp.build_graph("fiddlejax")
    edges = {m: graph.find_modules_directly_imported_by(m) for m in graph.modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while (w := stack.pop()) != v:
                group.append(w)
            if group:
                found.append(sorted([v, *group]))

    for m in sorted(edges):
        if m not in index:
            visit(m)
    return found


def module_lines() -> dict[str, int]:
    """Lines of each module of the library and the bundled models."""
    files = [*(ROOT / "fiddlejax").rglob("*.py"), *(ROOT / "models").glob("*.py")]
    return {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in files}


def class_lines(path: Path, name: str) -> int:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node.end_lineno - node.lineno + 1
    raise LookupError(name)


def test_no_import_circles():
    sys.setrecursionlimit(10_000)
    assert circles() == []


def test_no_module_over_the_limit():
    long = {k: n for k, n in module_lines().items() if n > MAX_MODULE_LINES}
    assert not long, f"split these modules (over {MAX_MODULE_LINES} lines): {long}"


def test_trainer_is_thin():
    assert class_lines(ROOT / "fiddlejax" / "train.py", "Trainer") <= MAX_TRAINER_LINES


def test_import_linter_contracts_are_kept():
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.fail("lint-imports is missing: pip install -e '.[test]'")
    r = subprocess.run([exe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "0 broken" in r.stdout


def root_modules() -> list[str]:
    return sorted(p.name for p in (ROOT / "fiddlejax").glob("*.py"))


def test_the_root_holds_few_modules():
    assert len(root_modules()) <= MAX_ROOT_MODULES, (
        f"{len(root_modules())} modules directly in fiddlejax/ ({root_modules()}): put a "
        "concern's modules in its package")


def test_the_layers_cover_every_top_level_module():
    """Each module and package directly under ``fiddlejax`` sits in a layer of the contract."""
    import tomllib

    contract = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    named = {n.strip() for c in contract["contracts"] if c["type"] == "layers"
             for layer in c["layers"] for n in layer.split(":")}
    tops = {f"fiddlejax.{p.stem}" for p in (ROOT / "fiddlejax").glob("*.py")} - {
        "fiddlejax.__init__"}
    tops |= {f"fiddlejax.{p.parent.name}" for p in (ROOT / "fiddlejax").glob("*/__init__.py")}
    assert tops <= named, f"not in any import-linter layer: {sorted(tops - named)}"


if __name__ == "__main__":
    sys.setrecursionlimit(10_000)
    lines = module_lines()
    print(f"import circles: {len(circles())}")
    print(f"modules: {len(lines)}, longest: "
          + ", ".join(f"{k} {n}" for k, n in sorted(lines.items(), key=lambda kv: -kv[1])[:5]))
    print(f"modules directly in fiddlejax/: {len(root_modules())}")
    print(f"Trainer: {class_lines(ROOT / 'fiddlejax' / 'train.py', 'Trainer')} lines")
