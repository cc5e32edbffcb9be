"""Prefill snapshot replay: the target prefill of a prompt runs once; its state
is saved and later requests over the same prompt restore it instead of recomputing it, then run
the rest of a request exactly as Engine.generate does: draft prefill, sampling of the first
token, the round program (graph capture when on) and decode.

What a snapshot holds (everything the engine's target prefill leaves behind that later steps
read): each target layer's cache (K, V, slot labels; a full layer's first n slots — slot(p) = p,
the rest are unwritten —, a ring's every slot), the target's final hidden states of the n prompt
positions (the draft prefill and the first round read them), and the last prompt position's
logits row. The first token is sampled from that row with the request's seed and sampling
settings, so one snapshot serves every seed, sampling setting, token budget and depth policy.

A snapshot is keyed by what the prefill's bits depend on: a digest of the engine's weights, the
prompt ids, the prefill's chunk width (max_width), ring slots (ring_pad), the ops backend and
the device type; replay refuses any other engine or prompt with a message naming the mismatch.
On disk (a directory): snapshot.safetensors + snapshot.json holding the key and each tensor's
sha256, checked on load, so a changed byte is refused rather than replayed.
tests/engine/test_snapshot.py shows replay equals real prefill bit for bit (tokens, round
records, cache digests) and that a one-element change in K is caught.

Dimension letters: n prompt positions, C cache slots, Hkv KV heads, D head dim, H hidden,
V vocabulary.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from iquestrt.cache import RuntimeCaches
from iquestrt.engine import Engine, EngineError
from iquestrt.engine_parts import EngineParts, ModelPrefill
from iquestrt.session import Session
from kernels.qk_rope import RopeTable
from reference.kv_layout import EMPTY, LayerKV
from reference.speculative import GenerationRequest, GenerationResult

FORMAT, VERSION = "iquestrt-prefill-snapshot", 1
JSON_NAME, TENSOR_NAME = "snapshot.json", "snapshot.safetensors"


class SnapshotError(ValueError):
    """A snapshot is unreadable, corrupted, or was taken for another prompt or engine."""


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()


def tensor_sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(_bytes(t)).hexdigest()


def prompt_sha256(prompt_ids) -> str:
    return tensor_sha256(torch.tensor(list(prompt_ids), dtype=torch.int64))


def weights_digest(weights) -> str:
    """sha256 over the model config and every weight tensor of a runtime Weights (names, dtypes,
    shapes, bytes) in field order; RoPE tables are derived data (their length follows
    max_positions), so they are left out."""
    h = hashlib.sha256(json.dumps([weights.cfg.target_json(), weights.cfg.draft_json()],
                                  sort_keys=True).encode())

    def walk(x, name: str) -> None:
        if isinstance(x, torch.Tensor):
            h.update(f"{name}:{x.dtype}:{tuple(x.shape)}".encode())
            h.update(_bytes(x))
        elif isinstance(x, RopeTable):
            return
        elif dataclasses.is_dataclass(x):
            for f in dataclasses.fields(x):
                if f.name not in ("cfg", "device", "max_positions"):
                    walk(getattr(x, f.name), f"{name}.{f.name}")
        elif isinstance(x, (tuple, list)):
            for i, y in enumerate(x):
                walk(y, f"{name}.{i}")
        else:
            h.update(f"{name}={x!r}".encode())

    walk(weights, "w")
    return h.hexdigest()


def caches_digest(caches: RuntimeCaches) -> str:
    """sha256 of what each cache holds: labelled positions in order with their K and V, then the
    committed lengths (unlabelled slots may keep a rejected row's bytes; they are never read)."""
    h = hashlib.sha256()
    for layer in [*caches.target, caches.draft]:
        lab = layer.slot_pos.cpu()
        keep = lab != EMPTY
        pos = lab[keep].long()
        order = torch.argsort(pos)
        for t in (pos[order], layer.k.cpu()[keep][order], layer.v.cpu()[keep][order]):
            h.update(_bytes(t))
    h.update(f"{caches.target_len},{caches.draft_next}".encode())
    return h.hexdigest()


def result_key(res: GenerationResult) -> tuple:
    """Everything a generation reports: tokens, stop reason, and per round the position, the
    drafts (token, q(token), entropy), accepted count, emitted tokens and bonus flag."""
    return (tuple(res.tokens), res.stop_reason,
            tuple((r.position, tuple((d.token, d.prob, d.entropy) for d in r.drafts), r.accepted,
                   tuple(r.emitted), r.bonus) for r in res.rounds))


@dataclass(frozen=True)
class SnapshotKey:
    weights_sha256: str
    prompt_sha256: str
    prompt_tokens: int
    max_width: int  # the prefill's chunk width
    ring_pad: int  # ring slots beyond each window
    ops: str
    device_type: str


@dataclass(frozen=True)
class PrefillSnapshot:
    key: SnapshotKey
    prompt_ids: tuple[int, ...]
    k: tuple[torch.Tensor, ...]  # per target layer [C', Hkv, D] bf16 (C' = n full, C ring)
    v: tuple[torch.Tensor, ...]
    slot_pos: tuple[torch.Tensor, ...]  # per target layer [C'] int32
    hidden: torch.Tensor  # [n, H] bf16
    last_logits: torch.Tensor  # [1, V] fp32, position n − 1

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"prompt_ids": torch.tensor(self.prompt_ids, dtype=torch.int64),
               "hidden": self.hidden, "last_logits": self.last_logits}
        for i, (k, v, s) in enumerate(zip(self.k, self.v, self.slot_pos, strict=True)):
            out |= {f"target.{i}.k": k, f"target.{i}.v": v, f"target.{i}.slot_pos": s}
        return {n: t.detach().contiguous().cpu() for n, t in out.items()}

    def save(self, directory: str | Path) -> None:
        """Write directory/{snapshot.json, snapshot.safetensors} (a new directory, renamed into
        place once complete)."""
        directory = Path(directory)
        if directory.exists():
            raise SnapshotError(f"snapshot {directory}: already exists (not overwritten)")
        tmp = directory.with_name(f".{directory.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        tensors = self.tensors()
        save_file(tensors, str(tmp / TENSOR_NAME))
        meta = {"format": FORMAT, "version": VERSION, "key": dataclasses.asdict(self.key),
                "tensors": {n: {"dtype": str(t.dtype).removeprefix("torch."),
                                "shape": list(t.shape), "sha256": tensor_sha256(t)}
                            for n, t in sorted(tensors.items())}}
        (tmp / JSON_NAME).write_text(json.dumps(meta, indent=1) + "\n")
        os.replace(tmp, directory)

    @classmethod
    def load(cls, directory: str | Path) -> PrefillSnapshot:
        directory = Path(directory)
        jpath, tpath = directory / JSON_NAME, directory / TENSOR_NAME
        for p in (jpath, tpath):
            if not p.is_file():
                raise SnapshotError(f"snapshot {directory}: missing {p.name}")
        try:
            meta = json.loads(jpath.read_text())
            key = SnapshotKey(**meta["key"])
            want = meta["tensors"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise SnapshotError(f"{jpath}: not a snapshot description ({e})") from None
        if (meta.get("format"), meta.get("version")) != (FORMAT, VERSION):
            raise SnapshotError(f"{jpath}: format {meta.get('format')!r} version "
                                f"{meta.get('version')!r}, expected {FORMAT!r} {VERSION}")
        tensors = load_file(str(tpath))
        if set(tensors) != set(want):
            raise SnapshotError(f"{tpath}: tensors {sorted(set(tensors) ^ set(want))} differ "
                                f"from {jpath.name}")
        for name, t in tensors.items():
            if tensor_sha256(t) != want[name]["sha256"]:
                raise SnapshotError(f"{tpath}: tensor {name!r} does not match its sha256 in "
                                    f"{jpath.name} (the file was changed or corrupted)")
        n_layers = sum(1 for n in tensors if n.endswith(".slot_pos"))
        snap = cls(key, tuple(tensors["prompt_ids"].tolist()),
                   tuple(tensors[f"target.{i}.k"] for i in range(n_layers)),
                   tuple(tensors[f"target.{i}.v"] for i in range(n_layers)),
                   tuple(tensors[f"target.{i}.slot_pos"] for i in range(n_layers)),
                   tensors["hidden"], tensors["last_logits"])
        if prompt_sha256(snap.prompt_ids) != key.prompt_sha256:
            raise SnapshotError(f"{jpath}: prompt ids do not match key.prompt_sha256")
        return snap


class ReplayPrefill(ModelPrefill):
    """The engine's prefill part: the target pass restored from `snap` while one is set (a
    request of generate_from_snapshot), else run; the draft's prefill runs either way."""

    snap: PrefillSnapshot | None = None

    def target(self, eng: Engine, st: Session) -> tuple[torch.Tensor, torch.Tensor]:
        snap = self.snap
        if snap is None:
            return super().target(eng, st)
        n, dev = len(st.tokens), eng.w.device
        _restore(st.caches, snap)
        st.caches.settle_target(eng.ops, n, n)
        return snap.last_logits.to(dev), snap.hidden.to(dev).clone()


class SnapshotEngine(Engine):
    """Engine with take_snapshot() and generate_from_snapshot(): its prefill part is a
    ReplayPrefill; generate() is unchanged."""

    _wdigest: str | None = None

    def __init__(self, weights, rcfg, prefetcher=None, parts: EngineParts | None = None):
        parts = parts if parts is not None else EngineParts.default(weights, rcfg, prefetcher)
        self.replay = ReplayPrefill()
        super().__init__(weights, rcfg, parts=dataclasses.replace(parts, prefill=self.replay))

    @property
    def weights_sha256(self) -> str:
        if self._wdigest is None:
            self._wdigest = weights_digest(self.w)
        return self._wdigest

    def snapshot_key(self, prompt_ids) -> SnapshotKey:
        r = self.rcfg
        return SnapshotKey(self.weights_sha256, prompt_sha256(prompt_ids), len(prompt_ids),
                           r.max_width, r.ring_pad, r.ops, self.w.device.type)

    def take_snapshot(self, prompt_ids) -> PrefillSnapshot:
        """The engine's target prefill (ModelPrefill: chunks of max_width rows) over the prompt."""
        ids = tuple(int(t) for t in prompt_ids)
        req = GenerationRequest(ids, 1, self.cfg.sampling, 0)  # only for the prompt's checks
        req.validate(self.cfg.target.vocab_size, self.cfg.target.max_position_embeddings)
        n, rows, dev = len(ids), self.rcfg.max_width, self.w.device
        caches = RuntimeCaches.create(self.cfg, self.rcfg, n + rows, dev)
        flags = torch.zeros(self.cfg.target.num_hidden_layers, dtype=torch.int32, device=dev)
        st = Session(req, caches, flags, list(ids))
        last_logits, hidden = ModelPrefill().target(self, st)
        ks, vs, labels = [], [], []
        for i, layer in enumerate(caches.target):
            lab = layer.slot_pos
            if not layer.layout.ring:
                if bool((lab[n:] != EMPTY).any()):
                    raise EngineError(f"snapshot: full layer {i} labels slots >= {n} after a "
                                      f"prefill of {n} positions")
                lab = lab[:n]
            c = lab.shape[0]
            ks.append(layer.k[:c].clone())
            vs.append(layer.v[:c].clone())
            labels.append(lab.clone())
        return PrefillSnapshot(self.snapshot_key(ids), ids, tuple(ks), tuple(vs), tuple(labels),
                               hidden, last_logits.clone())

    def check_snapshot(self, req: GenerationRequest, snap: PrefillSnapshot) -> None:
        """Refuse a snapshot taken for another prompt or an engine whose prefill differs."""
        if tuple(req.prompt_ids) != snap.prompt_ids:
            raise SnapshotError(
                f"snapshot: taken for another prompt ({snap.key.prompt_tokens} tokens, sha256 "
                f"{snap.key.prompt_sha256[:12]}…) than the request's ({len(req.prompt_ids)} "
                f"tokens, sha256 {prompt_sha256(req.prompt_ids)[:12]}…)")
        have, want = snap.key, self.snapshot_key(req.prompt_ids)
        for f in dataclasses.fields(SnapshotKey):
            a, b = getattr(have, f.name), getattr(want, f.name)
            if a != b:
                raise SnapshotError(f"snapshot: {f.name} is {a!r}, this engine's is {b!r} "
                                    "(take the snapshot with an engine of the same weights and "
                                    "prefill settings)")
        layers = self.cfg.target.num_hidden_layers
        if not len(snap.k) == len(snap.v) == len(snap.slot_pos) == layers:
            raise SnapshotError(f"snapshot: {len(snap.k)} target layers, the model has {layers}")

    def generate_from_snapshot(self, req: GenerationRequest, snap: PrefillSnapshot,
                               on_round=None, on_tokens=None) -> GenerationResult:
        """Engine.generate with the target prefill restored from `snap`."""
        self.validate(req)
        self.check_snapshot(req, snap)
        self.replay.snap = snap
        try:
            return self.generate(req, on_round, on_tokens)
        finally:
            self.replay.snap = None


def _restore(caches: RuntimeCaches, snap: PrefillSnapshot) -> None:
    for i, layer in enumerate(caches.target):
        k, v, lab = snap.k[i], snap.v[i], snap.slot_pos[i]
        c, cap = lab.shape[0], layer.layout.capacity
        ok = c == cap if layer.layout.ring else c <= cap
        if not ok or k.shape != (c, *layer.k.shape[1:]) or v.shape != k.shape:
            kind = "ring" if layer.layout.ring else "full"
            raise SnapshotError(f"snapshot: target layer {i} holds K {tuple(k.shape)} / "
                                f"labels [{c}], the request's cache is "
                                f"{tuple(layer.k.shape)} ({kind})")
        _copy_into(layer, k, v, lab)


def _copy_into(layer: LayerKV, k: torch.Tensor, v: torch.Tensor, lab: torch.Tensor) -> None:
    c = lab.shape[0]
    layer.k[:c].copy_(k)
    layer.v[:c].copy_(v)
    layer.slot_pos[:c].copy_(lab)
