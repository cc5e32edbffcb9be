"""Golden digests of the CPU decode path: a change that alters them fails with the first
differing round named. Updating them is explicit and records why:

    python -m qualification.goldens --update --why "new synthetic weight scales"

Digests cover output tokens, per-round drafts, acceptance counts and bonus flags — the values a
scheduling change must preserve. Logit bits are left out on purpose. The tokens depend on the
reference's float arithmetic, which is FP64 rounded once per op (reference/ops.py), so they do not
depend on the CPU's code path: tests/qualification/test_platform_bits.py computes them under
MKL_CBWR, ONEDNN_MAX_CPU_ISA and ATEN_CPU_CAPABILITY variants and requires one set of digests.
(With FP32 GEMMs and exps they did: an AMX host and an AVX-512 host with the same torch build
gave other BF16 digests.) Limits: the synthetic weights come from torch.randn, whose non-vectorized
path (ATEN_CPU_CAPABILITY=default, no AVX2) draws other normals, so such a build gets other weights;
and another torch build may still differ. For that case the file keeps optional per-platform entries
(torch build and machine) beside the primary goldens; a run compares against its own platform's
entry when there is one, else against the primary, and a mismatch on another platform says so and
names the command that records that platform's goldens (explicit, with a reason):

    python -m qualification.goldens --update --this-platform --why "torch 2.15 build"

`python -m qualification.goldens --json` prints this machine's digests as JSON (no comparison).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from reference.config import SamplingDefaults, preset
from reference.model import ReferenceModel
from reference.speculative import GenerationRequest, GenerationResult, RoundRecord, generate
from reference.synthetic import synthetic_params

GOLDEN_FILE = Path(__file__).parent / "goldens" / "reference_cpu.json"


@dataclass(frozen=True)
class GoldenCase:
    name: str
    precision: str
    depth: int
    sampling: SamplingDefaults
    seed: int
    prompt: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8)
    max_new_tokens: int = 48


def cases() -> list[GoldenCase]:
    greedy = SamplingDefaults(temperature=0.0, top_k=0, top_p=1.0)
    return [
        GoldenCase("fp32-greedy-d3", "fp32", 3, greedy, 0),
        GoldenCase("fp32-default-d3", "fp32", 3, SamplingDefaults(), 1),
        GoldenCase("bf16-default-d5", "bf16", 5, SamplingDefaults(), 2),
        GoldenCase("bf16-t07-k8-p09-d2", "bf16", 2, SamplingDefaults(0.7, 8, 0.9), 3),
        GoldenCase("bf16-plain", "bf16", 0, SamplingDefaults(), 4),
    ]


def _round_digest(r: RoundRecord) -> str:
    text = json.dumps([r.position, [d.token for d in r.drafts], r.accepted, r.emitted, r.bonus])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def run_case(case: GoldenCase, model: ReferenceModel) -> GenerationResult:
    req = GenerationRequest(case.prompt, case.max_new_tokens, case.sampling, case.seed)
    return generate(model, req, depth=case.depth)


def digests(models: dict[str, ReferenceModel] | None = None) -> dict[str, dict]:
    """{case: {"tokens": sha, "rounds": [sha per round]}} on the tiny synthetic model, seed 0.
    One CPU thread: torch's CPU reductions split by thread count, and the H200 host's 16 threads
    gave other digests than qualify's single thread (its 2-core CI machine happened to agree)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _digests(models)
    finally:
        torch.set_num_threads(threads)


def _digests(models: dict[str, ReferenceModel] | None) -> dict[str, dict]:
    if models is None:
        cfg = preset("tiny")
        params = synthetic_params(cfg, 0)
        models = {p: ReferenceModel(cfg, params, p) for p in ("fp32", "bf16")}
    out = {}
    for case in cases():
        res = run_case(case, models[case.precision])
        out[case.name] = {
            "tokens": hashlib.sha256(json.dumps(res.tokens).encode()).hexdigest()[:16],
            "rounds": [_round_digest(r) for r in res.rounds],
        }
    return out


