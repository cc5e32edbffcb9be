"""Where the shipped data is: the default model (`models/mini`) and `data/` (the request sets,
the corpus tokenizer and the corpus split), the same layout in every place it can be:

  1. `$IQUESTRT_DATA`, when set: a folder holding `models/mini` and `data/` (a copy of the
     checkout's, or of an installed wheel's `iquestrt/_shipped/`);
  2. the checkout: the folder above the `iquestrt` package, when it holds `models/mini`;
  3. an installed wheel: `iquestrt/_shipped/` (pyproject.toml's package-dir installs `models/`
     and `data/` there).
The gate baselines and goldens are package data of `qualification` and found beside it.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV = "IQUESTRT_DATA"
MODEL = Path("models") / "mini"


def _holds(root: Path) -> bool:
    return (root / MODEL / "config.json").is_file() and (root / "data").is_dir()


def root() -> Path:
    """The folder holding `models/mini` and `data/`; ValueError naming what is missing."""
    env = os.environ.get(ENV)
    if env is not None:
        where = Path(env).expanduser()
        if not _holds(where):
            raise ValueError(f"{ENV}={env}: no {MODEL}/config.json and data/ there (the "
                             f"variable names a folder with the checkout's models/ and data/)")
        return where
    package = Path(__file__).resolve().parent
    for candidate in (package.parent, package / "_shipped"):
        if _holds(candidate):
            return candidate
    raise ValueError(f"the shipped model and data are neither in {package.parent} (a checkout) "
                     f"nor in {package / '_shipped'} (an installed wheel); set {ENV} to a folder "
                     f"holding {MODEL} and data/")


def default_model() -> Path:
    """The shipped trained mini checkpoint."""
    return root() / MODEL


def data(*parts: str) -> Path:
    """A path under the shipped `data/` folder."""
    return root().joinpath("data", *parts)
