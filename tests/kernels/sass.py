"""What ptxas's sm_90 machine code (SASS) makes a warp wait for, read without a GPU.

Every SASS instruction of Volta and later carries scheduling control bits in the top of its
128-bit word: a variable-latency instruction (a global load, say) names a scoreboard it will
release when its data arrives, and a later instruction lists the scoreboards it must wait for
before it issues. Warps issue in order, so an instruction waiting on a load's scoreboard stalls
everything behind it. Bit positions (of the high 64-bit half): 41–44 stall cycles, 45 yield,
46–48 the scoreboard set on completion (7: none), 49–51 the one set when operands are read,
52–57 the wait mask — as decoded publicly by Jia et al., "Dissecting the NVIDIA Volta GPU
Architecture via Microbenchmarking" (2018), and unchanged through Hopper.

`cuobjdump -sass` (shipped with Triton's NVIDIA backend) prints each instruction with its two
64-bit halves as hex comments; that is all this reads.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

NONE = 7  # scoreboard index meaning "no scoreboard"

_LINE = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;\s+/\* (0x[0-9a-f]{16}) \*/")
_HIGH = re.compile(r"^\s+/\* (0x[0-9a-f]{16}) \*/")


@dataclass(frozen=True)
class Instr:
    text: str  # e.g. "@P6 LDGSTS.E.BYPASS.128 [R0+0x4000], desc[UR12][R58.64], P6"
    set_on_write: int  # scoreboard released when the result is written (NONE: none)
    wait_mask: int  # scoreboards (bit i = scoreboard i) this instruction waits for
    addr: int = -1  # byte offset in the function

    @property
    def opcode(self) -> str:
        words = self.text.split()
        return words[1] if words[0].startswith("@") else words[0]


def parse(sass: str) -> list[Instr]:
    """cuobjdump -sass text → its instructions in address order (the first function only)."""
    lines = sass.splitlines()
    out: list[Instr] = []
    for i, line in enumerate(lines[:-1]):
        m = _LINE.match(line)
        if not m:
            continue
        if m.group(1) == "0000" and out:
            break  # a second function begins
        high = int(_HIGH.match(lines[i + 1]).group(1), 16)
        ctrl = high >> 41
        out.append(Instr(m.group(2), (ctrl >> 5) & 7, (ctrl >> 11) & 0x3F, int(m.group(1), 16)))
    return out


def disassemble(cubin: bytes) -> list[Instr]:
    """A compiled kernel's cubin (triton's `k.asm["cubin"]`) → its instructions."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        run = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True,
                             check=True)
    finally:
        os.unlink(f.name)
    return parse(run.stdout)


def round_trips_before_tiles(code: list[Instr]) -> int:
    """Global-load round trips a warp goes through one after another before it issues its first
    cp.async tile load (LDGSTS): the depth of the chain of global loads (LDG) whose results it
    waits for. A load issued before any wait is at depth 0; one issued after waiting on a load
    of depth d is at d + 1; waiting on a load of depth d makes the trips at least d + 1. Loads
    that go out together count once, wherever they are waited for. 0: the first tile load goes
    out before any global load has come back."""
    pending: dict[int, int] = {}  # scoreboard of LDGs not yet waited for → their deepest depth
    trips = 0
    for ins in code:
        if ins.opcode.startswith("LDGSTS"):
            return trips
        for b in [b for b in pending if ins.wait_mask >> b & 1]:
            trips = max(trips, pending.pop(b) + 1)
        if ins.opcode.startswith("LDG.") and ins.set_on_write != NONE:
            pending[ins.set_on_write] = max(pending.get(ins.set_on_write, 0), trips)
    raise ValueError("no cp.async tile load (LDGSTS) in this code")


def loop_own_load_waits(code: list[Instr]) -> int:
    """In the function's widest loop (a backward branch and the instructions from its target up
    to it), the waits one pass makes for global loads (LDG) issued earlier in that same pass: each
    is a memory round trip the pass spends in series with its work. A load whose value is carried
    into the next pass is waited for there, before that pass issues it again, and does not count.
    A scoreboard counts every operation that set it: a later wait on it — for a shared-memory
    load that reuses it, say — waits for the global load too, and counts. 0 when the function has
    no loop."""
    spans = [(int(ins.text.split()[-1], 16), ins.addr) for ins in code
             if ins.opcode.startswith("BRA") and ins.text.split()[-1].startswith("0x")
             and int(ins.text.split()[-1], 16) < ins.addr]
    if not spans:
        return 0
    head, end = max(spans, key=lambda s: s[1] - s[0])
    pending: set[int] = set()  # scoreboards of this pass's LDGs not yet waited for
    waits = 0
    for ins in code:
        if not head <= ins.addr <= end:
            continue
        hit = {b for b in pending if ins.wait_mask >> b & 1}
        if hit:
            waits += 1
            pending -= hit
        if ins.set_on_write != NONE and (ins.opcode.startswith("LDG.") or ins.opcode == "LDG"):
            pending.add(ins.set_on_write)
    return waits
