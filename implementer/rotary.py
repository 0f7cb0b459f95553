"""Rotary tables: under the paged runtime they cover every position of the step.

Transformers-4.3x-era attention sizes its rotary table from the keys it holds,
``kv_seq_len = key_states.shape[-2]`` plus the past (``past_key_value[0].shape[-2]`` or
``get_usable_length``), then calls ``self.rotary_emb(value_states, seq_len=kv_seq_len)`` and
indexes the table with ``position_ids``. The runtime calls the model with the packed step and
no cache, so ``kv_seq_len`` is the step's T tokens while a decode position is up to the
request's length: the table would end before the positions it is indexed with. Every
``self.<module>(..., seq_len=E)`` call in a converted attention forward becomes
``seq_len=_paged_seq_len(E)``: ``E`` outside the runtime, under it at least the longest
request's KV length (``actual_seq_lengths_kv``), which is its last position + 1.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m
from kvskill.implementer.masks import _after_imports
from kvskill.implementer.snippets import statements

HELPER = "_paged_seq_len"
#: ``self.<module>(..., seq_len=E)`` whose E is not wrapped yet
SIZED_ROTARY_CALL = m.Call(
    func=m.Attribute(value=m.Name("self")),
    args=[
        m.ZeroOrMore(),
        m.Arg(keyword=m.Name("seq_len"), value=~m.Call(func=m.Name(HELPER))),
        m.ZeroOrMore(),
    ],
)


class _WrapSeqLen(cst.CSTTransformer):
    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.Call:
        if not m.matches(original_node, SIZED_ROTARY_CALL):
            return updated_node
        args = [
            a.with_changes(value=cst.Call(func=cst.Name(HELPER), args=[cst.Arg(a.value)]))
            if a.keyword is not None and a.keyword.value == "seq_len"
            else a
            for a in updated_node.args
        ]
        return updated_node.with_changes(args=args)


def cover_positions(forward: cst.FunctionDef) -> tuple[cst.FunctionDef, bool]:
    """FORWARD with every ``self.<module>(..., seq_len=E)`` sized by ``_paged_seq_len(E)``,
    and whether there was one."""
    if not m.findall(forward, SIZED_ROTARY_CALL):
        return forward, False
    return cst.ensure_type(forward.visit(_WrapSeqLen()), cst.FunctionDef), True


def with_helper(module: cst.Module, config: cst.PartialParserConfig) -> cst.Module:
    """MODULE with the ``_paged_seq_len`` helper after its imports (once)."""
    if m.findall(module, m.FunctionDef(name=m.Name(HELPER))):
        return module
    helper = statements("framework_rotary_helper.py.j2", config)
    helper[0] = helper[0].with_changes(
        leading_lines=[cst.EmptyLine(indent=False), cst.EmptyLine(indent=False)]
    )
    body = list(module.body)
    index = _after_imports(body)
    return module.with_changes(body=[*body[:index], *helper, *body[index:]])


__all__ = ["HELPER", "cover_positions", "with_helper"]
