"""Attention forwards that already carry an NPU branch: ``if <flag>: <fused attention over a
dense cache> else: <cache write + attention kernel>``.

Ascend vendors ship such a fast path (the flag asks the config and whether ``torch_npu``
imported). The fused attention there reads this step's keys and values or a dense cache, not
the paged one, so keeping the branch would leave a path of the converted forward that never
writes or reads the paged cache. The whole ``if`` is therefore part of the seam: it is
replaced by the statements of its kernel branch, whose cache write and kernel call the
forward rewrite then replaces as usual, so every path goes through the paged cache.

Only the clear shape is rewritten: an ``if`` at the top level of ``forward`` with an ``else``
(no ``elif``), one branch calling the fused operator without ``block_table`` (not paged), the
other calling no fused operator (its cache write and kernel are then found as in any forward). Any other fused-attention call in an
unconverted forward is a problem, and the conversion is refused naming it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst
import libcst.matchers as m
from kvskill.analyzer.gather import FA_CALL

_EMPTY = cst.Module(body=[])
#: a fused-attention call on the paged cache (it names its block table)
PAGED_FA_CALL = FA_CALL & m.Call(
    args=[m.ZeroOrMore(), m.Arg(keyword=m.Name("block_table")), m.ZeroOrMore()]
)


@dataclass(frozen=True)
class InlinedForward:
    """A forward with its NPU branches replaced by their kernel branches."""

    forward: cst.FunctionDef
    #: the conditions of the NPU branches that were replaced, as written
    conditions: list[str] = field(default_factory=list)
    #: why a fused-attention call of the forward cannot be rewritten
    problems: list[str] = field(default_factory=list)


def _statements(branch: cst.BaseSuite) -> list[cst.BaseStatement]:
    if isinstance(branch, cst.IndentedBlock):
        return list(branch.body)
    suite = cst.ensure_type(branch, cst.SimpleStatementSuite)
    return [cst.SimpleStatementLine(body=suite.body)]


def _kernel_branch(node: cst.If, owner: str) -> tuple[list[cst.BaseStatement] | None, str | None]:
    """(statements of the kernel branch, None) for an NPU branch; (None, why) otherwise."""
    condition = _EMPTY.code_for_node(node.test)
    if not isinstance(node.orelse, cst.Else):
        return None, (
            f"{owner} calls the fused attention in `if {condition}:` without a plain else "
            "branch holding the cache write and attention kernel"
        )
    branches = (node.body, node.orelse.body)
    fused = [bool(m.findall(b, FA_CALL)) for b in branches]
    if all(fused):
        return None, f"{owner} calls the fused attention in both branches of `if {condition}:`"
    npu, other = (branches[0], branches[1]) if fused[0] else (branches[1], branches[0])
    if m.findall(npu, PAGED_FA_CALL):
        return None, (
            f"{owner} already calls the paged fused attention (block_table=) under "
            f"`if {condition}:`, but the class declares no cache_entries for it"
        )
    # NOTE: whether the other branch writes the cache and calls a kernel is the seam's
    # question (facts.py), asked of the forward with this branch in the if's place, so every
    # kernel style the seam knows serves here too
    return _statements(other), None


def _lead(stmts: list[cst.BaseStatement], node: cst.If) -> list[cst.BaseStatement]:
    """STMTS, the first carrying the ``if``'s own leading lines (blank lines, comments)."""
    first = stmts[0].with_changes(leading_lines=[*node.leading_lines, *stmts[0].leading_lines])
    return [first, *stmts[1:]]


def npu_note(conditions: list[str]) -> list[cst.EmptyLine]:
    """Comment lines that lead the emitted seam: which NPU branches it replaced."""
    if not conditions:
        return []
    branches = ", ".join(f"`if {c}:`" for c in conditions)
    return [
        cst.EmptyLine(comment=cst.Comment(f"# kvskill: {branches} chose the fused attention")),
        cst.EmptyLine(
            comment=cst.Comment(
                "# over a dense cache; every path now takes the paged cache written below."
            )
        ),
    ]


def inline_npu_branches(owner: str, forward: cst.FunctionDef) -> InlinedForward:
    """FORWARD with each top-level NPU ``if`` replaced by its kernel branch.

    Args:
        owner: ``Class.forward``, for messages.
        forward: the attention forward as written.
    """
    block = cst.ensure_type(forward.body, cst.IndentedBlock)
    body: list[cst.BaseStatement] = []
    conditions: list[str] = []
    problems: list[str] = []
    for stmt in block.body:
        if not m.findall(stmt, FA_CALL):
            body.append(stmt)
            continue
        if not isinstance(stmt, cst.If):
            problems.append(
                f"{owner} calls the fused attention outside an `if <flag>: ... else: ...` "
                "NPU branch; it cannot tell which cache that call reads"
            )
            body.append(stmt)
            continue
        kernel, problem = _kernel_branch(stmt, owner)
        if kernel is None:
            assert problem is not None
            problems.append(problem)
            body.append(stmt)
            continue
        condition = _EMPTY.code_for_node(stmt.test)
        conditions.append(condition)
        body.extend(_lead(kernel, stmt))
    if not conditions:
        return InlinedForward(forward=forward, problems=problems)
    inlined = forward.with_changes(body=block.with_changes(body=body))
    return InlinedForward(forward=inlined, conditions=conditions, problems=problems)


__all__ = ["InlinedForward", "inline_npu_branches", "npu_note"]
