"""Shared fixtures for the corpus tests: the committed tokenizer and this machine's stdlib."""

import platform
import warnings

import pytest

from corpus.stdlib import DEFAULT_SPLIT, SplitMismatchWarning, _read_record, load_split
from corpus.tokenizer import load_tokenizer


@pytest.fixture(scope="session")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="session")
def split():
    """The committed split on this machine. Byte-exact checks need the recorded source files,
    so another Python version skips (with the reason); the recorded version must match exactly
    (a mismatch warning fails the test)."""
    rec = _read_record(DEFAULT_SPLIT)
    here = platform.python_version()
    if rec["python"] != here:
        pytest.skip(f"split recorded on Python {rec['python']}, running {here}")
    with warnings.catch_warnings():
        warnings.simplefilter("error", SplitMismatchWarning)
        return load_split()
