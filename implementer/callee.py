"""Attention the forward hands to a callee of the same file: a method of the class
(``self._attn(query, key, value, mask, head_mask)``, GPT-2 / GPT-J / CodeGen / Qwen-7B) or a
submodule the class builds (``self.core_attention(q, k, v, mask)``, ChatGLM2/3's
``CoreAttention``).

The seam still runs from the cache write to the call: the call is the kernel. Its end is
read inside the callee, in the callee's own names, and mapped back to the call:

* before the kernel the callee may only re-lay out or cast its query, key and value
  (``permute``, ``transpose``, ``to(torch.float32)``) and prepare masks; the seam reads
  query, key and value at the cache write, so those statements are not needed;
* the kernel is scaled dot-product attention (SDPA, or an ``if``/``else`` of SDPA calls that
  differ only in masking) or hand-written matmul attention, whose scale is bound to the
  call's arguments (``self`` becoming the submodule, ``self.core_attention``);
* what the callee does to the kernel's output before returning it (ChatGLM's ``permute(2, 0,
  1, 3)`` and merge of the heads, Qwen-7B's ``transpose(1, 2)``) is inlined after the seam,
  rebound the same way, so the forward receives the layout it received before.

The callee itself stays in the converted file, unused by the converted forward: its module
keeps its parameters (none, for attention) and its buffers (GPT-J's causal-mask ``bias``), so
checkpoints and state dicts load as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst
import libcst.matchers as m
from kvskill.analyzer.gather import (
    INTERFACE_CALL,
    SDPA_CALL,
    attention_methods,
    attention_submodules,
    matmul_attention,
    scores_matmul,
)
from kvskill.analyzer.gather import method as _method

#: calls that only re-lay out a tensor or change its dtype: what a callee may do to its query,
#: key and value before the kernel (the seam reads them at the cache write instead)
RELAYOUT_OR_CAST = frozenset(
    {"permute", "transpose", "contiguous", "to", "float", "half", "bfloat16", "type", "type_as"}
)


#: products of hand-written attention the seam does not read (named in the refusal)
_PRODUCTS = m.Call(func=m.Name() | m.Attribute(attr=m.Name())) & m.MatchIfTrue(
    lambda call: (
        (call.func.attr if isinstance(call.func, cst.Attribute) else call.func).value
        in ("einsum", "bmm", "baddbmm")
    )
)


@dataclass(frozen=True, kw_only=True)
class Callee:
    """A method or submodule the attention forward hands query, key and value to."""

    #: the attribute the forward calls (``_attn``, ``core_attention``)
    attr: str
    #: how messages name the function that runs (``VendorAttention._attn``,
    #: ``VendorCoreAttention.forward``)
    where: str
    #: that function; None when the submodule's class is not in the file or has no forward
    func: cst.FunctionDef | None
    #: what ``self`` is inside it, as the forward spells it (``self`` or ``self.core_attention``)
    receiver: str
    #: the class it belongs to (a submodule's), for messages
    owner: str
    is_submodule: bool


def class_callees(cls: cst.ClassDef, classes: dict[str, cst.ClassDef]) -> dict[str, Callee]:
    """CLS's callees that may run its attention, by the attribute the forward calls."""
    found = {
        name: Callee(
            attr=name,
            where=f"{cls.name.value}.{name}",
            func=func,
            receiver="self",
            owner=cls.name.value,
            is_submodule=False,
        )
        for name, func in attention_methods(cls).items()
    }
    for attr, class_name in attention_submodules(cls).items():
        module_cls = classes.get(class_name)
        found[attr] = Callee(
            attr=attr,
            where=f"{class_name}.forward",
            func=_method(module_cls, "forward") if module_cls is not None else None,
            receiver=f"self.{attr}",
            owner=class_name,
            is_submodule=True,
        )
    return found


def kernel_position(body: cst.IndentedBlock) -> tuple[int, int] | None:
    """(first, last) top-level statement of a callee's kernel: one SDPA / interface call
    (or an ``if`` holding it), else hand-written matmul attention; None without either."""
    for index, stmt in enumerate(body.body):
        if m.findall(stmt, SDPA_CALL | INTERFACE_CALL):
            return index, index
    return matmul_attention(body)


