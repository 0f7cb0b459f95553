"""Run a framework model's own Legacy path on a CPU, as the framework's engine and worker do.

The original of a framework-Legacy conversion is the framework's model itself (cann-recipes-infer
at ``fbc225d``, executor model-class contract). Its caches are what the model worker allocates
for a model without ``get_cache_info``: the model's ``init_cache(device)`` when it has one,
else ``[batch, max_len, *cache_unit]`` rows on every module holding ``k_cache`` / ``v_cache``,
``max_len = input_truncated_len + max_new_tokens``. The steps carry the metadata the
execution engine builds without a KV manager (``_build_model_inputs``):

    prefill of prompts [5, 3] (one step, rows 0 and 1, max_len 12):
      input_ids / position_ids [8]: 0 1 2 3 4 | 0 1 2
      actual_seq_lengths_q = _kv = [5, 3], actual_seq_lengths_cu_q = _cu_kv = [5, 8]
      kv_len = flat row slots [0 1 2 3 4 | 12 13 14]
    after it: kv_len = seq_lens - 1 = [4, 2]
    each decode step: kv_len += 1 (the new token's position), position_ids = kv_len,
      actual_seq_lengths_kv = kv_len + 1, actual_seq_lengths_q = [1, 1]

Greedy, all prompts in one static batch, as the Legacy path serves them. The caches start as
random values, not zeros: a read of a position never written changes the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import nn

#: the engine's causal tile: bool [2048, 2048], True = masked
MASK_SIZE = 2048


@dataclass(frozen=True, kw_only=True)
class LegacyRun:
    """What the Legacy original produced: per prompt its tokens and per-step logits [vocab]."""

    token_ids: list[list[int]]
    logits: list[list[torch.Tensor]]
    #: the shape of the first cache row tensor the worker allocated
    cache_shape: tuple[int, ...]


def legacy_infer_config(
    *, batch_size: int, input_truncated_len: int, max_new_tokens: int, block_size: int = 128
) -> SimpleNamespace:
    """The fields of the framework's ``InferenceConfig`` a Legacy model and its worker read."""
    return SimpleNamespace(
        model_config=SimpleNamespace(exe_mode="eager", with_ckpt=False, custom_params={}),
        data_config=SimpleNamespace(input_truncated_len=input_truncated_len),
        parallel_config=SimpleNamespace(
            world_size=1, attn_tp_size=1, moe_tp_size=1, embed_tp_size=1, lmhead_tp_size=1
        ),
        scheduler_config=SimpleNamespace(
            batch_size=batch_size,
            batch_size_per_dp_rank=batch_size,
            max_new_tokens=max_new_tokens,
            block_size=block_size,
        ),
    )


def allocate_legacy_caches(model: nn.Module, infer_config, *, seed: int) -> tuple[int, ...]:
    """The worker's ``init_kvcache``; returns the first cache's shape.

    NOTE: the worker allocates with ``torch.empty``; random values stand in for whatever the
    memory held, so the comparison would see a read of an unwritten position.
    """
    if hasattr(model, "init_cache"):
        model.init_cache(torch.device("cpu"))
    else:
        scheduler, data = infer_config.scheduler_config, infer_config.data_config
        max_len = data.input_truncated_len + scheduler.max_new_tokens
        dtype = next(model.parameters()).dtype
        for module in model.modules():
            if hasattr(module, "k_cache") and hasattr(module, "v_cache"):
                shape = (scheduler.batch_size_per_dp_rank, max_len, *module.cache_unit)
                module.k_cache = torch.empty(shape, dtype=dtype)
                module.v_cache = torch.empty(shape, dtype=dtype)
    generator = torch.Generator().manual_seed(seed)
    caches = [
        cache
        for module in model.modules()
        for cache in (getattr(module, "k_cache", None), getattr(module, "v_cache", None))
        if isinstance(cache, torch.Tensor) and cache.numel()
    ]
    if not caches:
        raise ValueError("the worker's cache allocation left every k_cache / v_cache empty")
    for cache in caches:
        cache.copy_(torch.randn(cache.shape, generator=generator).to(cache.dtype))
    return tuple(caches[0].shape)


def _prefill_metadata(metadata_cls, seq_lens: torch.Tensor, max_len: int):
    mask = ~torch.tril(torch.ones((MASK_SIZE, MASK_SIZE), dtype=torch.bool))
    cu = seq_lens.cumsum(0)
    # the engine's Legacy prefill kv_len: each token's slot in its row of the flat cache
    kv_len = torch.cat(
        [torch.arange(row * max_len, row * max_len + n) for row, n in enumerate(seq_lens.tolist())]
    )
    return metadata_cls(
        is_prefill=True,
        attention_mask=mask,
        kv_len=kv_len,
        actual_seq_lengths_kv=seq_lens.clone(),
        actual_seq_lengths_q=seq_lens.clone(),
        actual_seq_lengths_cu_kv=cu.clone(),
        actual_seq_lengths_cu_q=cu.clone(),
        prompt_tokens=int(seq_lens.sum()),
    )


def _decode_metadata(metadata_cls, kv_len: torch.Tensor):
    mask = ~torch.tril(torch.ones((MASK_SIZE, MASK_SIZE), dtype=torch.bool))
    kv_lengths = kv_len + 1
    q_lengths = torch.ones_like(kv_len)
    return metadata_cls(
        is_prefill=False,
        attention_mask=mask,
        kv_len=kv_len,
        actual_seq_lengths_kv=kv_lengths,
        actual_seq_lengths_q=q_lengths,
        actual_seq_lengths_cu_kv=kv_lengths.cumsum(0),
        actual_seq_lengths_cu_q=q_lengths.cumsum(0),
    )


def drive_legacy(
    model: nn.Module,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    infer_config,
    metadata_cls: type,
    seed: int = 0,
) -> LegacyRun:
    """Greedy generation of MAX_NEW_TOKENS per prompt on the model's Legacy path.

    Args:
        model: built with INFER_CONFIG (its batch size holds every prompt, its
            ``input_truncated_len`` the longest one).
        metadata_cls: the ``ForwardMetaData`` class the model's file imported.
    """
    max_len = infer_config.data_config.input_truncated_len + (
        infer_config.scheduler_config.max_new_tokens
    )
    cache_shape = allocate_legacy_caches(model, infer_config, seed=seed)
    seq_lens = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    tokens: list[list[int]] = [[] for _ in prompts]
    logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    input_ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long)
    position_ids = torch.cat([torch.arange(n) for n in seq_lens.tolist()])
    md = _prefill_metadata(metadata_cls, seq_lens, max_len)
    kv_len = seq_lens - 1
    with torch.no_grad():
        for step in range(max_new_tokens):
            out = model(input_ids, position_ids, forward_metadata=md)  # [B, 1, V]
            rows = out[:, -1].float()
            picked = rows.argmax(dim=-1)
            for i, (row, token) in enumerate(zip(rows, picked.tolist(), strict=True)):
                logits[i].append(row.cpu())
                tokens[i].append(token)
            if step + 1 == max_new_tokens:
                break
            kv_len = kv_len + 1
            input_ids, position_ids = picked, kv_len.clone()
            md = _decode_metadata(metadata_cls, kv_len)
    return LegacyRun(token_ids=tokens, logits=logits, cache_shape=cache_shape)
