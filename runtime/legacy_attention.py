"""Legacy attention inputs: each request's static row of keys and values, read back for the
model's own attention function, with the mask its positions need.

A Legacy layer (seed 003: ``cache_unit`` caches) keeps its attention math: logit
soft-capping, chunked attention and other variants the fused operator cannot express. The step's
tokens arrive packed (``[T, N, D]``, request after request); the model's attention function
wants a batch. So the queries are padded to ``[B, N, L, D]`` (L = the longest query of the
step), the keys and values are the first C positions of each request's row (C = its longest
context), and an additive mask gives every query exactly the keys the source model would
show it: earlier positions of its own request, within the layer's window or chunk. Padding
rows see nothing and are dropped by ``packed_output``.
"""

from __future__ import annotations

import torch
from kvskill.runtime.forward_context import ForwardMetaData
from torch import Tensor


def _visible(
    md: ForwardMetaData, device: torch.device, window: int | None, chunk: int | None
) -> tuple[Tensor, Tensor]:
    """(visible [B, L, C] bool, query index [B, L] into the packed tokens, -1 for padding)."""
    q_lens = md.actual_seq_lengths_q.to(device)
    kv_lens = md.actual_seq_lengths_kv.to(device)
    width, context = int(q_lens.max()), int(kv_lens.max())
    step = torch.arange(width, device=device).view(1, -1)
    real = step < q_lens.view(-1, 1)  # [B, L]
    starts = torch.cumsum(q_lens, 0) - q_lens
    token = torch.where(real, starts.view(-1, 1) + step, torch.full_like(step, -1))
    position = (kv_lens - q_lens).view(-1, 1) + step  # the query's own position
    key = torch.arange(context, device=device).view(1, 1, -1)
    visible = (key <= position.unsqueeze(-1)) & real.unsqueeze(-1)
    if window is not None:
        # a window of W keys counts the query itself: keys (p - W, p]
        visible &= key > position.unsqueeze(-1) - window
    if chunk is not None:
        visible &= key // chunk == position.unsqueeze(-1) // chunk
    return visible, token


def legacy_attention_inputs(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    md: ForwardMetaData,
    attn_type: str,
    *,
    window: int | None = None,
    chunk: int | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The model's attention inputs over this step's requests.

    Args:
        query: packed ``[T, N, D]``.
        k_cache, v_cache: ``[rows, max_model_len, N_kv, D]``; request b's row is
            ``block_table[attn_type][b, 0]`` and already holds this step's keys and values.
        window: the layer's sliding window W (keys ``(p - W, p]``), or None.
        chunk: the layer's attention chunk (keys of the query's own chunk only), or None.

    Returns:
        query ``[B, N, L, D]``, key and value ``[B, N_kv, C, D]``, and an additive mask
        ``[B, 1, L, C]`` in the query's dtype (0 where visible, the dtype's minimum elsewhere,
        as transformers builds its eager masks).
    """
    visible, token = _visible(md, query.device, window, chunk)
    rows = md.block_table[attn_type][:, 0].long()
    context = visible.size(-1)
    key = k_cache[rows, :context].transpose(1, 2)
    value = v_cache[rows, :context].transpose(1, 2)
    padded = query[token.clamp(min=0)]  # [B, L, N, D]; padding rows repeat token 0
    mask = torch.zeros(visible.shape, dtype=query.dtype, device=query.device)
    mask.masked_fill_(~visible, torch.finfo(query.dtype).min)
    return padded.transpose(1, 2), key, value, mask.unsqueeze(1)


def packed_output(output: Tensor, md: ForwardMetaData) -> Tensor:
    """The attention output ``[B, L, N, D]`` back as the step's packed ``[1, T, N, D]``."""
    q_lens = md.actual_seq_lengths_q.to(output.device)
    real = torch.arange(output.size(1), device=output.device).view(1, -1) < q_lens.view(-1, 1)
    return output[real].unsqueeze(0)


__all__ = ["legacy_attention_inputs", "packed_output"]
