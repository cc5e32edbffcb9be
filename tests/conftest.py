"""Test-wide device choice. Without a CUDA GPU, Triton kernels run under the interpreter
(TRITON_INTERPRET=1 must be set before any @triton.jit is decorated, hence here, first).
Tests marked `gpu` need compiled kernels on a real GPU and are skipped without one."""

import os

import pytest
import torch

HAS_GPU = torch.cuda.is_available()
# Test tensors are tiny: intra-op threads only add contention on the 2-core CI machine.
torch.set_num_threads(1)
if not HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    from tests.helpers import interpreter_speed

    interpreter_speed.install()


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (compiled Triton kernels)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device() -> torch.device:
    """Where kernels run: cuda when present, else cpu (interpreter)."""
    return torch.device("cuda" if HAS_GPU else "cpu")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A synthetic tiny E4M3 checkpoint written by `iquestrt make-checkpoint` (seed 0), for the
    module; tests that corrupt it work on a copy."""
    from iquestrt.cli import main

    out = tmp_path_factory.mktemp("tiny") / "tiny"
    assert main(["make-checkpoint", "--preset", "tiny", "--seed", "0", "--out", str(out)]) == 0
    return out
