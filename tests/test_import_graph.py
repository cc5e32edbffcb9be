"""The import graph of the checkout's packages has no cycle — module-level imports, imports
inside functions and `if TYPE_CHECKING:` blocks alike — and the shipped code never imports the
tests. Read from the source (ast), so nothing is imported to check it."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("iquestrt", "reference", "kernels", "qualification", "negative_controls", "corpus",
            "training", "benchmarks", "tools", "tests")


def modules(root: Path) -> dict[str, Path]:
    """Dotted module name → file, for every .py file under the packages."""
    out = {}
    for pkg in PACKAGES:
        for p in (root / pkg).rglob("*.py"):
            parts = p.relative_to(root).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _owner(name: str, mods: dict[str, Path]) -> str | None:
    """The checkout module `name` lives in (a.b.c → a.b when c is a name inside a.b)."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The checkout modules `name` imports anywhere in its file. `from pkg import sub` is an
    edge to pkg.sub when sub is a module (not to pkg's __init__, which Python has already
    started)."""
    out: set[str | None] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {_owner(a.name, mods) for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".")
                keep = len(parts) - node.level + (path.name == "__init__.py")
                base = ".".join(parts[:keep] + ([node.module] if node.module else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.add(sub if sub in mods else _owner(base, mods))
    return {m for m in out if m and m != name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def graph_of(root: Path) -> dict[str, set[str]]:
    mods = modules(root)
    return {m: imports(m, p, mods) for m, p in mods.items()}


def test_no_import_cycles():
    found = cycles(graph_of(REPO))
    assert found == [], "import cycles: " + "; ".join(" ↔ ".join(c) for c in found)


def test_shipped_code_never_imports_the_tests():
    g = graph_of(REPO)
    bad = sorted(f"{m} → {d}" for m, deps in g.items() if not m.startswith("tests")
                 for d in deps if d.startswith("tests"))
    assert bad == []


def test_the_check_finds_a_planted_cycle(tmp_path):
    """A lazy import inside a function closes a cycle a → b → c → a; relative and
    `from pkg import sub` forms resolve to the module, not the package."""
    pkg = tmp_path / "kernels"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from kernels import a\n")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("import kernels.c as c\n")
    (pkg / "c.py").write_text("def f():\n    from kernels.a import g\n")
    assert cycles(graph_of(tmp_path)) == [["kernels.a", "kernels.b", "kernels.c"]]
    (pkg / "c.py").write_text("def f():\n    from kernels import b\n")  # c → b only
    assert cycles(graph_of(tmp_path)) == [["kernels.b", "kernels.c"]]
    (pkg / "c.py").write_text("X = 1\n")
    assert cycles(graph_of(tmp_path)) == []  # __init__ → a is no cycle with a's `from . import`
