"""Gate 8 (qualification/readiness_gate.py): the runtime's ring policy passes; every unsafe
policy of the protocol's argument fails with its shortest bad interleaving; a PartialRing whose
views leave the policy's slots fails the aliasing check."""

import pytest

from kernels.readiness import PartialRing, RingPolicy
from qualification import readiness_gate


def test_runtime_policy_passes():
    ok, evidence = readiness_gate.run()
    assert ok, evidence
    assert "every interleaving free of stale reads and lost writes" in evidence[0]


@pytest.mark.parametrize("policy, kind", [
    (RingPolicy(3, 0), "stuck"),  # re-arms the buffer being read
    (RingPolicy(2, 1), "stale"),  # B = lag + 1: a slow rank has not re-armed yet
    (RingPolicy(3, 1, rearm_all_rows=False), "stale"),  # padding rows keep old values
])
def test_unsafe_policies_fail_with_an_interleaving(policy, kind):
    ok, evidence = readiness_gate.run(policy=policy)
    assert not ok
    assert evidence[0].startswith(f"{kind} after ") and "consume(rank" in evidence[0]
    assert any("PartialRing refuses the policy" in e for e in evidence)


def test_a_ring_off_the_policys_slots_fails(monkeypatch):
    real = PartialRing.rearm_view
    monkeypatch.setattr(PartialRing, "rearm_view",
                        lambda self, step, rank: real(self, step + 1, rank))
    ok, evidence = readiness_gate.run()
    assert not ok and evidence[0].startswith("PartialRing step 0 rank 0")
