"""Sampler mutants, caught by gate 6 (sampler gates). Each wraps the production
kernels.sampler.sample with one readable defect and runs the gate against the wrapped sampler."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace

import torch

import kernels.sampler as ks
from negative_controls.control import Control
from qualification import sampler_gate


@contextmanager
def _patched(wrapper):
    real = ks.sample
    ks.sample = wrapper(real)
    try:
        yield
    finally:
        ks.sample = real


def _without_position(real):
    def sample(logits, params, seed, positions, *a, **kw):
        return real(logits, params, seed, torch.zeros_like(positions), *a, **kw)

    return sample


def _drop_crossing_token(real):
    """Top-p keeps only the tokens strictly before the one that crosses p."""

    def sample(logits, params, seed, positions, *a, **kw):
        out = real(logits, params, seed, positions, *a, **kw)
        if params.top_p >= 1.0 or params.temperature == 0:
            return out
        probs = out.probs.clone()  # [R, W] served, in draw order
        for r in range(probs.shape[0]):
            kept = int((probs[r] > 0).sum())
            if kept > 1:
                probs[r, kept - 1] = 0
                probs[r] /= probs[r].sum()
        return out._replace(probs=probs)

    return sample


def _top_p_before_top_k(real):
    """Top-p is cut first, on the softmax over the whole vocabulary (the crossing token kept);
    the kernel then takes its top-k of that nucleus, with its own top-p off."""

    def sample(logits, params, seed, positions, *a, **kw):
        if params.top_p >= 1.0 or params.temperature == 0:
            return real(logits, params, seed, positions, *a, **kw)
        p = torch.softmax(logits.double() / params.temperature, dim=-1)  # [R, V]
        p_sorted, order = p.sort(dim=-1, descending=True, stable=True)
        before = p_sorted.cumsum(-1) - p_sorted  # mass strictly before each token
        nucleus = torch.zeros_like(p, dtype=torch.bool).scatter(1, order, before < params.top_p)
        cut = logits.masked_fill(~nucleus, float("-inf"))
        return real(cut, replace(params, top_p=1.0), seed, positions, *a, **kw)

    return sample


def _gate(wrapper, g: sampler_gate.SamplerGateConfig | None = None):
    """The control's gate run; `g` shrinks the gate for the harness's own tests."""

    def run(mutated: bool):
        if not mutated:
            return sampler_gate.run(g)
        with _patched(wrapper):
            return sampler_gate.run(g)

    return run


CONTROLS = (
    Control(
        "rng_keyed_without_position",
        "6 sampler gates",
        "the sampler's uniforms ignore the token position (every row and round reuses one uniform)",
        _gate(_without_position),
    ),
    Control(
        "top_p_drops_crossing_token",
        "6 sampler gates",
        "top-p keeps the shortest prefix strictly below p, dropping the token that crosses it",
        _gate(_drop_crossing_token),
    ),
    Control(
        "top_k_top_p_order_swapped",
        "6 sampler gates",
        "top-p is applied before top-k (nucleus of the full-vocabulary softmax, then its k best) "
        "instead of top-k, renormalize, then top-p",
        _gate(_top_p_before_top_k),
    ),
)
