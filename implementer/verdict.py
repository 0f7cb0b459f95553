"""The verdict of a low-precision verify: conversion error, or rounding?

In float16 / bfloat16 neither the original nor the converted model reproduces its own float32
logits: every matmul rounds, and an MoE router can pick another expert on a near tie. A fixed
logit tolerance is therefore either too loose for small logits or too strict for an MoE model
(issue 28: 0.656 on one seed, 0.031 on another, for a correct conversion). The verdict instead
measures the rounding itself:

- the **anchor** is the original model in float32 on the same weights;
- the **noise floor** is the original model's own drift in the low dtype from the anchor;
- the **drift** is the converted model's drift in the low dtype from the same anchor;
- the conversion passes when ``drift <= DRIFT_RATIO * noise floor + floor``, ``floor`` being
  one unit roundoff of the dtype times the largest anchor logit (a model whose rounding
  happens to cancel must not fail by a hair);
- tokens are compared as vLLM's ``check_logprobs_close`` does: identical until the first
  divergence, where each side's token must be among the other's ``TOP_K`` best.

A drift is the mean, over the steps compared, of the largest |logit - anchor logit| of the
step: a conversion error (a wrong scale, swapped KV heads) shifts every step, while a rounding
event (a router flip) moves one; a mean keeps one flip from failing a correct conversion,
which a maximum does not. Steps are compared up to and including a side's first divergence
from the anchor: after it the two continue from different tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

#: the dtypes judged against the float32 anchor; float32 keeps the exact check
LOW_PRECISION = ("bfloat16", "float16")
#: the conversion's drift may be this many times the original's own. Measured (shrunk
#: qwen3_moe / mixtral, bf16, seeds 0-7): correct conversions 0.8-1.3x; a softmax scale 5%
#: off 2.9-3.2x; KV heads swapped 70x and more.
DRIFT_RATIO = 2.0
#: vLLM's check_logprobs_close compares against this many top logprobs in its model tests
TOP_K = 5


@dataclass(frozen=True, kw_only=True)
class Generation:
    """One prompt's greedy tokens and the logits [vocab] of each step."""

    tokens: list[int]
    logits: list[torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class Divergence:
    """The first step at which a side's token differs from the anchor's."""

    prompt: int
    step: int
    anchor_token: int
    token: int
    #: rank (0 = best) of this side's token among the anchor's logits, and the reverse
    rank_in_anchor: int
    anchor_rank_here: int
    top_k: int

    @property
    def within_top_k(self) -> bool:
        return self.rank_in_anchor < self.top_k and self.anchor_rank_here < self.top_k

    def describe(self) -> str:
        return (
            f"prompt {self.prompt} step {self.step}: token {self.token} vs anchor "
            f"{self.anchor_token} (ranks {self.rank_in_anchor} / {self.anchor_rank_here}, "
            f"top-{self.top_k} {'ok' if self.within_top_k else 'NOT ok'})"
        )


@dataclass(frozen=True, kw_only=True)
class SideDrift:
    """A low-precision run of every prompt, measured against the float32 anchor."""

    #: the largest |logit - anchor logit| of every compared step, all prompts
    step_drifts: list[float]
    divergences: list[Divergence]
    #: a prompt whose steps the side did not record (the comparison cannot be made)
    missing_steps: bool = False

    @property
    def mean(self) -> float:
        if self.missing_steps or not self.step_drifts:
            return math.inf
        return sum(self.step_drifts) / len(self.step_drifts)

    @property
    def max(self) -> float:
        if self.missing_steps or not self.step_drifts:
            return math.inf
        return max(self.step_drifts)

    @property
    def tokens_ok(self) -> bool:
        return not self.missing_steps and all(d.within_top_k for d in self.divergences)

    def first_divergence(self) -> Divergence | None:
        return min(self.divergences, key=lambda d: (d.step, d.prompt), default=None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "mean_drift": _finite(self.mean),
            "max_drift": _finite(self.max),
            "steps": len(self.step_drifts),
            "tokens_ok": self.tokens_ok,
            "divergences": [
                {
                    "prompt": d.prompt,
                    "step": d.step,
                    "anchor_token": d.anchor_token,
                    "token": d.token,
                    "rank_in_anchor": d.rank_in_anchor,
                    "anchor_rank_here": d.anchor_rank_here,
                    "within_top_k": d.within_top_k,
                }
                for d in self.divergences
            ],
        }


def _rank(logits: torch.Tensor, token: int) -> int:
    """How many tokens score strictly higher than TOKEN (0 for the greedy choice)."""
    return int((logits > logits[token]).sum().item())


def measure(anchor: list[Generation], side: list[Generation], top_k: int = TOP_K) -> SideDrift:
    """SIDE's drift from ANCHOR, prompt by prompt, up to each prompt's first divergence."""
    drifts: list[float] = []
    divergences: list[Divergence] = []
    missing = False
    for index, (ref, run) in enumerate(zip(anchor, side, strict=True)):
        step = next(
            (i for i, (a, b) in enumerate(zip(ref.tokens, run.tokens, strict=False)) if a != b),
            None,
        )
        if step is None and len(ref.tokens) != len(run.tokens):
            step = min(len(ref.tokens), len(run.tokens))
        compared = len(ref.tokens) if step is None else step + 1
        if compared > min(len(run.logits), len(ref.logits)):
            missing = True  # the side recorded no logits (or no token) for a compared step
            continue
        drifts += [
            (run.logits[i].float() - ref.logits[i].float()).abs().max().item()
            for i in range(compared)
        ]
        if step is not None:
            divergences.append(
                Divergence(
                    prompt=index,
                    step=step,
                    anchor_token=ref.tokens[step],
                    token=run.tokens[step],
                    rank_in_anchor=_rank(ref.logits[step], run.tokens[step]),
                    anchor_rank_here=_rank(run.logits[step], ref.tokens[step]),
                    top_k=top_k,
                )
            )
    return SideDrift(step_drifts=drifts, divergences=divergences, missing_steps=missing)


def default_floor(dtype: str, anchor: list[Generation]) -> float:
    """One unit roundoff of DTYPE times the largest |anchor logit|: the smallest drift the
    dtype can show on these logits."""
    unit = torch.finfo(getattr(torch, dtype)).eps / 2
    scale = max(g.logits[i].abs().max().item() for g in anchor for i in range(len(g.logits)))
    return unit * scale


@dataclass(frozen=True, kw_only=True)
class LowPrecisionVerdict:
    """Whether the converted model's low-precision drift is rounding (see the module doc)."""

    dtype: str
    ratio_limit: float
    floor: float
    top_k: int
    original: SideDrift
    converted: SideDrift

    @property
    def noise_floor(self) -> float:
        return self.original.mean

    @property
    def drift(self) -> float:
        return self.converted.mean

    @property
    def allowed(self) -> float:
        return self.ratio_limit * self.noise_floor + self.floor

    @property
    def ratio(self) -> float:
        if math.isinf(self.drift):
            return math.inf
        return self.drift / self.noise_floor if self.noise_floor > 0 else 0.0

    @property
    def drift_ok(self) -> bool:
        return self.drift <= self.allowed

    @property
    def passed(self) -> bool:
        return self.drift_ok and self.converted.tokens_ok

    def summary(self) -> str:
        first = self.converted.first_divergence()
        return (
            f"{self.dtype} drift from the float32 original {self.drift:.3g} vs its own "
            f"{self.noise_floor:.3g} (ratio {self.ratio:.2f}, allowed {self.ratio_limit:g}x + "
            f"{self.floor:.2g}); first divergence: "
            + (first.describe() if first else "none, tokens identical")
        )

    def failures(self) -> list[str]:
        lines = []
        if self.converted.missing_steps:
            lines.append("the converted model recorded no logits for some compared steps")
        elif not self.drift_ok:
            lines.append(
                f"{self.dtype} drift {self.drift:.3g} > {self.ratio_limit:g} x the original's "
                f"own {self.noise_floor:.3g} + floor {self.floor:.2g} = {self.allowed:.3g}: "
                "more than rounding"
            )
        lines += [
            f"tokens diverge outside the top-{self.top_k}: {d.describe()}"
            for d in self.converted.divergences
            if not d.within_top_k
        ]
        return lines

    def to_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "dtype": self.dtype,
            "anchor": "float32",
            "noise_floor": _finite(self.noise_floor),
            "drift": _finite(self.drift),
            "ratio": _finite(self.ratio),
            "ratio_limit": self.ratio_limit,
            "floor": self.floor,
            "allowed": _finite(self.allowed),
            "top_k": self.top_k,
            "original": self.original.to_dict(),
            "converted": self.converted.to_dict(),
        }


def judge(
    dtype: str,
    anchor: list[Generation],
    original: list[Generation],
    converted: list[Generation],
    *,
    ratio_limit: float = DRIFT_RATIO,
    floor: float | None = None,
    top_k: int = TOP_K,
) -> LowPrecisionVerdict:
    """The verdict on CONVERTED, with ORIGINAL's drift (both in DTYPE) as the noise floor."""
    return LowPrecisionVerdict(
        dtype=dtype,
        ratio_limit=ratio_limit,
        floor=default_floor(dtype, anchor) if floor is None else floor,
        top_k=top_k,
        original=measure(anchor, original, top_k),
        converted=measure(anchor, converted, top_k),
    )


def _finite(value: float) -> float | None:
    return None if math.isinf(value) or math.isnan(value) else value
