"""A per-position rescale of the query between the latent cache write and attention.

Mistral Large 4 scales each query vector by a factor of its head and position after the cache
write (``MistralLarge4TextSoftmaxScaling``)::

    query_states = torch.cat((q_pass, q_rot), dim=-1)
    query_states = self.softmax_scaling(query_states, position_ids, head_dim_first=True)

    def forward(self, query_states, position_ids, head_dim_first):
        log_pos = (position_ids + 1).float().log()
        ...
        return query_states * scale.unsqueeze(-1)        # one factor per (head, position)

The paged seam replaces the statements between the write and the kernel, so the rescale has
to run in the converted forward too. It is kept only when the module provably multiplies
every query vector by one factor computed elementwise from its own position and the module's
parameters: then the packed batch of the runtime (``position_ids`` ``[1, T]``) gives every
token the factor it has alone, and, the factor being constant along the last axis, scaling
the two query parts apart equals scaling their concatenation. Anything else stays a rebind
the seam refuses.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

import libcst as cst
import libcst.matchers as m
from kvskill.analyzer.gather import method


def _code(node: cst.CSTNode) -> str:
    return cst.Module(body=[]).code_for_node(node).strip()


#: calls the factor may be computed with: elementwise maths, casts and axis insertion
_ELEMENTWISE = frozenset(
    {
        "float",
        "double",
        "half",
        "bfloat16",
        "to",
        "type",
        "log",
        "log1p",
        "log2",
        "exp",
        "sqrt",
        "rsqrt",
        "abs",
        "clamp",
        "floor",
        "ceil",
        "unsqueeze",
    }
)
#: attributes of the query the factor may read (never its values)
_QUERY_META = frozenset({"dtype", "device"})
#: ``<factor>.unsqueeze(-1)``: one factor per query vector, broadcast over its last axis
_PER_VECTOR = m.Call(
    func=m.Attribute(attr=m.Name("unsqueeze")),
    args=[m.Arg(value=m.UnaryOperation(operator=m.Minus(), expression=m.Integer("1")))],
)


@dataclass(frozen=True, kw_only=True)
class QueryRescale:
    """``<query> = self.<attr>(<query>, <args>)``, verified per position."""

    #: the attention's attribute holding the rescale module
    attr: str
    #: the call as written
    call: cst.Call

    def applied_to(self, name: str) -> cst.SimpleStatementLine:
        """The same rescale of the tensor NAME (a part of the query, same layout)."""
        first = self.call.args[0].with_changes(value=cst.Name(name))
        call = self.call.with_changes(args=[first, *self.call.args[1:]])
        return cst.SimpleStatementLine(
            body=[cst.Assign(targets=[cst.AssignTarget(target=cst.Name(name))], value=call)]
        )


def query_rescale(
    assign: cst.Assign,
    query: str,
    modules: dict[str, cst.Call],
    classes: dict[str, cst.ClassDef],
    bound_before: set[str],
) -> QueryRescale | str | None:
    """The rescale ASSIGN makes of QUERY, why it is not one that can be kept, or None when
    ASSIGN is not ``<query> = self.<attr>(<query>, ...)`` at all.

    Args:
        modules: the attention's ``self.<attr> = Cls(...)`` calls of ``__init__``.
        bound_before: names bound before the cache write (forward parameters included): the
            call's other arguments may read only those, which the seam leaves as they are.
    """
    call = m.Call(
        func=m.Attribute(value=m.Name("self"), attr=m.Name()),
        args=[m.Arg(value=m.Name(query), keyword=None), m.ZeroOrMore()],
    )
    if not (
        len(assign.targets) == 1
        and m.matches(assign.targets[0].target, m.Name(query))
        and m.matches(assign.value, call)
    ):
        return None
    found = cst.ensure_type(assign.value, cst.Call)
    attr = cst.ensure_type(found.func, cst.Attribute).attr.value
    where = f"`{_code(assign)}`"
    made = modules.get(attr)
    cls = classes.get(_code(made.func).split(".")[-1]) if made is not None else None
    if cls is None:
        return f"{where}: self.{attr} is not a module class of this file"
    read = {n for arg in found.args[1:] for n in _names(arg.value)} - {"self"}
    late = sorted(read - bound_before)
    if late:
        return f"{where} reads {late}, bound after the cache write"
    reason = _not_per_position(cls)
    if reason:
        return f"{where}: {cls.name.value}.forward {reason}"
    return QueryRescale(attr=attr, call=found)


def _names(node: cst.CSTNode) -> set[str]:
    """Plain names NODE reads (``q`` of ``q.dtype``, never the attribute name)."""
    attrs = {id(a.attr) for a in m.findall(node, m.Attribute()) if isinstance(a, cst.Attribute)}
    return {
        cst.ensure_type(n, cst.Name).value
        for n in m.findall(node, m.Name())
        if id(n) not in attrs and n.value not in ("None", "True", "False")
    }


def _not_per_position(cls: cst.ClassDef) -> str | None:
    """Why CLS's forward is not ``return q * <factor>.unsqueeze(-1)`` with the factor built
    elementwise from the other arguments and the module's parameters, or None when it is."""
    forward = method(cls, "forward")
    if forward is None or len(forward.params.params) < 2:
        return "is not forward(self, query, ...)"
    query = forward.params.params[1].name.value
    body = list(cst.ensure_type(forward.body, cst.IndentedBlock).body)
    *steps, last = body
    product = m.SimpleStatementLine(
        body=[
            m.Return(
                value=m.BinaryOperation(
                    left=m.Name(query), operator=m.Multiply(), right=_PER_VECTOR
                )
            )
        ]
    )
    if not m.matches(last, product):
        return f"does not end with `return {query} * <factor>.unsqueeze(-1)`"
    factor = cst.ensure_type(
        cst.ensure_type(cst.ensure_type(last, cst.SimpleStatementLine).body[0], cst.Return).value,
        cst.BinaryOperation,
    ).right
    for stmt in [*steps, factor]:
        # a branch on a flag (the query's layout) is fine when both arms are elementwise
        if isinstance(stmt, cst.BaseCompoundStatement) and not isinstance(stmt, cst.If):
            return f"loops or opens a block (`{_code(stmt).splitlines()[0]}`) before its product"
        if m.findall(stmt, m.Return()):
            return f"returns early (`{_code(stmt).splitlines()[0]}`)"
        reason = _elementwise(stmt, query)
        if reason:
            return reason
    return None


