"""Output folders of every writer (make-checkpoint, convert, report acceptance, experiment,
bench round): checked before any work, written beside the target and renamed into place.

The rules (README "Outputs"):
  * `--out` may not be, contain or lie inside an input (a checkpoint, a prompts file or request
    set folder, a snapshot folder) or the source tree (the folders of the installed packages;
    the checkout root itself, which holds them). It is refused by name before any work.
  * An existing non-empty `--out` is replaced only with `force`, and only when it holds the
    writer's marker file (a folder an earlier run of that writer made); an empty folder is taken.
  * Its nearest existing ancestor must be a writable directory with `need_bytes` free.
  * A symlinked `--out` is written through: the link's target is replaced, the link stays.
  * The work goes into `.NAME.tmp-PID` beside the target; an exception, Ctrl-C or SIGTERM
    removes it, and the next run removes what a killed run (its PID gone) left behind, so an
    interrupted run can simply be run again.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from iquestrt.files import swap_in

# the top-level packages of the wheel (pyproject's [tool.setuptools] packages)
SOURCE_PACKAGES = ("iquestrt", "reference", "kernels", "qualification", "negative_controls",
                   "benchmarks", "training")
_LEFTOVER = re.compile(r"^\.(?P<name>.+)\.(?:tmp|old)-(?P<pid>\d+)$")


class OutputError(ValueError):
    """An output folder that may not be written; the message names the flag and the path."""


class Terminated(BaseException):
    """SIGTERM arrived while an output was being written (raised like KeyboardInterrupt)."""


@dataclass(frozen=True)
class OutputSpec:
    flag: str  # the option that named the folder, for messages: "--out"
    marker: str  # a file every folder this writer makes holds: "record.json"
    need_bytes: int = 16 << 20  # free space the writer needs beside the target


def source_tree() -> list[tuple[str, Path]]:
    """(label, folder) of each installed top-level package."""
    root = Path(__file__).resolve().parents[1]
    return [(f"source package {n}", root / n) for n in SOURCE_PACKAGES
            if (root / n / "__init__.py").is_file()]


def _relation(out: Path, other: Path) -> str | None:
    if out == other:
        return "is"
    if out in other.parents:
        return "contains"
    if other in out.parents:
        return "lies inside"
    return None


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check(out: Path, spec: OutputSpec, *, force: bool = False,
          inputs: Mapping[str, Path | None] = ()) -> Path:
    """The real folder that `out` names, after every rule above; OutputError otherwise."""
    where = f"{spec.flag} {out}"
    real = Path(out).expanduser().resolve()
    named = [(label, p) for label, p in dict(inputs).items() if p is not None]
    for label, p in named + source_tree():
        rel = _relation(real, Path(p).expanduser().resolve())
        if rel is not None:
            raise OutputError(f"{where}: {rel} the {label} {p}; choose another folder")
    checkout = Path(__file__).resolve().parents[1]
    rel = _relation(real, checkout) if (checkout / "pyproject.toml").is_file() else None
    if rel in ("is", "contains"):  # inside it is fine: reports/ holds the records
        raise OutputError(f"{where}: {rel} the source checkout {checkout}; choose another "
                          f"folder")
    if real.exists():
        if not real.is_dir():
            raise OutputError(f"{where}: exists and is not a directory")
        if any(real.iterdir()):
            if not force:
                raise OutputError(f"{where}: already exists (pass --force to replace it)")
            if not (real / spec.marker).is_file():
                raise OutputError(f"{where}: --force replaces only a folder this command "
                                  f"wrote (one holding {spec.marker}); choose another folder")
    anc = _nearest_existing(real.parent)
    if not anc.is_dir():
        raise OutputError(f"{where}: {anc} is a file, not a folder")
    if not os.access(anc, os.W_OK | os.X_OK):
        raise OutputError(f"{where}: {anc} is not writable")
    free = shutil.disk_usage(anc).free
    if free < spec.need_bytes:
        raise OutputError(f"{where}: {free / 2**20:.1f} MiB free on {anc}, the output needs "
                          f"about {spec.need_bytes / 2**20:.1f} MiB")
    return real


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def sweep_leftovers(real: Path) -> None:
    """Remove `.NAME.tmp-PID` / `.NAME.old-PID` of `real` whose process is gone (killed runs).
    An `.old` copy is put back when the target itself is missing (a swap cut short)."""
    if not real.parent.is_dir():
        return
    for p in real.parent.iterdir():
        m = _LEFTOVER.match(p.name)
        if not m or m["name"] != real.name or _alive(int(m["pid"])):
            continue
        if ".old-" in p.name and not real.exists():
            os.replace(p, real)
        elif p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """SIGTERM raises Terminated in the main thread, so the cleanup below runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _raise(signum, frame):
        raise Terminated("SIGTERM")

    before = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


@contextlib.contextmanager
def writing(real: Path) -> Iterator[Path]:
    """A fresh temporary folder beside `real` (from `check`); on a normal exit it replaces
    `real`, on any exception (Ctrl-C and SIGTERM included) it is removed and `real` is as it
    was."""
    real.parent.mkdir(parents=True, exist_ok=True)
    sweep_leftovers(real)
    tmp = real.with_name(f".{real.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    with _sigterm_raises():
        try:
            tmp.mkdir()
            yield tmp
            swap_in(tmp, real)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
