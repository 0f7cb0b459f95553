"""KV004: an inline-built mask that is not the [2048, 2048] tile for sparse modes 2/3/4."""

from __future__ import annotations

from collections.abc import Iterator

from kvskill.analyzer.lint.context import FileContext
from kvskill.analyzer.lint.fa import fa_calls, sparse_modes
from kvskill.analyzer.lint.model import Finding
from kvskill.analyzer.lint.rule import Rule
from kvskill.analyzer.lint.rules._examples import example
from kvskill.analyzer.lint.rules._masks import inline_shape, shape_problem

COMPRESSED_MODES = frozenset({2, 3, 4})


class MaskShapeNot2048(Rule):
    """The mask for sparse_mode 2/3/4 is built with a shape other than [2048, 2048].

    In those modes the operator reads a fixed compressed tile of exactly 2048 x 2048
    (optionally with leading 1 dims), whatever the sequence or max_position_embeddings;
    a mask sized to the sequence is rejected on the device.
    """

    id = "KV004"
    name = "mask-shape-not-2048"
    VALID = [
        example(
            """\
from kvskill.runtime import get_init_attn_mask

def attend(q, k, v):
    mask = get_init_attn_mask(2048)
    return torch_npu.npu_fused_infer_attention_score(
        q, k, v, num_heads=8, scale=0.125, atten_mask=mask, sparse_mode=3)
"""
        ),
        example(
            """\
MASK_SIZE = 2048

def attend(q, k, v):
    mask = torch.ones(1, MASK_SIZE, MASK_SIZE, dtype=torch.bool).triu(1)
    return torch_npu.npu_fused_infer_attention_score(
        q, k, v, num_heads=8, scale=0.125, atten_mask=mask, sparse_mode=4,
        pre_tokens=127, next_tokens=0)
"""
        ),
    ]
    INVALID = [
        example(
            """\
def attend(q, k, v):
    seq_len = q.shape[0]
    mask = torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), diagonal=1)
    return torch_npu.npu_fused_infer_attention_score(
        q, k, v, num_heads=8, scale=0.125, atten_mask=mask, sparse_mode=3)
"""
        ),
        example(
            """\
from kvskill.runtime import get_init_attn_mask

def attend(q, k, v, config):
    return torch_npu.npu_fused_infer_attention_score(
        q, k, v, num_heads=8, scale=0.125, sparse_mode=3,
        atten_mask=get_init_attn_mask(4096))
"""
        ),
    ]

    def check(self, ctx: FileContext) -> Iterator[Finding]:
        for call in fa_calls(ctx):
            mask = call.kw("atten_mask")
            modes = sparse_modes(ctx, call)
            if mask is None or not modes or not modes <= COMPRESSED_MODES:
                continue
            for built in ctx.resolve(mask):
                dims = inline_shape(ctx, built)
                problem = shape_problem(ctx, dims) if dims else None
                if problem is None:
                    continue
                shown = ", ".join(str(m) for m in sorted(modes))
                yield self.finding(
                    ctx,
                    mask,
                    f"atten_mask for sparse_mode {shown} must be the [2048, 2048] tile, "
                    f"but {problem}",
                    "use get_init_attn_mask(2048) (bool, True above the diagonal) or the "
                    "runtime's md.attention_mask; never size it to the sequence",
                )
                break
