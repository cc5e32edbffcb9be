"""`@twin(ref)` — a kernel wrapper names its reference twin in code: the function of
reference/twins/<family>.py that takes the same arguments and gives the same values (bit for bit,
or within the wrapper's row of qualification/tolerances.py). The wrapper carries it as
`wrapper.twin`; tests/kernels/test_twin_pairs.py finds every pair from these marks, with no
table kept by hand."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)


def twin(ref: Callable) -> Callable[[F], F]:
    """Mark the decorated kernel wrapper with its twin `ref`; the wrapper itself is unchanged."""
    def mark(wrapper: F) -> F:
        wrapper.twin = ref
        return wrapper
    return mark
