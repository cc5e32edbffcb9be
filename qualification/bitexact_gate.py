"""Gate 3b — bit-exactness of the runtime's twins against reference Precision "matched".

The engine with ops "twins" (torch on the CPU, on every machine) prefills one short prompt
through its decode path (chunks of max_width rows, sliding rings wrapping) and its logits must
equal the matched reference's bit for bit: tolerance row runtime.vs_matched[twins] is exact,
because both compose the same twins at the same rounding points, one row at a time.

This is the gate for defects below every tolerance band: a legal-looking change of one
rounding point (e.g. the folded router reading the BF16-rounded activation instead of the FP32
expression) moves logits by far less than the stability bands of gates 1 and 2 allow, but not
by zero. Gate 1 makes the same comparison on a CPU run; this one runs on every machine and on
a prompt short enough for a negative control.

Dimension letters: T prompt tokens, V vocabulary.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from qualification.tolerances import measure, tolerance
from reference.model import ReferenceModel

if TYPE_CHECKING:
    from iquestrt.engine import Engine


@dataclass(frozen=True)
class BitexactGateConfig:
    length: int = 28  # > the tiny target ring (16 + 8 slots): the prefill's rings wrap
    seed: int = 17
    weights_seed: int = 0


@dataclass(frozen=True)
class RuntimeSetup:
    engine: Engine  # ops "twins" on the CPU
    refs: dict[str, ReferenceModel]  # "fp32", "matched" on the same E4M3 weights

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:  # [T] → [T, V] FP32
        return self.engine.prefill_logits(tokens.tolist())[0].cpu()


def build(weights_seed: int = 0) -> RuntimeSetup:
    """The twins engine and the references on one synthetic E4M3 tiny checkpoint."""
    from iquestrt.config import RuntimeConfig
    from iquestrt.engine import Engine
    from reference.checkpoint import load_checkpoint, make_synthetic_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        ckpt_dir = Path(tmp) / "tiny"
        make_synthetic_checkpoint(ckpt_dir, "tiny", weights_seed, fmt="fp8")
        ckpt = load_checkpoint(ckpt_dir)
        params = ckpt.dequantized()
        engine = Engine.from_checkpoint(ckpt_dir, RuntimeConfig(ops="twins", device="cpu",
                                                                ring_pad=8))
    refs = {p: ReferenceModel(ckpt.cfg, params, p) for p in ("fp32", "matched")}
    return RuntimeSetup(engine, refs)


def compare(setup: RuntimeSetup, tokens: torch.Tensor) -> tuple[bool, str]:
    """(runtime logits == matched logits bit for bit, one evidence line)."""
    got = setup.logits(tokens)  # [T, V]
    want = setup.refs["matched"].target(tokens, torch.arange(len(tokens)), None).logits
    if torch.equal(got, want):
        return True, f"{len(tokens)} positions: runtime (twins) == matched, bit for bit"
    differ = (got != want).any(-1).nonzero().flatten().tolist()  # positions
    err = (got.double() - want.double()).abs()
    pos, tok = divmod(int(err.argmax()), err.shape[1])
    return False, (
        f"NOT bit-exact at {len(differ)} of {len(tokens)} positions (first: {differ[0]}); "
        f"worst |Δlogit| {float(err.max()):.3e} at position {pos}, token {tok}; "
        f"{measure(got, want, tolerance('runtime.vs_matched', 'twins'))}"
    )


def prompt(g: BitexactGateConfig, vocab: int) -> torch.Tensor:  # [T]
    return torch.randint(0, vocab, (g.length,), generator=torch.Generator().manual_seed(g.seed))


def run(g: BitexactGateConfig | None = None) -> tuple[bool, list[str]]:
    g = g or BitexactGateConfig()
    setup = build(g.weights_seed)
    ok, line = compare(setup, prompt(g, setup.refs["matched"].cfg.target.vocab_size))
    return ok, [line]
