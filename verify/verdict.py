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
  the float32 check's own tolerance (``FLOOR_ATOL`` plus 16 float32 ulps of the largest anchor
  logit): a conversion as close to the anchor as float32 verify demands always passes, even
  when the original's rounding happens to cancel;
- tokens are compared as vLLM's ``check_logprobs_close`` compares two runs in one dtype: the
  converted model's against the original's, identical until the first divergence, where
  each side's token must be among the other's ``TOP_K`` best. Where the original's own run
  has already left the anchor's tokens (at that step or before), the two low-precision runs
  are two roundings of one model and neither is the reference: the converted token is then
  judged against the anchor instead (within the anchor's ``TOP_K`` both ways, or no further
  from the anchor's token than the original's own, which rounding took there). A sparse
  top-k attention (DSA) does this: its indexer keeps 24 of hundreds of positions in a shrunk
  twin, and bf16 rounding in earlier layers swaps some of them in either run.

A drift is the mean, over the steps compared, of the step's largest |logit - anchor logit|,
leaving out the largest ``TRIM`` of the steps: a conversion error (a wrong scale, swapped KV
heads) shifts every step, while a rounding event (an MoE router flipping on a near tie) moves
one step by up to 0.9 in a tiny MoE, once in one side and not in the other; a maximum, or a
plain mean, would fail a correct conversion for it. Steps are compared up to and including a
side's first divergence from the anchor: after it the two continue from different tokens.
Both sides are measured on the same steps, up to the earlier of their two divergences in
each prompt: a mean over other steps compares other things. (mistral_large4's twin in
bf16: the converted run left a 3-token prompt's anchor tokens at step 2 on a near tie, the
original at none, and the original's mean took in 5 more steps of drift 0.03 that the
converted one did not: ratio 2.11; on the same 8 steps 1.08.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the CLI imports DRIFT_RATIO for its help text without loading torch
    import torch

#: the dtypes judged against the float32 anchor; float32 keeps the exact check
LOW_PRECISION = ("bfloat16", "float16")
#: the conversion's drift may be this many times the original's own. Measured on shrunk
#: twins, seeds 0-7: correct conversions 0.93-1.04x (qwen3_moe bf16), 0.79-1.02x (mixtral
#: bf16), 0.94-0.98x (qwen3_moe fp16); a softmax scale 5% off 2.67-3.21x, 2.37-3.28x and
#: 20-22x; KV heads swapped about 118x (qwen3_moe bf16).
DRIFT_RATIO = 2.0
#: vLLM's check_logprobs_close compares against this many top logprobs in its model tests
TOP_K = 5
#: the fraction of the compared steps (the largest drifts) a drift leaves out
TRIM = 0.1
#: the floor: float32 verify's default atol and ulps (``verify.DEFAULT_ATOL``, ``LOGIT_ULPS``)
FLOOR_ATOL = 1e-4
FLOOR_ULPS = 16


@dataclass(frozen=True, kw_only=True)
class Generation:
    """One prompt's greedy tokens and the logits [vocab] of each step."""

    tokens: list[int]
    logits: list[torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class Divergence:
    """The first step at which a run's token differs from the one it is compared with."""

    prompt: int
    step: int
    reference_token: int
    token: int
    #: rank (0 = best) of this run's token among the reference's logits, and the reverse
    rank_in_reference: int
    reference_rank_here: int
    top_k: int
    #: what the reference is, for the message ("original", "float32 original")
    reference: str = "original"

    @property
    def within_top_k(self) -> bool:
        return self.rank_in_reference < self.top_k and self.reference_rank_here < self.top_k

    def describe(self) -> str:
        return (
            f"prompt {self.prompt} step {self.step}: token {self.token} vs the "
            f"{self.reference}'s {self.reference_token} (ranks {self.rank_in_reference} / "
            f"{self.reference_rank_here}, top-{self.top_k} "
            f"{'ok' if self.within_top_k else 'NOT ok'})"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt": self.prompt,
            "step": self.step,
            "reference_token": self.reference_token,
            "token": self.token,
            "rank_in_reference": self.rank_in_reference,
            "reference_rank_here": self.reference_rank_here,
            "within_top_k": self.within_top_k,
        }


@dataclass(frozen=True, kw_only=True)
class SideDrift:
    """A low-precision run of every prompt, measured against the float32 anchor."""

    #: the largest |logit - anchor logit| of every compared step, all prompts
    step_drifts: list[float]
    #: each prompt's first divergence from the anchor (for the report)
    divergences: list[Divergence]
    #: a prompt whose steps the side did not record (the comparison cannot be made)
    missing_steps: bool = False

    @property
    def mean(self) -> float:
        """The mean step drift without the largest TRIM of the steps (module doc)."""
        if self.missing_steps or not self.step_drifts:
            return math.inf
        kept = sorted(self.step_drifts)[: len(self.step_drifts) - int(TRIM * len(self.step_drifts))]
        return sum(kept) / len(kept)

    @property
    def max(self) -> float:
        if self.missing_steps or not self.step_drifts:
            return math.inf
        return max(self.step_drifts)

    def first_divergence(self) -> Divergence | None:
        return first(self.divergences)

    def to_dict(self) -> dict[str, Any]:
        return {
            "drift": _finite(self.mean),
            "max_step_drift": _finite(self.max),
            "steps": len(self.step_drifts),
            "divergences_from_anchor": [d.to_dict() for d in self.divergences],
        }


def first(divergences: list[Divergence]) -> Divergence | None:
    """The earliest divergence (by step, then prompt), or None."""
    return min(divergences, key=lambda d: (d.step, d.prompt), default=None)


def _rank(logits: torch.Tensor, token: int) -> int:
    """How many tokens score strictly higher than TOKEN (0 for the greedy choice)."""
    return int((logits > logits[token]).sum().item())


@dataclass(frozen=True, kw_only=True)
class _Compared:
    """One prompt of two runs: the steps whose logits compare, and where tokens diverge."""

    steps: int
    divergence: Divergence | None
    #: a compared step has no logits (or no token) in one of the runs
    missing: bool


def _compare(index: int, ref: Generation, run: Generation, top_k: int, reference: str) -> _Compared:
    step = next(
        (i for i, (a, b) in enumerate(zip(ref.tokens, run.tokens, strict=False)) if a != b),
        None,
    )
    if step is None and len(ref.tokens) != len(run.tokens):
        step = min(len(ref.tokens), len(run.tokens))
    steps = len(ref.tokens) if step is None else step + 1
    if steps > min(len(run.logits), len(ref.logits)) or (
        step is not None and step >= min(len(ref.tokens), len(run.tokens))
    ):
        return _Compared(steps=steps, divergence=None, missing=True)
    divergence = None
    if step is not None:
        divergence = Divergence(
            prompt=index,
            step=step,
            reference_token=ref.tokens[step],
            token=run.tokens[step],
            rank_in_reference=_rank(ref.logits[step], run.tokens[step]),
            reference_rank_here=_rank(run.logits[step], ref.tokens[step]),
            top_k=top_k,
            reference=reference,
        )
    return _Compared(steps=steps, divergence=divergence, missing=False)


def measure(
    anchor: list[Generation],
    side: list[Generation],
    top_k: int = TOP_K,
    steps: list[int] | None = None,
) -> SideDrift:
    """SIDE's drift from ANCHOR, prompt by prompt, up to each prompt's first divergence (and
    to at most ``steps[prompt]`` steps when given)."""
    drifts: list[float] = []
    divergences: list[Divergence] = []
    missing = False
    for index, (ref, run) in enumerate(zip(anchor, side, strict=True)):
        compared = _compare(index, ref, run, top_k, "float32 original")
        if compared.missing:
            missing = True
            continue
        count = compared.steps if steps is None else min(compared.steps, steps[index])
        drifts += [
            (run.logits[i].float() - ref.logits[i].float()).abs().max().item() for i in range(count)
        ]
        if compared.divergence is not None:
            divergences.append(compared.divergence)
    return SideDrift(step_drifts=drifts, divergences=divergences, missing_steps=missing)


def token_divergences(
    original: list[Generation], converted: list[Generation], top_k: int = TOP_K
) -> tuple[list[Divergence], bool]:
    """(each prompt's first divergence of CONVERTED from ORIGINAL, whether steps are
    missing): vLLM's ``check_logprobs_close`` pairing of two runs in one dtype."""
    found: list[Divergence] = []
    missing = False
    for index, (ref, run) in enumerate(zip(original, converted, strict=True)):
        compared = _compare(index, ref, run, top_k, "original")
        missing = missing or compared.missing
        if compared.divergence is not None:
            found.append(compared.divergence)
    return found, missing


def default_floor(anchor: list[Generation], atol: float = FLOOR_ATOL) -> float:
    """The float32 check's tolerance on these logits: ATOL plus 16 float32 ulps of the
    largest |anchor logit| (as ``verify`` allows in float32)."""
    import torch

    scale = max(g.logits[i].abs().max().item() for g in anchor for i in range(len(g.logits)))
    return atol + FLOOR_ULPS * torch.finfo(torch.float32).eps * scale


@dataclass(frozen=True, kw_only=True)
class LowPrecisionVerdict:
    """Whether the converted model's low-precision drift is rounding (see the module doc)."""

    dtype: str
    ratio_limit: float
    floor: float
    top_k: int
    original: SideDrift
    converted: SideDrift
    #: the converted run against the original run, both in the low dtype
    tokens: list[Divergence]
    #: a compared step without logits in the converted run: nothing can be judged
    missing_steps: bool = False

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
        return not math.isinf(self.noise_floor) and self.drift <= self.allowed

    def excused(self, divergence: Divergence) -> bool:
        """DIVERGENCE (from the original) lies where the original itself has left the
        float32 anchor, and the converted run left it no earlier and no further: within the
        anchor's top-k, or ranked both ways no lower than the original's own token."""
        own = [d for d in self.original.divergences if d.prompt == divergence.prompt]
        if not own or own[0].step > divergence.step:
            return False
        mine = [d for d in self.converted.divergences if d.prompt == divergence.prompt]
        if not mine:
            return True
        as_close = (
            mine[0].rank_in_reference <= own[0].rank_in_reference
            and mine[0].reference_rank_here <= own[0].reference_rank_here
        )
        return mine[0].step >= own[0].step and (mine[0].within_top_k or as_close)

    def token_failures(self) -> list[Divergence]:
        """Divergences from the original outside the top-k that rounding does not excuse."""
        return [d for d in self.tokens if not d.within_top_k and not self.excused(d)]

    @property
    def tokens_ok(self) -> bool:
        return not self.missing_steps and not self.token_failures()

    @property
    def passed(self) -> bool:
        return self.drift_ok and self.tokens_ok

    def summary(self) -> str:
        earliest = first(self.tokens)
        return (
            f"{self.dtype} drift from the float32 original {self.drift:.3g} vs its own "
            f"{self.noise_floor:.3g} (ratio {self.ratio:.2f}, allowed {self.ratio_limit:g}x + "
            f"{self.floor:.2g}); first divergence: "
            + (earliest.describe() if earliest else "none, tokens identical to the original's")
        )

    def failures(self) -> list[str]:
        lines = []
        if self.missing_steps or self.converted.missing_steps:
            lines.append("the converted model recorded no logits for some compared steps")
        elif not self.drift_ok:
            lines.append(
                f"{self.dtype} drift {self.drift:.3g} > {self.ratio_limit:g} x the original's "
                f"own {self.noise_floor:.3g} + floor {self.floor:.2g} = {self.allowed:.3g}: "
                "more than rounding"
            )
        lines += [
            f"tokens diverge outside the top-{self.top_k}: {d.describe()}"
            for d in self.token_failures()
        ]
        return lines

    def excuses(self) -> list[str]:
        """Why a divergence outside the top-k of the original was not failed."""
        return [
            f"{d.describe()}: the original's own {self.dtype} run left the float32 "
            f"original's tokens at step {self._own_step(d)} of this prompt; the converted "
            f"run left them no earlier, within the float32 original's top-{self.top_k} or "
            "no further than the original"
            for d in self.tokens
            if not d.within_top_k and self.excused(d)
        ]

    def _own_step(self, divergence: Divergence) -> int:
        return next(d.step for d in self.original.divergences if d.prompt == divergence.prompt)

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
            "tokens_ok": self.tokens_ok,
            "first_divergence": (first(self.tokens).to_dict() if self.tokens else None),
            "divergences": [d.to_dict() for d in self.tokens],
            "excused": self.excuses(),
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
    floor_atol: float | None = None,
    top_k: int = TOP_K,
) -> LowPrecisionVerdict:
    """The verdict on CONVERTED, with ORIGINAL's drift (both in DTYPE) as the noise floor."""
    tokens, missing = token_divergences(original, converted, top_k)
    # each prompt's steps both sides compare: up to the earlier first divergence (module doc)
    shared = [
        min(
            _compare(i, ref, low, top_k, "float32 original").steps
            for low in (original[i], converted[i])
        )
        for i, ref in enumerate(anchor)
    ]
    return LowPrecisionVerdict(
        tokens=tokens,
        missing_steps=missing,
        dtype=dtype,
        ratio_limit=ratio_limit,
        floor=default_floor(anchor, FLOOR_ATOL if floor_atol is None else floor_atol),
        top_k=top_k,
        original=measure(anchor, original, top_k, shared),
        converted=measure(anchor, converted, top_k, shared),
    )


def _finite(value: float) -> float | None:
    return None if math.isinf(value) or math.isnan(value) else value
