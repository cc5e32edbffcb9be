"""An experiment's record: source revision, environment, command, plan, checks, summary and raw
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
import subprocess
from pathlib import Path

import torch

from iquestrt.files import swap_in

REPO = Path(__file__).resolve().parents[2]
JSON_NAME, MD_NAME = "record.json", "record.md"


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                             timeout=20, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout


def revision() -> dict:
    """HEAD and `git status --porcelain` of the checkout: changed tracked files (" M path") and
    untracked ones ("?? path"); the measured code is HEAD plus those."""
    head = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain") or ""
    return {"commit": head.strip() if head else "unknown (not a git checkout)",
            "dirty": sorted(line.strip() for line in status.splitlines() if line.strip())}


def environment(device: str) -> dict:
    import triton

    env = {"python": platform.python_version(), "torch": torch.__version__,
           "triton": triton.__version__, "platform": platform.platform(),
           "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "device": device}
    if hasattr(os, "getloadavg"):
        env["load_avg_1m_at_start"] = round(os.getloadavg()[0], 2)  # other work on the machine
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
