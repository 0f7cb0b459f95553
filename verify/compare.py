"""One prompt's comparison: the converted model's tokens and logits against the original's.

float32 verify passes a prompt when its greedy tokens are identical (or first differ where
the reference scored both tokens within ``atol``, a near tie) and its logits stay within
``atol`` plus ``LOGIT_RTOL`` of the largest reference logit (the logit scale); float16 and
bfloat16 are judged by the noise-floor verdict of ``verdict.py`` instead.
"""

from __future__ import annotations

import math

import torch
from kvskill.verify.report import PromptResult

#: per dtype, the largest |logit difference| a prompt may show on top of the relative term
DEFAULT_ATOL = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}
#: On top of atol, a prompt's logits may differ by this many float32 spacings (ulps) of its
#: largest reference logit. NOTE: logits are compared in float32, where one ulp is about
#: eps * |logit|, so a fixed atol is stricter for a model with large logits than float32
#: can be. granite_swa (tied embeddings of std 1 and an unscaled q.k, attention_multiplier
#: 1.0) has logits near 170, where one ulp is 1.5e-5: there the original differs from its
#: own float64 run by up to 1.6e-4 and from itself with an equal sink formula by 4.2e-5,
#: while the conversion differs by 1.8e-4 (12 ulps; 3 with the usual 1/sqrt(d) scale). A
#: real error (a window off by one, a wrong scale) moves logits by 0.1 or more, far above
#: 16 ulps (3.3e-4 at 170); for logits of order 1 the term adds under 1e-5 to atol.
LOGIT_ULPS = 16
LOGIT_RTOL = LOGIT_ULPS * torch.finfo(torch.float32).eps


def compare_prompt(
    index: int,
    prompt: list[int],
    tokens: list[int],
    ref_logits: torch.Tensor,
    runtime_tokens: list[int],
    runtime_logits: list[torch.Tensor],
    atol: float,
) -> PromptResult:
    """One prompt's reference against what the driver generated.

    Tokens must be identical, or differ first where the reference scored both tokens within
    ``atol`` (a near tie); logits are compared up to and including the first differing step.
    """
    mismatch = next(
        (i for i, (a, b) in enumerate(zip(tokens, runtime_tokens, strict=False)) if a != b),
        None if len(tokens) == len(runtime_tokens) else min(len(tokens), len(runtime_tokens)),
    )
    # logits are comparable up to and including the first differing step
    steps = len(tokens) if mismatch is None else mismatch + 1
    steps = min(steps, len(ref_logits))
    diff = 0.0
    for step in range(steps):
        if step >= len(runtime_logits):  # the driver recorded no logits for this step
            diff = math.inf
            break
        diff = max(diff, (runtime_logits[step] - ref_logits[step]).abs().max().item())
    near_tie = False
    if mismatch is not None and mismatch < min(len(ref_logits), len(runtime_tokens)):
        scores = ref_logits[mismatch]
        margin = (scores[tokens[mismatch]] - scores[runtime_tokens[mismatch]]).item()
        near_tie = margin <= atol
    return PromptResult(
        index=index,
        prompt_len=len(prompt),
        reference_tokens=tokens,
        runtime_tokens=runtime_tokens,
        max_logit_diff=diff,
        first_mismatch=mismatch,
        near_tie=near_tie,
        logit_scale=logit_scale(ref_logits, steps),
    )


def logit_scale(ref_logits: torch.Tensor, steps: int) -> float:
    """Largest |reference logit| over the first ``steps`` steps (0.0 for none)."""
    return ref_logits[:steps].abs().max().item() if steps > 0 else 0.0