#: besides RELAYOUT_OR_CAST, the reshapes a forward may apply to its query between the cache
#: write and the kernel: the seam reads the query before them and lays it out itself
RESHAPES = RELAYOUT_OR_CAST | {"view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze"}


def relayout_root(
    expr: cst.BaseExpression, allowed: frozenset[str] = RELAYOUT_OR_CAST
) -> str | None:
    """``x`` when EXPR is ``x`` followed only by ALLOWED calls (``x.permute(1, 2, 0,
    3).contiguous()``), else None."""
    while isinstance(expr, cst.Call):
        func = expr.func
        if not isinstance(func, cst.Attribute) or func.attr.value not in allowed:
            return None
        expr = func.value
    return expr.value if isinstance(expr, cst.Name) else None


def rebinds_by_relayout(
    stmt: cst.BaseStatement, allowed: frozenset[str] = RELAYOUT_OR_CAST
) -> dict[str, str] | None:
    """``{target: source}`` when STMT only re-lays out or casts names: ``q = q.permute(...)``
    or ``q, k, v = [x.permute(1, 2, 0, 3) for x in [q, k, v]]``; else None."""
    if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1:
        return None
    assign = stmt.body[0]
    if not isinstance(assign, cst.Assign) or len(assign.targets) != 1:
        return None
    target, value = assign.targets[0].target, assign.value
    if isinstance(target, cst.Name):
        root = relayout_root(value, allowed)
        return {target.value: root} if root is not None else None
    if not isinstance(target, (cst.Tuple, cst.List)) or not isinstance(value, cst.ListComp):
        return None
    loop = value.for_in
    sources = loop.iter.elements if isinstance(loop.iter, (cst.List, cst.Tuple)) else []
    names = [e.value for e in target.elements]
    if (
        loop.inner_for_in is not None
        or loop.ifs
        or not isinstance(loop.target, cst.Name)
        or relayout_root(value.elt, allowed) != loop.target.value
        or len(sources) != len(names)
        or not all(isinstance(n, cst.Name) for n in names)
        or not all(isinstance(s.value, cst.Name) for s in sources)
    ):
        return None
    return {
        cst.ensure_type(n, cst.Name).value: cst.ensure_type(s.value, cst.Name).value
        for n, s in zip(names, sources, strict=True)
    }


