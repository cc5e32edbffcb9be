"""The decode engine: speculative rounds with the round semantics of reference/speculative.py
(read its docstring: positions, catch-up rows, settlement), on the runtime model, sampler and
verifier.

A request: validate (host, before any device work) → prefill on the host (the target over the
prompt, the draft over positions 1 … n−1, the first token) → rounds on device-resident state
(iquestrt/state.py, iquestrt/round.py), launched eagerly, as CUDA-graph replays by a host loop,
or by a WHILE graph on the device (iquestrt/graphs.py). The host reads the result log every
round when `on_round` watches, about every STREAM_TOKENS tokens when streaming, else every
RuntimeConfig.sync_rounds rounds (host loop) or once at the end (device loop); on the CPU every
round (reads are free), and so with the twins ops on a GPU (they read live rows on the host).
Every wait for the device is bounded (RuntimeConfig.wait_s).
Across requests the engine keeps its caches (capacity RuntimeConfig.max_positions), readiness
flags, device state and round program — and so the program's captured graphs — for every request
whose shape the state fits (DeviceState.fits: top_k / greedy, stop-id room, positions and
rounds); DeviceState.begin refills them in place. Another shape builds (and captures) anew.
One round (m = position of the newest token x_m, not yet in the target cache):
  1. draft depth 0 over the catch-up rows draft_next … m (token at p, target hidden of p−1);
     depths 1 … D−1 one row each. Each depth's last row is sampled (DRAFT_SAMPLE at the next
     position); its sparse served row is the q row of that draft.
  2. target forward over [x_m, y_1 … y_D] at positions m … m+D (writes their K/V);
  3. the sampler serves the D+1 target rows (sparse p rows); verify accepts a drafts and draws
     the replacement or the bonus;
  4. settle: the target keeps positions ≤ m+a, the draft ≤ m+a or, with draft_kv_settle
     "recompute", ≤ m (rollback relabels the rest); the hidden states of positions m … m+D are
     kept for the next depth 0.
Faults end the request with EngineError naming the round and layer (a round records them in the
log; the host raises when it reads it): a tail's readiness flag, non-finite logits, a token
outside the vocabulary. Bad requests raise ValueError before any device work.

Dimension letters: R rows (= max_width), Db = R − 1 draft slots, H hidden, V vocabulary,
W served width (top_k, 1 when greedy).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import torch
import triton

from iquestrt.cache import RuntimeCaches
from iquestrt.cond_nodes import DeviceTimeout, wait_bounded
from iquestrt.config import RuntimeConfig
from iquestrt.engine_parts import EngineParts, sample_first
from iquestrt.errors import RuntimeFault
from iquestrt.prefetch import PrefetchConfig, Prefetcher, has_predictors
from iquestrt.session import Session
from iquestrt.state import (
    FAULT_DRAFT_LOGITS,
    FAULT_READINESS,
    FAULT_TARGET_LOGITS,
    FAULT_TOKEN,
    DeviceState,
    LogRead,
    read_log,
)
from iquestrt.weights import Weights, load_weights
from kernels.sampler import MAX_TOP_K
from kernels.sampler.values import DeviceSampling
from reference.depth import DraftInfo
from reference.speculative import GenerationRequest, GenerationResult, RoundRecord, emit

STREAM_TOKENS = 32  # a streaming request's host reads the log about every this many tokens


class EngineError(RuntimeFault):
    """A fault during a request (readiness, non-finite logits, bad token); names where."""


def _entropy(ids: torch.Tensor, probs: torch.Tensor) -> float:
    """Of one sparse served row, summed in id order in float64 (reference/speculative.py)."""
    order = torch.argsort(ids.cpu())
    q = probs.cpu()[order]
    q = q[q > 0].double()
    return float(-(q * q.log()).sum())


class Engine:
    """The round loop over the parts it is given (iquestrt/engine_parts.py): by default the
    single-GPU engine's, built from the weights and RuntimeConfig."""

    def __init__(self, weights: Weights, rcfg: RuntimeConfig, prefetcher=None,
                 parts: EngineParts | None = None):
        cfg = weights.cfg
        rcfg.validate_for(cfg)
        if weights.device != rcfg.torch_device:
            raise ValueError(f"Engine: weights on {weights.device}, RuntimeConfig.device is "
                             f"{rcfg.device}")
        if weights.max_positions < rcfg.positions_cap(cfg):
            raise ValueError(f"Engine: RoPE tables cover {weights.max_positions} positions, "
                             f"RuntimeConfig.max_positions needs {rcfg.positions_cap(cfg)}")
        if parts is not None and prefetcher is not None:
            raise ValueError("Engine: pass the prefetcher inside parts (EngineParts.default) "
                             "when parts are given")
        parts = parts if parts is not None else EngineParts.default(weights, rcfg, prefetcher)
        if rcfg.tp_reduce != "gather" and not parts.tensor_parallel:
            raise ValueError(f"Engine: RuntimeConfig.tp_reduce {rcfg.tp_reduce!r} applies to "
                             "tensor parallelism (iquestrt.tp.engine.TPEngine); one rank has no "
                             "partials to reduce")
        self.w, self.rcfg, self.cfg, self.parts = weights, rcfg, cfg, parts
        self.ops, self.target, self.draft = parts.ops, parts.target, parts.draft
        self.programs = parts.programs
        self.session: Session | None = None
        # kept across requests so a captured round graph stays valid (it reads these tensors)
        self._caches: RuntimeCaches | None = None
        self._flags: torch.Tensor | None = None
        self._state: DeviceState | None = None

    @classmethod
    def from_checkpoint(cls, directory, rcfg: RuntimeConfig) -> Engine:
        """With rcfg.prefetch and a predictor file beside the weights, expert prefetch is on."""
        weights = load_weights(directory, rcfg.device, rcfg.max_positions)
        pre = None
        if rcfg.prefetch and has_predictors(directory):
            pre = Prefetcher.load(directory, weights, PrefetchConfig(), rcfg.max_width, rcfg.ops,
                                  pdl=rcfg.pdl)
        return cls(weights, rcfg, pre)

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

    def swap_ops(self, ops) -> object:
        """Run the models on `ops` from now on (a table that wraps the current one: the
        lockstep gate, planted defects, a recorder) → the table it replaces. Graphs captured
        before keep the kernels they captured."""
        old = self.ops
        self.ops = self.target.ops = self.draft.ops = ops
        return old

    # --- faults --------------------------------------------------------------------------------
    def check_logits(self, where: str, st: Session, logits: torch.Tensor, n: int, target: bool):
        """EngineError when a target layer raised its readiness flag or the first n rows of
        logits are not finite."""
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
        self, req: GenerationRequest, on_round: Callable[[RoundRecord], None] | None = None,
        on_tokens: Callable[[list[int]], bool | None] | None = None,
    ) -> GenerationResult:
        """Prefill on the host, then rounds on device state (iquestrt/round.py), launched
        eagerly or as graph replays (RuntimeConfig.graphs). The host reads the result log every
        round when on_round watches; when streaming (on_tokens), about every STREAM_TOKENS
        tokens, handing on_tokens the new tokens — it returns False to cancel the request
        (stop_reason "cancelled"); else every RuntimeConfig.sync_rounds rounds."""
        return self._observed("request", lambda: self._generate(req, on_round, on_tokens))

    def _observed(self, phase: str, run: Callable, *args):
        """run() wrapped by every observer's `phase` method, the first observer innermost."""
        for o in self.parts.observers:
            run = functools.partial(getattr(o, phase), self, *args, run)
        return run()

    def _generate(self, req: GenerationRequest, on_round, on_tokens) -> GenerationResult:
        self.validate(req)
        st = Session(req, *self._request_caches(), list(req.prompt_ids))
        self.session = st
        try:
            t0 = time.perf_counter()
            first, hidden = self._prefill(st)  # the first token is on the host: synced
            st.result.timing.prefill_s = time.perf_counter() - t0
            done = self._emit(st, [first])
            if on_tokens is not None and on_tokens([first]) is False and not done:
                st.result.stop_reason, done = "cancelled", True  # nothing decoded to settle
            if done:
                return st.result
            st.tokens.append(first)
            self._decode(st, hidden, on_round, on_tokens)
            return st.result
        except EngineError:
            self.ops.reset()
            raise

    def close(self) -> None:
        """Free the captured round graphs (a tensor-parallel group can only be destroyed once
        no graph holding its collectives is alive); a later request captures anew."""
        self.programs.close()

    def _request_caches(self) -> tuple[RuntimeCaches, torch.Tensor]:
        """The engine's caches (capacity RuntimeConfig.max_positions) and readiness flags,
        emptied for a new request: the same tensors every request, so round graphs captured on
        them serve later requests."""
        if self._caches is None:
            self._caches = self.parts.new_caches(self.rcfg.positions_cap(self.cfg))
            self._flags = torch.zeros(self.cfg.target.num_hidden_layers, dtype=torch.int32,
                                      device=self.w.device)
        else:
            self._caches.reset()
            self._flags.zero_()
        return self._caches, self._flags

    def _prefill(self, st: Session) -> tuple[int, torch.Tensor]:
        """Target over the prompt, the first token from its last row, then the draft's prefill
        (EngineParts.prefill says where each comes from) → (token, target hidden [n, H])."""
        last_logits, hidden = self.parts.prefill.target(self, st)
        tok = self._token("prefill", sample_first(self, st, last_logits).tokens[0])
        if self.rcfg.policy.max_depth > 0:
            self.parts.prefill.draft(self, st, hidden)
        return tok, hidden

    def _decode(self, st: Session, hidden: torch.Tensor, on_round, on_tokens=None) -> None:
        t, built = time.perf_counter(), self.programs.built
        launcher = self._observed("prepare", lambda: self._prepare(st, hidden), st)
        if self.w.device.type == "cuda":
            torch.cuda.synchronize(self.w.device)  # once a request: the set-up's end, timed
        st.result.timing.setup_s = time.perf_counter() - t
        st.result.timing.captured = self.rcfg.graphs and self.programs.built > built
        t = time.perf_counter()
        self._observed("loop", lambda: self._loop(st, launcher, on_round, on_tokens), st)
        st.result.timing.decode_s = time.perf_counter() - t  # the loop ends on a log read

    def _prepare(self, st: Session, hidden: torch.Tensor):
        """Device state from the prefill, and the round program (captured when graphs are on):
        outside the decode clock, like prefill."""
        req, vocab = st.req, self.cfg.target.vocab_size
        ds, reuse = self._state, True
        if ds is None or not ds.fits(req):
            ds, reuse = self._new_state(req), False
        ds.begin(req, vocab)
        ds.start(st.tokens, hidden[-1], st.caches.draft_next)
        st.device = self._state = ds
        return self.programs.get(self, ds, self.rcfg.policy, reuse=reuse)

    def _new_state(self, req: GenerationRequest) -> DeviceState:
        """Device state for req's shape (top_k / greedy, stop ids) with power-of-two room for
        its positions and rounds, so that later requests of the shape fit it too."""
        rows, dev, cap = self.rcfg.max_width, self.w.device, self.rcfg.positions_cap(self.cfg)
        need = len(req.prompt_ids) + 1 + req.max_new_tokens + rows
        return DeviceState.create(
            positions=min(triton.next_power_of_2(need), cap + 1), rows=rows,
            hidden=self.cfg.target.hidden_size,
            max_rounds=min(triton.next_power_of_2(req.max_new_tokens), cap),
            stops=max(8, len(req.stop_ids)),
            sampling=DeviceSampling.create(req.sampling, self.cfg.target.vocab_size, dev),
            device=dev)

    def _loop(self, st: Session, launcher, on_round, on_tokens=None) -> None:
        """The decode clock: launch rounds, read the log, stop at the request's end."""
        ds = st.device
        if on_round is not None or ds.tokens.device.type == "cpu" or self.rcfg.ops == "twins":
            every = 1  # twins read live rows on the host and replay no 0-row round after the end
        elif on_tokens is not None:
            every = max(1, STREAM_TOKENS // (self.rcfg.policy.max_depth + 1))
        elif self.rcfg.loop == "device":
            every = st.req.max_new_tokens  # a round emits >= 1 token: one launch runs it all
        else:
            every = self.rcfg.sync_rounds
        read, sent = 0, len(st.result.tokens)  # the prefill's token went out already
        while True:
            launcher.launch(read, every)
            if ds.tokens.device.type == "cuda":
                try:
                    wait_bounded(torch.cuda.current_stream(), self.rcfg.wait_s,
                                 f"rounds {read} … {read + every - 1}")
                except DeviceTimeout as e:
                    raise EngineError(str(e)) from e
            log = read_log(ds, read, st.flags)
            done = False
            for i in range(log.head.shape[0]):
                if self._take(st, log, i, on_round):
                    done = True
                    break
            if on_tokens is not None and len(st.result.tokens) > sent:
                new, sent = st.result.tokens[sent:], len(st.result.tokens)
                if on_tokens(new) is False and not done:
                    st.result.stop_reason, done = "cancelled", True
            if done:
                self._finish(st)
                return
            read += log.head.shape[0]
            if log.fault[0]:
                raise EngineError(self._fault_message(log))
            if log.done:
                raise EngineError("the device marked the request done but the host's budget and "
                                  "stop tokens did not end it (a bug: log and emit disagree)")

    def _take(self, st: Session, log: LogRead, i: int, on_round) -> bool:
        """Round i of a log read → RoundRecord (host copies of the caches' lengths updated);
        True when the request is finished."""
        m, a, bonus, d, n_em = (int(x) for x in log.head[i])
        if log.fault[0] and log.fault[1] == log.first + i:
            raise EngineError(self._fault_message(log))
        drafts = []
        for j in range(d):
            ids, probs, y = log.q_ids[i, j], log.q_probs[i, j], int(log.drafts[i, j])
            prob = float(probs[ids == y].sum())  # q(y): y appears once
            drafts.append(DraftInfo(y, prob, _entropy(ids, probs)))
        emitted = [int(t) for t in log.emitted[i, :n_em]]
        c = st.caches
        c.target_len = m + a + 1
        if d > 0:  # as RoundProgram._settle
            c.draft_next = min(self.cfg.draft.settled_draft_next(m, a + 1), m + d)
        st.rounds += 1
        rec = RoundRecord(m, drafts, a, emitted, bonus == 1)
        before = len(st.result.tokens)
        done = self._emit(st, emitted)
        rec.emitted = emitted[: len(st.result.tokens) - before]
        st.result.rounds.append(rec)
        if on_round is not None:
            on_round(rec)
        if not done:
            st.tokens.extend(emitted)
        return done

    def _finish(self, st: Session) -> None:
        """Budget/stop-trimmed tokens must not stay cached either (eager, after the loop)."""
        req, c, ops = st.req, st.caches, self.ops
        last = len(req.prompt_ids) + len(st.result.tokens) - 1
        c.settle_target(ops, min(c.target_len, last), c.target_len)
        c.settle_draft(ops, last)

    def _fault_message(self, log: LogRead) -> str:
        code, rnd, where, value = log.fault
        v = self.cfg.target.vocab_size
        if code == FAULT_READINESS:
            return (f"round {rnd}: readiness failure flag raised by target layer {where} (a "
                    "partial sum held NaN: an unwritten or non-finite input)")
        if code == FAULT_TARGET_LOGITS:
            return f"round {rnd}: non-finite logits from the final norm or lm_head (no layer " \
                   "raised its flag)"
        if code == FAULT_DRAFT_LOGITS:
            return f"round {rnd} draft depth {where}: non-finite logits from the draft layer"
        if code == FAULT_TOKEN:
            at = f" draft depth {where}" if where >= 0 else ""
            return f"round {rnd}{at}: token {value} outside [0, {v})"
        return f"round {rnd}: unknown fault code {code}"

    @staticmethod
    def _emit(st: Session, emitted: list[int]) -> bool:
        return emit(st.result, st.req, emitted)
