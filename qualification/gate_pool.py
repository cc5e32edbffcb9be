"""Qualify's gates in separate processes, `jobs` at a time (`qualify --jobs N`).

The gates are independent and each is deterministic in one process with one thread, so running
them side by side changes no verdict and no bit: every gate runs in a fresh Python process
(`python -m qualification.gate_child NAME [qualify options]`), which builds its own models, runs
the one gate with torch on one thread and prints its GateResult as the last line of its output,
after RESULT_TAG. The parent forwards each process's output lines prefixed with the gate's name
(long gates show progress), waits at most `timeout_s` for each, and turns a process that exits
without a result — a crash, a kill, a timeout — into a FAIL naming the cause and the end of its
output. On a GPU host the processes share the one GPU (each its own CUDA context); the work of
most gates is host-side reference arithmetic, which is what runs in parallel.

Order: the gates start longest first (COST_S, measured on the H200 and the 2-core CPU), so the
longest is never left to the end; the report keeps qualify's gate order.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed

from qualification.gates import FAIL, GateResult

RESULT_TAG = "GATE-RESULT "
TAIL_LINES = 12  # output lines a failed process's result keeps
# rough seconds per gate, the larger of the H200's and the 2-core CPU's (full run): only the
# start order depends on it
COST_S = {"lockstep": 130, "distribution": 100, "runtime": 80, "acceptance": 42, "seed_width": 35,
          "sampler": 33, "distribution_e2e": 29, "schedule": 27, "depth_policy": 55,
          "tp_sampling": 22, "rings": 17, "goldens": 17, "reference_consistency": 15,
          "reuse": 13, "engine_caches": 30}


def default_jobs() -> int:
    """Gate processes at a time: one per core, at most 4 (the GPU suite's tested `-n 4`)."""
    return max(1, min(4, os.cpu_count() or 1))


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # already gone
        pass


def _run_one(name: str, options: Sequence[str], timeout_s: float, say: Callable[[str], None],
             live: set[subprocess.Popen]) -> GateResult:
    cmd = [sys.executable, "-m", "qualification.gate_child", name, *options]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    # its own process group: a kill reaches what it started too (compilers holding the pipe)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    live.add(proc)
    killed = threading.Event()

    def kill() -> None:  # the bounded wait: a gate still running after timeout_s is killed
        killed.set()
        _kill_group(proc)

    timer = threading.Timer(timeout_s, kill)
    timer.start()
    tail: list[str] = []
    result: GateResult | None = None
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            if line.startswith(RESULT_TAG):
                result = GateResult(**json.loads(line[len(RESULT_TAG):]))
                continue
            tail = (tail + [line])[-TAIL_LINES:]
            say(f"      {name} | {line}")
        rc = proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:
            _kill_group(proc)
            proc.wait()
        live.discard(proc)
    seconds = time.perf_counter() - t0
    if result is not None and rc == 0:
        result.seconds = seconds
        return result
    why = (f"timed out after {timeout_s:g} s" if killed.is_set()
           else f"its process exited with status {rc} without a result")
    return GateResult(name, FAIL, f"crashed: {why}", [f"gate {name}: {why}", *tail],
                      seconds=seconds)


def run(names: Sequence[str], options: Sequence[str], jobs: int, timeout_s: float,
        say: Callable[[str], None] = print) -> dict[str, GateResult]:
    """{name: GateResult} of the named gates, each in its own process, `jobs` at a time.
    options: the qualify options the gates see (`--quick`, `--model M`)."""
    if jobs < 1:
        raise ValueError(f"gate_pool.run: jobs must be ≥ 1, got {jobs}")
    if timeout_s <= 0:
        raise ValueError(f"gate_pool.run: timeout_s must be > 0, got {timeout_s}")
    lock = threading.Lock()

    def locked_say(text: str) -> None:
        with lock:
            say(text)

    order = sorted(names, key=lambda n: -COST_S.get(n, 0))
    out: dict[str, GateResult] = {}
    live: set[subprocess.Popen] = set()  # the gate processes running now
    pool = ThreadPoolExecutor(max_workers=jobs)
    try:
        futures = {pool.submit(_run_one, n, options, timeout_s, locked_say, live): n
                   for n in order}
        for done, fut in enumerate(as_completed(futures), 1):
            name, res = futures[fut], fut.result()
            out[name] = res
            locked_say(f"[{done}/{len(order)}] {name}: {res.verdict} in {res.seconds:.0f} s")
            if res.verdict == FAIL:
                locked_say("\n".join(f"      | {e[:400]}" for e in res.evidence[:6]))
    except BaseException:  # Ctrl-C or a bug here: the gate processes (own sessions) go too
        pool.shutdown(wait=False, cancel_futures=True)
        for proc in list(live):
            _kill_group(proc)
        raise
    pool.shutdown(wait=True)
    return out
