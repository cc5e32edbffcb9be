"""`python -m negative_controls.run`: baseline gates must pass, then every control must be caught.

Prints a table (control, gate, caught, evidence) and exits non-zero when a baseline fails or a
control is not caught. A baseline that raises fails. A mutated run that raises is caught only
when the exception is the runtime's or a gate's own detection (EngineError, DistributionError);
any other exception is a broken control and counts as NOT caught.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # kernels under the interpreter; set before any kernel import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

from iquestrt.engine import EngineError  # noqa: E402
from negative_controls import (  # noqa: E402
    combine_controls,
    coverage_controls,
    e2e_controls,
    engine_controls,
    kernel_controls,
    prefetch_controls,
    readiness_controls,
    rejection_controls,
    ring_controls,
    router_controls,
    sampler_controls,
    sink_controls,
)
from qualification.distribution_rounds import DistributionError  # noqa: E402

ALL = (
    ring_controls.CONTROLS
    + sampler_controls.CONTROLS
    + rejection_controls.CONTROLS
    + sink_controls.CONTROLS
    + combine_controls.CONTROLS
    + readiness_controls.CONTROLS
    + router_controls.CONTROLS
    + engine_controls.CONTROLS
    + e2e_controls.CONTROLS
    + prefetch_controls.CONTROLS
    + coverage_controls.CONTROLS
    + kernel_controls.CONTROLS
)


def _safe(run, mutated: bool) -> tuple[bool, list[str]]:
    """A gate run → (passed, evidence). An exception fails the run; a mutated run is caught by
    one only when it is the runtime's or the gate's own detection (EngineError: a fault the
    engine recorded; DistributionError: a gate's check of its inputs). Any other exception means
    the control itself is broken (e.g. a tensor on the wrong device) and is reported as such."""
    try:
        return run(mutated)
    except (EngineError, DistributionError) as e:
        return False, [f"raised {type(e).__name__}: {e}"]
    except Exception as e:
        if not mutated:
            return False, [f"raised {type(e).__name__}: {e}"]
        raise ControlBroken(f"{type(e).__name__}: {e}") from e


def _baseline(c, memo: dict) -> tuple[bool, list[str]]:
    """The control's unmutated run; run once for all controls whose `run.baseline` is the same
    gate run (their unmutated runs are that one call, and every gate is deterministic)."""
    key = getattr(c.run, "baseline", None)
    if key is None:
        return _safe(c.run, False)
    if key not in memo:
        memo[key] = _safe(c.run, False)
    return memo[key]


class ControlBroken(Exception):
    """A mutated run crashed outside the runtime's and the gates' own checks."""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m negative_controls.run", description=__doc__)
    ap.add_argument("--only", nargs="*", help="control names to run (default: all)")
    ap.add_argument("--jobs", type=int, default=4 if torch.cuda.is_available() else 1,
                    help="kernel controls' gate processes run at a time (default: 4 on a GPU)")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    controls = [c for c in ALL if not a.only or c.name in a.only]
    unknown = sorted(set(a.only or ()) - {c.name for c in ALL})
    if unknown:
        ap.error(f"unknown controls {unknown}; choose from {[c.name for c in ALL]}")
    kernel_controls.prepare([c.name for c in controls], a.jobs)
    rows, failed = [], False
    baselines: dict = {}  # a gate run shared by several controls (Control.run.baseline) → result
    for i, c in enumerate(controls, 1):
        t0 = time.perf_counter()
        base_ok, base_ev = _baseline(c, baselines)
        try:
            mut_ok, mut_ev = _safe(c.run, True) if base_ok else (True, ["baseline failed"])
        except ControlBroken as e:
            mut_ok, mut_ev = True, [f"CONTROL BROKEN (not a catch): {e}"]
        caught = base_ok and not mut_ok
        failed |= not caught
        evidence = mut_ev[0] if base_ok else f"BASELINE FAILED: {base_ev[0]}"
        rows.append((c.name, c.gate, "yes" if caught else "NO", evidence))
        print(
            f"[{i}/{len(controls)}] {c.name}: {'caught' if caught else 'NOT CAUGHT'} "
            f"({time.perf_counter() - t0:.0f}s)" + ("" if caught else f": {evidence[:300]}"),
            flush=True,
        )
    widths = [max(len(r[j]) for r in rows + [("control", "gate", "caught", "")]) for j in range(3)]
    print(
        "\n"
        + "  ".join(h.ljust(w) for h, w in zip(("control", "gate", "caught"), widths, strict=True))
        + "  evidence"
    )
    for r in rows:
        print("  ".join(x.ljust(w) for x, w in zip(r[:3], widths, strict=True)) + "  " + r[3][:160])
    print(f"\n{sum(r[2] == 'yes' for r in rows)} of {len(rows)} controls caught")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
