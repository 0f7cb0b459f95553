"""KV011: MLA absorb decode run with sparse_mode 3."""

from __future__ import annotations

from collections.abc import Iterator

from kvskill.analyzer.lint.context import FileContext
from kvskill.analyzer.lint.fa import Phase, fa_calls, phase_of, sparse_modes
from kvskill.analyzer.lint.model import Finding
from kvskill.analyzer.lint.rule import Rule
from kvskill.analyzer.lint.rules._examples import example


class MlaDecodeSparseMode3(Rule):
    """The MLA (query_rope / key_rope) fused attention runs decode with sparse_mode 3.

    MLA absorb decode (one query token per request against the latent cache) must use
    sparse_mode 0 with ``atten_mask=None``; mode 3 there gives badly wrong output. Prefill
    keeps mode 3, so the call needs an explicit prefill / decode split. Reported for an
    MLA call that runs sparse_mode 3 and never 0 in a decode branch, or with a fixed
    sparse_mode 3 and no prefill / decode branch around it.
    """

    id = "KV011"
    name = "mla-decode-sparse-mode-3"
    VALID = [
        example(
            """\
def attend(q, kv, q_rope, k_rope, md):
    if md.is_prefill:
        sparse_mode, mask = 3, md.attention_mask
    else:
        sparse_mode, mask = 0, None
    return torch_npu.npu_fused_infer_attention_score(
        q, kv, kv, query_rope=q_rope, key_rope=k_rope, num_heads=16, num_key_value_heads=1,
        scale=0.1, input_layout="TND_NTD", atten_mask=mask, sparse_mode=sparse_mode)
"""
        ),
        example(
            """\
def attend(q, kv, q_rope, k_rope, md):
    return torch_npu.npu_fused_infer_attention_score(
        q, kv, kv, query_rope=q_rope, key_rope=k_rope, num_heads=16, num_key_value_heads=1,
        scale=0.1, input_layout="TND_NTD",
        atten_mask=md.attention_mask if md.is_prefill else None,
        sparse_mode=3 if md.is_prefill else 0)
"""
        ),
    ]
    INVALID = [
        example(
            """\
def attend(q, kv, q_rope, k_rope, md):
    return torch_npu.npu_fused_infer_attention_score(
        q, kv, kv, query_rope=q_rope, key_rope=k_rope, num_heads=16, num_key_value_heads=1,
        scale=0.1, input_layout="TND_NTD", atten_mask=md.attention_mask, sparse_mode=3)
"""
        ),
        example(
            """\
def attend(q, kv, q_rope, k_rope, md):
    if not md.is_prefill:
        return torch_npu.npu_fused_infer_attention_score_v2(
            q, kv, kv, query_rope=q_rope, key_rope=k_rope, num_query_heads=16,
            num_key_value_heads=1, softmax_scale=0.1, input_layout="TND_NTD",
            atten_mask=md.attention_mask, sparse_mode=3)
    return None
"""
        ),
    ]

    def check(self, ctx: FileContext) -> Iterator[Finding]:
        for call in fa_calls(ctx):
            if not call.is_mla:
                continue
            modes = sparse_modes(ctx, call)
            phase = phase_of(ctx, call.node)
            if modes is None or phase is Phase.PREFILL:
                continue
            # NOTE: a decode path that can run mode 0 as well picks the mode per step (the
            # executor's DeepSeek keeps mode 3 for multi-token MTP decode, `q_len > 1`),
            # which is right; only a mode 3 that decode cannot escape is reported.
            if 3 in modes and 0 not in modes:
                where = "in a decode branch" if phase is Phase.DECODE else "for decode too"
                yield self.finding(
                    ctx,
                    call.node,
                    f"MLA fused attention runs sparse_mode 3 {where}: MLA absorb decode "
                    "must run sparse_mode 0 without a mask",
                    "split on md.is_prefill: prefill sparse_mode=3 + "
                    "atten_mask=md.attention_mask, decode sparse_mode=0 + atten_mask=None",
                )
