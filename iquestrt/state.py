"""Device-resident request state and the result log.

Everything a round reads or writes lives here as device tensors, so a round is a straight-line
program with no host reads (iquestrt/round.py) and can be captured in a CUDA graph. The host
writes the state once after prefill and afterwards only reads the log — after every round when
a caller watches rounds, else every `RuntimeConfig.sync_rounds` rounds — and raises the fault a
round recorded.

Positions (int32 [1] scalars):
  m           the newest token x_m; tokens[0 … m] are prompt + emitted, x_m is in no target cache
  draft_next  the next draft position to write; draft rows draft_next … m are the next depth 0's
              catch-up rows (1 or 2 of them after prefill)
  hidden_at   hidden[i] is the target's final hidden state of position hidden_at + i
A finished (or failed) request has done = 1: a round launched after that (the host reads the log
only every few rounds) runs every kernel with 0 live rows and commits nothing.

Log row r (rounds in order; row L is a dump row for rounds that commit nothing):
  head[r] = (m, accepted a, bonus, drafts run, emitted count)
  emitted[r, :a+1] = accepted drafts + replacement or bonus, −1 after
  drafts[r, :D] = the drafts y_1 … y_D
  q_ids/q_probs[r, j] = the draft's served row at depth j (its sample is q_ids' draw)
fault = (code, round, where, value): 0 none, 1 readiness flag (where = layer), 2 non-finite
target logits, 3 non-finite draft logits (where = depth), 4 token out of range (where = depth,
−1 for the target; value = the token).

Dimension letters: R rows, Db = R − 1 draft slots, W served width, L log rows, H hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.sampler.values import DeviceSampling
from reference.op_types import FaultLog, RoundState
from reference.speculative import GenerationRequest

FAULT_NONE, FAULT_READINESS, FAULT_TARGET_LOGITS, FAULT_DRAFT_LOGITS, FAULT_TOKEN = range(5)
HEAD = ("m", "accepted", "bonus", "drafts", "emitted")


@dataclass
class DeviceState:
    tokens: torch.Tensor  # [P + 1] int64: tokens by position; slot P is a dump slot
    stop: torch.Tensor  # [S] int64 stop ids (−2 pads: never a token)
    m: torch.Tensor  # [1] int32
    draft_next: torch.Tensor  # [1] int32
    hidden: torch.Tensor  # [R, H] bf16
    hidden_at: torch.Tensor  # [1] int32
    n_new: torch.Tensor  # [1] int32 tokens emitted so far (the prefill's first included)
    max_new: torch.Tensor  # [1] int32 the request's token budget
    seed: torch.Tensor  # [1] int64 the request seed's bits (kernels.sampler.checks.seed_args)
    sampling: DeviceSampling  # temperature / top-p on the device; top_k, greedy: the shape
    done: torch.Tensor  # [1] int32
    round: torch.Tensor  # [1] int32 rounds committed
    fault: torch.Tensor  # [4] int64
    head: torch.Tensor  # [L + 1, 5] int32
    emitted: torch.Tensor  # [L + 1, R] int64
    drafts: torch.Tensor  # [L + 1, Db] int64 the drafts y_1 … y_D
    q_ids: torch.Tensor  # [L + 1, Db, W] int64
    q_probs: torch.Tensor  # [L + 1, Db, W] fp32

    @classmethod
    def create(cls, *, positions: int, rows: int, hidden: int, max_rounds: int, stops: int,
               sampling: DeviceSampling, device) -> DeviceState:
        """Buffers for any request of one shape (sampling's top_k / greedy) within the
        capacities: positions (tokens), max_rounds (log rows), stops (stop ids); `begin` fills
        one in."""
        i32 = dict(dtype=torch.int32, device=device)
        stop = torch.full((max(1, stops),), -2, dtype=torch.int64, device=device)
        width = 1 if sampling.greedy else sampling.top_k
        L = max_rounds
        return cls(
            tokens=torch.zeros(positions + 1, dtype=torch.int64, device=device),
            stop=stop, m=torch.zeros(1, **i32), draft_next=torch.zeros(1, **i32),
            hidden=torch.zeros(rows, hidden, dtype=torch.bfloat16, device=device),
            hidden_at=torch.zeros(1, **i32), n_new=torch.zeros(1, **i32),
            max_new=torch.zeros(1, **i32), seed=torch.zeros(1, dtype=torch.int64, device=device),
            sampling=sampling,
            done=torch.zeros(1, **i32), round=torch.zeros(1, **i32),
            fault=torch.zeros(4, dtype=torch.int64, device=device),
            head=torch.zeros(L + 1, len(HEAD), **i32),
            emitted=torch.full((L + 1, rows), -1, dtype=torch.int64, device=device),
            drafts=torch.zeros(L + 1, rows - 1, dtype=torch.int64, device=device),
            q_ids=torch.full((L + 1, rows - 1, width), -1, dtype=torch.int64, device=device),
            q_probs=torch.zeros(L + 1, rows - 1, width, dtype=torch.float32, device=device),
        )

    @property
    def rows(self) -> int:
        return self.emitted.shape[1]

    @property
    def dump_row(self) -> int:
        return self.head.shape[0] - 1

    @property
    def dump_slot(self) -> int:
        return self.tokens.shape[0] - 1

    def fits(self, req: GenerationRequest) -> bool:
        """Whether this state (and a round graph captured on it) can serve req."""
        return (self.sampling.matches(req.sampling) and len(req.stop_ids) <= self.stop.shape[0]
                and len(req.prompt_ids) + 1 + req.max_new_tokens + self.rows <= self.dump_slot
                and req.max_new_tokens <= self.dump_row)

    def begin(self, req: GenerationRequest, vocab: int) -> None:
        """A new request on these buffers: its budget, stop ids, seed and sampling values, and
        every counter, flag and log row as `create` left them (in place: a captured round graph
        reads the same tensors)."""
        if not self.fits(req):
            raise ValueError("DeviceState.begin: the request does not fit this state's shape")
        self.sampling.update(req.sampling, vocab)
        self.stop.fill_(-2)
        if req.stop_ids:
            self.stop[: len(req.stop_ids)] = torch.tensor(req.stop_ids, dtype=torch.int64)
        self.max_new.fill_(req.max_new_tokens)
        self.seed.fill_(req.seed - 2**64 if req.seed >= 2**63 else req.seed)
        for t in (self.done, self.round, self.fault, self.head, self.drafts, self.q_probs):
            t.zero_()
        for t in (self.emitted, self.q_ids):
            t.fill_(-1)

    def start(self, tokens: list[int], hidden_last: torch.Tensor, draft_next: int) -> None:
        """After prefill: tokens = prompt + the first sampled token (position m = len − 1);
        hidden_last [H] = the target's final hidden state of position m − 1."""
        n = len(tokens)
        self.tokens[:n] = torch.tensor(tokens, dtype=torch.int64)
        self.m.fill_(n - 1)
        self.draft_next.fill_(draft_next)
        self.hidden[0] = hidden_last
        self.hidden_at.fill_(n - 2)
        self.n_new.fill_(1)

    @property
    def round_state(self) -> RoundState:
        """What a round's settlement writes (ops.settle_round)."""
        return RoundState(self.tokens, self.stop, self.m, self.draft_next, self.hidden,
                          self.hidden_at, self.n_new, self.max_new, self.done, self.round,
                          self.fault, self.head, self.emitted, self.drafts, self.q_ids,
                          self.q_probs)

    @property
    def log(self) -> FaultLog:
        """The fault record of this round (ops.check_logits / ops.record_draft write it)."""
        return FaultLog(self.fault, self.round)


@dataclass(frozen=True)
class LogRead:
    """The host's copy of log rows first … last−1 and the request's flags."""

    first: int
    head: torch.Tensor  # [n, 5] int32
    emitted: torch.Tensor  # [n, R]
    drafts: torch.Tensor  # [n, Db]
    q_ids: torch.Tensor  # [n, Db, W]
    q_probs: torch.Tensor  # [n, Db, W]
    fault: tuple[int, int, int, int]
    done: bool
    flags: torch.Tensor  # [layers] int32


def read_log(st: DeviceState, first: int, flags: torch.Tensor) -> LogRead:
    """Copy the rounds committed since `first` (one synchronizing read of the round count, then
    the rows): the only device→host traffic of a request between prefill and the end."""
    last = int(st.round[0])
    sl = slice(first, last)
    return LogRead(first, st.head[sl].cpu(), st.emitted[sl].cpu(), st.drafts[sl].cpu(),
                   st.q_ids[sl].cpu(),
                   st.q_probs[sl].cpu(), tuple(int(x) for x in st.fault.cpu()),
                   bool(st.done[0]), flags.cpu())
