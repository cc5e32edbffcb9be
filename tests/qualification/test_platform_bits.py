"""The golden digests do not depend on the CPU's code path.

Each variant runs in a fresh process (MKL, oneDNN and ATen read these settings at load): MKL's
conditional-numerical-reproducibility modes pick other sgemm / VML kernels, ONEDNN_MAX_CPU_ISA
caps oneDNN's ISA, ATEN_CPU_CAPABILITY=avx2 halves ATen's vector width. The same process also
hashes a plain FP32 GEMM and exp: those bits must differ between at least two variants, or the
variants changed nothing on this machine and the digest check would prove nothing. The machine
as found runs in the test's own process (none of those settings is set there), with two threads
asked for: the digests run on one and give the caller's count back.
"""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from qualification import goldens

ROOT = Path(__file__).resolve().parents[2]

VARIANTS = {  # the machine as found: in this process (`_here`)
    "MKL_CBWR=COMPATIBLE": {"MKL_CBWR": "COMPATIBLE"},
    "MKL_CBWR=AVX2": {"MKL_CBWR": "AVX2"},
    "MKL_CBWR=AVX512": {"MKL_CBWR": "AVX512"},
    "ONEDNN_MAX_CPU_ISA=AVX2": {"ONEDNN_MAX_CPU_ISA": "AVX2"},
    "ATEN_CPU_CAPABILITY=avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
}



def fp32_probe() -> str:
    """sha256 of a plain FP32 GEMM and exp, in every variant's process. Inputs from NumPy's
    legacy generator (its stream is frozen and does not use ATen), so every variant hashes the
    same FP32 operations on the same values."""
    rs = np.random.RandomState(0)
    a = torch.from_numpy(rs.standard_normal((8, 256)).astype(np.float32))
    b = torch.from_numpy(rs.standard_normal((1000, 256)).astype(np.float32))
    fp32 = torch.cat([(a @ b.t()).reshape(-1), torch.exp(a).reshape(-1)])
    return hashlib.sha256(fp32.numpy().tobytes()).hexdigest()


RUN = """
import json, torch
from qualification import goldens
from tests.qualification.test_platform_bits import fp32_probe
torch.set_num_threads(1)
print(json.dumps({"digests": goldens.digests(), "fp32": fp32_probe()}))
"""


def _run(extra: dict[str, str]) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("MKL_CBWR", "ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")}
    res = subprocess.run([sys.executable, "-c", RUN], cwd=ROOT, env={**env, **extra},
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def _here() -> dict:
    """The machine as found, in this process: the probe on one thread, the digests asked for
    with two (they take one and give two back)."""
    found = {"MKL_CBWR", "ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY"} & set(os.environ)
    assert not found, f"unset {sorted(found)}: this test sets them itself, one variant each"
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        fp32 = fp32_probe()
        torch.set_num_threads(2)
        digests = goldens.digests()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    return {"digests": digests, "fp32": fp32}


@pytest.mark.slow
def test_golden_digests_are_the_same_on_every_cpu_code_path():
    runs = {"as found": _here(), **{name: _run(extra) for name, extra in VARIANTS.items()}}
    probes = {r["fp32"] for r in runs.values()}
    assert len(probes) > 1, "no variant changed FP32 GEMM/exp bits here: the check proves nothing"
    want, where = goldens.expected(goldens.load(), goldens.platform_key())
    for name, r in runs.items():
        assert goldens.compare(r["digests"], runs["as found"]["digests"]) == [], name
        assert goldens.compare(r["digests"], want) == [], f"{name} vs {where}"
