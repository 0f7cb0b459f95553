"""KV018: npu_sparse_flash_attention called outside its MLA-absorb mode."""

from __future__ import annotations

from collections.abc import Iterator

from kvskill.analyzer.lint.context import FileContext
from kvskill.analyzer.lint.model import Finding
from kvskill.analyzer.lint.rule import Rule
from kvskill.analyzer.lint.rules._examples import example
from kvskill.analyzer.lint.sparse import SPARSE_ATTENTION, sparse_calls

MLA_ABSORB = 2


class SparseAttentionMlaAbsorb(Rule):
    """npu_sparse_flash_attention runs without attention_mode=2 or without its rope parts.

    The operator supports only MLA absorb: ``attention_mode=2`` (the schema default is 0)
    with the latent as key and value and the rope parts as ``query_rope`` / ``key_rope``
    ("only supported with rope passed"). Leaving either out is refused on the device; folding
    the rope into the query instead splits the scores wrongly.
    """

    id = "KV018"
    name = "sparse-attention-mla-absorb"
    VALID = [
        example(
            """\
def attend(q_nope, q_pe, k, k_pe, topk, scale):
    out, _, _ = torch_npu.npu_sparse_flash_attention(
        q_nope, k, k, topk, scale, query_rope=q_pe, key_rope=k_pe, attention_mode=2)
    return out
"""
        ),
    ]
    INVALID = [
        example(
            """\
def attend(q_nope, q_pe, k, k_pe, topk, scale):
    out, _, _ = torch_npu.npu_sparse_flash_attention(
        q_nope, k, k, topk, scale, query_rope=q_pe, key_rope=k_pe)
    return out
"""
        ),
        example(
            """\
def attend(q, k, topk, scale):
    out, _, _ = torch_npu.npu_sparse_flash_attention(q, k, k, topk, scale, attention_mode=2)
    return out
"""
        ),
    ]

    def check(self, ctx: FileContext) -> Iterator[Finding]:
        for call in sparse_calls(ctx):
            if call.op != SPARSE_ATTENTION:
                continue
            modes = call.values(ctx, "attention_mode")
            if modes is not None and modes != {MLA_ABSORB}:
                shown = ", ".join(str(v) for v in sorted(modes, key=str))
                yield self.finding(
                    ctx,
                    call.first("attention_mode") or call.node,
                    f"{call.op} runs attention_mode {shown}; it supports only 2 (MLA absorb)",
                    "pass attention_mode=2 with the latent cache as key and value",
                )
            missing = [n for n in ("query_rope", "key_rope") if call.never_passes(ctx, n)]
            if missing:
                yield self.finding(
                    ctx,
                    call.node,
                    f"{call.op} is called without {' and '.join(missing)}; the operator needs "
                    "the rope parts passed separately",
                    "pass query_rope=q_pe and key_rope=<the rope cache> (rope dim 64)",
                )
