"""The wheel carries every top-level package that packaged code imports (an installed `iquestrt
--help` once died on `import benchmarks`, and gate 1b imports benchmarks.rank)."""

import ast
import fnmatch
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _included() -> list[str]:
    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())
    return cfg["tool"]["setuptools"]["packages"]["find"]["include"]


def _local_packages() -> set[str]:
    return {p.parent.name for p in REPO.glob("*/__init__.py")}


def _packaged(name: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatch(name, pat) for pat in patterns)


def test_every_local_package_imported_by_packaged_code_is_packaged():
    patterns, local = _included(), _local_packages()
    missing: dict[str, str] = {}
    for pkg in sorted(p for p in local if _packaged(p, patterns)):
        for path in (REPO / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module] if isinstance(node, ast.ImportFrom) and node.module
                         and node.level == 0 else [])
                for n in names:
                    top = n.split(".")[0]
                    if top in local and not _packaged(top, patterns):
                        missing.setdefault(top, str(path.relative_to(REPO)))
    assert not missing, f"imported but not in pyproject's packages.find include: {missing}"

