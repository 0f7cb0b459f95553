"""Recognise fused-attention calls and the branch (prefill / decode, sliding / full) they
sit in, however the operator is reached.

All of these are the same operator to the rules:
``torch_npu.npu_fused_infer_attention_score(...)``, ``torch.ops.npu.<op>(...)`` and its
``.default``, ``import torch_npu as tnpu; tnpu.<op>(...)``, ``from torch_npu import <op>``,
``from kvskill.runtime.ops import torch_npu``, ``self.fa_ops.<op>(...)`` and a local or
``self.`` alias such as ``fa = torch_npu.<op>``.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass
from enum import Enum

import libcst as cst
import libcst.matchers as m
from kvskill.analyzer import gather
from kvskill.analyzer.lint.context import FileContext

FA_V1, FA_V2 = gather.FA_OPS
#: operator name -> FA version
FA_OPS = {FA_V1: "v1", FA_V2: "v2"}

#: default values of the keywords the rules read (npu_ops.md §1.1 / §2.1)
DEFAULT_SPARSE_MODE = 0


class Phase(str, Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class FaCall:
    """One call of FA v1 or v2 and its keyword arguments."""

    node: cst.Call
    version: str  #: "v1" | "v2"
    kwargs: dict[str, cst.Arg]
    has_star_kwargs: bool  #: ``**options`` given: any keyword may be hidden in it

    def kw(self, name: str) -> cst.BaseExpression | None:
        arg = self.kwargs.get(name)
        return arg.value if arg is not None else None

    @property
    def is_mla(self) -> bool:
        """The rope-split MLA path (query_rope / key_rope given)."""
        return "query_rope" in self.kwargs or "key_rope" in self.kwargs


def op_name(ctx: FileContext, func: cst.BaseExpression) -> str | None:
    """The fused-attention operator ``func`` refers to, or None."""
    return operator_name(ctx, func, FA_OPS, mentioned=ctx.mentions_fa)


def operator_name(
    ctx: FileContext,
    func: cst.BaseExpression,
    ops: Collection[str],
    *,
    mentioned: bool,
    depth: int = 0,
) -> str | None:
    """Which of ``ops`` the callee ``func`` refers to, or None.

    ``mentioned`` says whether any of the names appears in the file at all; without it no
    import can bind one, and the (costly) scope analysis is skipped.
    """
    if depth > 6:
        return None
    if isinstance(func, cst.Attribute):
        if func.attr.value in ops:
            return func.attr.value
        if func.attr.value == "default" and isinstance(func.value, cst.Attribute):
            return operator_name(ctx, func.value, ops, mentioned=mentioned, depth=depth + 1)
    if isinstance(func, cst.Name):
        if func.value in ops:
            return func.value
        if not mentioned:
            return None
        for qualified in ctx.qualified(func):
            last = qualified.rsplit(".", 1)[-1]
            if last in ops:
                return last
    # an alias: ``fa = torch_npu.<op>`` or ``self.fa = torch_npu.<op>``
    values = ctx.assigned_values(func) if isinstance(func, cst.Name | cst.Attribute) else None
    if values:
        names = {
            operator_name(ctx, value, ops, mentioned=mentioned, depth=depth + 1) for value in values
        }
        if len(names) == 1:
            return names.pop()
    return None


def fa_calls(ctx: FileContext) -> list[FaCall]:
    """Every fused-attention call in the file, in source order (computed once per file)."""
    cached = ctx.cache.get("fa_calls")
    if cached is not None:
        return cached
    out: list[FaCall] = []
    ctx.cache["fa_calls"] = out
    if not ctx.mentions_fa:
        return out
    for call in ctx.calls:
        name = op_name(ctx, call.func)
        if name is None:
            continue
        kwargs = {a.keyword.value: a for a in call.args if a.keyword is not None}
        star = any(a.star == "**" for a in call.args)
        out.append(FaCall(call, FA_OPS[name], kwargs, star))
    return out


_PREFILL_WORD = re.compile(r"prefill", re.IGNORECASE)
_DECODE_WORD = re.compile(r"decod", re.IGNORECASE)
_SLIDING_WORD = re.compile(r"sliding|SlidingWindow|window", re.IGNORECASE)


def _polarity(test: cst.BaseExpression, held: bool) -> tuple[cst.BaseExpression, bool]:
    """Strip ``not`` and ``== False`` so the caller sees a bare test and whether it held."""
    while isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not):
        test, held = test.expression, not held
    return test, held


def _conjuncts(test: cst.BaseExpression, held: bool) -> list[tuple[cst.BaseExpression, bool]]:
    """Tests known to hold (or fail) on this branch: ``a and b`` held means both held."""
    test, held = _polarity(test, held)
    if isinstance(test, cst.BooleanOperation):
        if isinstance(test.operator, cst.And) and held:
            return _conjuncts(test.left, True) + _conjuncts(test.right, True)
        if isinstance(test.operator, cst.Or) and not held:
            return _conjuncts(test.left, False) + _conjuncts(test.right, False)
        return []
    return [(test, held)]


def _flag_text(ctx: FileContext, test: cst.BaseExpression) -> str | None:
    """The text of a test that is a plain flag (name, attribute, call or comparison with a
    string), or None for anything more complex."""
    if isinstance(test, cst.Name | cst.Attribute | cst.Call | cst.Comparison):
        return ctx.code(test)
    return None


def phase_of(ctx: FileContext, node: cst.CSTNode, _seen: frozenset = frozenset()) -> Phase | None:
    """Whether ``node`` only runs in prefill, only in decode, or (None) either / unknown.

    Reads the innermost ``if`` whose test names prefill or decode (``md.is_prefill``,
    ``not is_prefill``, ``if is_decode``), then the enclosing function's name
    (``forward_decode``, ``_prefill_attention``), then where the class reaches that method:
    the executor's DeepSeek forward picks ``fn = self.forward_page_attention_normal`` only
    under ``if is_prefill``, so everything in that method is prefill.
    """
    phase = _phase_here(ctx, node)
    if phase is not None:
        return phase
    return _phase_of_callers(ctx, node, _seen)


def _phase_here(ctx: FileContext, node: cst.CSTNode) -> Phase | None:
    for test, held in ctx.branches(node):
        for part, part_held in _conjuncts(test, held):
            text = _flag_text(ctx, part)
            if text is None:
                continue
            if isinstance(part, cst.Comparison):
                continue  # `q_len == 1` and friends: too many spellings to trust
            if _PREFILL_WORD.search(text):
                return Phase.PREFILL if part_held else Phase.DECODE
            if _DECODE_WORD.search(text):
                return Phase.DECODE if part_held else Phase.PREFILL
    function = ctx.enclosing_function(node)
    while function is not None:
        name = function.name.value
        if _DECODE_WORD.search(name) and not _PREFILL_WORD.search(name):
            return Phase.DECODE
        if _PREFILL_WORD.search(name) and not _DECODE_WORD.search(name):
            return Phase.PREFILL
        function = ctx.enclosing_function(function)
    return None


def _phase_of_callers(ctx: FileContext, node: cst.CSTNode, seen: frozenset) -> Phase | None:
    """The one phase every ``self.<method>`` reference to ``node``'s method runs in, or None
    (no reference, references in both phases or in an unknown one)."""
    method = ctx.enclosing_function(node)
    cls = ctx.enclosing_class(method) if method is not None else None
    if method is None or cls is None or ctx.enclosing_function(method) is not None:
        return None
    key = (cls, method.name.value)
    if key in seen:
        return None  # a method reaching itself says nothing about its phase
    refs = _self_refs(ctx, cls).get(method.name.value, [])
    phases = {phase_of(ctx, ref, seen | {key}) for ref in refs}
    return phases.pop() if len(phases) == 1 else None


def _self_refs(ctx: FileContext, cls: cst.ClassDef) -> dict[str, list[cst.Attribute]]:
    """``self.<name>`` expressions in CLS's methods, by name (computed once per class)."""
    memo = ctx.cache.setdefault("self_refs", {})
    if cls not in memo:
        found: dict[str, list[cst.Attribute]] = {}
        for attr in m.findall(cls, m.Attribute(value=m.Name("self"))):
            attr = cst.ensure_type(attr, cst.Attribute)
            found.setdefault(attr.attr.value, []).append(attr)
        memo[cls] = found
    return memo[cls]


