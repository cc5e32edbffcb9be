"""A wheel built from this tree, installed into a fresh virtualenv and run from an unrelated
directory, as a user gets it: the console script, the default model and data (package data),
a qualify gate. The fresh venv holds only the wheel; it sees this test environment's packages
(torch, triton, …: nothing is downloaded) through a .pth line placed after its own
site-packages, so the wheel's copies of our packages are the ones imported — checked."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300  # one command; the slowest (a qualify gate) takes ~15 s on 2 cores


def _run(cmd: list[str], cwd: Path, env: dict) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert p.returncode == 0, (f"{cmd} exited {p.returncode}:\n{p.stdout[-2000:]}\n"
                              f"{p.stderr[-3000:]}")
    return p


def _source_copy(dst: Path) -> Path:
    """The files the build reads: pyproject, README, the packages' folders, the shipped data."""
    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    tops = {p.split(".")[0] for p in cfg["packages"]} - {"iquestrt._shipped"}
    folders = tops | set(cfg["package-dir"].values())
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for f in sorted(folders):
        shutil.copytree(REPO / f, dst / f, ignore=ignore)
    for f in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / f, dst / f)
    return dst


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel")
    src = _source_copy(tmp / "src")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "IQUESTRT_DATA")}
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
          "-w", str(tmp / "dist"), str(src)], tmp, env)
    wheel = next((tmp / "dist").glob("iquestrt-*.whl"))
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp, env)
    py = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index",
          "-q", str(wheel)], tmp, env)
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                     tmp, env).stdout.strip())
    deps = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
    (site / "zz_test_dependencies.pth").write_text("\n".join(sorted(deps)) + "\n")
    work = tmp / "elsewhere"
    work.mkdir()
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return py, venv, work, env, site


@pytest.mark.slow
def test_the_wheels_packages_are_the_ones_imported(installed):
    py, venv, work, env, site = installed
    out = _run([str(py), "-c", "import iquestrt, qualification, reference, kernels, "
                "benchmarks.rank; from iquestrt import assets; print(iquestrt.__file__); "
                "print(assets.default_model())"], work, env).stdout.split()
    assert all(Path(p).is_relative_to(site) for p in out), out
    assert Path(out[1]) == site / "iquestrt" / "_shipped" / "models" / "mini"


@pytest.mark.slow
def test_declared_dependencies_are_satisfied(installed):
    py, venv, work, env, site = installed
    p = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "check"], cwd=work,
                       env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    ours = [line for line in p.stdout.splitlines() if line.lower().startswith("iquestrt ")]
    assert not ours, ours


@pytest.mark.slow
def test_console_script_help_and_generate_from_another_directory(installed):
    py, venv, work, env, site = installed
    assert "generate" in _run([str(venv / "bin" / "iquestrt"), "--help"], work, env).stdout
    out = _run([str(venv / "bin" / "iquestrt"), "generate", "--prompt", "def add(a, b):",
                "--max-new-tokens", "8", "--quiet"], work, env).stdout.splitlines()
    assert len(out[0].split()) == 8 and all(t.isdigit() for t in out[0].split()), out


@pytest.mark.slow
def test_a_qualify_gate_runs_from_the_wheel(installed):
    py, venv, work, env, site = installed
    p = _run([str(py), "-m", "qualification.qualify", "--only", "readiness", "--jobs", "1",
              "--out", str(work / "q")], work, env)
    assert "8 readiness protocol" in p.stdout and "pass" in p.stdout
    assert (work / "q" / "qualify.json").is_file()


@pytest.mark.slow
def test_report_acceptance_runs_on_the_shipped_defaults(installed):
    """Model, request set and output folder default: the wheel's data, ./acceptance-report."""
    py, venv, work, env, site = installed
    _run([str(venv / "bin" / "iquestrt"), "report", "acceptance", "--limit", "1",
          "--max-new-tokens", "8", "--max-prompt-tokens", "64", "--depth", "3", "--quiet"],
         work, env)
    out = work / "acceptance-report"
    assert (out / "acceptance.nc").is_file() and (out / "summary.md").is_file()
    summary = (out / "summary.md").read_text()
    assert "_shipped" in summary and "mini" in summary, summary[:400]


@pytest.mark.parametrize("words", [[], ["make-checkpoint"], ["convert"], ["generate"],
                                   ["report"], ["report", "acceptance"], ["experiment"],
                                   ["serve"], ["bench"], ["bench", "round"]])
def test_every_subcommand_helps_from_another_directory(installed, words):
    py, venv, work, env, site = installed
    out = _run([str(venv / "bin" / "iquestrt"), *words, "--help"], work, env).stdout
    assert out.startswith("usage: iquestrt" + "".join(" " + w for w in words)), out[:200]


@pytest.mark.slow
def test_make_checkpoint_and_convert_from_the_wheel(installed):
    py, venv, work, env, site = installed
    exe = str(venv / "bin" / "iquestrt")
    _run([exe, "make-checkpoint", "--preset", "tiny", "--format", "bf16", "--out", "ck"],
         work, env)
    _run([exe, "convert", "--checkpoint", "ck", "--out", "ck8", "--quantize"], work, env)
    out = _run([exe, "generate", "--checkpoint", "ck8", "--prompt-ids", "1,2,3",
                "--max-new-tokens", "4", "--quiet"], work, env).stdout.splitlines()
    assert len(out[0].split()) == 4, out


@pytest.mark.slow
def test_serve_from_the_wheel(installed):
    """The server process started by the venv's interpreter, from another directory: the
    shipped model is found, a completion is served."""
    import httpx

    from iquestrt.server.spawn import spawn

    py, venv, work, env, site = installed
    served = spawn(["--ops", "twins", "--max-model-len", "128", "--model-name", "mini"],
                   work / "serve.log", TIMEOUT_S, env=env, cwd=work, python=py)
    try:
        assert httpx.get(served.base + "/v1/models").json()["data"][0]["id"] == "mini"
        r = httpx.post(served.base + "/v1/completions", timeout=TIMEOUT_S,
                       json={"prompt": "def add(a, b):", "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    finally:
        served.stop()
