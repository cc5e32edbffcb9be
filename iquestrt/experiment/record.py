"""An experiment's record: source revision (iquestrt/report/provenance.py), environment,
command, warnings and machine load (iquestrt/experiment/trust.py), plan, checks, summary and raw
runs, written as DIR/record.json and DIR/record.md.

Written by iquestrt/outputs.py's rules: DIR may not touch an input or the source tree, is
replaced only with force and only when it holds a record.json, and appears in one rename; a
failure while writing leaves DIR as it was and no temporary directory behind.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import torch

from iquestrt import outputs
from iquestrt.report.provenance import revision  # noqa: F401 (benchmarks/rank imports it here)

JSON_NAME, MD_NAME = "record.json", "record.md"
OUTPUT = outputs.OutputSpec("--out", JSON_NAME)


def environment(device: str) -> dict:
    import triton

    env = {"python": platform.python_version(), "torch": torch.__version__,
           "triton": triton.__version__, "platform": platform.platform(),
           "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "device": device}
    if device.startswith("cuda") and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(torch.device(device))
        env["cuda"] = torch.version.cuda
    return env


def check_out(out: Path, force: bool, inputs=()) -> Path:
    """Before the experiment runs (iquestrt/outputs.py's rules) → the real output folder."""
    return outputs.check(Path(out), OUTPUT, force=force, inputs=inputs)


def write_record(out: Path, record: dict, markdown: str, force: bool = False, inputs=()) -> None:
    with outputs.writing(check_out(out, force, inputs)) as tmp:
        (tmp / JSON_NAME).write_text(json.dumps(record, indent=1, allow_nan=False) + "\n")
        (tmp / MD_NAME).write_text(markdown)
