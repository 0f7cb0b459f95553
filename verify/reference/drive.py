"""How ``verify`` drives the original model: transformers ``generate`` (``reference_generate``),
or the model's own tuple cache (``tuple_cache_generate``).

Vendor files written for transformers 4.3x keep their KV cache as tuples grown with
``torch.cat`` and returned as ``past_key_values`` (the Plan's ``code.cache_api`` is
``tuple_cat``). ``generate`` of newer transformers hands every model a ``Cache`` object, which
such a forward cannot read, so that original is driven here instead: greedy, one request,
feeding back the tuples it returned - exactly what ``generate`` did for it when it was written,
on any installed transformers.
"""

from __future__ import annotations

from typing import Any

import torch
from kvskill.verify.reference.recompute import greedy_config
from torch import nn

#: the Plan's ``code.cache_api`` of a cache written as tuples grown with ``torch.cat``
TUPLE_CACHE_API = "tuple_cat"


def drives_own_tuple_cache(code: dict[str, Any]) -> bool:
    """Whether the original keeps its cache as tuples (from the Plan's ``code`` section)."""
    return code.get("cache_api") == TUPLE_CACHE_API


def tuple_cache_generate(
    model: nn.Module, prompt: list[int], max_new_tokens: int
) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and raw logits ``[steps, vocab]``, the model's tuples fed back each step."""
    input_ids = torch.tensor([prompt])
    positions = torch.arange(len(prompt)).unsqueeze(0)
    past = None
    tokens: list[int] = []
    logits: list[torch.Tensor] = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            seen = int(positions[0, -1]) + 1
            out = model(
                input_ids=input_ids,
                attention_mask=torch.ones(1, seen, dtype=torch.long),
                position_ids=positions,
                past_key_values=past,
                use_cache=True,
            )
            row = (out.logits if hasattr(out, "logits") else out[0])[0, -1].float()
            token = int(row.argmax())
            tokens.append(token)
            logits.append(row)
            past = out.past_key_values if hasattr(out, "past_key_values") else out[1]
            input_ids = torch.tensor([[token]])
            positions = torch.tensor([[seen]])
    return tokens, torch.stack(logits)


__all__ = ["TUPLE_CACHE_API", "drives_own_tuple_cache", "tuple_cache_generate"]


def reference_generate(
    model: nn.Module, prompt: list[int], max_new_tokens: int
) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and raw logits ``[steps, vocab]`` from transformers ``generate``."""
    config = greedy_config(max_new_tokens, output_logits=True, return_dict_in_generate=True)
    # NOTE: both sides generate exactly max_new_tokens; the model's own EOS must not stop
    # the reference early (the runtime runs with ignore_eos).
    model.generation_config.eos_token_id = None
    input_ids = torch.tensor([prompt])
    # NOTE: an explicit all-ones mask: without one, generate masks out every prompt token
    # equal to pad_token_id (0), which the runtime attends to (seed 2 draws token 0).
    with torch.no_grad():
        out = model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logits = torch.stack([step[0].float() for step in out.logits])
    return tokens, logits
