"""Drive a framework standalone model as its own runner does, on a CPU.

The framework's standalone runners (cann-recipes-infer ``models/pangu_7b/runner_*.py`` at
``fbc225d``, over the executor's ``ModelRunner`` loop) own the generation loop, not the
caches' layout; the model class does that part:

    prompts right-padded to one width S (pad_token_id), attention_mask 1 on real tokens
    past_key_values = model.init_cache(input_ids)              once, kept between calls
    each step:  inputs = model.prepare_inputs_for_generation(input_ids, past_key_values,
                         attention_mask, is_prefill, kv_len, share_mask_tril)
                logits = model.prefill(**inputs) or model.decode(**inputs)   [B, 1, vocab]
                next = argmax(logits)[:, -1:]
                kv_len = max(inputs["position_ids"], dim=1) + 1       (the runner's variable)

    prompts [5, 2] -> S 5; prefill kv_len [0, 0], rows written at 0..4 (padding included);
    first decode kv_len [5, 2]: each row's next token goes after its last real token.

The same loop drives the Legacy original and its mode 2 conversion; the conversion changed
what ``init_cache`` and ``prepare_inputs_for_generation`` return, not how they are called.
Greedy, all prompts in one static batch. The caches start as random values, not zeros: a read
of a position never written changes the tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

#: the fused attention's compressed causal tile the runner hands to prefill: [2048, 2048]
MASK_SIZE = 2048


@dataclass(kw_only=True)
class RunnerProtocolRun:
    """What one generate produced: per prompt its tokens and per-step logits [vocab]."""

    token_ids: list[list[int]]
    logits: list[list[torch.Tensor]]
    #: the caches ``init_cache`` returned (kept, so a second run reuses them dirty)
    past_key_values: Any
    #: per step, what ``on_step`` returned (e.g. the metadata the model set)
    steps: list[Any] = field(default_factory=list)


def right_padded(prompts: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) [B, S], right-padded as the framework's tokenizer does."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[row, : len(prompt)] = 1
    return input_ids, attention_mask


def randomize_caches(past_key_values: Any, seed: int) -> None:
    """Fill every cache tensor with seeded random values (the runner's memory is not zero on
    a device that reuses it; a read of an unwritten position must show)."""
    generator = torch.Generator().manual_seed(seed)
    for layer in past_key_values:
        for cache in layer:
            cache.copy_(torch.randn(cache.shape, generator=generator).to(cache.dtype))


def drive_runner_protocol(
    model: nn.Module,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    pad_token_id: int,
    seed: int = 0,
    past_key_values: Any = None,
    after_init: Callable[[nn.Module, Any], None] | None = None,
    on_step: Callable[[dict[str, Any]], Any] | None = None,
) -> RunnerProtocolRun:
    """Greedy generation of MAX_NEW_TOKENS per prompt through the model's runner protocol.

    Args:
        past_key_values: caches of an earlier run to reuse as they are (dirty); None asks
            ``init_cache`` for new ones, filled with random values.
        after_init: called with (model, new caches) after ``init_cache``.
        on_step: called with each step's model inputs after the forward; its results are
            kept in ``steps``.
    """
    input_ids, attention_mask = right_padded(prompts, pad_token_id)
    if past_key_values is None:
        past_key_values = model.init_cache(input_ids)
        randomize_caches(past_key_values, seed)
        if after_init is not None:
            after_init(model, past_key_values)
    state: dict[str, Any] = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "share_mask_tril": ~torch.tril(torch.ones((MASK_SIZE, MASK_SIZE), dtype=torch.bool)),
        "is_prefill": True,
        "kv_len": None,
    }
    run = RunnerProtocolRun(
        token_ids=[[] for _ in prompts],
        logits=[[] for _ in prompts],
        past_key_values=past_key_values,
    )
    with torch.no_grad():
        for _ in range(max_new_tokens):
            inputs = model.prepare_inputs_for_generation(past_key_values=past_key_values, **state)
            step = model.prefill if state["is_prefill"] else model.decode
            logits = step(**inputs)  # [B, 1, vocab]
            if on_step is not None:
                run.steps.append(on_step(inputs))
            rows = logits[:, -1].float()
            picked = rows.argmax(dim=-1)
            for i, (row, token) in enumerate(zip(rows, picked.tolist(), strict=True)):
                run.logits[i].append(row.cpu())
                run.token_ids[i].append(token)
            state["kv_len"] = torch.max(inputs["position_ids"], dim=1)[0] + 1
            state["input_ids"] = picked.view(-1, 1)
            state["is_prefill"] = False
    return run


__all__ = ["RunnerProtocolRun", "drive_runner_protocol", "randomize_caches", "right_padded"]
