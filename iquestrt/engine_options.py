"""How `LLM` (and `iquestrt generate`) builds its backend: the options, checked before any
loading beyond the checkpoint's config, and the two backends behind one interface —
`check(req)`, `generate(req, on_tokens)`, `close()`."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from reference.checkpoint import Checkpoint
from reference.depth import policy_from_spec
from reference.model import ReferenceModel
from reference.speculative import GenerationRequest, GenerationResult, ReferenceGenerator

BACKENDS = ("runtime", "reference")


@dataclass(frozen=True)
class EngineOptions:
    backend: str = "runtime"  # "runtime" (the IQuestRT engine) | "reference" (slow, exact)
    ops: str = "auto"  # runtime: "kernels" | "twins" | "auto" (kernels on a GPU, twins on a CPU)
    graphs: bool | None = None  # runtime: one CUDA graph per round; None = with kernels on a GPU
    loop: str = "host"  # runtime with graphs: "device" loops rounds in a WHILE node
    pdl: bool | None = None  # runtime: programmatic dependent launch; None = on where it can
    # run (compiled kernels on a Hopper or newer GPU, one rank: the TP ranks' peer reads have not
    # run under PDL on GPUs yet), True = required (an error elsewhere)
    ring_pad: int = 64  # runtime: ring slots beyond each window
    draft_depth: int | str = 3  # fixed 0 … 7 (0: no speculation) or "adaptive"
    precision: str | None = None  # reference: "fp32" | "bf16" (default) | "matched"
    max_model_len: int | None = None  # prompt + new tokens a request may hold (runtime cache)
    tp: int = 1  # runtime: tensor-parallel ranks (processes started by torchrun)
    tp_reduce: str = "gather"  # runtime with tp: "gather" | "peer"
    stream_timeout_s: float = 600.0  # a stream's wait for its next tokens

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"EngineOptions.backend: {self.backend!r}, expected one of "
                             f"{BACKENDS}")
        if self.ops not in ("auto", "kernels", "twins"):
            raise ValueError(f"EngineOptions.ops: {self.ops!r}, expected auto, kernels or twins")
        if self.loop not in ("host", "device"):
            raise ValueError(f"EngineOptions.loop: {self.loop!r}, expected host or device")
        if self.precision not in (None, "fp32", "bf16", "matched"):
            raise ValueError(f"EngineOptions.precision: {self.precision!r}, expected fp32, bf16 "
                             f"or matched")
        if self.max_model_len is not None and (isinstance(self.max_model_len, bool) or not
                                               isinstance(self.max_model_len, int)
                                               or self.max_model_len < 2):
            raise ValueError(f"EngineOptions.max_model_len: must be an integer >= 2, got "
                             f"{self.max_model_len!r}")
        if not self.stream_timeout_s > 0:
            raise ValueError(f"EngineOptions.stream_timeout_s: must be > 0, got "
                             f"{self.stream_timeout_s}")
        if self.backend == "reference":
            changed = [f for f, off in (("graphs", self.graphs in (None, False)),
                                        ("pdl", self.pdl is not True), ("tp", self.tp == 1),
                                        ("loop", self.loop == "host")) if not off]
            if changed:
                raise ValueError(f"EngineOptions.{changed[0]}: applies to backend 'runtime' "
                                 f"only (backend is 'reference')")
        elif self.precision is not None:
            raise ValueError("EngineOptions.precision: applies to backend 'reference' only "
                             "(compare the runtime with backend 'reference', precision "
                             "'matched')")


def build_backend(ckpt: Checkpoint, o: EngineOptions):
    try:
        policy = policy_from_spec(str(o.draft_depth), ckpt.directory)
    except ValueError as e:
        raise ValueError(f"EngineOptions.draft_depth: {e}") from None
    slots = ckpt.cfg.draft.num_draft_slots
    if policy.max_depth > slots:
        raise ValueError(f"EngineOptions.draft_depth: must be in [0, {slots}] or 'adaptive', got "
                         f"{o.draft_depth}")
    if o.backend == "reference":
        return ReferenceBackend(ckpt, o, policy)
    return RuntimeBackend(ckpt, o, policy)


class ReferenceBackend:
    def __init__(self, ckpt: Checkpoint, o: EngineOptions, policy):
        self.cfg = ckpt.cfg
        model = ReferenceModel(ckpt.cfg, ckpt.dequantized(), precision=o.precision or "bf16")
        self.generator = ReferenceGenerator(model, policy)
        self.device = torch.device("cpu")
        t = ckpt.cfg.target
        self.max_model_len = min(o.max_model_len or t.max_position_embeddings,
                                 t.max_position_embeddings)

    def check(self, req: GenerationRequest) -> None:
        _fits(req, self.max_model_len)
        req.validate(self.cfg.target.vocab_size, self.cfg.target.max_position_embeddings)

    def generate(self, req: GenerationRequest, on_tokens) -> GenerationResult:
        return self.generator.generate(req, on_tokens=on_tokens)

    def close(self) -> None:
        pass


DEFAULT_MAX_MODEL_LEN = 4096  # the runtime's cache when max_model_len is not given


class RuntimeBackend:
    """The IQuestRT engine, imported late: on a CPU the Triton interpreter must be on before
    the first kernels module is imported."""

    def __init__(self, ckpt: Checkpoint, o: EngineOptions, policy):
        gpu = torch.cuda.is_available()
        ops = o.ops if o.ops != "auto" else ("kernels" if gpu else "twins")
        # graphs replay the compiled kernels; the twins read device values on the host
        graphs = (gpu and ops == "kernels") if o.graphs is None else o.graphs
        if ops == "kernels" and not gpu:
            os.environ.setdefault("TRITON_INTERPRET", "1")
        if graphs and not gpu:
            raise ValueError("EngineOptions.graphs: CUDA graphs need a GPU (none is visible)")
        if o.loop == "device" and not graphs:
            raise ValueError("EngineOptions.loop device: the device loop replays the round's "
                             "CUDA graph; turn EngineOptions.graphs on")
        if o.pdl and not (gpu and ops == "kernels"):
            raise ValueError(f"EngineOptions.pdl: programmatic dependent launch needs the "
                             f"compiled kernels on a GPU (ops {ops}, "
                             f"{'a GPU' if gpu else 'no GPU'} visible)")
        _check_tp(o)
        from iquestrt.config import KERNEL_WIDTH, RuntimeConfig
        from iquestrt.engine import Engine

        t = ckpt.cfg.target
        self.cfg = ckpt.cfg
        self.max_model_len = min(o.max_model_len or DEFAULT_MAX_MODEL_LEN,
                                 t.max_position_embeddings - KERNEL_WIDTH)  # a round's rows
        rcfg = RuntimeConfig(ops=ops, device="cuda" if gpu else "cpu", ring_pad=o.ring_pad,
                             max_positions=self.max_model_len + KERNEL_WIDTH, policy=policy,
                             graphs=graphs, loop=o.loop, tp_reduce=o.tp_reduce,
                             pdl=o.pdl if o.pdl is not None or o.tp == 1 else False)
        self.tp = o.tp
        if o.tp == 1:  # a rank of a TP group holds a share: each rank's own check is its load
            _check_memory(ckpt, rcfg, self.max_model_len)
        if o.tp > 1:
            self.engine = _tp_engine(ckpt, rcfg)
        else:
            self.engine = Engine.from_checkpoint(ckpt.directory, rcfg)
        self.device = self.engine.w.device

    def check(self, req: GenerationRequest) -> None:
        _fits(req, self.max_model_len)
        self.engine.validate(req)

    def generate(self, req: GenerationRequest, on_tokens) -> GenerationResult:
        return self.engine.generate(req, on_tokens=on_tokens)

    def close(self) -> None:
        self.engine.close()  # its graphs hold the NCCL communicator under tp
        if self.tp > 1:
            from iquestrt.tp.group import close_group

            close_group()


def free_bytes(device: str) -> int:
    """Memory a new allocation can take: the GPU's free memory, or the host's MemAvailable."""
    if device.startswith("cuda"):
        return torch.cuda.mem_get_info()[0]
    try:
        with open("/proc/meminfo") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
        return kb * 1024
    except (OSError, StopIteration, ValueError):  # not Linux: no bound to check against
        return 1 << 62


def _check_memory(ckpt: Checkpoint, rcfg, max_model_len: int) -> None:
    """The weights and the caches of max_model_len fit in free memory, before either is made."""
    from iquestrt.cache import RuntimeCaches
    from reference.checkpoint_validate import stored_bytes

    caches = RuntimeCaches.nbytes(ckpt.cfg, rcfg, rcfg.max_positions)
    need = caches + stored_bytes(ckpt.cfg, "fp8")
    free = free_bytes(rcfg.device)
    if need > free:
        raise ValueError(f"EngineOptions.max_model_len {max_model_len}: the weights and caches "
                         f"need {need / 2**30:.2f} GiB ({caches / 2**30:.2f} GiB of caches), "
                         f"{free / 2**30:.2f} GiB is free on {rcfg.device}; lower it")


def _fits(req: GenerationRequest, max_model_len: int) -> None:
    n = len(req.prompt_ids) + req.max_new_tokens
    if n > max_model_len:
        raise ValueError(f"prompt ({len(req.prompt_ids)} tokens) + SamplingParams.max_tokens "
                         f"({req.max_new_tokens}) = {n} exceeds EngineOptions.max_model_len "
                         f"{max_model_len}")


def _check_tp(o: EngineOptions) -> None:
    """tp N needs N processes started by torchrun (before any loading)."""
    if isinstance(o.tp, bool) or not isinstance(o.tp, int) or not 1 <= o.tp <= 8:
        raise ValueError(f"EngineOptions.tp: must be in [1, 8], got {o.tp}")
    if o.tp == 1:
        if o.tp_reduce != "gather":
            raise ValueError(f"EngineOptions.tp_reduce {o.tp_reduce}: applies to EngineOptions.tp "
                             ">= 2 (one rank has no partials to reduce)")
        return
    world = os.environ.get("WORLD_SIZE")
    if world is None:
        raise ValueError(f"EngineOptions.tp {o.tp}: start the command under torchrun with {o.tp} "
                         f"processes: "
                         f"torchrun --nproc-per-node {o.tp} -m iquestrt.cli generate --tp {o.tp} …")
    if world != str(o.tp):
        raise ValueError(f"EngineOptions.tp {o.tp}: torchrun started {world} processes "
                         f"(WORLD_SIZE)")
    if o.loop == "device":
        raise ValueError("EngineOptions.tp with EngineOptions.loop device: the device loop with "
                         "tensor parallelism is "
                         "not supported (NCCL kernels inside a WHILE node); use the host loop")


def _tp_engine(ckpt: Checkpoint, rcfg):
    from iquestrt.tp.engine import TPEngine
    from iquestrt.tp.group import init_group
    from iquestrt.weights import load_weights

    group = init_group()  # the torchrun environment; multicast switched off first
    return TPEngine(load_weights(ckpt.directory, rcfg.device, rcfg.max_positions), rcfg, group)
