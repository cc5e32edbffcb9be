"""Small file helpers shared by the CLI commands: a checkpoint's tokenizer, and publishing a
finished output folder atomically (readers see the old folder or the new one, never a part)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def checkpoint_tokenizer(checkpoint: Path):
    """The checkpoint's tokenizer.json (Hugging Face `tokenizers` format), or None when the
    checkpoint has none; one that is there but unreadable is refused by name."""
    from reference.checkpoint_validate import optional_file

    path = optional_file(checkpoint, Path(checkpoint) / "tokenizer.json")
    if path is None:
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the library raises its own exception types
        raise ValueError(f"{path}: not a valid tokenizer file: {e}") from None


def swap_in(tmp: Path, out: Path) -> None:
    """Publish the finished folder `tmp` as `out`; an existing `out` is replaced, and restored
    if the replacement fails."""
    if not out.exists():
        os.replace(tmp, out)
        return
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    os.replace(out, old)
    try:
        os.replace(tmp, out)
    except BaseException:
        os.replace(old, out)
        raise
    shutil.rmtree(old)
