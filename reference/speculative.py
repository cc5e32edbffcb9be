"""The slow, obviously correct speculative `generate()`: recursive MTP drafting, standard
rejection sampling, KV rollback. The runtime returns the same `GenerationResult`.

Positions. After a round the target cache holds positions 0 … m−1 and the newest emitted token
x_m (position m) is not yet in any target cache. A round:
  1. Draft depth 0 runs the catch-up rows: every position from the draft cache's next position
     up to m, each row = (token at p, target final hidden at p−1). Its last row predicts y_1
     (position m+1). Depth j ≥ 1 runs one row: (y_j, draft hidden of depth j−1) at position m+j.
     The draft samples each y_{j+1} from its served distribution q_j with uniforms keyed
     (seed, position m+j+1, DRAFT_SAMPLE).
  2. The target verifies rows [x_m, y_1 … y_D] at positions m … m+D; row j gives p_j for
     position m+j+1.
  3. rejection.verify accepts a prefix of a drafts and emits a replacement (first rejection) or
     the bonus (all accepted, from row D).
  4. Settle: the target keeps positions ≤ m+a (x_m and the accepted drafts). The draft
     (DraftConfig.draft_kv_settle): "keep" keeps its rows at positions ≤ m+a (rows written at
     depths whose token was accepted; when all D drafts are accepted, position m+D has no draft
     row yet: the next depth 0 catches it up); "recompute" keeps positions ≤ m, and the next
     depth 0 rewrites m+1 … m+a+1 with the target's hidden states (a+1 rows).
A draft row's RoPE position is its position + DraftConfig.draft_position_offset (0, or −1: that
of its hidden state); windows and cache positions are the row positions above.
Depth 0 (no speculation) is plain target sampling with TARGET_SAMPLE at every position.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from reference.config import SamplingDefaults
from reference.depth import DepthPolicy, DraftInfo, FixedDepth
from reference.model import ReferenceModel
from reference.rejection import verify
from reference.rng import Purpose, uniforms
from reference.row_memo import RowMemo
from reference.sampling import draw, served_distribution


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingDefaults
    seed: int
    stop_ids: tuple[int, ...] = ()

    def validate(self, vocab_size: int, max_positions: int) -> None:
        if not self.prompt_ids:
            raise ValueError("prompt_ids: the prompt must hold at least one token")
        bad = [t for t in self.prompt_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt_ids: tokens {bad[:5]} outside [0, {vocab_size})")
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens: must be >= 1, got {self.max_new_tokens}")
        need = len(self.prompt_ids) + self.max_new_tokens + 16
        if need > max_positions:
            raise ValueError(
                f"prompt ({len(self.prompt_ids)}) + max_new_tokens ({self.max_new_tokens}) "
                f"+ draft headroom exceeds max_position_embeddings={max_positions}"
            )
        bad = [t for t in self.stop_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"stop_ids: tokens {bad} outside [0, {vocab_size})")
        if not 0 <= self.seed < 2**64:
            raise ValueError(f"seed: must be in [0, 2^64), got {self.seed}")
        self.sampling.validate(vocab_size)


@dataclass
class RoundRecord:
    position: int  # m: position of the committed token verified in this round
    drafts: list[DraftInfo]
    accepted: int  # a: drafts accepted (0 … len(drafts))
    emitted: list[int]  # accepted drafts + replacement or bonus (after stop/budget trimming)
    bonus: bool  # the last emitted token came from the extra target row


@dataclass
class Timing:
    """Wall seconds of one request's phases. prefill_s ends with the first token on the host;
    setup_s is the decode's set-up (device state, round graphs captured when the request's shape
    is new: `captured`); decode_s is the decode clock, first round launched to last log read.
    Triton compiles a kernel at its first call, so the first request's prefill and set-up
    include compilation."""

    prefill_s: float = 0.0
    setup_s: float = 0.0
    decode_s: float = 0.0
    captured: bool = False


@dataclass
class GenerationResult:
    tokens: list[int]  # new tokens, the prompt excluded
    rounds: list[RoundRecord] = field(default_factory=list)
    stop_reason: str = "length"  # "stop" | "length" | "cancelled" (on_tokens returned False)
    timing: Timing = field(default_factory=Timing, compare=False)  # wall clock: not compared

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification round, bonus/replacement included."""
        n = [len(r.emitted) for r in self.rounds]
        return sum(n) / len(n) if n else 0.0


def _entropy(q: torch.Tensor) -> float:
    qs = q[q > 0].double()
    return float(-(qs * qs.log()).sum())


def _sample_rows(logits, params, seed, positions, purpose):
    probs = served_distribution(logits, params)  # [R, V]
    u = uniforms(seed, positions, purpose)
    return draw(probs, u), probs


def emit(result: GenerationResult, req: GenerationRequest, emitted: list[int]) -> bool:
    """Append emitted tokens, honouring stop tokens and the budget; True when finished. Shared by
    the reference and the runtime so both trim a round's tokens the same way."""
    for tok in emitted:
        result.tokens.append(tok)
        if tok in req.stop_ids:
            result.stop_reason = "stop"
            return True
        if len(result.tokens) >= req.max_new_tokens:
            result.stop_reason = "length"
            return True
    return False


