"""What a tensor-parallel run reports: the split, rank 0's communication and the KV bytes
per token of one rank against one process holding every head."""

from __future__ import annotations

import torch


def kv_bytes_per_token(cache_info) -> int:
    """Bytes one token occupies in every cache entry of CACHE_INFO (this rank's heads)."""
    return sum(
        entry.num_head * entry.dim * torch.empty((), dtype=entry.dtype).element_size()
        for layer in cache_info.layer_infos
        for entry in layer.caches
    )


def tensor_parallel_summary(llm) -> dict:
    """``llm.tensor_parallel.report`` plus KV bytes per token per rank and unsplit (the
    per-rank heads scaled back to the model's KV heads; MLA latents are never split)."""
    tp = llm.tensor_parallel
    report = tp.report(llm.stats.num_steps)
    plan = tp.shard.plan
    per_rank = kv_bytes_per_token(llm.cache_info)
    factor = 1 if plan.mla else plan.num_kv_heads / plan.kv_heads_per_rank
    report["kv_bytes_per_token_per_rank"] = per_rank
    report["kv_bytes_per_token_unsplit"] = int(per_rank * factor)
    return report
