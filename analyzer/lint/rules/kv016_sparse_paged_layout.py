"""KV016: block_table and the PA_BSND key layout not passed together to a DSA operator."""

from __future__ import annotations

from collections.abc import Iterator

from kvskill.analyzer.lint.context import FileContext
from kvskill.analyzer.lint.model import Finding
from kvskill.analyzer.lint.rule import Rule
from kvskill.analyzer.lint.rules._examples import example
from kvskill.analyzer.lint.sparse import PAGED_LAYOUT, sparse_calls


class SparsePagedLayout(Rule):
    """A DSA operator gets block_table without layout_kv/layout_key 'PA_BSND', or the reverse.

    The paged cache ``[block_num, block_size, N, D]`` is read through ``block_table`` only
    when the key layout (``layout_kv`` of the sparse attention, ``layout_key`` of the
    indexer) is 'PA_BSND'; both default to 'BSND', where the cache's first axis would be
    read as the batch. 'PA_BSND' without a block table has no pages to follow.
    """

    id = "KV016"
    name = "sparse-paged-layout"
    VALID = [
        example(
            """\
def select(q, k_cache, weights, md):
    return torch_npu.npu_lightning_indexer(
        q, k_cache, weights, actual_seq_lengths_query=md.cu_q,
        actual_seq_lengths_key=md.kv_len, block_table=md.block_table, layout_query="TND",
        layout_key="PA_BSND", sparse_count=2048, sparse_mode=3)[0]
"""
        ),
        example(
            """\
def select(q, k, weights):
    return torch_npu.npu_lightning_indexer(q, k, weights, sparse_count=2048, sparse_mode=3)[0]
"""
        ),
    ]
    INVALID = [
        example(
            """\
def select(q, k_cache, weights, md):
    return torch_npu.npu_lightning_indexer(
        q, k_cache, weights, actual_seq_lengths_query=md.cu_q,
        actual_seq_lengths_key=md.kv_len, block_table=md.block_table, layout_query="TND",
        sparse_count=2048, sparse_mode=3)[0]
"""
        ),
        example(
            """\
def attend(q_nope, q_pe, cache, k_pe, topk, md, scale):
    kwargs = {"query": q_nope, "key": cache, "value": cache, "sparse_indices": topk,
              "scale_value": scale, "block_table": md.block_table,
              "actual_seq_lengths_query": md.cu_q, "actual_seq_lengths_kv": md.kv_len,
              "layout_query": "TND", "layout_kv": "TND", "sparse_mode": 3}
    kwargs.update({"query_rope": q_pe, "key_rope": k_pe, "attention_mode": 2})
    out, _, _ = torch_npu.npu_sparse_flash_attention(**kwargs)
    return out
"""
        ),
        example(
            """\
def attend(q_nope, q_pe, cache, k_pe, topk, md, scale):
    return torch_npu.npu_sparse_flash_attention(
        q_nope, cache, cache, topk, scale, query_rope=q_pe, key_rope=k_pe,
        actual_seq_lengths_query=md.cu_q, actual_seq_lengths_kv=md.kv_len,
        layout_query="TND", layout_kv="PA_BSND", sparse_mode=3, attention_mode=2)
"""
        ),
    ]

    def check(self, ctx: FileContext) -> Iterator[Finding]:
        for call in sparse_calls(ctx):
            keyword = call.key_layout_keyword
            layouts = call.values(ctx, keyword)
            if layouts is None:
                continue
            if call.may_pass(ctx, "block_table") and PAGED_LAYOUT not in layouts:
                shown = ", ".join(repr(v) for v in sorted(layouts, key=str))
                yield self.finding(
                    ctx,
                    call.first("block_table"),
                    f"{call.op} gets block_table but {keyword} is {shown}: the paged cache is "
                    f"read through the block table only with {keyword}='PA_BSND'",
                    f"pass {keyword}='PA_BSND' with the paged cache [block_num, block_size, N, D]",
                )
            elif layouts == {PAGED_LAYOUT} and call.never_passes(ctx, "block_table"):
                yield self.finding(
                    ctx,
                    call.first(keyword) or call.node,
                    f"{call.op} runs {keyword}='PA_BSND' without a block_table: the paged "
                    "cache has no pages to follow",
                    "pass block_table=md.block_table[self.attn_type] (int32 [B, max_blocks])",
                )