def callee_kernel(facts, kernel_index: int, assign, call: cst.Call, callee: Callee):
    """The kernel of ``out[, weights] = self.<attr>(query, key, value, ...)``: a ``_Kernel``
    (``implementer/facts.py``) in the forward's names, or None with the reasons in FACTS'
    problems (and what the fused operator cannot do in its ``fused_limits``)."""
    # NOTE: imported here, not at the top: facts.py reads a forward's kernel and calls this
    # module for a callee's, and this module reads the callee's kernel with facts.py's readers
    from kvskill.implementer import facts as f

    where = callee.where
    if callee.func is None:
        facts.problems.append(
            f"{facts.name}.forward hands query, key and value to self.{callee.attr} "
            f"({callee.owner}), which is not a class of this file with a forward; the seam "
            "cannot read the attention it runs"
        )
        return None
    body = cst.ensure_type(callee.func.body, cst.IndentedBlock)
    position = kernel_position(body)
    if position is None:
        products = sorted(
            {f.code(cst.ensure_type(c, cst.Call).func) for c in m.findall(body, _PRODUCTS)}
        )
        facts.problems.append(
            f"{where} runs no attention the seam reads (scaled_dot_product_attention, an "
            "attention interface, or matmul + softmax + matmul)"
            + (f"; it computes with {' and '.join(products)}" if products else "")
        )
        return None
    # the callee's kernel, read in its own names (messages name the callee)
    inner = f.AttentionFacts(name=callee.owner, converted=False)
    if position[0] == position[1]:
        kernel = f._kernel_facts(inner, body, *position, {})
    else:
        kernel = f._matmul_kernel(inner, body, *position, where=where)
    facts.fused_limits.extend(inner.fused_limits)
    if kernel is None:
        facts.problems.extend(inner.problems)
        return None
    problems = list(inner.problems)
    if kernel.style not in (f.KernelStyle.SDPA, f.KernelStyle.MATMUL):
        problems.append(
            f"{where} runs attention as {kernel.style.value}; a callee is followed for "
            "scaled_dot_product_attention and matmul attention, whose output is [b, h, s, d]"
        )
    params = f._params(callee.func)[1:]
    positional = [a for a in call.args if a.keyword is None]
    if any(a.star for a in call.args):
        problems.append(f"{facts.name}.forward passes *args/**kwargs to self.{callee.attr}")
    bound: dict[str, cst.BaseExpression] = {
        p: a.value for p, a in zip(params, positional, strict=False)
    }
    bound.update({a.keyword.value: a.value for a in call.args if a.keyword is not None})
    before = list(body.body[: position[0]])
    renamed = _relayouts(where, params, before, problems)
    query, key, value = (renamed.get(n, n) for n in _kernel_operands(body, position, kernel.query))
    if query not in bound:
        problems.append(f"{where} computes attention from {kernel.query}, not a parameter")
    inputs = tuple(f.code(bound[n]) if n in bound else "?" for n in (key, value))
    if "?" in inputs:
        problems.append(f"{where} attends over keys or values that are not its parameters")
    rebind = {**bound, "self": cst.parse_expression(callee.receiver)}
    scale = None
    if kernel.scale is not None:
        scale_expr = cst.parse_expression(kernel.scale)
        local = sorted(
            f._used_names([cst.SimpleStatementLine([cst.Expr(scale_expr)])])
            & (f._assigned_names(before) - set(params))
        )
        if local:
            problems.append(f"{where} scales its scores by {kernel.scale}, which reads its locals")
        scale = f.code(scale_expr.visit(f._BindParams(rebind)))
    targets = f._targets(assign)
    if not targets:
        problems.append(f"{facts.name}.forward assigns self.{callee.attr}(...) to a non-name")
    after = _output_tail(where, body, position, kernel, before, targets, problems)
    if problems:
        facts.problems.extend(problems)
        return None
    tail = tuple(stmt.visit(f._BindParams(rebind)) for stmt in after)
    return f._Kernel(
        index=kernel_index,
        style=f.KernelStyle.SUBMODULE if callee.is_submodule else f.KernelStyle.METHOD,
        query=f.code(bound[query]),
        scale=scale,
        sinks=None,
        targets=targets,
        inputs=(inputs[0], inputs[1]),
        after=tail,
    )


def _relayouts(
    where: str, params: list[str], before: list[cst.BaseStatement], problems: list[str]
) -> dict[str, str]:
    """``{name: parameter}`` the callee's statements before its kernel re-lay out or cast its
    parameters into; a problem for any other rebinding of a parameter that is not a mask."""
    renamed: dict[str, str] = {}
    from kvskill.implementer.facts import _assigned_names

    for stmt in before:
        moves = rebinds_by_relayout(stmt)
        if moves is not None and all(renamed.get(s, s) in params for s in moves.values()):
            renamed.update({t: renamed.get(s, s) for t, s in moves.items()})
            continue
        assigned = _assigned_names([stmt])
        touched = ({renamed.get(n, n) for n in assigned} | assigned) & set(params)
        # a mask is the runtime's business (the fused operator masks by itself)
        touched = {n for n in touched if "mask" not in n.lower()}
        if touched:
            problems.append(
                f"{where} changes its parameters {sorted(touched)} before attention "
                f"(`{first_line(stmt)}`), beyond a permute, transpose or cast"
            )
        for name in assigned:
            renamed.pop(name, None)
    return renamed


