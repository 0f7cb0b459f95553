"""KV006: fused attention called without a softmax scale (the default is 1.0)."""

from __future__ import annotations

from collections.abc import Iterator

from kvskill.analyzer.lint.context import FileContext
from kvskill.analyzer.lint.fa import fa_calls
from kvskill.analyzer.lint.model import Finding
from kvskill.analyzer.lint.rule import Rule
from kvskill.analyzer.lint.rules._examples import example

SCALE_KEYWORD = {"v1": "scale", "v2": "softmax_scale"}


class MissingSoftmaxScale(Rule):
    """Fused attention is called without ``scale`` (v1) / ``softmax_scale`` (v2).

    The operator's default is 1.0, not head_dim ** -0.5, so the softmax is far too sharp
    and the output is wrong without any error. (A scale passed under the other version's
    name is KV005.)
    """

    id = "KV006"
    name = "missing-softmax-scale"
    VALID = [
        example(
            """\
def attend(self, q, k, v, md):
    return torch_npu.npu_fused_infer_attention_score(
        q, k, v, num_heads=8, scale=self.scaling, atten_mask=md.attention_mask,
        sparse_mode=3)
"""
        ),
        example(
            """\
def attend(q, k, v, **fa_options):
    return torch_npu.npu_fused_infer_attention_score_v2(q, k, v, **fa_options)
"""
        ),
    ]
    INVALID = [
        example(
            """\
def attend(q, k, v, md):
    return torch_npu.npu_fused_infer_attention_score_v2(
        q, k, v, num_query_heads=8, atten_mask=md.attention_mask, sparse_mode=3)
"""
        ),
    ]

    def check(self, ctx: FileContext) -> Iterator[Finding]:
        for call in fa_calls(ctx):
            if call.has_star_kwargs or set(call.kwargs) & {"scale", "softmax_scale"}:
                continue
            keyword = SCALE_KEYWORD[call.version]
            yield self.finding(
                ctx,
                call.node,
                f"FA {call.version} called without `{keyword}=`: the operator's default "
                "scale is 1.0, not head_dim ** -0.5",
                f"pass `{keyword}=self.scaling` (head_dim ** -0.5, times mscale² for YaRN "
                "mscale_all_dim models)",
            )
