"""Golden digests of the CPU decode path: a change that alters them fails with the first
differing round named. Updating them is explicit and records why:

    python -m qualification.goldens --update --why "new synthetic weight scales (issue 2)"

Digests cover output tokens, per-round drafts, acceptance counts and bonus flags — the values a
scheduling change must preserve. Logit bits are left out on purpose: the CPU GEMM kernels may
differ between machines, tokens and acceptance decisions do not unless a near-tie flips.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

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
    """{case: {"tokens": sha, "rounds": [sha per round]}} on the tiny synthetic model, seed 0."""
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


def load() -> dict:
    if not GOLDEN_FILE.is_file():
        raise FileNotFoundError(f"{GOLDEN_FILE}: no goldens; create them with --update --why")
    return json.loads(GOLDEN_FILE.read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m qualification.goldens", description=__doc__)
    ap.add_argument("--update", action="store_true", help="recompute and store the goldens")
    ap.add_argument("--why", help="required with --update: the reason, stored in the file")
    a = ap.parse_args(argv)
    got = digests()
    if a.update:
        if not a.why:
            ap.error("--update needs --why")
        history = load().get("history", []) if GOLDEN_FILE.is_file() else []
        GOLDEN_FILE.parent.mkdir(exist_ok=True)
        payload = {"cases": got, "history": history + [a.why]}
        GOLDEN_FILE.write_text(json.dumps(payload, indent=1) + "\n")
        print(f"updated {GOLDEN_FILE} ({len(got)} cases): {a.why}")
        return 0
    problems = compare(got, load()["cases"])
    print("\n".join(problems) or "goldens match")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