def in_sliding_branch(ctx: FileContext, node: cst.CSTNode) -> bool | None:
    """True inside ``if self.sliding_window:`` (or an attn_type == "SlidingWindow" test),
    False in its else part, None when no such test guards ``node``."""
    for test, held in ctx.branches(node):
        for part, part_held in _conjuncts(test, held):
            text = _flag_text(ctx, part)
            if text is None or not _SLIDING_WORD.search(text):
                continue
            if isinstance(part, cst.Comparison):
                ops = {type(t.operator) for t in part.comparisons}
                if ops <= {cst.Equal, cst.Is}:
                    # `attn_type == "SlidingWindow"` holds on the sliding path;
                    # `self.sliding_window is None` holds on the full path.
                    return not part_held if "None" in text else part_held
                if ops <= {cst.NotEqual, cst.IsNot}:
                    # `self.sliding_window is not None` holds on the sliding path;
                    # `attn_type != "SlidingWindow"` holds on the full path.
                    return part_held if "None" in text else not part_held
                continue
            return part_held
    return None


def sparse_modes(ctx: FileContext, call: FaCall) -> frozenset | None:
    """The sparse_mode values this call can run with; None when not statically known."""
    expr = call.kw("sparse_mode")
    if expr is None:
        return None if call.has_star_kwargs else frozenset({DEFAULT_SPARSE_MODE})
    return ctx.possible_values(expr)


def mask_is_none(ctx: FileContext, call: FaCall) -> bool:
    """True only when the call certainly passes no attention mask."""
    expr = call.kw("atten_mask")
    if expr is None:
        # atten_mask is keyword-only; only a ** splat can hide one
        return not call.has_star_kwargs
    return ctx.possible_values(expr) == frozenset({None})
