"""Engines on the trained mini model for the coverage gates (engine reuse, seed width, sharded
sampling, depth policy): the kernels on a CUDA GPU (as qualification/prefetch_gate.py chooses),
the twins on the CPU (the same bits on every machine, qualification/mini_engine.py).

`outcome` is what a request leaves behind: its tokens, every round record (position, drafts with
q(token) and entropy, accepted, emitted, bonus — width_gate.record_key) and the stop reason, and
a digest of what the engine's caches hold afterwards (iquestrt.snapshot.caches_digest).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qualification.mini_engine import RING_PAD
from qualification.width_gate import record_key
from reference.checkpoint import Checkpoint
from reference.depth import AdaptiveDepth, FixedDepth
from reference.speculative import GenerationRequest, GenerationResult

MAX_POSITIONS = 512


def on_gpu() -> bool:
    return torch.cuda.is_available()


def backend() -> tuple[str, str]:
    """(ops, device): ("kernels", "cuda") with a GPU, else ("twins", "cpu")."""
    return ("kernels", "cuda") if on_gpu() else ("twins", "cpu")


def weights(ckpt: Checkpoint, device: str | None = None):
    from iquestrt.weights import from_checkpoint

    return from_checkpoint(ckpt, device or backend()[1], MAX_POSITIONS)


def engine(w, policy: FixedDepth | AdaptiveDepth, *, ops: str | None = None,
           graphs: bool = False):
    """An engine on weights `w` (on w.device); graphs only where the device is a GPU."""
    from iquestrt.config import RuntimeConfig
    from iquestrt.engine import Engine

    ops = ops or ("kernels" if w.device.type == "cuda" else "twins")
    rcfg = RuntimeConfig(ops=ops, device=str(w.device), ring_pad=RING_PAD,
                         max_positions=MAX_POSITIONS, policy=policy,
                         graphs=graphs and w.device.type == "cuda")
    return Engine(w, rcfg)


@dataclass(frozen=True)
class Outcome:
    tokens: list[int]
    records: list  # width_gate.record_key
    stop_reason: str
    digest: str  # caches_digest after the request

    @classmethod
    def of(cls, eng, res: GenerationResult) -> Outcome:
        from iquestrt.snapshot import caches_digest

        return cls(res.tokens, record_key(res), res.stop_reason,
                   caches_digest(eng.session.caches))


def outcome(eng, req: GenerationRequest) -> Outcome:
    return Outcome.of(eng, eng.generate(req))


def describe(req: GenerationRequest) -> str:
    s = req.sampling
    seed = f"2^63+{req.seed - 2**63}" if req.seed >= 2**63 else str(req.seed)
    return (f"{len(req.prompt_ids)} prompt tokens, {req.max_new_tokens} new, T {s.temperature}, "
            f"top-k {s.top_k}, top-p {s.top_p}, seed {seed}, stop ids {list(req.stop_ids)}")


def differences(got: Outcome, want: Outcome, other: str = "") -> list[str]:
    """How `got` differs from `want` (first differing token, round, stop reason, caches);
    [] if it does not. `other` names want's side in the messages."""
    from qualification.mini_engine import first_difference

    out = []
    if got.tokens != want.tokens:
        i = first_difference(got.tokens, want.tokens)
        out.append(f"tokens differ{other} from token {i} on ({len(got.tokens)} vs "
                   f"{len(want.tokens)} tokens)")
    if got.records != want.records:
        i = first_difference(got.records, want.records)
        out.append(f"round records differ{other} from round {i} on ({len(got.records)} vs "
                   f"{len(want.records)} rounds)")
    if got.stop_reason != want.stop_reason:
        out.append(f"stop reason {got.stop_reason!r}, {want.stop_reason!r}{other}")
    if got.digest != want.digest:
        out.append(f"cache contents differ{other}")
    return out
