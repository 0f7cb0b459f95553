"""KV001: sparse_mode 0 without a mask on a path that serves prefill."""

from __future__ import annotations

from collections.abc import Iterator

from kvskill.analyzer.lint.context import FileContext
from kvskill.analyzer.lint.fa import Phase, fa_calls, mask_is_none, phase_of, sparse_modes
from kvskill.analyzer.lint.model import Finding
from kvskill.analyzer.lint.rule import Rule
from kvskill.analyzer.lint.rules._examples import example


class NoCausalMaskInPrefill(Rule):
    """Fused attention runs with sparse_mode 0 and no mask where prefill tokens pass.

    With sparse_mode 0 and ``atten_mask=None`` every query attends to every key, so a
    prefill token sees the tokens after it: the output is garbage and nothing raises.
    Only a decode-only branch (one query token per request, e.g. MLA absorb decode) may
    run like that; the rule stays silent inside ``if not md.is_prefill`` / ``else`` of
    ``if md.is_prefill`` and in functions named ``*decode*``.
    """

    id = "KV001"
    name = "no-causal-mask-in-prefill"
    VALID = [
        example(
            """\
def attend(q, k, v, md, bs):
    return torch_npu.npu_fused_infer_attention_score(
        q, k, v, num_heads=8, scale=0.125, input_layout="TND",
        atten_mask=md.attention_mask, sparse_mode=3,
        block_table=md.block_table["FullAttention"], block_size=bs,
        actual_seq_lengths=md.actual_seq_lengths_cu_q,
        actual_seq_lengths_kv=md.actual_seq_lengths_kv)
"""
        ),
        example(
            """\
def attend_mla(q, kv, q_rope, k_rope, md):
    if md.is_prefill:
        mode, mask = 3, md.attention_mask
        return torch_npu.npu_fused_infer_attention_score(
            q, kv, kv, query_rope=q_rope, key_rope=k_rope, num_heads=16, scale=0.1,
            input_layout="TND_NTD", atten_mask=mask, sparse_mode=mode)
    return torch_npu.npu_fused_infer_attention_score(
        q, kv, kv, query_rope=q_rope, key_rope=k_rope, num_heads=16, scale=0.1,
        input_layout="TND_NTD", atten_mask=None, sparse_mode=0)
"""
        ),
    ]
    INVALID = [
        example(
            """\
def attend(q, k, v, md, bs):
    return torch_npu.npu_fused_infer_attention_score(
        q, k, v, num_heads=8, scale=0.125, input_layout="TND", sparse_mode=0,
        block_table=md.block_table["FullAttention"], block_size=bs,
        actual_seq_lengths=md.actual_seq_lengths_cu_q,
        actual_seq_lengths_kv=md.actual_seq_lengths_kv)
"""
        ),
        example(
            """\
import torch_npu as tnpu

def attend_prefill(q, k, v, lens):
    out, _ = tnpu.npu_fused_infer_attention_score_v2(
        q, k, v, num_query_heads=8, softmax_scale=0.125, input_layout="TND",
        actual_seq_qlen=lens, actual_seq_kvlen=lens)
    return out
"""
        ),
    ]

    def check(self, ctx: FileContext) -> Iterator[Finding]:
        for call in fa_calls(ctx):
            if sparse_modes(ctx, call) != frozenset({0}) or not mask_is_none(ctx, call):
                continue
            if phase_of(ctx, call.node) is Phase.DECODE:
                continue
            yield self.finding(
                ctx,
                call.node,
                f"FA {call.version} runs sparse_mode=0 with atten_mask=None on a path that "
                "serves prefill: prefill tokens attend to later tokens (no causal mask)",
                "pass sparse_mode=3 with atten_mask=md.attention_mask (bool [2048, 2048]); "
                "keep sparse_mode=0 + None only in a decode-only branch (MLA absorb decode)",
            )
