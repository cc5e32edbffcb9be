"""Gate 5b: end to end on the trained mini model, the first emitted tokens under speculation have
the law of plain target sampling.

Plain sampling draws x1 from the target's served row after the prompt, x2 from the served row
after prompt + x1, and so on. Its law over the first H tokens is the product of those rows
(computed here with one target forward per prefix: 1 + k + k² forwards for H = 3 and top-k k).
Speculative decoding (the recursive draft at a fixed depth, rejection sampling, replacement and
bonus tokens) must give the same law. N requests with seeds 0 … N−1 (max_new_tokens = H) are
drawn with the reference generator in Precision "matched" — the computation the runtime's twins
engine performs bit for bit (gate 3b; re-checked here on the first `engine_check` seeds) — and a
G-test at α = 1e-3 compares their H-token prefixes with the law. Cells as in gate 5: the most
probable outcomes with expected count ≥ 5, the rest pooled (distribution_law.make_cells); the
evidence states the least total-variation distance the test detects with 99 % power at this N.

Sampling is temperature 1 with top-k 3 and top-p 1 (27 outcomes for H = 3), so a few thousand
requests give each outcome enough draws; every path of verification occurs (first draft rejected,
accepted then rejected, all accepted with a bonus).

The requests and the law's forwards run on a RowMemo of the model (reference/row_memo.py): every
request has the same prompt and at most 3 candidates per token, so almost every row a request
needs was computed for an earlier one; the memo computes each distinct row once and gives the
plain model's bits (tests/reference/test_row_memo.py compares the tokens with plain requests).

Dimension letters: V vocabulary, H tokens per outcome, N requests.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from fractions import Fraction

import torch

from qualification import distribution_law as law
from qualification.mini_engine import engine, load_mini, prompts
from reference import rejection
from reference.config import SamplingDefaults
from reference.depth import FixedDepth
from reference.model import ReferenceModel
from reference.row_memo import RowMemo
from reference.sampling import served_distribution
from reference.speculative import GenerationRequest, ReferenceGenerator

ALPHA = 1e-3
POWER = 0.99


@dataclass(frozen=True)
class E2EConfig:
    n: int = 3000  # requests (seeds 0 … n−1)
    horizon: int = 3  # emitted tokens per outcome
    depth: int = 3
    prompt_tokens: int = 24
    sampling: SamplingDefaults = field(
        default_factory=lambda: SamplingDefaults(temperature=1.0, top_k=3, top_p=1.0))
    engine_check: int = 3  # seeds whose tokens the twins engine must reproduce bit for bit
    progress: int = 500  # report every this many requests (and once at the end)


def exact_law(model: ReferenceModel, prompt: tuple[int, ...], g: E2EConfig) -> law.Law:
    """{(x1 … xH): probability} of plain target sampling (served rows, as fractions)."""
    memo, out = RowMemo(model), {}

    def walk(prefix: tuple[int, ...], mass: Fraction) -> None:
        if len(prefix) == g.horizon:
            out[prefix] = out.get(prefix, Fraction(0)) + mass
            return
        toks = torch.tensor(prompt + prefix)
        logits = memo.target(toks, torch.arange(len(toks))).logits[-1:]  # [1, V]
        row = served_distribution(logits, g.sampling)[0].double()  # [V]
        for x in torch.nonzero(row > 0).flatten().tolist():
            walk(prefix + (x,), mass * Fraction(float(row[x])))

    walk((), Fraction(1))
    total = sum(out.values())
    return {k: v / total for k, v in out.items()}


def draws(model: ReferenceModel, prompt: tuple[int, ...], g: E2EConfig, report=None
          ) -> list[tuple[int, ...]]:
    """The first g.horizon tokens of requests with seeds 0 … g.n − 1, as plain per-request
    ReferenceGenerator calls on `model` give them. The memo is made here, under whatever patch
    the caller applies around the requests (a RowMemo does not see patches made after it has
    rows)."""
    memo = RowMemo(model)
    gen = ReferenceGenerator(memo, FixedDepth(g.depth))
    res, t0 = [], time.perf_counter()
    for seed in range(g.n):
        r = gen.generate(GenerationRequest(prompt, g.horizon, g.sampling, seed))
        res.append(tuple(r.tokens))
        if report is not None and ((seed + 1) % g.progress == 0 or seed + 1 == g.n):
            report(f"  5b: {seed + 1}/{g.n} requests ({time.perf_counter() - t0:.0f} s; rows "
                   f"{memo.misses} computed, {memo.hits} from the memo)")
    return res


def run(g: E2EConfig | None = None, report=print, mutate=None) -> tuple[bool, str, list[str]]:
    """→ (ok, margin, evidence). mutate: a context manager applied around the sampled requests
    (negative controls and the sensitivity test)."""
    g = g or E2EConfig()
    ckpt = load_mini()
    model = ReferenceModel(ckpt.cfg, ckpt.dequantized(), "matched")
    prompt = prompts(g.prompt_tokens)[0].ids
    exact = exact_law(model, prompt, g)
    V = ckpt.cfg.target.vocab_size
    codes, probs = law.ordered(exact, V)
    lam = law.Noncentrality(ALPHA, POWER)
    cells = law.make_cells(codes, probs, g.n, lam)
    with mutate() if mutate is not None else contextlib.nullcontext():
        got = draws(model, prompt, g, report)
    blocks = torch.tensor([law.encode_tuple(t, V) for t in got], dtype=torch.int64)
    test = law.g_test(blocks, cells)
    tv = law.detectable_tv(cells, g.n, lam)
    evidence = [
        f"mini model, prompt {len(prompt)} tokens, depth {g.depth}, T=1 top-k "
        f"{g.sampling.top_k}: {g.n} requests vs the exact law of plain sampling over the first "
        f"{g.horizon} tokens ({len(exact)} outcomes, {len(cells.probs)} cells)",
        f"G = {test.g:.2f}, df {test.df}, p = {test.p_value:.3g} (α = {ALPHA}); draws outside "
        f"the support: {test.impossible}; worst cell z = {test.worst_z:.2f}",
        f"power: detects any law at total variation ≥ {tv:.3f} with probability {POWER}",
    ]
    ok = test.p_value >= ALPHA
    if g.engine_check and mutate is None:
        eng = engine(ckpt, g.depth, max_positions=len(prompt) + g.horizon + 16)
        for seed in range(g.engine_check):
            req = GenerationRequest(prompt, g.horizon, g.sampling, seed)
            if tuple(eng.generate(req).tokens) != got[seed]:
                ok = False
                evidence.append(f"the twins engine differs from the matched reference at seed "
                                f"{seed}")
                break
        else:
            evidence.append(f"twins engine == matched reference on seeds 0…{g.engine_check - 1}")
    return ok, f"p = {test.p_value:.3g}", evidence


@contextlib.contextmanager
def replacement_from_p():
    """Broken verification: the token after the first rejection is drawn from p instead of
    norm(max(0, p − q)) (reference/rejection.py), which favours tokens the draft over-proposes."""
    real = rejection.residual_distribution
    rejection.residual_distribution = lambda p, q: p
    try:
        yield
    finally:
        rejection.residual_distribution = real
