"""What the wheel carries, read from pyproject.toml against the sources: every package of the
tree, every local package that packaged code imports (an installed `iquestrt --help` once died on
`import benchmarks`), every third-party import declared as a dependency (an installed `iquestrt
report acceptance` once died writing netCDF without scipy), and the shipped data."""

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]
LISTED = set(SETUPTOOLS["packages"])
CODE = sorted(p for p in LISTED if not p.startswith("iquestrt._shipped"))


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def _sources():
    for pkg in CODE:
        folder = REPO / pkg.replace(".", "/")
        yield from sorted(folder.glob("*.py"))


# imports declared in an extra instead of the dependencies, with the extra
EXTRAS = {"cuda": "gpu"}  # cuda.bindings: the device loop's WHILE / IF graph nodes, GPU only
# benchmark scripts run from a checkout only (they build their inputs with the tests' helpers, or
# drive the server with the [test] extra's HTTP client)
CHECKOUT_ONLY = {"benchmarks/bench_attention.py": "pytest", "benchmarks/bench_round.py": "tests",
                 "benchmarks/bench_serve.py": "httpx"}


def _requirement_name(req: str) -> str:
    return re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0].lower().replace("_", "-")


def test_every_package_folder_of_the_tree_is_listed():
    tops = {p.split(".")[0] for p in CODE}
    found = {str(init.parent.relative_to(REPO)).replace("/", ".")
             for top in tops for init in (REPO / top).rglob("__init__.py")}
    assert found - LISTED == set(), "packages not in pyproject's [tool.setuptools] packages"
    assert set(CODE) - found == set(), "listed packages without an __init__.py"


def test_every_local_package_imported_by_packaged_code_is_listed():
    local = {p.parent.name for p in REPO.glob("*/__init__.py")}
    missing = {}
    for path in _sources():
        for name in _imports(path):
            top = name.split(".")[0]
            if top in local and top not in LISTED:
                missing.setdefault(top, str(path.relative_to(REPO)))
    assert not missing, f"imported but not packaged: {missing}"


def test_every_third_party_import_of_packaged_code_is_a_declared_dependency():
    declared = {_requirement_name(r) for r in PYPROJECT["project"]["dependencies"]}
    extras = PYPROJECT["project"]["optional-dependencies"]
    local = {p.parent.name for p in REPO.glob("*/__init__.py")}
    providers = importlib.metadata.packages_distributions()
    missing = {}
    for path in _sources():
        rel = str(path.relative_to(REPO))
        for name in _imports(path):
            top = name.split(".")[0]
            if top in sys.stdlib_module_names or top in local or top == "__future__":
                continue
            if CHECKOUT_ONLY.get(rel) == top:
                continue
            if top in EXTRAS:
                assert any(_requirement_name(r).startswith(top) for r in
                           extras[EXTRAS[top]]), f"{top}: not in the [{EXTRAS[top]}] extra"
                continue
            dists = {d.lower().replace("_", "-") for d in providers.get(top, [top])}
            if not dists & declared:
                missing.setdefault(top, str(path.relative_to(REPO)))
    assert not missing, f"imported by packaged code, not in [project] dependencies: {missing}"


def _matches(path: str, pattern: str) -> bool:
    """setuptools' package-data glob: `*` stays within one folder."""
    from fnmatch import fnmatchcase

    ps, qs = path.split("/"), pattern.split("/")
    return len(ps) == len(qs) and all(fnmatchcase(a, b) for a, b in zip(ps, qs, strict=True))


def test_the_shipped_data_is_package_data():
    """Every file of models/ and data/ matches a package-data pattern of its package."""
    data = SETUPTOOLS["package-data"]
    for pkg, folder in SETUPTOOLS["package-dir"].items():
        files = [p.relative_to(REPO / folder).as_posix() for p in (REPO / folder).rglob("*")
                 if p.is_file() and "__pycache__" not in p.parts]
        assert files, folder
        left = [f for f in files if not any(_matches(f, pat) for pat in data[pkg])]
        assert not left, f"{folder}: files no package-data pattern of {pkg} ships: {left}"
    golden = [p.relative_to(REPO / "qualification").as_posix()
              for p in (REPO / "qualification").glob("*/*.json")]
    assert golden and all(any(_matches(f, pat) for pat in data["qualification"])
                          for f in golden), golden
