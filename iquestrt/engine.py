"""The decode engine: speculative rounds with the round semantics of reference/speculative.py
(read its docstring: positions, catch-up rows, settlement), on the runtime model, sampler and
verifier. This first version is eager with a host loop: the host reads the accepted count each
round; CUDA graphs, the device loop, adaptive depth and prefetch come later (issue 4).

One round (m = position of the newest token x_m, not yet in the target cache):
  1. draft depth 0 over the catch-up rows draft_next … m (token at p, target hidden of p−1),
     in chunks of ≤ max_width; depths 1 … D−1 one row each. Each depth's last row is sampled
     (DRAFT_SAMPLE at the next position); its sparse served row is the q row of that draft.
  2. target forward over [x_m, y_1 … y_D] at positions m … m+D (writes their K/V);
  3. the sampler serves the D+1 target rows (sparse p rows); verify accepts a drafts and draws
     the replacement or the bonus;
  4. settle: both caches keep positions ≤ m+a (rollback relabels the rest); the hidden states of
     positions m … m+a are kept for the next depth 0.
Faults end the request with EngineError naming the round and layer: a tail's readiness flag,
non-finite logits, a token outside the vocabulary. Bad requests raise ValueError before any
device work.

Dimension letters: R rows (= max_width), Db = R − 1 draft slots, H hidden, V vocabulary,
W served width (top_k, 1 when greedy).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from iquestrt.cache import RuntimeCaches
from iquestrt.config import RuntimeConfig
from iquestrt.draft import DraftModel
from iquestrt.model import TargetModel
from iquestrt.ops import Live, make_ops
from iquestrt.weights import Weights, load_weights
from kernels.sampler import MAX_TOP_K
from reference.depth import DraftInfo
from reference.rng import Purpose
from reference.speculative import GenerationRequest, GenerationResult, RoundRecord, emit


class EngineError(RuntimeError):
    """A fault during a request (readiness, non-finite logits, bad token); names where."""


@dataclass
class Session:
    """State of the running (or last) request; on_round callbacks may inspect it."""

    req: GenerationRequest
    caches: RuntimeCaches
    flags: torch.Tensor  # [L] int32: readiness failure flag of each target layer
    tokens: list[int]  # prompt + emitted tokens, by position
    hidden: torch.Tensor | None = None  # [P, H] bf16 target final hidden of positions hidden_at…
    hidden_at: int = 0
    rounds: int = 0
    result: GenerationResult = field(default_factory=lambda: GenerationResult(tokens=[]))


def _entropy(ids: torch.Tensor, probs: torch.Tensor) -> float:
    """Of one sparse served row, summed in id order in float64 (reference/speculative.py)."""
    order = torch.argsort(ids.cpu())
    q = probs.cpu()[order]
    q = q[q > 0].double()
    return float(-(q * q.log()).sum())


class Engine:
    def __init__(self, weights: Weights, rcfg: RuntimeConfig):
        cfg = weights.cfg
        rcfg.validate_for(cfg)
        if weights.device != rcfg.torch_device:
            raise ValueError(f"Engine: weights on {weights.device}, RuntimeConfig.device is "
                             f"{rcfg.device}")
        if weights.max_positions < rcfg.positions_cap(cfg):
            raise ValueError(f"Engine: RoPE tables cover {weights.max_positions} positions, "
                             f"RuntimeConfig.max_positions needs {rcfg.positions_cap(cfg)}")
        self.w, self.rcfg, self.cfg = weights, rcfg, cfg
        self.ops = make_ops(rcfg.ops, rcfg.device, rcfg.max_polls)
        self.target = TargetModel(weights, self.ops, rcfg.max_width)
        self.draft = DraftModel(weights, self.ops, rcfg.max_width)
        self.session: Session | None = None

    @classmethod
    def from_checkpoint(cls, directory, rcfg: RuntimeConfig) -> Engine:
        return cls(load_weights(directory, rcfg.device, rcfg.max_positions), rcfg)

    def prefill_logits(self, tokens: list[int]):
        """A plain prefill of `tokens` through the target in chunks of max_width rows (the decode
        path) → (logits [T, V] FP32, hidden [T, H], caches holding positions 0 … T−1). Used by
        qualification (runtime vs reference) and the tests; generate() runs the same forward."""
        dev, rows = self.w.device, self.rcfg.max_width
        caches = RuntimeCaches.create(self.cfg, self.rcfg, len(tokens) + rows, dev)
        flags = torch.zeros(self.cfg.target.num_hidden_layers, dtype=torch.int32, device=dev)
        logits, hidden = [], []
        for c in range(0, len(tokens), rows):
            chunk = torch.tensor(tokens[c : c + rows], device=dev)
            lg, hd = self.target.forward(chunk, c, caches, flags)
            logits.append(lg[: len(chunk)].clone())
            hidden.append(hd[: len(chunk)].clone())
        if flags.any():
            layer = int(flags.nonzero()[0])
            raise EngineError(f"prefill_logits: readiness failure flag at layer {layer}")
        caches.target_len = len(tokens)
        return torch.cat(logits), torch.cat(hidden), caches

    # --- input checks (host only) -------------------------------------------------------------
    def validate(self, req: GenerationRequest) -> None:
        t = self.cfg.target
        if not isinstance(req, GenerationRequest):
            raise ValueError(f"request: expected a GenerationRequest, got {type(req).__name__}")
        req.validate(t.vocab_size, t.max_position_embeddings)
        s = req.sampling
        if s.temperature > 0 and not 1 <= s.top_k <= MAX_TOP_K:
            raise ValueError(
                f"sampling.top_k={s.top_k}: the runtime's sampler serves 1 <= top_k <= "
                f"{MAX_TOP_K} when temperature > 0 (top_k = 0, the whole vocabulary, is not "
                "supported); use the reference backend for it"
            )
        need = len(req.prompt_ids) + req.max_new_tokens + self.rcfg.max_width
        cap = self.rcfg.positions_cap(self.cfg)
        if need > cap:
            raise ValueError(
                f"prompt ({len(req.prompt_ids)}) + max_new_tokens ({req.max_new_tokens}) + round "
                f"width ({self.rcfg.max_width}) = {need} positions exceed the runtime cache of "
                f"{cap} (RuntimeConfig.max_positions)"
            )

    # --- faults --------------------------------------------------------------------------------
    def _check(self, where: str, st: Session, logits: torch.Tensor, n: int, target: bool):
        if target and bool(st.flags.any()):
            layer = int(torch.nonzero(st.flags)[0, 0])
            raise EngineError(f"{where}: readiness failure flag raised by target layer {layer} "
                              "(a partial sum held NaN: an unwritten or non-finite input)")
        if not bool(torch.isfinite(logits[:n]).all()):
            part = ("the final norm or lm_head (no layer raised its flag)" if target
                    else "the draft layer")
            raise EngineError(f"{where}: non-finite logits from {part}")

    def _token(self, where: str, tok) -> int:
        tok = int(tok)
        if not 0 <= tok < self.cfg.target.vocab_size:
            raise EngineError(f"{where}: token {tok} outside [0, {self.cfg.target.vocab_size})")
        return tok

    # --- generation ----------------------------------------------------------------------------
    def generate(
        self, req: GenerationRequest, on_round: Callable[[RoundRecord], None] | None = None
    ) -> GenerationResult:
        self.validate(req)
        dev, rows = self.w.device, self.rcfg.max_width
        cap = len(req.prompt_ids) + req.max_new_tokens + rows
        st = Session(req, RuntimeCaches.create(self.cfg, self.rcfg, cap, dev),
                     torch.zeros(self.cfg.target.num_hidden_layers, dtype=torch.int32,
                                 device=dev), list(req.prompt_ids))
        self.session = st
        try:
            first = self._prefill(st)
            if self._emit(st, [first]):
                return st.result
            st.tokens.append(first)
            while not self._round(st, on_round):
                pass
            return st.result
        except EngineError:
            self.ops.reset()
            raise

    def _prefill(self, st: Session) -> int:
        n, rows, dev = len(st.tokens), self.rcfg.max_width, self.w.device
        hidden = []
        for c in range(0, n, rows):
            chunk = torch.tensor(st.tokens[c : c + rows], device=dev)
            logits, h = self.target.forward(chunk, c, st.caches, st.flags)
            self._check("prefill", st, logits, chunk.shape[0], True)
            hidden.append(h[: chunk.shape[0]].clone())
        st.caches.settle_target(self.ops, n, n)
        st.hidden, st.hidden_at = torch.cat(hidden), 0
        last = chunk.shape[0] - 1
        s = self.ops.sample(logits[last : last + 1], st.req.sampling, st.req.seed,
                            torch.tensor([n], device=dev), Purpose.TARGET_SAMPLE, Live.of(1, dev))
        return self._token("prefill", s.tokens[0])

    def _round(self, st: Session, on_round) -> bool:
        """One speculative round; True when the request is finished."""
        req, ops, dev, rows = st.req, self.ops, self.w.device, self.rcfg.max_width
        where = f"round {st.rounds}"
        m = len(st.tokens) - 1
        drafts, q_ids, q_probs, d_buf = self._draft(st, m, where)
        d = len(drafts)
        toks = torch.tensor([st.tokens[m]] + [x.token for x in drafts], device=dev)
        logits, hidden = self.target.forward(toks, m, st.caches, st.flags)  # positions m … m+D
        self._check(where, st, logits, d + 1, True)
        pos = torch.arange(m + 1, m + 1 + rows, device=dev)  # [R] position each row predicts
        p = ops.sample(logits, req.sampling, req.seed, pos, Purpose.TARGET_SAMPLE,
                       Live.of(d + 1, dev))
        v = ops.verify(p, q_ids, q_probs, d_buf, req.seed, m + 1, Live.of(d, dev))
        a, bonus = int(v.n_accepted[0]), bool(v.bonus[0])
        emitted = [x.token for x in drafts[:a]] + [self._token(where, v.next_token[0])]
        st.caches.settle_target(ops, m + a + 1, m + d + 1)
        st.caches.settle_draft(ops, m + a + 1)
        st.hidden, st.hidden_at = hidden[: a + 1].clone(), m
        st.rounds += 1
        rec = RoundRecord(m, drafts, a, emitted, bonus)
        before = len(st.result.tokens)
        done = self._emit(st, emitted)
        rec.emitted = emitted[: len(st.result.tokens) - before]
        st.result.rounds.append(rec)
        if on_round is not None:
            on_round(rec)
        if done:  # budget/stop-trimmed tokens must not stay cached either
            last = len(req.prompt_ids) + len(st.result.tokens) - 1
            c = st.caches
            c.settle_target(ops, min(c.target_len, last), c.target_len)
            c.settle_draft(ops, last)
            return True
        st.tokens.extend(emitted)
        return False

    def _draft(self, st: Session, m: int, where: str):
        """Recursive drafting → (DraftInfo list, q ids [Db, W], q probs [Db, W], drafts [Db])."""
        req, ops, dev, rows = st.req, self.ops, self.w.device, self.rcfg.max_width
        policy, c = self.rcfg.policy, st.caches
        width = 1 if req.sampling.temperature == 0 else req.sampling.top_k
        q_ids = torch.full((rows - 1, width), -1, dtype=torch.int64, device=dev)
        q_probs = torch.zeros(rows - 1, width, dtype=torch.float32, device=dev)
        d_buf = torch.zeros(rows - 1, dtype=torch.int64, device=dev)
        drafts: list[DraftInfo] = []
        if not policy.more(drafts):
            return drafts, q_ids, q_probs, d_buf
        # catch-up rows draft_next … m read the target hidden states of positions one earlier
        if not st.hidden_at < c.draft_next <= m <= st.hidden_at + st.hidden.shape[0]:
            raise EngineError(f"{where}: draft rows from {c.draft_next} need target hidden states "
                              f"of positions {st.hidden_at} … {st.hidden_at + len(st.hidden) - 1}")
        for s in range(c.draft_next, m + 1, rows):  # depth 0: catch-up rows, then x_m
            e = min(s + rows, m + 1)
            h = st.hidden[s - 1 - st.hidden_at : e - 1 - st.hidden_at]  # hidden of p − 1
            toks = torch.tensor(st.tokens[s:e], device=dev)
            logits, hid = self.draft.forward(toks, h, s, c.draft)
            c.draft_next = e
            self._check(f"{where} draft depth 0", st, logits, e - s, False)
        last = e - s - 1
        while True:
            j, nxt = len(drafts), c.draft_next  # the position this depth's last row predicts
            out = ops.sample(logits[last : last + 1], req.sampling, req.seed,
                             torch.tensor([nxt], device=dev), Purpose.DRAFT_SAMPLE,
                             Live.of(1, dev))
            y = self._token(f"{where} draft depth {j}", out.tokens[0])
            q_ids[j], q_probs[j], d_buf[j] = out.ids[0], out.probs[0], y
            prob = float(out.probs[0][out.ids[0] == y].sum())  # q(y): y appears once
            drafts.append(DraftInfo(y, prob, _entropy(out.ids[0], out.probs[0])))
            if not policy.more(drafts) or len(drafts) >= policy.max_depth:
                return drafts, q_ids, q_probs, d_buf
            logits, hid = self.draft.forward(torch.tensor([y], device=dev),
                                             hid[last : last + 1], nxt, c.draft)
            c.draft_next, last = nxt + 1, 0
            self._check(f"{where} draft depth {j + 1}", st, logits, 1, False)

    @staticmethod
    def _emit(st: Session, emitted: list[int]) -> bool:
        return emit(st.result, st.req, emitted)
