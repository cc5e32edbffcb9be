"""A real `iquestrt serve` (uvicorn, the mini model, twins engine) on 127.0.0.1 for the module."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from iquestrt.server.spawn import spawn

REPO = Path(__file__).resolve().parents[2]
START_S = 120  # loading the mini model and importing the stack, on a busy 2-core host


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    served = spawn(["--ops", "twins", "--max-queue", "2", "--max-model-len", "256",
                    "--model-name", "mini"], log, START_S,
                   env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO)
    yield served.base, served.proc, log
    served.stop()
