"""KV009: a CacheEntry's num_head that ignores attention tensor parallelism."""

from __future__ import annotations

import re
from collections.abc import Iterator

import libcst as cst
from kvskill.analyzer.lint.context import FileContext
from kvskill.analyzer.lint.model import Finding
from kvskill.analyzer.lint.rule import Rule
from kvskill.analyzer.lint.rules._examples import example

_HEAD_COUNT = re.compile(r"num_key_value_heads|num_kv_heads|n_kv_heads|num_attention_heads|n_heads")
_PER_RANK = re.compile(r"per_rank|tp_size|tp_world|world_size|//|tensor_parallel", re.IGNORECASE)
NUM_HEAD_POSITION = 3  # CacheEntry(cache_name, attn_type, dim, num_head, ...)


def _num_head_arg(call: cst.Call) -> cst.BaseExpression | None:
    for arg in call.args:
        if arg.keyword is not None and arg.keyword.value == "num_head":
            return arg.value
    positional = [a for a in call.args if a.keyword is None and not a.star]
    if len(positional) > NUM_HEAD_POSITION:
        return positional[NUM_HEAD_POSITION].value
    return None


def _texts(ctx: FileContext, expr: cst.BaseExpression, depth: int = 0) -> list[str]:
    """The text of ``expr`` and of everything its names were assigned from."""
    out = [ctx.code(expr)]
    if depth < 4:
        for value in ctx.assigned_values(expr) or ():
            out.extend(_texts(ctx, value, depth + 1))
    return out


class NumHeadNotPerRank(Rule):
    """A CacheEntry's num_head is the model's head count, not the count per attention rank.

    With attention tensor parallelism each rank holds max(num_kv_heads // attn_tp_size, 1)
    KV heads; a cache declared with the global count is too large and its shape does not
    match the per-rank K/V written into it once attn_tp_size > 1.
    """

    id = "KV009"
    name = "num-head-not-per-rank"
    VALID = [
        example(
            """\
class Attn(nn.Module):
    def __init__(self, config, infer_config, attn_tp_size=1):
        super().__init__()
        self.num_key_value_heads_per_rank = max(config.num_key_value_heads // attn_tp_size, 1)
        self.block_size = infer_config.scheduler_config.block_size
        self.k_cache = torch.Tensor([])
        self.cache_entries = [
            CacheEntry(cache_name="k_cache", attn_type="FullAttention", dim=64,
                       num_head=self.num_key_value_heads_per_rank, dtype=torch.float16,
                       needs_block=True, block_size=self.block_size,
                       tensor_setter=self.set_k_cache),
        ]
"""
        ),
        example(
            """\
class MlaAttn(nn.Module):
    def __init__(self, config, infer_config):
        super().__init__()
        self.block_size = infer_config.scheduler_config.block_size
        self.cache_entries = [
            CacheEntry("nope_cache", "FullAttention", config.kv_lora_rank, 1, torch.bfloat16,
                       True, self.block_size, tensor_setter=self.set_nope_cache),
        ]
"""
        ),
    ]
    INVALID = [
        example(
            """\
class Attn(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.cache_entries = [
            CacheEntry(cache_name="k_cache", attn_type="FullAttention", dim=64,
                       num_head=config.num_key_value_heads, dtype=torch.float16,
                       needs_block=True, block_size=128, tensor_setter=self.set_k_cache),
        ]
"""
        ),
        example(
            """\
class Attn(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_kv_heads = config.num_key_value_heads
        self.cache_entries = [
            CacheEntry("v_cache", "FullAttention", 64, self.num_kv_heads, torch.float16,
                       True, 128, tensor_setter=self.set_v_cache),
        ]
"""
        ),
    ]

    def check(self, ctx: FileContext) -> Iterator[Finding]:
        for call in ctx.calls:
            func = call.func
            name = func.attr.value if isinstance(func, cst.Attribute) else ctx.code(func)
            if name != "CacheEntry":
                continue
            num_head = _num_head_arg(call)
            if num_head is None:
                continue
            texts = _texts(ctx, num_head)
            if any(_PER_RANK.search(t) for t in texts):
                continue
            if not any(_HEAD_COUNT.search(t) for t in texts):
                continue
            yield self.finding(
                ctx,
                num_head,
                f"num_head=`{ctx.code(num_head)}` is the model's head count, not the KV "
                "heads held by one attention rank",
                "set self.num_key_value_heads_per_rank = max(num_key_value_heads // "
                "attn_tp_size, 1) and pass num_head=self.num_key_value_heads_per_rank",
            )
