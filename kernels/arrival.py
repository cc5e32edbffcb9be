"""The last-arrival handoff inside one launch: each of a group's programs, once its own stores
are issued, adds 1 to the group's counter; the program that reads `expected − 1` there knows
every other program of the group has stored (acq_rel: their stores happen-before its later
loads, which must still bypass caches that missed them — volatile) and does the group's finish.
It puts the counter back to 0, so the counters are all 0 between launches (kernels/row_chunks.py,
the QKV projection's folded prologue in kernels/qk_rope.py).

Nobody waits on anybody: the grid may run in any order (the Triton interpreter runs the programs
one after another)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def last_arrival(counter_ptr, expected: tl.constexpr):
    """Arrive on *counter_ptr → whether this program is the last of `expected` (then the counter
    is back to 0)."""
    tl.debug_barrier()  # release: every thread's stores are issued before the counter moves
    done = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    last = done == expected - 1
    tl.store(counter_ptr, 0, mask=last)
    return last

