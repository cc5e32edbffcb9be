"""Gate results, the gate table, and the reports `nox -s qualify` writes.

A gate returns a GateResult: verdict, margin (share of the allowed band used, or a p-value —
the `margin` text says which), the evidence a reader needs, and its run time. Reports are
written to a temporary name and renamed at the end, so an interrupted run never leaves a
report that looks complete.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

PASS, FAIL, NOT_BUILT = "pass", "FAIL", "not built"
GPU_ONLY = "GPU only"  # a gate of GPU mechanisms on a CPU machine: not run, never a pass
NOT_RUN = "not run"  # left out by `qualify --only`: the report is then a subset, never a pass


@dataclass
class GateResult:
    gate: str
    verdict: str  # PASS | FAIL | NOT_BUILT | GPU_ONLY | NOT_RUN
    margin: str  # e.g. "41% of band", "p = 0.37 (alpha 1e-3)"
    evidence: list[str] = field(default_factory=list)
    seconds: float = 0.0


def revision() -> str:
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return (rev or "unknown") + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def environment() -> dict[str, str]:
    import torch
    import triton

    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "triton": triton.__version__,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "platform": platform.platform(),
        "triton_interpret": os.environ.get("TRITON_INTERPRET", ""),
    }


def table(results: list[GateResult]) -> str:
    rows = [("gate", "verdict", "margin", "time")]
    rows += [(r.gate, r.verdict, r.margin, f"{r.seconds:.1f}s") for r in results]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True))  # noqa: E731
    return "\n".join(
        [line(rows[0]), "  ".join("-" * w for w in widths)] + [line(r) for r in rows[1:]]
    )


def write_reports(out: Path, results: list[GateResult], meta: dict) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    payload = {**meta, "gates": [asdict(r) for r in results]}
    md = [f"# Qualification — {meta['revision']}", ""]
    md += [f"- {k}: `{v}`" for k, v in meta.items() if k != "environment"]
    md += [
        f"- environment: `{json.dumps(meta['environment'])}`",
        "",
        "```",
        table(results),
        "```",
        "",
    ]
    for r in results:
        md += [f"## {r.gate}: {r.verdict}", "", *[f"- {e}" for e in r.evidence], ""]
    paths = (out / "qualify.json", out / "qualify.md")
    for path, text in zip(paths, (json.dumps(payload, indent=2), "\n".join(md)), strict=True):
        tmp = path.with_suffix(path.suffix + ".partial")
        tmp.write_text(text)
        tmp.replace(path)
    return paths
