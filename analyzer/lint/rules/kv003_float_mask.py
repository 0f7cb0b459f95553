"""KV003: a floating-point atten_mask passed to fused attention."""

from __future__ import annotations

from collections.abc import Iterator

from kvskill.analyzer.lint.context import FileContext
from kvskill.analyzer.lint.fa import fa_calls
from kvskill.analyzer.lint.model import Finding
from kvskill.analyzer.lint.rule import Rule
from kvskill.analyzer.lint.rules._examples import example
from kvskill.analyzer.lint.rules._masks import FLOAT, mask_dtype


class FloatAttenMask(Rule):
    """The atten_mask given to fused attention is floating point (-inf fill or float dtype).

    The operator accepts only bool, int8 or uint8 masks with True/1 = masked out; an
    additive float mask (0 / -inf, the SDPA convention) is rejected on the device. Built
    from ``torch.ones`` without a dtype, from ``masked_fill(..., -inf)``, ``.float()``,
    ``.to(query.dtype)`` and the like, inline or through a variable.
    """

    id = "KV003"
    name = "float-atten-mask"
    VALID = [
        example(
            """\
def attend(q, k, v):
    mask = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)
    return torch_npu.npu_fused_infer_attention_score(
        q, k, v, num_heads=8, scale=0.125, atten_mask=mask, sparse_mode=3)
"""
        ),
        example(
            """\
class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("mask", torch.triu(torch.ones(2048, 2048), diagonal=1).bool())

    def forward(self, q, k, v):
        return torch_npu.npu_fused_infer_attention_score(
            q, k, v, num_heads=8, scale=0.125, atten_mask=self.mask, sparse_mode=3)
"""
        ),
    ]
    INVALID = [
        example(
            """\
def attend(q, k, v):
    mask = torch.full((2048, 2048), float("-inf")).triu(1)
    return torch_npu.npu_fused_infer_attention_score(
        q, k, v, num_heads=8, scale=0.125, atten_mask=mask, sparse_mode=3)
"""
        ),
        example(
            """\
def attend(q, k, v, causal):
    return torch.ops.npu.npu_fused_infer_attention_score(
        q, k, v, num_heads=8, scale=0.125, atten_mask=causal.to(q.dtype), sparse_mode=3)
"""
        ),
        example(
            """\
def attend(q, k, v):
    return torch_npu.npu_fused_infer_attention_score(
        q, k, v, num_heads=8, scale=0.125,
        atten_mask=torch.triu(torch.ones(2048, 2048), diagonal=1), sparse_mode=3)
"""
        ),
    ]

    def check(self, ctx: FileContext) -> Iterator[Finding]:
        for call in fa_calls(ctx):
            mask = call.kw("atten_mask")
            if mask is None or mask_dtype(ctx, mask) != FLOAT:
                continue
            yield self.finding(
                ctx,
                mask,
                f"atten_mask `{ctx.code(mask)}` is floating point; FA accepts only "
                "bool/int8/uint8 masks (True = masked out) and rejects float masks",
                "build it as bool, e.g. get_init_attn_mask(2048) or "
                "torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1); "
                "or append .to(torch.bool)",
            )