def compare(got: dict[str, dict], want: dict[str, dict]) -> list[str]:
    """Differences, each naming the case and the first differing round; [] when equal."""
    problems = []
    for name in sorted(set(got) | set(want)):
        if name not in want or name not in got:
            problems.append(f"{name}: {'new case' if name not in want else 'case missing'}")
            continue
        g, w = got[name]["rounds"], want[name]["rounds"]
        first = next((i for i, (a, b) in enumerate(zip(g, w, strict=False)) if a != b), None)
        if first is None and len(g) != len(w):
            first = min(len(g), len(w))
        if first is not None:
            problems.append(f"{name}: first differing round {first} (of {len(w)} golden)")
        elif got[name]["tokens"] != want[name]["tokens"]:
            problems.append(f"{name}: same rounds but different tokens")
    return problems


def platform_key() -> str:
    """What the digests may depend on beyond the code: the torch build and the architecture (not
    the CPU's vector ISA or BLAS path: module docstring)."""
    return f"torch {torch.__version__} / {platform.machine()}"


def expected(stored: dict, key: str) -> tuple[dict, str]:
    """(cases to compare with, where they come from) for platform `key`."""
    own = stored.get("platforms", {}).get(key)
    if own is not None:
        return own["cases"], f"this platform's entry ({key})"
    return stored["cases"], f"primary goldens (recorded on {stored.get('platform', 'unrecorded')})"


def hint(stored: dict, key: str) -> str | None:
    """A line for a mismatch on a platform other than the primary's, else None."""
    if key in stored.get("platforms", {}) or stored.get("platform") == key:
        return None
    return (f"this platform ({key}) is not the primary's ({stored.get('platform', 'unrecorded')})"
            ": CPU float kernels may differ between torch builds and processors; if the "
            "difference is the platform's, record it with `python -m qualification.goldens "
            "--update --this-platform --why \"…\"`")


def load() -> dict:
    if not GOLDEN_FILE.is_file():
        raise FileNotFoundError(f"{GOLDEN_FILE}: no goldens; create them with --update --why")
    return json.loads(GOLDEN_FILE.read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m qualification.goldens", description=__doc__)
    ap.add_argument("--update", action="store_true", help="recompute and store the goldens")
    ap.add_argument("--why", help="required with --update: the reason, stored in the file")
    ap.add_argument("--json", action="store_true",
                    help="print this machine's digests as JSON and exit (no comparison)")
    ap.add_argument("--this-platform", action="store_true",
                    help="with --update: store an entry for this platform only (the primary "
                         "goldens stay)")
    a = ap.parse_args(argv)
    if a.this_platform and not a.update:
        ap.error("--this-platform applies to --update")
    if a.json and (a.update or a.this_platform):
        ap.error("--json prints digests only; it takes no --update")
    got, key = digests(), platform_key()
    if a.json:
        print(json.dumps(got, sort_keys=True))
        return 0
    if a.update:
        if not a.why:
            ap.error("--update needs --why")
        stored = load() if GOLDEN_FILE.is_file() else {}
        history = stored.get("history", []) + [f"{key}: {a.why}"]
        if a.this_platform:
            if "cases" not in stored:
                ap.error("--this-platform needs primary goldens first (--update without it)")
            platforms = {**stored.get("platforms", {}), key: {"cases": got, "why": a.why}}
            payload = {**stored, "platforms": platforms, "history": history}
        else:
            payload = {**stored, "cases": got, "platform": key, "history": history}
        GOLDEN_FILE.parent.mkdir(exist_ok=True)
        tmp = GOLDEN_FILE.with_suffix(".tmp")
        tmp.write_text(json.dumps(payload, indent=1) + "\n")
        tmp.replace(GOLDEN_FILE)
        print(f"updated {GOLDEN_FILE} ({len(got)} cases, {key}): {a.why}")
        return 0
    stored = load()
    want, where = expected(stored, key)
    problems = compare(got, want)
    if problems and hint(stored, key):
        problems.append(hint(stored, key))
    print("\n".join(problems) or f"goldens match ({where})")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
