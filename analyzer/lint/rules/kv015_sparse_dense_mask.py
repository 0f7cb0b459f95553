"""KV015: a dense atten_mask passed to the sparse attention or the indexer."""

from __future__ import annotations

from collections.abc import Iterator

from kvskill.analyzer.lint.context import FileContext
from kvskill.analyzer.lint.model import Finding
from kvskill.analyzer.lint.rule import Rule
from kvskill.analyzer.lint.rules._examples import example
from kvskill.analyzer.lint.sparse import sparse_calls


class SparseDenseMask(Rule):
    """A dense atten_mask is passed to the DSA sparse attention or lightning indexer.

    ``npu_sparse_flash_attention`` attends only to the positions ``sparse_indices`` lists,
    and both it and ``npu_lightning_indexer`` apply causality through ``sparse_mode=3``;
    neither takes an ``atten_mask`` (torch_npu 2.13.0 schema), so the call fails to bind on
    the device. A mask carried over from the fused-attention call it replaced is the usual
    cause. Read through ``**kwargs`` dicts built in the same function.
    """

    id = "KV015"
    name = "sparse-attention-dense-mask"
    VALID = [
        example(
            """\
def attend(q_nope, q_pe, cache, k_pe, topk, md, scale):
    return torch_npu.npu_sparse_flash_attention(
        q_nope, cache, cache, topk, scale, query_rope=q_pe, key_rope=k_pe,
        block_table=md.block_table, actual_seq_lengths_query=md.cu_q,
        actual_seq_lengths_kv=md.kv_len, layout_query="TND", layout_kv="PA_BSND",
        sparse_mode=3, attention_mode=2)
"""
        ),
    ]
    INVALID = [
        example(
            """\
def attend(q_nope, q_pe, cache, k_pe, topk, md, scale):
    return torch_npu.npu_sparse_flash_attention(
        q_nope, cache, cache, topk, scale, query_rope=q_pe, key_rope=k_pe,
        atten_mask=md.attention_mask, block_table=md.block_table,
        actual_seq_lengths_query=md.cu_q, actual_seq_lengths_kv=md.kv_len,
        layout_query="TND", layout_kv="PA_BSND", sparse_mode=3, attention_mode=2)
"""
        ),
        example(
            """\
def select(q, k_cache, weights, md):
    kwargs = {"query": q, "key": k_cache, "weights": weights, "block_table": md.block_table,
              "actual_seq_lengths_query": md.cu_q, "actual_seq_lengths_key": md.kv_len,
              "layout_query": "TND", "layout_key": "PA_BSND", "sparse_count": 2048}
    kwargs.update({"atten_mask": md.attention_mask})
    return torch_npu.npu_lightning_indexer(**kwargs)[0]
"""
        ),
    ]

    def check(self, ctx: FileContext) -> Iterator[Finding]:
        for call in sparse_calls(ctx):
            if not call.may_pass(ctx, "atten_mask"):
                continue
            yield self.finding(
                ctx,
                call.first("atten_mask"),
                f"{call.op} takes no atten_mask: the positions come from the indexer's top-k "
                "and causality from sparse_mode=3; the keyword does not bind on the device",
                "drop atten_mask and keep sparse_mode=3 (rightDownCausal)",
            )
