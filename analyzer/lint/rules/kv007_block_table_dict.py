"""KV007: the whole per-group block_table dict passed to fused attention."""

from __future__ import annotations

import re
from collections.abc import Iterator

import libcst as cst
from kvskill.analyzer.lint.context import FileContext
from kvskill.analyzer.lint.fa import fa_calls
from kvskill.analyzer.lint.model import Finding
from kvskill.analyzer.lint.rule import Rule
from kvskill.analyzer.lint.rules._examples import example

_METADATA_NAME = re.compile(r"metadata|^md$|^meta$", re.IGNORECASE)
_FRAMEWORK_TEXT = r"get_forward_metadata|kvskill\.runtime|attn_type\]"


def _from_forward_metadata(ctx: FileContext, base: cst.BaseExpression) -> bool:
    """``base`` is bound to ``get_forward_metadata()`` (our runtime: a dict per group)."""
    for value in ctx.assigned_values(base) or ():
        if isinstance(value, cst.Call):
            func = value.func
            name = func.attr.value if isinstance(func, cst.Attribute) else ctx.code(func)
            if name == "get_forward_metadata":
                return True
    return False


def _is_whole_dict(ctx: FileContext, expr: cst.BaseExpression, framework: bool) -> bool:
    if not (isinstance(expr, cst.Attribute) and expr.attr.value == "block_table"):
        return False
    base = expr.value
    if _from_forward_metadata(ctx, base):
        return True
    last = base.attr.value if isinstance(base, cst.Attribute) else ctx.code(base)
    return framework and bool(_METADATA_NAME.search(last))


class BlockTableWholeDict(Rule):
    """FA gets ``block_table=<metadata>.block_table``: the dict of all groups, not a tensor.

    In framework mode the forward metadata holds one block table per cache group
    (``{"FullAttention": tensor, "SlidingWindow": tensor}``); the attention must pick its
    own with ``[self.attn_type]``. (A runner-owned ``self.block_table`` tensor in
    standalone code is fine and not reported.)
    """

    id = "KV007"
    name = "block-table-whole-dict"
    VALID = [
        example(
            """\
class Attn(nn.Module):
    def forward(self, q, k, v):
        md = get_forward_metadata()
        return torch_npu.npu_fused_infer_attention_score(
            q, k, v, num_heads=8, scale=0.125, atten_mask=md.attention_mask, sparse_mode=3,
            block_table=md.block_table[self.attn_type], block_size=16,
            actual_seq_lengths_kv=md.actual_seq_lengths_kv)
"""
        ),
        example(
            """\
class StandaloneAttn(nn.Module):
    def forward_decode(self, q, k, v, kv_lens):
        return torch_npu.npu_fused_infer_attention_score(
            q, k, v, num_heads=8, scale=0.125, atten_mask=None, sparse_mode=0,
            block_table=self.block_table, block_size=128, actual_seq_lengths_kv=kv_lens)
"""
        ),
    ]
    INVALID = [
        example(
            """\
class Attn(nn.Module):
    def forward(self, q, k, v):
        md = get_forward_metadata()
        return torch_npu.npu_fused_infer_attention_score(
            q, k, v, num_heads=8, scale=0.125, atten_mask=md.attention_mask, sparse_mode=3,
            block_table=md.block_table, block_size=16,
            actual_seq_lengths_kv=md.actual_seq_lengths_kv)
"""
        ),
        example(
            """\
class Attn(nn.Module):
    def forward(self, q, k, v, forward_metadata):
        table = forward_metadata.block_table
        slots = forward_metadata.slot_mapping[self.attn_type]
        return torch_npu.npu_fused_infer_attention_score(
            q, k, v, num_heads=8, scale=0.125, sparse_mode=3,
            atten_mask=forward_metadata.attention_mask, block_table=table, block_size=16,
            actual_seq_lengths_kv=forward_metadata.actual_seq_lengths_kv)
"""
        ),
    ]

    def check(self, ctx: FileContext) -> Iterator[Finding]:
        framework = ctx.mentions(_FRAMEWORK_TEXT)
        for call in fa_calls(ctx):
            table = call.kw("block_table")
            if table is None:
                continue
            if any(_is_whole_dict(ctx, built, framework) for built in ctx.resolve(table)):
                yield self.finding(
                    ctx,
                    table,
                    f"block_table=`{ctx.code(table)}` is the dict of every cache group's "
                    "block table, not this layer's int32 tensor",
                    "pass block_table=md.block_table[self.attn_type]",
                )
