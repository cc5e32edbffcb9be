"""An experiment's record: source revision (iquestrt/report/provenance.py), environment,
command, warnings and machine load (iquestrt/experiment/trust.py), plan, checks, summary and raw
runs, written as DIR/record.json and DIR/record.md.

Atomic: the files are written to a sibling temporary directory that replaces DIR in one rename;
an existing DIR is only replaced with force (moved aside first, put back if the swap fails, then
deleted). A failure while writing leaves DIR as it was and no temporary directory behind.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
from pathlib import Path

import torch

from iquestrt.files import swap_in
from iquestrt.report.provenance import revision  # noqa: F401 (benchmarks/rank imports it here)

JSON_NAME, MD_NAME = "record.json", "record.md"


def environment(device: str) -> dict:
    import triton

    env = {"python": platform.python_version(), "torch": torch.__version__,
           "triton": triton.__version__, "platform": platform.platform(),
           "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "device": device}
    if device.startswith("cuda") and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(torch.device(device))
        env["cuda"] = torch.version.cuda
    return env


def check_out(out: Path, force: bool) -> None:
    """Before the experiment runs: refuse an existing --out without --force."""
    if out.exists() and not force:
        raise ValueError(f"--out {out}: already exists (pass --force to replace it)")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: exists and is not a directory")


def write_record(out: Path, record: dict, markdown: str, force: bool = False) -> None:
    out = Path(out)
    check_out(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        (tmp / JSON_NAME).write_text(json.dumps(record, indent=1, allow_nan=False) + "\n")
        (tmp / MD_NAME).write_text(markdown)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        swap_in(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
