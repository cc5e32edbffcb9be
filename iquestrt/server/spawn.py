"""Start `iquestrt serve` in a child process and wait (bounded) until /health answers: used by
the server tests and by benchmarks/bench_serve.py, which talk to a real uvicorn over TCP."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Served:
    base: str  # http://127.0.0.1:PORT
    proc: subprocess.Popen
    log: Path

    def stop(self, wait_s: float = 30.0) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(wait_s)


def spawn(args: list[str], log: Path, start_s: float, env: dict | None = None,
          cwd: Path | None = None, python: str | Path | None = None) -> Served:
    """`PYTHON -m iquestrt.cli serve --port P ARGS…` (default: this interpreter) with
    stdout+stderr in `log`; RuntimeError with the log's tail when it exits or is not healthy
    within start_s seconds."""
    port = free_port()
    cmd = [str(python or sys.executable), "-m", "iquestrt.cli", "serve", "--port", str(port),
           *args]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    served = Served(f"http://127.0.0.1:{port}", proc, Path(log))
    deadline = time.monotonic() + start_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}: {log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(served.base + "/health", timeout=2) as r:
                if r.status == 200:
                    return served
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            served.stop()
            raise RuntimeError(f"server not healthy after {start_s} s: {log.read_text()[-3000:]}")
        time.sleep(0.2)
