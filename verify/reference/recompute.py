"""Whether a failed verify is the original's fault: its cached generation against a recompute.

verify's reference is transformers' ``generate`` with the model's own cache. Some sources
carry a cache path that disagrees with the model itself: transformers 4.55's bamba never
sets ``has_previous_state`` (its hybrid cache is falsy, ``len() == 0``), so every decode
step restarts the Mamba layers from zero states. The converted model then matches the
model's math and still "differs". When tokens differ, the shortest differing prompt is
generated once more with ``use_cache=False`` (every step a full forward over the whole
sequence, which no cache can corrupt); if that disagrees with the cached reference, the
report says so and whether the runtime's tokens equal the recompute. The verdict is not
changed: the note tells the reader where to look.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def greedy_config(max_new_tokens: int, **options: Any):
    """transformers' ``GenerationConfig`` for exactly MAX_NEW_TOKENS greedy tokens (no EOS
    stop: the runtime runs with ignore_eos), with OPTIONS added."""
    from transformers import GenerationConfig

    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        **options,
    )


def recompute_tokens(model: nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens of ``generate(use_cache=False)``: a full forward per step."""
    config = greedy_config(max_new_tokens, use_cache=False)
    model.generation_config.eos_token_id = None  # as verify's reference: no early stop
    input_ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config
        )
    return out[0, len(prompt) :].tolist()


def cache_path_note(
    model: nn.Module,
    index: int,
    prompt: list[int],
    cached: list[int],
    runtime: list[int],
) -> str | None:
    """A note when the original's cached tokens CACHED for PROMPT differ from its own
    recompute, else None (the recompute itself may fail on a model that needs its cache)."""
    try:
        recomputed = recompute_tokens(model, prompt, len(cached))
    except Exception:  # noqa: BLE001 - a source without a cache-free path: nothing to tell
        return None
    if recomputed == cached:
        return None
    step = next(i for i, (a, b) in enumerate(zip(recomputed, cached, strict=True)) if a != b)
    verdict = (
        "the runtime's tokens equal the recompute"
        if runtime == recomputed
        else "the runtime's tokens differ from both"
    )
    return (
        f"prompt {index}: the original's own cached generate disagrees with its full "
        f"recompute (use_cache=False) from step {step}: the source's cache path is broken "
        f"under this transformers, so the reference is not the model's math; {verdict}"
    )