def _elementwise(node: cst.CSTNode, query: str) -> str | None:
    """Why NODE is not elementwise arithmetic that reads QUERY only for its dtype or device."""
    for call in m.findall(node, m.Call()):
        func = cst.ensure_type(call, cst.Call).func
        name = func.attr.value if isinstance(func, cst.Attribute) else _code(func)
        if name not in _ELEMENTWISE:
            return f"calls `{_code(func)}(...)`, not an elementwise operation"
    for sub in m.findall(node, m.SubscriptElement()):
        index = cst.ensure_type(sub, cst.SubscriptElement).slice
        whole = m.matches(index, m.Index(value=m.Name("None") | m.Ellipsis())) or m.matches(
            index, m.Slice(lower=None, upper=None, step=None)
        )
        if not whole:
            return f"indexes `{_code(index)}`, which may mix positions"
    for attr in m.findall(node, m.Attribute(value=m.Name(query))):
        if cst.ensure_type(attr, cst.Attribute).attr.value not in _QUERY_META:
            return f"reads `{_code(attr)}` of the query"
    bare = {id(a.value) for a in m.findall(node, m.Attribute(value=m.Name(query)))}
    if any(id(n) not in bare for n in m.findall(node, m.Name(query))):
        return f"reads the query's values besides the product (`{_code(node).splitlines()[0]}`)"
    return None


#: ``x = self.<attr>(x, ...)`` in the text: files without one are not parsed
_CANDIDATE = re.compile(r"^\s*(\w+) = self\.\w+\(\1\b", re.M)


@dataclass(frozen=True, kw_only=True)
class RescaleSite:
    """A per-position query rescale found in a modeling file, for the analyzer's evidence."""

    owner: str
    line: int
    statement: str
    module_class: str


def rescale_sites(modeling_file: str) -> list[RescaleSite]:
    """Every ``x = self.<attr>(x, ...)`` in a class's forward whose module class multiplies x
    by one factor per vector computed elementwise (``_not_per_position``), with its line."""
    return list(_sites_in(Path(modeling_file).read_text(encoding="utf-8")))


@functools.lru_cache(maxsize=8)
def _sites_in(text: str) -> tuple[RescaleSite, ...]:
    """:func:`rescale_sites` of a file's TEXT (cached: analyze and verify both ask)."""
    if not _CANDIDATE.search(text):
        return ()
    # NOTE: a plain parse; the line is looked up in the text (position metadata over a whole
    # modeling file costs seconds, and most files have no site)
    module = cst.parse_module(text)
    classes = {c.name.value: c for c in module.body if isinstance(c, cst.ClassDef)}
    sites = []
    for cls in classes.values():
        forward, init = method(cls, "forward"), method(cls, "__init__")
        if forward is None or init is None:
            continue
        modules = _module_classes(init, classes)
        for node in m.findall(forward, m.Assign(targets=[m.AssignTarget(target=m.Name())])):
            assign = cst.ensure_type(node, cst.Assign)
            name = cst.ensure_type(assign.targets[0].target, cst.Name).value
            call = assign.value
            if not m.matches(call, m.Call(func=m.Attribute(value=m.Name("self")))):
                continue
            attr = cst.ensure_type(cst.ensure_type(call, cst.Call).func, cst.Attribute).attr.value
            target = modules.get(attr)
            first = cst.ensure_type(call, cst.Call).args
            if target is None or not first or not m.matches(first[0].value, m.Name(name)):
                continue
            if _not_per_position(target) is None:
                sites.append(
                    RescaleSite(
                        owner=cls.name.value,
                        line=_line_of(text, _code(assign)),
                        statement=_code(assign),
                        module_class=target.name.value,
                    )
                )
    return tuple(sites)


def _module_classes(
    init: cst.FunctionDef, classes: dict[str, cst.ClassDef]
) -> dict[str, cst.ClassDef]:
    """``self.<attr> = Cls(...)`` of ``__init__`` whose class is in the file, by attribute."""
    found = {}
    for node in m.findall(
        init, m.Assign(targets=[m.AssignTarget(target=m.Attribute(value=m.Name("self")))])
    ):
        assign = cst.ensure_type(node, cst.Assign)
        if isinstance(assign.value, cst.Call):
            cls = classes.get(_code(assign.value.func).split(".")[-1])
            if cls is not None:
                found[cst.ensure_type(assign.targets[0].target, cst.Attribute).attr.value] = cls
    return found


def _line_of(text: str, statement: str) -> int:
    """1-based line of the first line of STATEMENT in TEXT (0 when it spans lines it does
    not match verbatim)."""
    first = statement.splitlines()[0].strip()
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip() == first:
            return number
    return 0
