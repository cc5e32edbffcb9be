"""The one tolerance table: per op and dtype, each row with its source and the deliberately
broken variant that exceeds it. Exact rows (atol = rtol = 0) compare with torch.equal.

Error metrics (computed in float64 by `check`):
  max_rel = max|a − b| / max(max|b|, tiny)   — worst element relative to the tensor's scale
  rms_rel = rms(a − b) / rms(b)
A tolerance passes when max_rel ≤ max_rel_tol and rms_rel ≤ rms_rel_tol.

Flip rows (flip_rows > 0): outputs on a rounding grid (bf16) whose only legal difference is a
rounding that flips to the neighbouring grid value where the kernel's FP32 rounding points (an
FP32 inverse norm, FP32 products) and the twin's (FP64, then FP32, then bf16) fall on the two
sides of a bf16 midpoint. Whether an element flips depends only on its row's inverse norm and
its input's mantissa, so flips are rare per row but come in clusters inside one: every element
of the row with that mantissa flips (27 elements of one row, one mantissa at four exponents, on
the H200). The rms of such a cluster says little (2.1e-4 there); a flip row passes when
max_rel ≤ its bound (a flip moves an element by one ulp of an input, ≤ 2^-7 of the tensor's
scale; cancellation can make that many of the output's own ulps), at most flip_rows · R +
flip_slack of the R rows (leading dimensions) differ anywhere, and no row differs in more than
flip_row_share of its elements.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tolerance:
    op: str
    dtype: str
    max_rel: float  # 0 with rms_rel 0 means bit-exact
    rms_rel: float
    source: str  # why this number
    broken_variant: str  # the mutant that must exceed it (name in negative_controls/ or tests)
    flip_rows: float = 0.0  # > 0: a flip row (module docstring): rows with flips allowed per row
    flip_slack: int = 0  # … plus this many
    flip_row_share: float = 0.0  # the largest share of a row's elements that may differ

    @property
    def exact(self) -> bool:
        return self.max_rel == 0.0 and self.rms_rel == 0.0 and self.flip_rows == 0.0

    @property
    def flips(self) -> bool:
        return self.flip_rows > 0.0

    def allowed_rows(self, rows: int) -> float:
        return self.flip_rows * rows + self.flip_slack


@dataclass(frozen=True)
class Margin:
    max_rel: float
    rms_rel: float
    worst_index: tuple[int, ...]
    tol: Tolerance
    rows_flipped: int = 0  # flip rows: rows with a differing element …
    rows: int = 0  # … of this many
    row_share: float = 0.0  # flip rows: the largest share of one row's elements that differ
    differ: int = 0  # flip rows: differing elements (reported)
    steps: float = 0.0  # flip rows: the largest distance in grid steps (reported)

    def _flip_used(self) -> float:
        t = self.tol
        return max(self.max_rel / t.max_rel, self.rows_flipped / t.allowed_rows(self.rows),
                   self.row_share / t.flip_row_share)

    @property
    def ok(self) -> bool:
        if self.tol.exact:
            return self.max_rel == 0.0
        if self.tol.flips:
            return self._flip_used() <= 1.0
        return self.max_rel <= self.tol.max_rel and self.rms_rel <= self.tol.rms_rel

    @property
    def band_used(self) -> float:
        """The larger of the two errors as a share of its allowed band."""
        if self.tol.flips:
            return self._flip_used()
        return max(self.max_rel / self.tol.max_rel, self.rms_rel / self.tol.rms_rel)

    def __str__(self) -> str:
        used = (
            "exact"
            if self.tol.exact
            else f"{self.band_used:.1%} of band"
        )
        flips = (f" flips={self.differ} in {self.rows_flipped}/{self.rows} rows (allowed "
                 f"{self.tol.allowed_rows(self.rows):.2f}), ≤ {self.row_share:.2%} of a row, "
                 f"max {self.steps:g} grid steps" if self.tol.flips else "")
        return (
            f"{self.tol.op}[{self.tol.dtype}]: max_rel={self.max_rel:.3e} "
            f"rms_rel={self.rms_rel:.3e}{flips} worst at {self.worst_index} ({used})"
        )


FLIP_ROWS, FLIP_SLACK, FLIP_ROW_SHARE = 1e-2, 2, 1 / 8  # the norms' flip rows (sources below)
FLIP_SOURCE = (
    "; a flip row (module docstring): max_rel as above, at most 1e-2 of the rows + 2 with a "
    "flip, none in more than 1/8 of its elements. Measured on the H200 "
    "(benchmarks/exp_norm_flips.py, gate 1b's rank model, 112 attention tails, 1.67M elements): "
    "the kernel equals an FP32 torch emulation of its formula bit for bit, and the twin differs "
    "from both in one row of one call, at 27 elements (0.9 % of the row), one bf16 step each, "
    "all of one input mantissa (1.90625 at four exponents): 1.90625 · 0.70286883 (FP64 inverse "
    "norm) = 1.33984371 rounds to the FP32 1.33984375, a bf16 tie, and up; the kernel's FP32 "
    "inverse norm, 1.5e-8 lower, rounds down. A row's 128 mantissas each sit that close to a "
    "midpoint with probability ~2^-15, so ≈ 0.4 % of rows flip somewhere (measured: 1 of ~700); "
    "three rows of one 8-row call ~1e-7. A moved rounding point flips most rows at ~1/4 of "
    "their elements"

)

_ROWS: tuple[Tolerance, ...] = (
    # --- reference model self-consistency -------------------------------------------------
    Tolerance(
        "reference.verify_vs_decode",
        "fp32",
        1e-5,
        5e-6,
        "FP32 GEMMs of different row counts differ only in accumulation order: ~K·eps_fp32 "
        "relative at K ≤ 384 for the tiny preset; measured on tiny (synthetic q/k-norm gain "
        "1.5), 6 seeds x 24 (prefix, R) pairs: worst 2.5e-6 max / 1.6e-6 rms",
        "a verify row that sees one key too many (window + 1)",
    ),
    Tolerance(
        "reference.verify_vs_decode",
        "bf16",
        8e-2,
        4e-2,
        "BF16 mode rounds ~10 values per layer to BF16 (u = 2^-8); FP32 GEMMs of different row "
        "counts flip single roundings, which the residual stream and near-tie routing carry "
        "forward. Measured on tiny, 6 seeds x 24 (prefix, R) pairs: worst 5.0e-2 max / "
        "2.4e-2 rms; band ≈ 1.6x the worst",
        "a verify row that sees one key too many (window + 1): ≥ 0.13 max / ≥ 0.15 rms on tiny",
    ),
    Tolerance(
        "reference.cache_vs_recompute",
        "fp32",
        1e-5,
        5e-6,
        "same mechanism and band as reference.verify_vs_decode[fp32]: prefill+decode vs one "
        "no-cache pass differ only in GEMM row counts; measured worst 2.2e-6 max / 1.3e-6 rms",
        "decode rows that see one key too many (window + 1)",
    ),
    Tolerance(
        "reference.cache_vs_recompute",
        "bf16",
        8e-2,
        4e-2,
        "same mechanism and band as reference.verify_vs_decode[bf16]",
        "decode rows that see one key too many (window + 1)",
    ),
    # --- reference ops vs float64/mpmath oracles (tests/helpers/oracles.py) -------------------
    # fp32 rows: a few FP32 roundings per output (u32 = 2^-24), measured ≤ 5e-7 everywhere;
    # bf16 rows: inputs already on the BF16 grid, so the final rounding (u = 2^-8) dominates.
    Tolerance(
        "ref.rms_norm",
        "fp32",
        1e-6,
        5e-7,
        "FP32 mean of D ≤ 3072 squares, rsqrt, two products: ≲ 16·u32; measured 1.2e-7",
        "eps outside the sqrt (x/(rms+eps)) at rms(x) ≈ sqrt(eps); weight used as 1 + w",
    ),
    Tolerance(
        "ref.rms_norm",
        "bf16",
        4e-3,
        4e-3,
        "one final BF16 rounding: each element within u = 2^-8 of itself; measured 2.3e-3",
        "weight used as 1 + w",
    ),
    Tolerance(
        "ref.rope",
        "fp32",
        1e-6,
        5e-7,
        "angles in FP64, cos/sin rounded to FP32, two products and a sum: ≲ 8·u32 vs mpmath at "
        "positions up to 524287; measured 5e-8",
        "angles computed in FP32 (≈3e-2 at position 524287); GPT-J interleaved pairs; "
        "inv_freq over head_dim",
    ),
    Tolerance(
        "ref.rope",
        "bf16",
        4e-3,
        4e-3,
        "one final BF16 rounding (u = 2^-8); measured 2.2e-3",
        "GPT-J interleaved pairs",
    ),
    Tolerance(
        "ref.rope_passthrough",
        "any",
        0.0,
        0.0,
        "dims ≥ rotary_dim are copied, never rotated",
        "rotating all head dims",
    ),
    Tolerance(
        "ref.attention",
        "fp32",
        2e-6,
        1e-6,
        "FP32 dot products over D, exp/logsumexp over ≤ 64 keys, sigmoid sink factor: ≲ 32·u32; "
        "measured 2e-7",
        "sink dropped; sink key of group g+1; GQA heads tiled (h % Hkv); window ±1 with "
        "sentinel keys",
    ),
    Tolerance(
        "ref.attention",
        "bf16",
        4e-3,
        4e-3,
        "BF16 q/k/v, FP32 math, one final BF16 rounding (u = 2^-8); measured 1.8e-3",
        "sink dropped",
    ),
    Tolerance(
        "ref.route",
        "fp32",
        2e-6,
        1e-6,
        "FP32 router GEMM over H ≤ 128, softmax, renormalization: ≲ 32·u32; measured 4.7e-7",
        "weights not renormalized after top-k",
    ),
    Tolerance(
        "ref.route_ids",
        "int64",
        0.0,
        0.0,
        "expert indices are exact: order (probability desc, index asc)",
        "ties broken by higher index",
    ),
    Tolerance(
        "ref.swiglu",
        "fp32",
        4e-6,
        2e-6,
        "three FP32 GEMMs (K ≤ 256) rounded to FP32 after each projection; measured 5e-7",
        "gate and up halves swapped",
    ),
    Tolerance(
        "ref.swiglu",
        "bf16",
        1.6e-2,
        8e-3,
        "BF16 roundings of gate, up, activation and output (4u max, 2u rms with u = 2^-8); "
        "measured 5.5e-3 / 3.7e-3",
        "gate and up halves swapped",
    ),
    Tolerance(
        "ref.moe",
        "fp32",
        4e-6,
        2e-6,
        "as ref.swiglu[fp32] plus an FP32 weighted sum over K slots; measured 3.5e-7",
        "one expert's contribution dropped; expert rows misassigned",
    ),
    Tolerance(
        "ref.moe",
        "bf16",
        1.6e-2,
        8e-3,
        "as ref.swiglu[bf16]; FP32 weights and slot sum, one final rounding; measured 4.4e-3",
        "one expert's contribution dropped",
    ),
    Tolerance(
        "ref.dequant_block",
        "fp32",
        0.0,
        0.0,
        "E4M3 (4 significant bits) × FP32 scale is exact in FP64; one RNE rounding to FP32 "
        "equals the FP64 product rounded",
        "scale grid shifted by one block",
    ),
    Tolerance(
        "ref.dequant_act",
        "fp32",
        0.0,
        0.0,
        "as ref.dequant_block, per row and 128 columns",
        "scale groups shifted by one",
    ),
    Tolerance(
        "ref.quantize_block",
        "e4m3",
        0.0,
        0.0,
        "data on the E4M3 grid times a power of two per block round-trips losslessly; "
        "scales equal FP32(amax/448); codes are RNE of w/scale",
        "power-of-two scale rounding forced on off-grid data (block max no longer 448)",
    ),
    Tolerance(
        "ref.quantize_act",
        "e4m3",
        0.0,
        0.0,
        "as ref.quantize_block, per row and 128 columns",
        "amax taken over the whole row",
    ),
    # --- reference sampling / rejection (reference/sampling.py, reference/rejection.py) ------
    # e = 2^-24 (fp32 unit roundoff); n = kept tokens <= V <= 16 in the tests that use these.
    Tolerance(
        "reference.served_distribution",
        "fp32",
        4e-6,
        4e-6,
        "vs a float64 oracle of the same semantics: z = x/T (1 rounding, amplified by |z| <= 16 "
        "in exp: 16e), exp (<= 2e), two sequential sums of n terms (2ne) and two divisions (2e): "
        "(2*16 + 2*16 + 6)e ~= 4.2e-6 relative per element, cases chosen away from ties",
        "top-k/top-p order swapped, or no renormalization after top-k (O(0.1) in the tests)",
    ),
    Tolerance(
        "reference.residual_distribution",
        "fp32",
        1.5e-6,
        1.5e-6,
        "vs the exact rational norm(max(p - q, 0)) of the same fp32 p, q: one subtraction (e), "
        "a sequential sum of <= 16 terms (15e), one division (e): 17e ~= 1.0e-6 relative",
        "residual not renormalized (tests/reference/test_rejection.py mutant)",
    ),
    Tolerance(
        "reference.emitted_token_law",
        "fp32",
        3e-4,
        3e-4,
        "the implementation's exact law on the 2^-24 uniform grid vs the ideal target law "
        "p/sum(p): grid and fl(u*Z) boundary shifts, sequential-sum roundings and sum(p) != 1 "
        "give <= (n^2 + 16n + 32)e absolute per token, ~2.2e-5 at n = 12, relative to "
        "max p >= 1/n: 2.6e-4. Typical measured error is ~1e-7",
        "exact-match acceptance, replacement from p (tests/reference/test_rejection.py), >= 1e-2",
    ),
    # --- runtime vs reference (gate 1) ---------------------------------------------------------
    Tolerance(
        "runtime.vs_matched", "twins", 0.0, 0.0,
        "the runtime's twins ops compose the same reference twins, row by row, in the order of "
        "reference Precision 'matched': the logits are the same bits",
        "the runtime without FP8 activation quantization (bf16-fold): tests/engine/test_engine.py",
    ),
    Tolerance(
        "runtime.rounding_noise", "fp32", 2.0**-21, 2.0**-21 / 3**0.5,
        "gate 1's matched band (qualification/matched_band.py): the relative noise u·eps, u ~ "
        "U(−1, 1), put on every FP64 → FP32 rounding of the matched reference to emulate another "
        "legal summation order; eps = 2^-21 (4 FP32 ulps): the FP32 GEMM stages of the kernels "
        "differ from their twins by 1.3–1.5e-7 relative L2 on the H200 (the MoE's gate/up at TP8 "
        "shapes, benchmarks/exp_moe_rounding.py), and the draws' per-position median (2.8e-7 on "
        "mini) stays above the compiled kernels' (5.1e-8): the band is not narrower than the "
        "kernels' own variation (reports/qualify/h200-2026-12-02)",
        "a missing sink, an activation-quantizer scale off by ≥ 0.25 % in one layer (H200): "
        "qualification/gate1_power.py",
    ),
    # --- kernels ----------------------------------------------------------------------------
    # kernels/fp8 rows
    Tolerance(
        "kernels.fp8.quantize_act",
        "e4m3",
        0.0,
        0.0,
        "same IEEE operations as reference.ops.quantize_act (amax, div_rn by 448, div_rn of x, "
        "clamp ±448, E4M3 round-to-nearest-even snapped by hand), so codes and scales are "
        "bit-identical",
        "multiply by the reciprocal 448/amax; round-half-away E4M3 cast (the Triton interpreter's "
        "own fp32→E4M3 cast) — tests/kernels/test_fp8.py",
    ),
    Tolerance(
        "kernels.fp8.dequant_block",
        "fp32",
        0.0,
        0.0,
        "one fp32 multiply per element, as reference.ops.dequant_block",
        "partial edge block reading its neighbour's scale — tests/kernels/test_fp8.py",
    ),
    # kernels/moe rows
    Tolerance(
        "kernels.moe.gate_up",
        "fp32",
        1e-5,
        1e-6,
        "stage 1 (SiLU(gate)·up per slot) vs moe_gate_up_fp8_ref: FP32 accumulation order over "
        "H ≤ 3072 (24 scale blocks, summed in K-split partials of 6 blocks added in order) plus "
        "ulp-level exp in SiLU, ~1e-7 measured; 1e-5 stays 100× "
        "below a BF16 round trip of the intermediate (2^-9)",
        "intermediate stored as BF16; gate/up halves swapped; one expert's scale block shifted by "
        "one — tests/kernels/test_moe.py::test_broken_variants_exceed_their_rows",
    ),
    Tolerance(
        "kernels.moe.down",
        "fp32",
        1e-5,
        1e-6,
        "stage 2 (requant, down GEMM, k-ordered weighted sum) vs moe_down_fp8_ref on the same "
        "FP32 intermediate: the requant is bit-exact, so only FP32 accumulation order over I ≤ 192 "
        "and K ≤ 8 (plus FMA contraction on the GPU) remains",
        "power-of-two requant scales; BF16 intermediate; dropped top-k slot; proj scale block "
        "shifted — test_moe.py::test_broken_variants_exceed_their_rows",
    ),
    Tolerance(
        "kernels.moe",
        "bf16",
        2.0**-7,
        2e-4,
        "bf16 output vs the twin's stage 2 on the kernel's intermediate, both rounded to bf16 once "
        "(RNE): FP32 differences ≪ half an ulp, so an element differs by at most one ulp where "
        "they straddle a rounding boundary (also asserted per element); one ulp ≤ 2^-7 of max|b|",
        "fp32→bf16 by truncation (the Triton interpreter's own cast) — test_moe.py",
    ),
    Tolerance(
        "kernels.moe.e2e",
        "bf16",
        1e-2,
        1e-3,
        "whole op vs the whole twin: the two intermediates differ by ulps (exp inside SiLU), so "
        "a requant E4M3 code can flip where an intermediate sits on a rounding tie; one flip moves "
        "a row by ≲ 1/(16·√I) of its scale; plus bf16 one-ulp flips",
        "dropped last top-k slot (off-by-one k loop) — "
        "test_moe.py::test_broken_variants_exceed_their_rows",
    ),
    Tolerance(
        "kernels.moe.vs_unquantized",
        "qual5",
        1e-3,
        1e-3,
        "the qualification bar for FP8 GEMMs: 1 − 2⟨x,y⟩/(|x|²+|y|²) in fp64 must stay below "
        "max_rel (= rms_rel) for every output row, kernel bf16 output vs ops.moe in FP32 on "
        "dequantized weights; "
        "evaluated by test_moe.py::qual5_metric, not by check()",
        "dropped top-k slot — test_moe.py::test_broken_variants_exceed_their_rows",
    ),
    # kernels/attention rows
    Tolerance(
        "kernels.kv_write",
        "bf16/int32",
        0.0,
        0.0,
        "a KV write and rollback move bits (K, V, int32 slot labels); the twin is "
        "reference.twins.kv_cache.write_ref / rollback_ref",
        "ring eviction skipped (slot = p instead of p mod C); rollback skipped after wrap",
    ),
    Tolerance(
        "kernels.attention",
        "bf16-in/fp32-out",
        1e-4,
        2e-5,
        "same bf16 q/k/v as the FP32 twin; bf16·bf16 products are exact in FP32, so only FP32 "
        "accumulation order of q·k (≲ D·2^-24·Σ|q_i k_i| ≈ 5e-5 on logits ≤ 30 at D ≤ 128), "
        "exp2/log2 approximations (≤ 2^-22 rel.), the two-term bf16 split of p (≤ 2^-16 rel.) "
        "and the split merge differ",
        "window ±1 at a sentinel boundary (≥ 0.05); sink dropped; sink of group g+1; combine "
        "without the LSE rescale; ring of exactly W slots with 8 rows written before reading",
    ),
    Tolerance(
        "kernels.attention",
        "bf16",
        2.0**-7 + 1e-4,
        4.0e-3,
        "the fp32-out row plus a rounding to bf16 on each side: where the two FP32 values "
        "straddle a rounding boundary the outputs are one bf16 ulp apart, up to 2^-7 of the "
        "element and so of max|b| (qualification/lockstep_rank.py under the interpreter: one of "
        "576 elements, 1.2578 vs 1.2656 at max|b| 1.78, max_rel 4.39e-3); the rms of a few such "
        "flips stays far below 2^-8",
        "same broken variants as the fp32-out row (each moves outputs by ≥ 0.05 relative)",
    ),
    Tolerance(
        "kernels.attention.bit_exact",
        "any",
        0.0,
        0.0,
        "padded width (garbage padding rows) vs exact width; a rolled-back ring vs one that "
        "never saw the rejected rows: each pair runs the same arithmetic in the same "
        "order",
        "ring of exactly W slots (rejected rows evict history the next round needs); padding "
        "rows treated as live (written into the NaN-poisoned output)",
    ),
    # kernels/sampler rows
    # e = 2^-24. exp is the one step not pinned to the bit (reference/sampling.py docstring).
    Tolerance(
        "kernels.sampler.vs_replay", "fp32", 0.0, 0.0,
        "kernels/sampler/ vs a numpy-fp32 replay of reference/sampling.py that takes exp from "
        "kernels.sampler.kernel_exp: every other step is the same IEEE operation in the same "
        "order (div_rn, sequential sums, fp32 u*Z), so ids, order, probabilities and tokens are "
        "bit-exact (tests/kernels/test_sampler.py)",
        "any of the mutants below; ties broken by the higher index",
    ),
    Tolerance(
        "kernels.sampler.probs", "fp32", 2.0**-21, 2.0**-21,
        "kernel vs its twin reference.twins.sampler.sample_ref (exp32: FP64 exp rounded to "
        "FP32): kernel_exp (NumPy float32 exp under the interpreter, libdevice __nv_expf on "
        "sm_90) and exp32 "
        "differ by <= 3 ulp (all fp32 z - m in [-104, 0] enumerated: 11% differ, max 3 ulp); "
        "carried through S, e/S and the top-p renormalization: measured worst 3.9e max_rel, "
        "3.4e rms_rel (1600 rows, K <= 64, T 0.5-2, logit spreads up to x6.5), per element <= 5 "
        "ulp; band 8e = 2^-21",
        "probabilities not renormalized after top-p (>= 4e-2); probabilities carried in bf16 "
        "(~2^-9) — test_sampler.py::test_broken_variants_fail_their_rows",
    ),
    Tolerance(
        "kernels.sampler.ids", "int64", 0.0, 0.0,
        "candidate ids, their order and the kept support equal the twin's in every row whose "
        "nearest decision (order gap between distinct logits, top-p crossing) is farther than "
        "kernels.sampler.probs + K·e; nearer rows are counted and reported by the test",
        "top-p dropping the crossing token; top-k/top-p order swapped (test_sampler.py)",
    ),
    Tolerance(
        "kernels.sampler.token", "int64", 0.0, 0.0,
        "the drawn token equals the twin's unless fl(u·Z) lies within kernels.sampler.probs + K·e "
        "of a CDF boundary (counted); u = reference.rng.uniforms(seed, position, purpose, index) "
        "exactly (tl.philox, top 24 bits)",
        "RNG keyed without the position; purpose ignored (test_sampler.py)",
    ),
    Tolerance(
        "kernels.sampler.device_values", "exact", 0.0, 0.0,
        "kernels.sampler.values.DeviceSampling: the kernels load the same fp32 temperature and "
        "top-p (and the host-decided top-p switch) that the scalar path passes as arguments, so "
        "tokens, ids and probabilities are the same bits",
        "values not read after update (test_sampler_values.py: probabilities must change)",
    ),
    Tolerance(
        "kernels.verify", "int64", 0.0, 0.0,
        "(n_accepted, next_token, bonus, emitted) equal reference.rejection.verify on the same "
        "sparse p/q bit for bit: only fp32 u·q < p, p − q, div_rn and sequential sums in the "
        "reference's orders, no exp",
        "exact-match acceptance; replacement drawn from p; bonus after a rejection; p/q "
        "inverted; RNG keyed without the position (tests/kernels/test_verify.py)",
    ),
    Tolerance(
        "kernels.round_record", "int64/fp32", 0.0, 0.0,
        "the round's fault log and draft record (kernels/round_record.py) are selects, "
        "compares and one integer add of the twin's (reference.twins.round_record): moved "
        "bits, no arithmetic on the probabilities",
        "a fault over an earlier one; dead rows checked; the draft not clamped; the fault's "
        "round not recorded (tests/kernels/test_round_record.py)",
    ),
    Tolerance(
        "kernels.round_scalars", "int32/int64/fp32", 0.0, 0.0,
        "the round's scalars (kernels/round_scalars.py: where the depths begin, the "
        "verification rows, the rollback bounds) are the integer adds, products and selects of "
        "the twin's (reference.twins.round_scalars) and constant stores: no rounding",
        "positions off by one; the last draft position not the cache's next one; the draft "
        "rollback bound of the other settlement (tests/kernels/test_round_scalars.py)",
    ),
    # rows of the lockstep gate (qualification/lockstep.py) for values that are moved or
    # rounded in one defined way, so exact
    Tolerance(
        "kernels.quantize_act", "e4m3", 0.0, 0.0,
        "a producer's quantization of its output (the tails, the attention combine) is "
        "reference.ops.quantize_act of the values it wrote: amax, amax / 448 and RNE to E4M3 "
        "are single IEEE operations, so the E4M3 codes are bit-exact",
        "amax divided by 240 instead of 448; a 128-column group offset dropped",
    ),
    Tolerance(
        "kernels.quantize_act", "fp32", 0.0, 0.0,
        "the scales of that quantization (amax / 448 per row and 128-column group, 1 for an "
        "all-zero group) are bit-exact for the same reason",
        "scales doubled (tests/engine/test_engine_kernels.py::test_kernels_checks_are_sensitive)",
    ),
    Tolerance(
        "kernels.draft_entry.positions", "int32", 0.0, 0.0,
        "the draft entry's RoPE positions (base + r for live rows, -1 for padding) are integer "
        "arithmetic",
        "positions from the unsettled m + d + 1 after a rejection",
    ),
    Tolerance(
        "kernels.eh_proj.fused", "bf16", 0.0, 0.0,
        "kernels/eh_proj.py fuses the draft entry into the eh_proj GEMM's operand load: the "
        "same values enter the same GEMM tiles in the same order as entry + linear, so the "
        "output is bit-exact with the two kernels (compiled on the H200 and interpreted)",
        "the hidden half's norm weight taken from the embedding half",
    ),
    # kernels/residual_norm rows
    Tolerance(
        "kernels.residual_norm.exact", "bf16", 0.0, 0.0,
        "bits that no reduction order touches (kernels/tails.py vs reference/twins/tails.py): the "
        "partial sum in pinned rank order, x = bf16(h + bf16(Σ)·scale) (IEEE, no FMA), h when the "
        "o_proj output a lies on a 1/16 grid (its sum of squares is then exact in any order, so "
        "an is too); and kernel vs kernel: padded vs exact width, permuted producer arrival, "
        "late producers on another stream",
        "fp32→bf16 by truncation (the interpreter's own cast) — test_tails.py::"
        "test_broken_variants_exceed_their_rows; a stale partial consumed as fresh — "
        "test_readiness.py (B = lag + 1, live-rows-only re-arm); FMA contraction is excluded by "
        "test_tails.py::test_compiled_kernels_build_for_sm90",
    ),
    Tolerance(
        "kernels.residual_norm.attn_tail", "bf16", 2.0**-7, 2e-4,
        "h and f_in vs attn_tail_ref: bit-exact except where a norm's bf16 rounding flips — the "
        "kernel's FP32 inverse norm and products against the twin's FP64 value rounded through "
        "FP32 (compiled and interpreted alike: at the rank's H = 3072 the interpreter flipped 3 "
        "elements of one of 8 Gaussian rows); one flip of an moves h by ulp(an) ≤ 2^-8·max|an| ≤ "
        "2^-7·max|h|" + FLIP_SOURCE,
        "f_in normalized from the FP32 h32 (rounding point moved), an not rounded before the "
        "residual, attn_out_scale dropped — "
        "tests/kernels/test_tails.py::test_broken_variants_exceed_their_rows",
        flip_rows=FLIP_ROWS, flip_slack=FLIP_SLACK, flip_row_share=FLIP_ROW_SHARE,
    ),
    Tolerance(
        "kernels.residual_norm.moe_tail", "bf16", 2.0**-7, 2e-4,
        "xn' vs moe_tail_ref: x is bit-exact (see .exact), xn' = bf16(rms_norm(x)) flips where "
        "the sum-of-squares order moves 1/sqrt by an ulp, as for attn_tail" + FLIP_SOURCE,
        "xn' normalized from the FP32 residual (x not rounded), f not rounded before the scale "
        "— test_tails.py::test_broken_variants_exceed_their_rows",
        flip_rows=FLIP_ROWS, flip_slack=FLIP_SLACK, flip_row_share=FLIP_ROW_SHARE,
    ),
    Tolerance(
        "kernels.router.logits", "fp32", 2e-5, 4e-6,
        "folded-router logits vs rms_norm(h32)·Wᵀ of the twin, inputs with a on a 1/16 grid (so "
        "h32 is bit-exact): FP32 dot products of H ≤ 3072 terms in two orders (~√H·2^-24 of "
        "max|logit| ≈ 3e-6) and a per-row 1/sqrt ulp (1.2e-7); measured ≤ 3.7e-7 on the "
        "interpreter. Ids are compared exactly wherever the twin's sorted logits around the "
        "top-k are more than 2·max_rel·max|logit| apart (near-ties are counted and reported)",
        "router reading the rounded bf16 f_in (precision bf16, not bf16-fold): ≥ 2e-4 — "
        "test_tails.py::test_broken_variants_exceed_their_rows",
    ),
    Tolerance(
        "kernels.router.weights", "fp32", 1e-5, 5e-6,
        "kernel weights vs ops.route applied to the kernel's own logits: softmax exp (the GPU's "
        "ex2.approx ≤ 2^-22 rel. plus argument rounding |l−max|·log2e·2^-24 ≈ 2e-6 at spreads "
        "≤ 20), sums of E and K terms in other orders; measured ≤ 1.2e-7 on the interpreter",
        "weights not renormalized over the top k — "
        "test_tails.py::test_broken_variants_exceed_their_rows",
    ),
    # kernels/rows.py: layer 0's SwiGLU tail and the draft's norms / FP32 residual / router
    Tolerance(
        "kernels.rows.norm", "bf16", 2.0**-7, 2e-4,
        "norm_rows vs the twins' row-by-row reference.ops.rms_norm: identical rounding points; "
        "the order of each sum of squares moves 1/sqrt by an ulp and a bf16 rounding flips (as "
        "kernels.residual_norm.attn_tail); a flipped inner bf16(rms(b)) moves the sum by one "
        "bf16 ulp of that term ≤ 2^-8·max|s|" + FLIP_SOURCE,
        "the inner rms(b) not rounded to bf16, the norm weight dropped — tests/kernels/"
        "test_rows.py::test_broken_variants_exceed_their_rows",
        flip_rows=FLIP_ROWS, flip_slack=FLIP_SLACK, flip_row_share=FLIP_ROW_SHARE,
    ),
    Tolerance(
        "kernels.rows.norm", "fp32", 2.0**-7, 2e-4,
        "the FP32 residual s = a + bf16(rms(b)) (draft): a flip of the inner bf16 rounding "
        "moves s by one bf16 ulp of that term; otherwise bit-exact",
        "the inner rms(b) not rounded to bf16 — tests/kernels/test_rows.py",
    ),
    Tolerance(
        "kernels.rows.silu", "bf16", 2.0**-7, 2e-4,
        "bf16(silu(g)·u): exp differs by a few fp32 ulps between libdevice/NumPy and torch, "
        "so a bf16 rounding of the product flips now and then (≤ one bf16 ulp of the element)",
        "silu·up without the bf16 rounding of g, u (FP32 inputs) or silu(u)·g — "
        "tests/kernels/test_rows.py",
    ),
    Tolerance(
        "kernels.rows.route", "fp32", 1e-5, 5e-6,
        "router weights vs reference.ops.route on the same BF16 rows: FP32 dot products in "
        "another order (≈√H·2^-24 of max|logit|), exp, and sums of E and K terms; ids are "
        "compared exactly away from near-ties (kernels.rows.route int32)",
        "weights not renormalized over the top k — tests/kernels/test_rows.py",
    ),
    Tolerance(
        "kernels.rows.route", "int32", 0.0, 0.0,
        "expert ids exact (order: probability desc, index asc) where the twin's sorted "
        "probabilities around the k-th are not a near-tie",
        "ties broken by the higher index; routing from fp32 instead of the bf16 input — "
        "tests/kernels/test_rows.py",
    ),
    Tolerance(
        "kernels.router.ids", "int32", 0.0, 0.0,
        "expert ids exact vs ops.route on the kernel's own logits (order: probability desc, index "
        "asc), and vs the twin's ids wherever the top-k is not a near-tie (kernels.router.logits)",
        "ties broken by higher index; top-k from the bf16 f_in — test_tails.py",
    ),
    # kernels/linear rows
    Tolerance(
        "kernels.linear_fp8", "fp32", 1e-5, 5e-6,
        "kernels.linear.linear_fp8 (and each split-K partial) vs linear_fp8_ref on Gaussian data "
        "(per-group magnitudes 2^±6): the act-quant is bit-exact, so only FP32 accumulation "
        "order differs — kernel: exact 128-term MMA block sums scaled by sw·sx, twin: dequantized "
        "operands (one rounding each) in torch's blocked order; ≲ √K·2^-24 of max|y| plus "
        "tensor-core accumulation and FMA on the GPU. Measured ≤ 8.1e-7 max / 7.4e-7 rms on the "
        "interpreter (K ≤ 3072, 12 seeds); also bounds split counts 1/2/3 against each other "
        "(measured 1.4e-7)",
        "one weight scale block shifted; scale per 128-N ignoring the K block; a split-K partial "
        "dropped; activation scale per row or rounded to a power of two (all ≥ 1e-3) — "
        "tests/kernels/test_linear.py::test_broken_variants_exceed_their_rows",
    ),
    Tolerance(
        "kernels.linear_fp8", "bf16", 2.0**-7, 2.0**-7,
        "bf16 output vs the twin (also linear_bf16_f32's bf16 output), both rounded once (RNE) "
        "from FP32 values that differ by the fp32 row's ≤ 1e-5·max|y|: an element moves by at "
        "most one ulp of itself (≤ 2^-8·|y|) plus that difference, so both metrics stay below "
        "2^-7 whatever the flip count (measured ≤ 0.1% of elements flip; near-cancelling outputs "
        "can differ by several of their own tiny ulps). How the kernel rounds is checked exactly "
        "instead: bf16 out == RNE of the fp32 out (kernels.linear.bit_exact)",
        "weight scale grid shifted by one K block (≥ 0.1); fp32→bf16 by truncation fails "
        "kernels.linear.bit_exact — test_linear.py::test_broken_variants_exceed_their_rows",
    ),
    Tolerance(
        "kernels.linear_fp8.snapped", "fp32", 0.0, 0.0,
        "snapped inputs (integer E4M3 codes, ±448 per activation group, power-of-two scales "
        "within 2^3 of each other): the act-quant is lossless and every partial sum is an integer "
        "multiple of 2^-9 below 2^15, so any FP32 accumulation order is exact (the test asserts "
        "twin == FP64) and kernel == twin for every split count, partials included",
        "one scale block shifted; scale per 128-N ignoring the K block; split-K partial dropped "
        "— test_linear.py::test_broken_variants_exceed_their_rows",
    ),
    Tolerance(
        "kernels.linear_bf16_f32", "fp32", 1e-5, 5e-6,
        "kernels.linear.linear_bf16_f32 vs ops.linear(out_dtype=float32): bf16·bf16 products are "
        "exact in FP32, only the accumulation order over K ≤ 6144 differs (plus tensor-core "
        "accumulation on the GPU); measured ≤ 2.9e-7 max / 2.7e-7 rms on the interpreter",
        "logits rounded to bf16 (≈2^-9); the partial last K block dropped — "
        "test_linear.py::test_linear_bf16_broken_variants",
    ),
    Tolerance(
        "kernels.linear_bf16_f32.snapped", "fp32", 0.0, 0.0,
        "operands k·2^-4 and k·2^-6 with |k| ≤ 16: every FP32 partial sum is exact in any order",
        "logits rounded to bf16; a K block dropped",
    ),
    Tolerance(
        "kernels.linear.bit_exact", "bf16", 0.0, 0.0,
        "linear_fp8 with 5 live rows in an 8-row buffer (garbage padding) vs a 5-row buffer, "
        "run vs rerun of every split count (same tiles, same order, no atomics); the bf16 "
        "output of linear_fp8 / linear_bf16_f32 vs torch's RNE of their fp32 output",
        "padding rows read (NaN/1e30 garbage would leak); split-K through atomics; fp32→bf16 "
        "by truncation (the Triton interpreter's own cast)",
    ),
    Tolerance(
        "kernels.linear.bit_exact", "fp32", 0.0, 0.0,
        "as kernels.linear.bit_exact[bf16], for linear_bf16_f32's FP32 logits",
        "padding rows read",
    ),
    Tolerance(
        "kernels.qk_rope", "bf16", 0.0, 0.0,
        "kernels.qk_rope vs qk_rope_ref: same rounding points as model._attn in BF16 mode; the "
        "head's sum of squares in FP64 (bf16 squares exact, order-free up to 2^-46), the rest IEEE "
        "FP32 in the reference's order (div.rn, sqrt.rn, no FMA: enable_fp_fusion=False), cos/sin "
        "gathered from ops.rope_cos_sin's own FP32 values, RNE to bf16",
        "GPT-J interleaved pairs; rotary over all head dims; q-norm weight as 1 + w; k-norm "
        "weight on q; position off by one; the other layer type's RoPE base — "
        "tests/kernels/test_qk_rope.py::test_broken_variants_exceed_their_rows",
    ),
    Tolerance(
        "kernels.qk_rope.vs_reference", "bf16", 2.0**-7, 1e-3,
        "the twin vs the literal model._attn path (ops.rms_norm's FP32 mean in torch's CPU "
        "order, ops.rope): the two means differ by an ulp in ~40% of heads, which flips a bf16 "
        "q/k element ~once in 3e5 (measured: 1 of 286720); a flip is ≤ 1 ulp of y, ≤ 2^-7 of "
        "max|q| after RoPE; rms of one flip in ≥ 1024 elements ≲ 1e-3",
        "same broken variants as kernels.qk_rope (each ≥ 3e-2 of max|q|) — test_qk_rope.py",
    ),
    # --- training ---------------------------------------------------------------------------
    Tolerance(
        "training.target_vs_reference", "fp32",
        1e-5, 5e-6,
        "training/model.py's batched [B, T] target vs reference/model.py FP32 logits, same "
        "weights: only FP32 reassociation differs (batched GEMMs and grouped expert bmm's vs "
        "per-row GEMMs). Measured on tiny (synthetic weights, B 2, T 24, 12 seeds): worst "
        "4.3e-6 max / 2.7e-6 rms",
        "target window + 1 (≥ 0.19); sink dropped (≥ 0.9) — "
        "tests/training/test_model_matches_reference.py",
    ),
    Tolerance(
        "training.draft_vs_reference", "fp32",
        8e-5, 4e-5,
        "training/model.py's recursive draft (all depths at once, teacher-forced) vs "
        "reference/model.py's draft run as inference does (depth 0 catch-up rows, then one row "
        "per depth with this round's rows in the cache, rolled back per round): FP32 "
        "reassociation carried through up to 7 recursive depths, growing ~linearly with depth. "
        "Measured on tiny (B 2, T 24, 12 seeds): worst 3.4e-5 max / 1.5e-5 rms (depth 7)",
        "draft window + 1, draft RoPE base = target full-layer base, hprev not shifted, "
        "this round's deeper keys replaced by depth-0 keys (each ≥ 1e-2) — "
        "tests/training/test_model_matches_reference.py",
    ),
    # --- per-rank round benchmark baseline (benchmarks/rank) ---------------------------------
    Tolerance(
        "bench_rank.baseline_vs_reference", "bf16",
        8e-2, 6e-2,
        "benchmarks/rank/baseline.py's BF16 torch target (F.linear BF16 GEMMs, experts looped or "
        "gathered with bmm) vs reference/model.py in bf16 mode on the same BF16 weights: each "
        "GEMM rounds its FP32-accumulated sum once, in another order than ops.linear's FP32 "
        "product, so single bf16 roundings flip and the router's near-ties can pick another "
        "expert. Measured on small_rank_config (8 layers, 48 experts, 24 rows, 8 seeds × both "
        "expert modes): worst 3.1e-2 max / 2.6e-2 rms",
        "attention without the sink key (0.79 / 0.72); ffn_out_scale dropped (0.65 / 0.52) — "
        "tests/benchmarks/rank/test_rank_baseline.py",
    ),
)

TABLE: dict[tuple[str, str], Tolerance] = {(t.op, t.dtype): t for t in _ROWS}


def tolerance(op: str, dtype: str) -> Tolerance:
    try:
        return TABLE[(op, dtype)]
    except KeyError:
        raise KeyError(f"tolerances: no row for op={op!r} dtype={dtype!r}") from None


def measure(actual: torch.Tensor, expected: torch.Tensor, tol: Tolerance) -> Margin:
    """Errors of `actual` against `expected` in float64, with the worst element's index."""
    if actual.shape != expected.shape:
        raise ValueError(f"{tol.op}: shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    a, b = actual.double(), expected.double()
    if not torch.isfinite(a).all():
        bad = torch.nonzero(~torch.isfinite(a))[0].tolist()
        rows = a.numel() // max(a.shape[-1], 1) if a.dim() else 1
        return Margin(float("inf"), float("inf"), tuple(bad), tol, rows, rows, 1.0, a.numel(),
                      float("inf"))
    diff = (a - b).abs()
    scale = max(b.abs().max().item(), 1e-30)
    idx = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
    rms_b = max(b.pow(2).mean().sqrt().item(), 1e-30)
    max_rel, rms_rel = diff.max().item() / scale, diff.pow(2).mean().sqrt().item() / rms_b
    if not tol.flips:
        return Margin(max_rel, rms_rel, idx, tol)
    steps = grid_steps(actual, expected, tol.dtype)
    per_row = (steps.reshape(-1, steps.shape[-1]) if steps.dim() else steps.reshape(1, 1)) > 0
    counts = per_row.sum(-1)  # [rows] differing elements per row
    return Margin(max_rel, rms_rel, idx, tol, int((counts > 0).sum()), per_row.shape[0],
                  float(counts.max()) / per_row.shape[1] if per_row.numel() else 0.0,
                  int(counts.sum()), float(steps.max()) if steps.numel() else 0.0)


_GRIDS = {"bf16": (torch.bfloat16, torch.int16)}


def grid_steps(actual: torch.Tensor, expected: torch.Tensor, dtype: str) -> torch.Tensor:
    """|a − b| counted in steps of the `dtype` grid (adjacent representable values are 1 apart,
    ±0 are one point), float64 of the tensors' shape; inf where a value is off the grid or not
    finite."""
    if dtype not in _GRIDS:
        raise ValueError(f"tolerances.grid_steps: no grid for dtype {dtype!r} "
                         f"(have {list(_GRIDS)})")
    fdt, idt = _GRIDS[dtype]

    def ordered(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        g = x.to(fdt)
        on = (g.double() == x.double()) & torch.isfinite(x.double())
        bits = g.view(idt).to(torch.int64)
        mag = bits & ((1 << (torch.iinfo(idt).bits - 1)) - 1)  # sign-magnitude → a line
        return torch.where(bits < 0, -mag, mag), on

    oa, a_on = ordered(actual)
    ob, b_on = ordered(expected)
    steps = (oa - ob).abs().double()
    return torch.where(a_on & b_on, steps, torch.full_like(steps, float("inf")))


def check(actual: torch.Tensor, expected: torch.Tensor, op: str, dtype: str) -> Margin:
    """Assert `actual` matches `expected` under the table's row; returns the margin."""
    tol = tolerance(op, dtype)
    if tol.exact:
        if not torch.equal(actual, expected):
            m = measure(actual.double(), expected.double(), tol)
            raise AssertionError(f"not bit-exact: {m}")
        return Margin(0.0, 0.0, (), tol)
    m = measure(actual, expected, tol)
    if not m.ok:
        raise AssertionError(f"outside tolerance: {m}; source: {tol.source}")
    return m
