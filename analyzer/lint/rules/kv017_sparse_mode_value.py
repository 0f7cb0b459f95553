"""KV017: a DSA operator run with a sparse_mode other than 0 or 3."""

from __future__ import annotations

from collections.abc import Iterator

from kvskill.analyzer.lint.context import FileContext
from kvskill.analyzer.lint.model import Finding
from kvskill.analyzer.lint.rule import Rule
from kvskill.analyzer.lint.rules._examples import example
from kvskill.analyzer.lint.sparse import sparse_calls

SUPPORTED = frozenset({0, 3})


class SparseModeValue(Rule):
    """A DSA operator runs with a sparse_mode other than 0 (all keys) or 3 (rightDownCausal).

    The lightning indexer and the sparse attention document sparse_mode 0 and 3 only; the
    fused attention's modes 2 (leftUpCausal) and 4 (band) do not carry over, and a window
    is the indexer's job here. Prefill and decode of a causal model both use 3: the
    bottom-right alignment already lets a decode token see its whole prefix.
    """

    id = "KV017"
    name = "sparse-mode-value"
    VALID = [
        example(
            """\
def select(q, k, weights, causal):
    return torch_npu.npu_lightning_indexer(
        q, k, weights, sparse_count=2048, sparse_mode=3 if causal else 0)[0]
"""
        ),
    ]
    INVALID = [
        example(
            """\
def select(q, k, weights):
    return torch_npu.npu_lightning_indexer(q, k, weights, sparse_count=2048, sparse_mode=2)[0]
"""
        ),
        example(
            """\
def attend(q_nope, q_pe, k, k_pe, topk, scale, is_prefill):
    mode = 3 if is_prefill else 4
    out, _, _ = torch_npu.npu_sparse_flash_attention(
        q_nope, k, k, topk, scale, query_rope=q_pe, key_rope=k_pe, sparse_mode=mode,
        attention_mode=2)
    return out
"""
        ),
    ]

    def check(self, ctx: FileContext) -> Iterator[Finding]:
        for call in sparse_calls(ctx):
            modes = call.values(ctx, "sparse_mode")
            if modes is None or modes <= SUPPORTED:
                continue
            bad = sorted((v for v in modes if v not in SUPPORTED), key=str)
            yield self.finding(
                ctx,
                call.first("sparse_mode") or call.node,
                f"{call.op} runs sparse_mode {', '.join(map(str, bad))}; it takes only 0 (all "
                "keys) or 3 (rightDownCausal)",
                "sparse_mode=3 for causal prefill and decode (0 only for non-causal use)",
            )
