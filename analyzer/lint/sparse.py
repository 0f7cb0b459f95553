"""Recognise the DeepSeek sparse attention (DSA) operator calls and the keywords they pass.

The operators: ``npu_lightning_indexer`` (top-k positions) and ``npu_sparse_flash_attention``
(attention over them), with their quantized twins, reached as the fused attention is
(``torch_npu.<op>``, ``torch.ops.npu.<op>``, imports and aliases; see ``fa.py``). The
framework's DSA models pass their keywords through a dict:

    kwargs = {"query": q, "block_table": bt, "layout_kv": "PA_BSND", "sparse_mode": 3}
    if quant:
        kwargs.update({"key_quant_mode": 2})
    torch_npu.npu_sparse_flash_attention(**kwargs)

so a ``**name`` whose name is bound to dict literals in the function is read as keywords:
the literal's keys plus every ``name.update({...})`` in the same function (the latter may
or may not run, so they add possible values, never certainty).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst
import libcst.matchers as m
from kvskill.analyzer.lint.context import FileContext
from kvskill.analyzer.lint.fa import operator_name

LIGHTNING_INDEXER = "npu_lightning_indexer"
SPARSE_ATTENTION = "npu_sparse_flash_attention"
QUANT_LIGHTNING_INDEXER = "npu_quant_lightning_indexer"
QUANT_SPARSE_ATTENTION = "npu_kv_quant_sparse_flash_attention"
#: operator -> the keyword naming its key/value layout
KEY_LAYOUT_KEYWORD = {
    LIGHTNING_INDEXER: "layout_key",
    QUANT_LIGHTNING_INDEXER: "layout_key",
    SPARSE_ATTENTION: "layout_kv",
    QUANT_SPARSE_ATTENTION: "layout_kv",
}
SPARSE_OPS = tuple(KEY_LAYOUT_KEYWORD)
PAGED_LAYOUT = "PA_BSND"
#: schema defaults of the keywords the rules read (torch_npu 2.13.0)
DEFAULTS = {"layout_key": "BSND", "layout_kv": "BSND", "sparse_mode": 3, "attention_mode": 0}


@dataclass(frozen=True)
class SparseCall:
    """One DSA operator call and the keyword values it can pass."""

    node: cst.Call
    op: str
    #: keyword -> every expression that can supply it
    kwargs: dict[str, list[cst.BaseExpression]]
    #: keywords passed on every path (written in the call or in the dict literal itself)
    certain: frozenset[str]
    #: False when a ``**`` splat could not be read: any keyword may be hidden in it
    complete: bool = field(default=True)

    @property
    def key_layout_keyword(self) -> str:
        return KEY_LAYOUT_KEYWORD[self.op]

    def first(self, name: str) -> cst.BaseExpression | None:
        values = self.kwargs.get(name)
        return values[0] if values else None

    def values(self, ctx: FileContext, name: str) -> frozenset | None:
        """The literal values ``name`` can take (its default when it may be left out), or
        None when any of them is not statically known."""
        exprs = self.kwargs.get(name, [])
        if not exprs and not self.complete:
            return None
        out: frozenset = frozenset()
        for expr in exprs:
            part = ctx.possible_values(expr)
            if part is None:
                return None
            out |= part
        if name not in self.certain:
            if not self.complete:
                return None
            out |= {DEFAULTS.get(name)}
        return out

    def may_pass(self, ctx: FileContext, name: str) -> bool:
        """Some path passes ``name`` with a value that is not certainly None."""
        return any(
            ctx.possible_values(expr) != frozenset({None}) for expr in self.kwargs.get(name, [])
        )

    def never_passes(self, ctx: FileContext, name: str) -> bool:
        """Certainly no path passes ``name`` (or only None)."""
        return self.complete and not self.may_pass(ctx, name)


def sparse_calls(ctx: FileContext) -> list[SparseCall]:
    """Every DSA operator call in the file, in source order (computed once per file)."""
    cached = ctx.cache.get("sparse_calls")
    if cached is not None:
        return cached
    out: list[SparseCall] = []
    ctx.cache["sparse_calls"] = out
    mentioned = any(op in ctx.source for op in SPARSE_OPS)
    if not mentioned:
        return out
    for call in ctx.calls:
        name = operator_name(ctx, call.func, SPARSE_OPS, mentioned=True)
        if name is not None:
            out.append(_read_call(ctx, call, name))
    return out


def _read_call(ctx: FileContext, call: cst.Call, op: str) -> SparseCall:
    kwargs: dict[str, list[cst.BaseExpression]] = {}
    certain: set[str] = set()
    complete = True
    for arg in call.args:
        if arg.keyword is not None:
            kwargs.setdefault(arg.keyword.value, []).append(arg.value)
            certain.add(arg.keyword.value)
        elif arg.star == "**":
            splat = _read_splat(ctx, arg.value)
            if splat is None:
                complete = False
                continue
            for key, (exprs, is_certain) in splat.items():
                kwargs.setdefault(key, []).extend(exprs)
                if is_certain:
                    certain.add(key)
        elif arg.star == "*":
            complete = False
    return SparseCall(call, op, kwargs, frozenset(certain), complete)


def _read_splat(
    ctx: FileContext, expr: cst.BaseExpression
) -> dict[str, tuple[list[cst.BaseExpression], bool]] | None:
    """Keys of a ``**name`` built from dict literals and ``name.update({...})`` calls, each
    with its value expressions and whether every path sets it; None when not readable."""
    if isinstance(expr, cst.Dict):
        literals, updates = [expr], []
    elif isinstance(expr, cst.Name):
        bound = ctx.assigned_values(expr)
        if not bound or not all(isinstance(v, cst.Dict) for v in bound):
            return None
        function = ctx.enclosing_function(expr)
        if function is None or _written_by_subscript(function, expr.value):
            return None
        literals = [cst.ensure_type(v, cst.Dict) for v in bound]
        found = _updates(ctx, function, expr.value)
        if found is None:
            return None
        # an update on every path to the call sets its keys as surely as the literal does
        before = [d for d, call in found if _runs_before(ctx, call, expr)]
        literals = [_merged(lit, before) for lit in literals]
        updates = [d for d, call in found if not _runs_before(ctx, call, expr)]
    else:
        return None
    literal_entries = [_entries(literal) for literal in literals]
    update_entries = [_entries(update) for update in updates]
    if any(e is None for e in (*literal_entries, *update_entries)):
        return None
    # a key every literal binding sets is passed on every path; an update may not run
    certain = set.intersection(*(set(e) for e in literal_entries))
    out: dict[str, tuple[list[cst.BaseExpression], bool]] = {}
    for entries in (*literal_entries, *update_entries):
        for key, value in entries.items():
            out.setdefault(key, ([], key in certain))[0].append(value)
    return out


def _entries(literal: cst.Dict) -> dict[str, cst.BaseExpression] | None:
    out = {}
    for element in literal.elements:
        if not isinstance(element, cst.DictElement) or not isinstance(
            element.key, cst.SimpleString
        ):
            return None  # a `**other` inside the literal, or a computed key
        key = element.key.evaluated_value
        if not isinstance(key, str):
            return None
        out[key] = element.value
    return out


def _merged(literal: cst.Dict, updates: list[cst.Dict]) -> cst.Dict:
    """``literal`` with the entries of ``updates`` appended (later keys win, as in Python)."""
    elements = list(literal.elements)
    for update in updates:
        elements.extend(update.elements)
    return literal.with_changes(elements=elements)


def _runs_before(ctx: FileContext, update: cst.Call, use: cst.CSTNode) -> bool:
    """The statement holding ``update`` sits in a block that also holds ``use`` (directly or
    nested) and comes first: every path to ``use`` runs it."""
    statement = next(
        (a for a in ctx.ancestors(update) if isinstance(a, cst.SimpleStatementLine)), None
    )
    block = ctx.parent(statement) if statement is not None else None
    if block is None or not hasattr(block, "body"):
        return False
    for ancestor in ctx.ancestors(use):
        if ctx.parent(ancestor) is block:
            body = list(block.body)
            return body.index(statement) < body.index(ancestor)
    return False


def _updates(
    ctx: FileContext, function: cst.FunctionDef, name: str
) -> list[tuple[cst.Dict, cst.Call]] | None:
    """The dict literals ``name.update({...})`` adds in ``function``, with their calls; None
    when one is not a literal."""
    found = []
    for call in m.findall(
        function, m.Call(func=m.Attribute(value=m.Name(name), attr=m.Name("update")))
    ):
        call = cst.ensure_type(call, cst.Call)
        if (
            len(call.args) != 1
            or not isinstance(call.args[0].value, cst.Dict)
            or call.args[0].keyword
        ):
            return None
        found.append((call.args[0].value, call))
    return found


def _written_by_subscript(function: cst.FunctionDef, name: str) -> bool:
    """``name[...] = value`` anywhere in the function (keys this reader does not follow)."""
    target = m.AssignTarget(target=m.Subscript(value=m.Name(name)))
    return bool(m.findall(function, m.Assign(targets=[m.ZeroOrMore(), target, m.ZeroOrMore()])))