def _kernel_operands(
    body: cst.IndentedBlock, position: tuple[int, int], query: str
) -> tuple[str, str, str]:
    """The root names of the query, key and value the callee's kernel reads."""
    from kvskill.implementer.facts import _branch_kernel_assign, _root_name

    first = body.body[position[0]]
    if position[0] == position[1]:
        assign = (
            _branch_kernel_assign(first)
            if isinstance(first, cst.If)
            else cst.ensure_type(first, cst.SimpleStatementLine).body[0]
        )
        call = cst.ensure_type(cst.ensure_type(assign, cst.Assign).value, cst.Call)
        positional = [a.value for a in call.args if a.keyword is None]
        offset = 0 if m.matches(call, SDPA_CALL) else 1
        names = [_root_name(e) or "?" for e in positional[offset : offset + 3]]
        return names[0], names[1], names[2]
    product = scores_matmul(
        cst.ensure_type(cst.ensure_type(first, cst.SimpleStatementLine).body[0], cst.Assign).value
    )
    assert product is not None, "matmul_attention found these scores"
    output = cst.ensure_type(
        cst.ensure_type(body.body[position[1]], cst.SimpleStatementLine).body[0], cst.Assign
    ).value
    mixed = cst.ensure_type(output, cst.Call).args[1].value
    return (
        _root_name(cst.parse_expression(query)) or "?",
        _root_name(product.args[1].value) or "?",
        _root_name(mixed) or "?",
    )


def _output_tail(
    where: str,
    body: cst.IndentedBlock,
    position: tuple[int, int],
    kernel,
    before: list[cst.BaseStatement],
    targets: list[str],
    problems: list[str],
) -> list[cst.BaseStatement]:
    """The callee's statements after its kernel, as they will run after the seam: its
    output renamed to the forward's first target and its return turned into that
    assignment. A problem when they do more than re-lay out the output (a branch, a read of
    the attention weights the fused operator does not produce, a local from before the
    kernel)."""
    from kvskill.implementer.facts import _assigned_names, _used_names, code

    stmts = list(body.body[position[1] + 1 :])
    output, dropped = kernel.targets[0], set(kernel.targets[1:])
    if not stmts or not m.matches(stmts[-1], m.SimpleStatementLine(body=[m.Return()])):
        problems.append(f"{where} does not end with a return of its attention output")
        return []
    returned = cst.ensure_type(
        cst.ensure_type(stmts[-1], cst.SimpleStatementLine).body[0], cst.Return
    ).value
    first = returned.elements[0].value if isinstance(returned, cst.Tuple) else returned
    middle = stmts[:-1]
    for stmt in middle:
        if not isinstance(stmt, cst.SimpleStatementLine) or m.findall(stmt, m.Return()):
            problems.append(
                f"{where} does more than re-lay out its attention output before returning it "
                f"(`{first_line(stmt)}`)"
            )
            return []
    tail_names = (
        _used_names([*middle, cst.SimpleStatementLine([cst.Expr(first)])]) if first else set()
    )
    read_dropped = sorted(tail_names & dropped)
    if first is None or read_dropped:
        problems.append(
            f"{where} returns {read_dropped or 'nothing'} computed from its attention weights, "
            "which the fused operator does not produce"
        )
        return []
    stale = sorted(tail_names & (_assigned_names(before) - {output}) - _assigned_names(middle))
    if stale:
        problems.append(
            f"{where} re-lays out its attention output with {stale}, computed before the "
            "attention, which the seam replaces"
        )
        return []
    rename = {output: cst.Name(targets[0])} if targets else {}
    tail = [stmt.visit(_Rename(rename)) for stmt in middle]
    if not m.matches(first, m.Name(output)):
        value = first.visit(_Rename(rename))
        tail.append(cst.parse_statement(f"{targets[0]} = {code(value)}"))
    return tail


def first_line(stmt: cst.BaseStatement) -> str:
    """The first line of STMT as the file spells it, without the comments leading into it."""
    from kvskill.implementer.facts import code

    return code(stmt.with_changes(leading_lines=[])).splitlines()[0]


class _Rename(cst.CSTTransformer):
    """Names replaced by other names (the callee's output by the forward's target)."""

    def __init__(self, names: dict[str, cst.Name]) -> None:
        super().__init__()
        self.names = names

    def leave_Attribute(
        self, original_node: cst.Attribute, updated_node: cst.Attribute
    ) -> cst.BaseExpression:
        return updated_node.with_changes(attr=original_node.attr)

    def leave_Name(self, original_node: cst.Name, updated_node: cst.Name) -> cst.BaseExpression:
        return self.names.get(original_node.value, updated_node)


__all__ = [
    "RELAYOUT_OR_CAST",
    "RESHAPES",
    "callee_kernel",
    "first_line",
    "Callee",
    "class_callees",
    "kernel_position",
    "rebinds_by_relayout",
    "relayout_root",
    "scores_matmul",
]