class ReferenceGenerator:
    """Slow reference decoding; `policy` FixedDepth(0) is plain sampling. `model` may be a RowMemo
    of a matched model (reference/row_memo.py): the same tokens, each distinct row computed once
    for all the requests that use the memo."""

    def __init__(self, model: ReferenceModel | RowMemo, policy: DepthPolicy | None = None):
        self.model = model
        self.policy = policy or FixedDepth(0)

    def generate(
        self, req: GenerationRequest, on_round: Callable[[RoundRecord], None] | None = None,
        on_tokens: Callable[[list[int]], bool | None] | None = None,
    ) -> GenerationResult:
        """on_tokens (streaming) receives every emitted token once, in order: the first token,
        then each round's (trimmed) emitted tokens; it returns False to cancel the request
        (stop_reason "cancelled")."""
        t0 = time.perf_counter()
        m_ = self.model
        t = m_.cfg.target
        req.validate(t.vocab_size, t.max_position_embeddings)
        tokens = list(req.prompt_ids)  # every token by position, emitted ones appended
        n = len(tokens)
        tcache, dcache = m_.new_target_cache(), m_.new_draft_cache()
        out = m_.target(torch.tensor(tokens), torch.arange(n), tcache)
        hidden = {p: out.hidden[p] for p in range(n)}  # target final hidden by position
        first, _ = _sample_rows(
            out.logits[-1:], req.sampling, req.seed, torch.tensor([n]), Purpose.TARGET_SAMPLE
        )
        result = GenerationResult(tokens=[])
        done = emit(result, req, [int(first)])
        t1 = result.timing.prefill_s = time.perf_counter() - t0
        if on_tokens is not None and on_tokens([int(first)]) is False and not done:
            result.stop_reason, done = "cancelled", True
        if done:
            return result
        tokens.append(int(first))
        while True:
            m = len(tokens) - 1  # position of the newest token, not yet in the target cache
            drafts, q_rows = self._draft(req, tokens, hidden, dcache, m)
            d = len(drafts)
            rows = torch.tensor([tokens[m]] + [x.token for x in drafts])
            vout = m_.target(rows, torch.arange(m, m + d + 1), tcache)
            p_rows = served_distribution(vout.logits, req.sampling)  # [D+1, V]
            q = torch.stack(q_rows) if q_rows else p_rows[:0]
            res = verify(
                p_rows,
                q,
                torch.tensor([x.token for x in drafts], dtype=torch.int64),
                req.seed,
                m + 1,
            )
            a = res.n_accepted
            emitted = [x.token for x in drafts[:a]] + [res.next_token]
            # settle: the target keeps x_m and the accepted drafts (positions ≤ m+a)
            tcache.truncate(m + a + 1)
            keep_d = m_.cfg.draft.settled_draft_next(m, a + 1)
            dcache.truncate(min(keep_d, dcache.next_position))
            hidden = {m + j: vout.hidden[j] for j in range(a + 1)}
            rec = RoundRecord(m, drafts, a, emitted, res.bonus)
            done = emit(result, req, emitted)
            rec.emitted = emitted[: len(result.tokens) - (len(tokens) - len(req.prompt_ids))]
            result.rounds.append(rec)
            if on_round is not None:
                on_round(rec)
            if on_tokens is not None and rec.emitted and on_tokens(list(rec.emitted)) is False \
                    and not done:
                result.stop_reason, done = "cancelled", True
            if done:  # budget/stop trimmed tokens must not stay cached either
                result.timing.decode_s = time.perf_counter() - t0 - t1
                last = len(req.prompt_ids) + len(result.tokens) - 1
                tcache.truncate(min(tcache.next_position, last))
                dcache.truncate(min(dcache.next_position, last))
                return result
            tokens.extend(emitted)

    def _draft(self, req, tokens, hidden, dcache, m):
        """Recursive drafting for one round; returns (DraftInfo list, served q rows)."""
        m_, drafts, q_rows = self.model, [], []
        if not self.policy.more(drafts):
            return drafts, q_rows
        pos = torch.arange(dcache.next_position, m + 1)  # catch-up rows, then the newest token
        h = torch.stack([hidden[int(p) - 1] for p in pos])
        tok = torch.tensor([tokens[int(p)] for p in pos])
        while True:
            out = m_.draft(tok, h, pos, dcache)
            nxt = torch.tensor([int(pos[-1]) + 1])
            y, q = _sample_rows(out.logits[-1:], req.sampling, req.seed, nxt, Purpose.DRAFT_SAMPLE)
            y = int(y[0])
            q_rows.append(q[0])
            drafts.append(DraftInfo(y, float(q[0, y]), _entropy(q[0])))
            if not self.policy.more(drafts) or len(drafts) >= self.policy.max_depth:
                return drafts, q_rows
            tok, h, pos = torch.tensor([y]), out.hidden[-1:], nxt

def generate(model: ReferenceModel, req: GenerationRequest, depth: int = 0, **kw):
    """Convenience: reference generation with a fixed draft depth."""
    return ReferenceGenerator(model, FixedDepth(depth)).generate(req, **kw)
