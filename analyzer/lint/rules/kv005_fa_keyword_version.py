"""KV005: a keyword of one FA version passed to the other."""

from __future__ import annotations

from collections.abc import Iterator

from kvskill.analyzer.lint.context import FileContext
from kvskill.analyzer.lint.fa import FA_V1, FA_V2, fa_calls
from kvskill.analyzer.lint.model import Finding
from kvskill.analyzer.lint.rule import Rule
from kvskill.analyzer.lint.rules._examples import example
from kvskill.core.fa_keywords import V1_ONLY, V1_TO_V2, V2_ONLY, V2_TO_V1


def _wrong_keyword(version: str, keyword: str) -> tuple[str, str] | None:
    """(message, fix) when ``keyword`` does not belong to FA ``version``."""
    if version == "v1":
        if keyword in V2_TO_V1:
            right = V2_TO_V1[keyword]
            return (
                f"`{keyword}` is the FA v2 name; {FA_V1} calls it `{right}`",
                f"rename `{keyword}=` to `{right}=` (or call {FA_V2})",
            )
        if keyword in V2_ONLY or (keyword.endswith("_dtype") and keyword != "dtype"):
            return (
                f"`{keyword}` exists only in FA v2",
                f"call {FA_V2} and rename the v1 keywords (num_query_heads, "
                "softmax_scale, actual_seq_qlen, actual_seq_kvlen)",
            )
        return None
    if keyword in V1_TO_V2:
        right = V1_TO_V2[keyword]
        return (
            f"`{keyword}` is the FA v1 name; {FA_V2} calls it `{right}`",
            f"rename `{keyword}=` to `{right}=` (or call {FA_V1})",
        )
    if keyword in V1_ONLY:
        return (
            f"`{keyword}` exists only in FA v1",
            f"call {FA_V1}, or drop `{keyword}=`",
        )
    return None


class FaKeywordVersionMismatch(Rule):
    """A keyword of FA v1 is given to FA v2, or the other way round.

    The renamed pairs (scale / softmax_scale, num_heads / num_query_heads,
    actual_seq_lengths / actual_seq_qlen, actual_seq_lengths_kv / actual_seq_kvlen, ...)
    are easy to mix up; a misspelt scale or head count silently falls back to the
    operator's default (scale 1.0, one head) where it is not rejected outright.
    """

    id = "KV005"
    name = "fa-keyword-version-mismatch"
    VALID = [
        example(
            """\
def attend(q, k, v, md, sinks):
    return torch_npu.npu_fused_infer_attention_score_v2(
        q, k, v, num_query_heads=8, num_key_value_heads=2, softmax_scale=0.125,
        input_layout="TND", atten_mask=md.attention_mask, sparse_mode=3,
        actual_seq_qlen=md.actual_seq_lengths_cu_q, actual_seq_kvlen=md.actual_seq_lengths_kv,
        learnable_sink=sinks)
"""
        ),
    ]
    INVALID = [
        example(
            """\
def attend(q, k, v, md):
    return torch_npu.npu_fused_infer_attention_score(
        q, k, v, num_heads=8, softmax_scale=0.125, input_layout="TND",
        atten_mask=md.attention_mask, sparse_mode=3,
        actual_seq_lengths=md.actual_seq_lengths_cu_q,
        actual_seq_lengths_kv=md.actual_seq_lengths_kv)
"""
        ),
        example(
            """\
from torch_npu import npu_fused_infer_attention_score_v2 as fa

def attend(q, k, v, md):
    return fa(
        q, k, v, num_heads=8, softmax_scale=0.125, input_layout="TND",
        atten_mask=md.attention_mask, sparse_mode=3,
        actual_seq_qlen=md.actual_seq_lengths_cu_q, actual_seq_kvlen=md.actual_seq_lengths_kv)
"""
        ),
    ]

    def check(self, ctx: FileContext) -> Iterator[Finding]:
        for call in fa_calls(ctx):
            for keyword, arg in call.kwargs.items():
                wrong = _wrong_keyword(call.version, keyword)
                if wrong is not None:
                    yield self.finding(ctx, arg, *wrong)
