"""Prefill snapshot replay (iquestrt/snapshot.py): generation from a restored target prefill
equals generation from real prefill bit for bit — tokens, round records (drafts, q(y), entropies,
acceptance, bonus), a digest of every cache after the request — on the tiny correlated checkpoint
and on the shipped mini model, sampling and greedy, fixed and adaptive depth; the snapshot
survives its disk round trip; a changed K element is refused on load and, replayed from memory,
changes the result; snapshots of another prompt, checkpoint or prefill width are refused."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from iquestrt.config import RuntimeConfig
from iquestrt.snapshot import (
    TENSOR_NAME,
    PrefillSnapshot,
    SnapshotEngine,
    SnapshotError,
    caches_digest,
    result_key,
)
from iquestrt.weights import from_checkpoint
from reference.checkpoint import load_checkpoint
from reference.depth import FixedDepth, load_policy
from reference.speculative import GenerationRequest
from tests.helpers.engine_setup import GREEDY, SAMPLING, held, make_ckpt, rounds_key

# 27 positions: both tiny rings (target 16 + 8 slots, draft 8 + 8) wrap during prefill
PROMPT = (5, 17, 300, 22, 9, 411, 78, 150, 3, 64, 200, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17,
          18, 19, 20, 33, 91)
OTHER = PROMPT[:-1] + (92,)
MINI = Path(__file__).resolve().parents[2] / "models" / "mini"


@pytest.fixture(scope="module")
def corr(tmp_path_factory):
    return load_checkpoint(make_ckpt(tmp_path_factory.mktemp("corr"), "correlated"))


def _engine(ck, **kw) -> SnapshotEngine:
    kw.setdefault("ring_pad", 8)
    kw.setdefault("policy", FixedDepth(3))
    rcfg = RuntimeConfig(ops="twins", max_positions=256, **kw)
    return SnapshotEngine(from_checkpoint(ck, "cpu", 256), rcfg)


def _real_and_replay(eng: SnapshotEngine, snap: PrefillSnapshot, req: GenerationRequest):
    real = eng.generate(req)
    real_digest = caches_digest(eng.session.caches)
    forwards = []
    target_forward = eng.target.forward
    eng.target.forward = lambda *a: forwards.append(a) or target_forward(*a)
    try:
        replay = eng.generate_from_snapshot(req, snap)
    finally:
        del eng.target.forward
    assert not forwards, "the replay ran the target prefill instead of restoring it"
    return (real, real_digest), (replay, caches_digest(eng.session.caches))


def _assert_bit_exact(real, replay) -> None:
    (a, da), (b, db) = real, replay
    assert a.tokens == b.tokens
    assert rounds_key(a) == rounds_key(b)
    assert a.stop_reason == b.stop_reason
    assert da == db


@pytest.mark.parametrize("sampling", [SAMPLING, GREEDY], ids=["sampling", "greedy"])
@pytest.mark.slow
def test_tiny_replay_from_disk_equals_real_prefill(corr, sampling, tmp_path):
    eng = _engine(corr)
    eng.take_snapshot(PROMPT).save(tmp_path / "snap")
    snap = PrefillSnapshot.load(tmp_path / "snap")
    for seed, n_new in ((3, 40), (11, 17)):  # one snapshot, several seeds and budgets
        real, replay = _real_and_replay(eng, snap, GenerationRequest(PROMPT, n_new, sampling, seed))
        _assert_bit_exact(real, replay)
        acc = {r.accepted for r in real[0].rounds}
        assert len(real[0].rounds) >= 5 and len(acc) >= 2, f"acceptance paths {sorted(acc)}"


@pytest.mark.slow
def test_tiny_replay_other_policies(corr):
    """Depth 0 (no draft prefill) and depth 5 reuse a snapshot taken by a depth-3 engine."""
    snap = _engine(corr).take_snapshot(PROMPT)
    for depth in (0, 5):
        eng = _engine(corr, policy=FixedDepth(depth))
        real, replay = _real_and_replay(eng, snap, GenerationRequest(PROMPT, 24, SAMPLING, 5))
        _assert_bit_exact(real, replay)


@pytest.mark.parametrize("sampling", [SAMPLING, GREEDY], ids=["sampling", "greedy"])
@pytest.mark.slow
def test_mini_replay_equals_real_prefill(sampling):
    ck = load_checkpoint(MINI)
    policy = load_policy(MINI)  # the shipped fitted adaptive policy
    rcfg = RuntimeConfig(ops="twins", max_positions=128, policy=policy)
    eng = SnapshotEngine(from_checkpoint(ck, "cpu", 128), rcfg)
    prompt = tuple(range(1000, 1040))
    snap = eng.take_snapshot(prompt)
    real, replay = _real_and_replay(eng, snap, GenerationRequest(prompt, 24, sampling, 1))
    _assert_bit_exact(real, replay)


def _first_full_layer(snap: PrefillSnapshot) -> int:
    return next(i for i, lab in enumerate(snap.slot_pos) if lab.shape[0] == len(snap.prompt_ids))


def test_changed_k_element_is_refused_on_load(corr, tmp_path):
    snap = _engine(corr).take_snapshot(PROMPT)
    snap.save(tmp_path / "snap")
    PrefillSnapshot.load(tmp_path / "snap")  # intact: loads
    path = tmp_path / "snap" / TENSOR_NAME
    tensors = load_file(str(path))
    name = f"target.{_first_full_layer(snap)}.k"
    tensors[name][4, 0, 0] += 1.0
    save_file(tensors, str(path))
    with pytest.raises(SnapshotError, match=rf"tensor '{name}' does not match its sha256"):
        PrefillSnapshot.load(tmp_path / "snap")


@pytest.mark.slow
def test_changed_k_element_changes_the_replay(corr):
    """The bit-exact comparison can fail: a snapshot with one K element changed (a full layer,
    position 4: visible to every later query), replayed from memory, changes the round records
    and the caches."""
    eng = _engine(corr)
    snap = eng.take_snapshot(PROMPT)
    i = _first_full_layer(snap)
    k = snap.k[i].clone()
    k[4, 0, 0] += 1.0
    bad = dataclasses.replace(snap, k=snap.k[:i] + (k,) + snap.k[i + 1 :])
    req = GenerationRequest(PROMPT, 24, SAMPLING, 3)
    real, replay = _real_and_replay(eng, bad, req)
    assert rounds_key(real[0]) != rounds_key(replay[0])
    assert real[1] != replay[1]
    assert result_key(real[0]) != result_key(replay[0])


@pytest.mark.slow
def test_cache_digest_sees_one_held_element(corr):
    eng = _engine(corr)
    eng.generate(GenerationRequest(PROMPT, 8, GREEDY, 0))
    caches = eng.session.caches.clone()
    before = caches_digest(caches)
    pos, _, _ = held(caches.target[0])
    caches.target[0].k[int(pos[-1])].view(torch.int16)[0, 0] ^= 1  # one bit of one held row
    assert caches_digest(caches) != before


@pytest.mark.slow
def test_other_prompt_checkpoint_or_width_is_refused(corr, tmp_path):
    snap = _engine(corr).take_snapshot(PROMPT)
    eng = _engine(corr)
    with pytest.raises(SnapshotError, match="taken for another prompt"):
        eng.generate_from_snapshot(GenerationRequest(OTHER, 8, SAMPLING, 0), snap)
    req = GenerationRequest(PROMPT, 8, SAMPLING, 0)
    other = load_checkpoint(make_ckpt(tmp_path / "synth", "synthetic"))
    with pytest.raises(SnapshotError, match="weights_sha256 is '[0-9a-f]+', this engine's is"):
        _engine(other).generate_from_snapshot(req, snap)
    with pytest.raises(SnapshotError, match="ring_pad is 8, this engine's is 12"):
        _engine(corr, ring_pad=12).generate_from_snapshot(req, snap)
    with pytest.raises(SnapshotError, match="max_width is 8, this engine's is 6"):
        _engine(corr, max_width=6).generate_from_snapshot(req, snap)
    assert eng.generate_from_snapshot(req, snap).tokens  # the right engine accepts it
