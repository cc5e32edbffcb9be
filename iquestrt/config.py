"""Runtime settings of the decode engine (the model's shapes live in reference/config.py).

Ring sizes: a sliding layer (window W, counting the query itself) keeps a ring of W + ring_pad
slots. A round writes up to max_width rows before reading them, so ring_pad ≥ max_width − 1 is
what keeps every verification row's full window alive (kernels/kv_cache.py has the argument).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reference.config import ModelConfig
from reference.depth import AdaptiveDepth, FixedDepth

OPS_BACKENDS = ("kernels", "twins")
LOOPS = ("host", "device")
TP_REDUCES = ("gather", "peer")
KERNEL_WIDTH = 8  # rows of the padded buffers: the tails' router handles at most 8 rows


class RuntimeConfigError(ValueError):
    """A runtime setting is out of range or does not fit the model; the message names it."""


def pdl_available(ops: str, device: str) -> bool:
    """Whether programmatic dependent launch can run: compiled kernels ('kernels' ops on a CUDA
    device that is visible) on compute capability >= 9.0 (kernels/launch.py check_pdl)."""
    dev = torch.device(device)
    if ops != "kernels" or dev.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(dev)[0] >= 9


def _require(cond: bool, field: str, msg: str) -> None:
    if not cond:
        raise RuntimeConfigError(f"RuntimeConfig.{field}: {msg}")

MAX_RING_PAD = 4096  # slots beyond a window: a round needs max_width - 1; 64 is one key tile


@dataclass(frozen=True)
class RuntimeConfig:
    ops: str = "twins"  # "kernels": Triton (compiled on GPU, interpreter on CPU); "twins": torch
    device: str = "cpu"
    max_width: int = KERNEL_WIDTH  # verification rows per round: 1 committed + up to 7 drafts
    ring_pad: int = 64  # ring slots beyond each window (real config: one 64-key tile)
    max_positions: int | None = None  # RoPE tables / cache cap; None = max_position_embeddings
    max_polls: int = 64  # readiness polls of a tail before it raises its failure flag
    policy: FixedDepth | AdaptiveDepth = FixedDepth(3)  # draft depth per round (0 = plain)
    graphs: bool = False  # replay one captured CUDA graph per round (GPU only)
    sync_rounds: int = 4  # rounds launched between two host reads of the result log (GPU)
    loop: str = "host"  # "device": rounds looped by a WHILE graph node (needs graphs; GPU only)
    wait_s: float = 300.0  # longest wait for launched rounds before the request fails
    prefetch: bool = True  # expert prefetch on sliding layers when the checkpoint ships a
    # predictor (prefetch.safetensors; iquestrt/prefetch.py); never changes a bit
    tp_reduce: str = "gather"  # tensor parallelism: "gather" all-gathers the partials; "peer":
    # the tails read every rank's ring slot directly (iquestrt/tp/peer_ring.py; kernels ops)
    peer_max_polls: int = 1 << 24  # a tail's polls for peers' slots (ranks may lag: generous)
    pdl: bool | None = None  # launch the kernels with programmatic dependent launch
    # (kernels/launch.py; compiled kernels on a CUDA device of compute capability >= 9.0).
    # None: on exactly where it can be (ops 'kernels' on such a device), else off; resolved to a
    # bool at construction, so a built config always says what runs

    def __post_init__(self) -> None:
        _require(self.ops in OPS_BACKENDS, "ops", f"choose one of {OPS_BACKENDS}, got {self.ops!r}")
        try:
            torch.device(self.device)
        except (RuntimeError, TypeError):
            raise RuntimeConfigError(
                f"RuntimeConfig.device: not a device: {self.device!r}"
            ) from None
        _require(
            isinstance(self.max_width, int) and 1 <= self.max_width <= KERNEL_WIDTH,
            "max_width",
            f"must be an int in [1, {KERNEL_WIDTH}] (the kernels' row width), got {self.max_width}",
        )
        _require(
            isinstance(self.ring_pad, int)
            and self.max_width - 1 <= self.ring_pad <= MAX_RING_PAD,
            "ring_pad",
            f"must be in [max_width - 1 = {self.max_width - 1}, {MAX_RING_PAD}] (rows written "
            f"before they are read may not evict a window still needed; more slots only cost "
            f"memory), got {self.ring_pad}",
        )
        _require(
            self.max_positions is None or self.max_positions >= 1,
            "max_positions",
            f"must be >= 1 or None, got {self.max_positions}",
        )
        _require(
            isinstance(self.max_polls, int) and 1 <= self.max_polls < 2**31,
            "max_polls",
            f"must be an int in [1, 2^31), got {self.max_polls!r}",
        )
        _require(
            isinstance(self.sync_rounds, int) and 1 <= self.sync_rounds <= 64,
            "sync_rounds",
            f"must be an int in [1, 64], got {self.sync_rounds!r}",
        )
        _require(self.loop in LOOPS, "loop", f"choose one of {LOOPS}, got {self.loop!r}")
        _require(self.tp_reduce in TP_REDUCES, "tp_reduce",
                 f"choose one of {TP_REDUCES}, got {self.tp_reduce!r}")
        _require(self.tp_reduce != "peer" or self.ops == "kernels", "tp_reduce",
                 "'peer' needs ops='kernels' (the twins read partials as one tensor)")
        _require(
            isinstance(self.peer_max_polls, int) and 1 <= self.peer_max_polls < 2**31,
            "peer_max_polls",
            f"must be an int in [1, 2^31), got {self.peer_max_polls!r}",
        )
        _require(self.pdl is None or isinstance(self.pdl, bool), "pdl",
                 f"must be a bool or None (on where available), got {self.pdl!r}")
        if self.pdl is None:  # frozen: the resolved value replaces the request
            object.__setattr__(self, "pdl", pdl_available(self.ops, self.device))
        _require(not self.pdl or (self.ops == "kernels"
                                  and torch.device(self.device).type == "cuda"), "pdl",
                 f"programmatic dependent launch needs ops='kernels' on a CUDA device, got "
                 f"ops={self.ops!r} on {self.device!r}")
        _require(
            self.loop == "host" or self.graphs,
            "loop",
            "the device loop replays the round's CUDA graph: set graphs=True",
        )
        _require(
            isinstance(self.wait_s, (int, float)) and 0 < self.wait_s <= 86400,
            "wait_s",
            f"must be a number of seconds in (0, 86400], got {self.wait_s!r}",
        )
        _require(
            not self.graphs or torch.device(self.device).type == "cuda",
            "graphs",
            f"CUDA graphs need a CUDA device, got device {self.device!r}",
        )
        _require(not self.graphs or self.ops == "kernels", "graphs",
                 "CUDA graphs replay the compiled kernels: set ops='kernels' (the twins read "
                 "device values on the host, which a captured graph cannot)")
        _require(
            isinstance(self.policy, (FixedDepth, AdaptiveDepth)),
            "policy",
            f"must be a reference.depth.FixedDepth or AdaptiveDepth, got "
            f"{type(self.policy).__name__}",
        )
        _require(
            self.policy.max_depth <= self.max_width - 1,
            "policy",
            f"draft depth {self.policy.max_depth} needs {self.policy.max_depth + 1} verification "
            f"rows; max_width is {self.max_width}",
        )

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    def positions_cap(self, cfg: ModelConfig) -> int:
        if self.max_positions is None:
            return cfg.target.max_position_embeddings
        return self.max_positions

    def target_ring_slots(self, cfg: ModelConfig) -> int:
        return cfg.target.sliding_window + self.ring_pad

    def draft_ring_slots(self, cfg: ModelConfig) -> int:
        return cfg.draft.sliding_window + self.ring_pad

    def validate_for(self, cfg: ModelConfig) -> None:
        """Checks that need the model: depth within the draft's slots, caps within the model."""
        _require(
            self.policy.max_depth <= cfg.draft.num_draft_slots,
            "policy",
            f"draft depth {self.policy.max_depth} exceeds the draft's num_draft_slots="
            f"{cfg.draft.num_draft_slots}",
        )
        cap = self.positions_cap(cfg)
        _require(
            cap <= cfg.target.max_position_embeddings,
            "max_positions",
            f"{cap} exceeds the model's max_position_embeddings="
            f"{cfg.target.max_position_embeddings}",
        )
        _require(
            cap >= self.max_width + 1,
            "max_positions",
            f"{cap} leaves no room for a prompt and a round of {self.max_width} rows",
        )
