"""`python -m qualification.repeat --runs 20 [--quick] --out reports/qualify/repeat-DATE/repeat.md`:
run `qualify` N times in a row, each in its own process, and record whether every run gave the same
verdict and margin for every gate (the statistical gates have fixed seeds, so the suite never
flakes). Each run's table is read from its qualify.json. The record is written only after
the last run (to a temporary name, then renamed): an interrupted series leaves no record.

Exit status: 0 when all runs agree (whatever the verdicts), 1 when any gate's verdict or margin
differs between runs, 2 when a run could not produce its report.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from qualification.gates import environment, revision


def one_run(quick: bool, out: Path, timeout_s: float) -> list[tuple[str, str, str]]:
    """(gate, verdict, margin) rows of one qualify run in a fresh process."""
    cmd = [sys.executable, "-m", "qualification.qualify", "--out", str(out)]
    if quick:
        cmd.append("--quick")
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    report = out / "qualify.json"
    if not report.is_file():
        raise RuntimeError(f"qualify wrote no report (exit {res.returncode}): "
                           f"{res.stderr.strip()[-600:]}")
    gates = json.loads(report.read_text())["gates"]
    return [(g["gate"], g["verdict"], g["margin"]) for g in gates]


def compare(runs: list[list[tuple[str, str, str]]]) -> list[str]:
    """Differences against run 1, one line per (run, gate); [] when all agree."""
    first, lines = runs[0], []
    for i, rows in enumerate(runs[1:], start=2):
        if [r[0] for r in rows] != [r[0] for r in first]:
            lines.append(f"run {i}: other gates than run 1")
            continue
        for a, b in zip(first, rows, strict=True):
            if a != b:
                lines.append(f"run {i}, {a[0]}: {b[1]} / {b[2]} vs run 1: {a[1]} / {a[2]}")
    return lines


def record(runs, diffs, quick: bool, seconds: list[float]) -> str:
    cmd = "python -m qualification.qualify" + (" --quick" if quick else "")
    env = environment()
    head = [f"# {len(runs)} consecutive `{cmd}` runs: "
            + ("identical verdicts and margins" if not diffs else "DIFFERENT results"), "",
            f"Revision {revision()}; {env.get('device', '?')}, torch {env.get('torch', '?')}, "
            f"python {env.get('python', '?')}. Each run in its own process "
            f"(`python -m qualification.repeat`); wall time per run: "
            f"{min(seconds):.0f}–{max(seconds):.0f} s.", ""]
    if diffs:
        return "\n".join(head + ["Differences:", ""] + [f"- {d}" for d in diffs]) + "\n"
    table = ["| gate | verdict | margin |", "| --- | --- | --- |"]
    table += [f"| {g} | {v} | {m} |" for g, v, m in runs[0]]
    return "\n".join(head + ["Every run gave exactly these rows:", ""] + table) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m qualification.repeat", description=__doc__)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, required=True, help="the Markdown record to write")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    a = ap.parse_args(argv)
    if not 2 <= a.runs <= 1000:
        ap.error(f"--runs: expected 2..1000, got {a.runs}")
    runs, seconds = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.runs):
            t0 = time.perf_counter()
            try:
                runs.append(one_run(a.quick, Path(tmp) / f"run{i}", a.timeout))
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                print(f"run {i + 1}/{a.runs}: {e}", file=sys.stderr)
                return 2
            seconds.append(time.perf_counter() - t0)
            diffs = compare(runs)
            print(f"run {i + 1}/{a.runs}: {seconds[-1]:.0f} s, "
                  f"{'agrees' if not diffs else 'DIFFERS'}", flush=True)
    diffs = compare(runs)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = a.out.with_suffix(".tmp")
    tmp_out.write_text(record(runs, diffs, a.quick, seconds))
    tmp_out.replace(a.out)
    print(f"wrote {a.out}")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
