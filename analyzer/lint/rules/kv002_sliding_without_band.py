"""KV002: sliding-window layers that run without the band mode (sparse_mode 4)."""

from __future__ import annotations

import re
from collections.abc import Iterator

import libcst as cst
from kvskill.analyzer.lint.context import FileContext
from kvskill.analyzer.lint.fa import FaCall, fa_calls, in_sliding_branch, sparse_modes
from kvskill.analyzer.lint.model import Finding
from kvskill.analyzer.lint.rule import Rule
from kvskill.analyzer.lint.rules._examples import example

SLIDING = "SlidingWindow"
_WINDOW_WORD = re.compile(r"sliding|window", re.IGNORECASE)


def declares_sliding(ctx: FileContext, cls: cst.ClassDef | None) -> bool:
    """Whether ``cls`` can set ``self.attn_type`` (or a CacheEntry attn_type) to
    "SlidingWindow". Unknown values count as no."""
    if cls is None:
        return False
    for value in ctx.class_attr_values(cls, "attn_type"):
        values = ctx.possible_values(value)
        if values and SLIDING in values:
            return True
    for call in ctx.calls:
        func = call.func
        name = func.attr.value if isinstance(func, cst.Attribute) else getattr(func, "value", "")
        if name != "CacheEntry" or ctx.enclosing_class(call) is not cls:
            continue
        for arg in call.args:
            if arg.keyword is not None and arg.keyword.value == "attn_type":
                values = ctx.possible_values(arg.value)
                if values and SLIDING in values:
                    return True
    return False


class SlidingWithoutBand(Rule):
    """A sliding-window layer's fused attention cannot run sparse_mode 4 (band).

    sparse_mode 0 ignores ``pre_tokens`` without a mask (and aligns it top-left with
    one), and sparse_mode 3 is plain causal: either way a sliding layer sees keys outside
    its window once the sequence is longer than the window. Short tests still pass, which
    is why this slips through. Reported when the call sits in a sliding branch, passes a
    window as ``pre_tokens``, or belongs to a class that declares SlidingWindow layers,
    and no sparse_mode it can take is 4.
    """

    id = "KV002"
    name = "sliding-window-without-band"
    VALID = [
        example(
            """\
class Attn(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        sliding = config.layer_types[layer_idx] == "sliding_attention"
        self.attn_type = "SlidingWindow" if sliding else "FullAttention"
        self.sliding_window = config.sliding_window if sliding else None

    def forward(self, q, k, v):
        md = get_forward_metadata()
        sparse_mode = 4 if self.sliding_window else 3
        return torch_npu.npu_fused_infer_attention_score(
            q, k, v, num_heads=8, scale=0.125, input_layout="TND",
            atten_mask=md.attention_mask, sparse_mode=sparse_mode,
            pre_tokens=(self.sliding_window or 1) - 1, next_tokens=0,
            block_table=md.block_table[self.attn_type], block_size=16,
            actual_seq_lengths=md.actual_seq_lengths_cu_q,
            actual_seq_lengths_kv=md.actual_seq_lengths_kv)
"""
        ),
        example(
            """\
def attend(self, q, k, v, md):
    if self.attn_type == "SlidingWindow":
        return torch_npu.npu_fused_infer_attention_score(
            q, k, v, num_heads=8, scale=0.125, atten_mask=md.attention_mask,
            sparse_mode=4, pre_tokens=self.sliding_window - 1, next_tokens=0)
    return torch_npu.npu_fused_infer_attention_score(
        q, k, v, num_heads=8, scale=0.125, atten_mask=md.attention_mask, sparse_mode=3)
"""
        ),
    ]
    INVALID = [
        example(
            """\
def attend(self, q, k, v, md):
    if self.sliding_window is not None:
        return torch_npu.npu_fused_infer_attention_score(
            q, k, v, num_heads=8, scale=0.125, atten_mask=None, sparse_mode=0)
    return torch_npu.npu_fused_infer_attention_score(
        q, k, v, num_heads=8, scale=0.125, atten_mask=md.attention_mask, sparse_mode=3)
"""
        ),
        example(
            """\
class Attn(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        sliding = config.layer_types[layer_idx] == "sliding_attention"
        self.attn_type = "SlidingWindow" if sliding else "FullAttention"

    def forward(self, q, k, v):
        md = get_forward_metadata()
        return torch_npu.npu_fused_infer_attention_score(
            q, k, v, num_heads=8, scale=0.125, input_layout="TND",
            atten_mask=md.attention_mask, sparse_mode=3,
            block_table=md.block_table[self.attn_type], block_size=16,
            actual_seq_lengths=md.actual_seq_lengths_cu_q,
            actual_seq_lengths_kv=md.actual_seq_lengths_kv)
"""
        ),
        example(
            """\
def attend(q, k, v, window):
    return torch_npu.npu_fused_infer_attention_score(
        q, k, v, num_heads=8, scale=0.125, sparse_mode=0, pre_tokens=window, next_tokens=0)
"""
        ),
    ]

    def check(self, ctx: FileContext) -> Iterator[Finding]:
        for call in fa_calls(ctx):
            modes = sparse_modes(ctx, call)
            if modes is None or 4 in modes:
                continue
            reason = self._reason(ctx, call)
            if reason is None:
                continue
            shown = ", ".join(str(m) for m in sorted(modes))
            yield self.finding(
                ctx,
                call.node,
                f"{reason}, but this FA call only runs sparse_mode {shown}: the layer "
                "attends outside its window once the sequence is longer than the window",
                "use sparse_mode=4 with pre_tokens=sliding_window - 1, next_tokens=0 and "
                "atten_mask=md.attention_mask for sliding layers (prefill and decode alike)",
            )

    @staticmethod
    def _reason(ctx: FileContext, call: FaCall) -> str | None:
        branch = in_sliding_branch(ctx, call.node)
        if branch is False:
            return None
        if branch:
            return "the call sits in a sliding-window branch"
        pre = call.kw("pre_tokens")
        if pre is not None and _WINDOW_WORD.search(ctx.code(pre)):
            return "pre_tokens carries a sliding window"
        if declares_sliding(ctx, ctx.enclosing_class(call.node)):
            return "this class declares SlidingWindow layers"
        return None
