"""Sessions: `nox -s tests` (CPU CI), `lint`, `qualify`, `negative_controls`.

torch is installed first, pinned by IQUESTRT_TORCH (default "torch==2.13.0", the CPU build
cached on the CI machines) so that resolving `.[test]` never downloads a multi-GB CUDA build;
set IQUESTRT_TORCH to another requirement (e.g. "torch==2.14.1") to choose another build, or to
"" to let pip pick. triton is pinned to the GPU machine's version.
"""

import os

import nox

nox.options.reuse_existing_virtualenvs = True
nox.options.default_venv_backend = "venv"
nox.options.sessions = ["tests", "lint"]

TRITON = "triton==3.6.0"


def _install(session: nox.Session) -> None:
    torch = os.environ.get("IQUESTRT_TORCH", "torch==2.13.0")
    session.install(*([torch] if torch else []), TRITON)
    session.install("-e", ".[test]", TRITON, *([torch] if torch else []))


# CI's 2 cores: one pytest worker per core, each test file on one worker (its module fixtures
# built once); 935 s instead of 1 705 s for the suite on a 2-core host (commit 7d93e23). Benchmarks
# are GPU-only and skipped here; disabling them keeps pytest-benchmark quiet under xdist.
# --durations: every run (CI's included) lists its 25 slowest tests, the data for keeping the
# suite inside its time budget.
PARALLEL = ["-n", "auto", "--maxprocesses", "4", "--dist", "loadfile", "--benchmark-disable",
            "--durations", "25"]


@nox.session
def tests(session: nox.Session) -> None:
    _install(session)
    # posargs add to the parallel run: `nox -s tests -- -m "not slow"` is the fast tier,
    # `nox -s tests -- tests/kernels` one folder
    session.run("python", "-m", "pytest", *PARALLEL, *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff")
    session.run("ruff", "check", *(session.posargs or ["."]))


@nox.session
def qualify(session: nox.Session) -> None:
    _install(session)
    session.run("python", "-m", "qualification.qualify", *session.posargs)


@nox.session
def negative_controls(session: nox.Session) -> None:
    _install(session)
    session.run("python", "-m", "negative_controls.run", *session.posargs)
