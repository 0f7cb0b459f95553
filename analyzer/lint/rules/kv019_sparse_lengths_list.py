"""KV019: a DSA operator's sequence lengths given as a Python list."""

from __future__ import annotations

from collections.abc import Iterator

import libcst as cst
import libcst.matchers as m
from kvskill.analyzer.lint.context import FileContext
from kvskill.analyzer.lint.model import Finding
from kvskill.analyzer.lint.rule import Rule
from kvskill.analyzer.lint.rules._examples import example
from kvskill.analyzer.lint.sparse import sparse_calls

LENGTH_KEYWORDS = ("actual_seq_lengths_query", "actual_seq_lengths_key", "actual_seq_lengths_kv")
_LIST_BUILDER = m.List() | m.ListComp() | m.Call(func=m.Attribute(attr=m.Name("tolist")))
_LIST_BUILDER |= m.Call(func=m.Name("list"))


class SparseLengthsList(Rule):
    """A DSA operator gets its actual_seq_lengths_* as a Python list instead of a tensor.

    The fused attention types its lengths ``SymInt[]`` (lists), but the lightning indexer
    and the sparse attention type them ``Tensor?`` (int32, the framework passes
    ``.to(torch.int32)``): a list does not bind. Reported for list literals,
    comprehensions, ``list(...)`` and ``.tolist()``, inline or through a variable.
    """

    id = "KV019"
    name = "sparse-lengths-list"
    VALID = [
        example(
            """\
def select(q, k, weights, cu_q):
    return torch_npu.npu_lightning_indexer(
        q, k, weights, actual_seq_lengths_query=cu_q.to(torch.int32), layout_query="TND",
        layout_key="TND", actual_seq_lengths_key=cu_q.to(torch.int32), sparse_count=2048)[0]
"""
        ),
    ]
    INVALID = [
        example(
            """\
def select(q, k, weights, cu_q):
    lengths = cu_q.tolist()
    return torch_npu.npu_lightning_indexer(
        q, k, weights, actual_seq_lengths_query=lengths, actual_seq_lengths_key=lengths,
        layout_query="TND", layout_key="TND", sparse_count=2048)[0]
"""
        ),
    ]

    def check(self, ctx: FileContext) -> Iterator[Finding]:
        for call in sparse_calls(ctx):
            for keyword in LENGTH_KEYWORDS:
                for expr in call.kwargs.get(keyword, []):
                    if not any(_is_list(node) for node in ctx.resolve(expr)):
                        continue
                    yield self.finding(
                        ctx,
                        expr,
                        f"{call.op} gets {keyword} `{ctx.code(expr)}` as a Python list; the "
                        "operator types it Tensor? (int32)",
                        f"pass a 1-D int32 tensor, e.g. {keyword}=lengths.to(torch.int32)",
                    )


def _is_list(node: cst.BaseExpression) -> bool:
    return m.matches(node, _LIST_BUILDER)
