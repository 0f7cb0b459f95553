"""How a modeling file rotates query and key channels, read with libcst from its rotation
functions (never run).

Two channel pairings exist. *Half* (GPT-NeoX / Llama ``rotate_half``): channel i turns with
channel i + d/2. *Interleaved* (GPT-J, Meta's original LLaMA, ChatGLM, DeepSeek): channel 2i
turns with channel 2i + 1. Files write the interleaved rotation in four shapes:

- complex numbers: ``torch.view_as_complex`` over ``reshape(..., -1, 2)`` (DeepSeek-V2);
- strided slices: ``x[..., ::2]`` and ``x[..., 1::2]`` (GPT-J's ``rotate_every_two``, GLM);
- explicit pairs: ``reshape(..., d // 2, 2)`` then ``[..., 0]`` / ``[..., 1]`` (ChatGLM3);
- a de-interleaving permutation ``view(..., d // 2, 2).transpose(...)`` before a half
  rotation (DeepSeek-V3 hub code): pairs of the stored layout, rotated in half order.

A rotation may cover only part of each head (*partial* rotary); the rest passes through.
"""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst
import libcst.matchers as m

#: shapes of the interleaved rotation -> how the evidence names them
INTERLEAVED_SHAPES = {
    "complex": "view_as_complex pairs",
    "strided": "[..., ::2] / [..., 1::2] pairs",
    "pairs": "reshape(..., 2) pairs [..., 0] / [..., 1]",
    "permute": "view(..., d // 2, 2).transpose de-interleaving",
}

_SHAPE_CALLS = m.Name("view") | m.Name("reshape")


@dataclass(frozen=True, kw_only=True)
class RotationFacts:
    """What one function's body shows."""

    #: a key of INTERLEAVED_SHAPES, or None (half, or no rotation at all)
    interleaved: str | None
    #: slices ``[..., :n]`` and ``[..., n:]``: a tail of the head passes through unrotated
    passes_tail: bool
    #: names of the plain functions it calls
    callees: frozenset[str]


def function_facts(source: str) -> RotationFacts | None:
    """The facts of a module-level function's source text; None when it does not parse."""
    try:
        module = cst.parse_module(source)
    except cst.ParserSyntaxError:
        return None
    return RotationFacts(
        interleaved=_interleaved_shape(module),
        passes_tail=_passes_tail(module),
        callees=frozenset(
            cst.ensure_type(call, cst.Call).func.value  # type: ignore[attr-defined]
            for call in m.findall(module, m.Call(func=m.Name()))
        ),
    )


def _interleaved_shape(node: cst.CSTNode) -> str | None:
    if m.findall(
        node, m.Call(func=m.Name("view_as_complex") | m.Attribute(attr=m.Name("view_as_complex")))
    ):
        return "complex"
    if m.findall(node, m.Slice(step=m.Integer("2"))):
        return "strided"
    pair_shape = m.Call(
        func=m.Attribute(attr=_SHAPE_CALLS),
        args=[m.ZeroOrMore(), m.Arg(value=m.Integer("2"), keyword=None)],
    )
    transposed = m.Call(
        func=m.Attribute(value=pair_shape, attr=m.Name("transpose") | m.Name("permute"))
    )
    if m.findall(node, transposed):
        return "permute"
    if m.findall(node, pair_shape) and _indexes_last(node, "0") and _indexes_last(node, "1"):
        return "pairs"
    return None


def _indexes_last(node: cst.CSTNode, index: str) -> bool:
    """``x[..., <index>]`` somewhere in ``node``."""
    return bool(
        m.findall(
            node,
            m.Subscript(
                slice=[
                    m.SubscriptElement(slice=m.Index(value=m.Ellipsis())),
                    m.SubscriptElement(slice=m.Index(value=m.Integer(index))),
                ]
            ),
        )
    )


def _passes_tail(node: cst.CSTNode) -> bool:
    """``x[..., :n]`` and ``y[..., n:]`` with a bound that is not a literal 0."""
    bound = m.MatchIfTrue(lambda v: v is not None and not m.matches(v, m.Integer("0")))

    def last(slice_: m.Slice) -> m.Subscript:
        return m.Subscript(
            slice=[
                m.SubscriptElement(slice=m.Index(value=m.Ellipsis())),
                m.SubscriptElement(slice=slice_),
            ]
        )

    head = last(m.Slice(lower=None, upper=bound, step=None))
    tail = last(m.Slice(lower=bound, upper=None, step=None))
    return bool(m.findall(node, head)) and bool(m.findall(node, tail))


def half_width_rotary(source: str) -> bool:
    """The module builds its rotary tables for half of a head: ``<X>Rotary<Y>(<dim> // 2, ...)``
    with a per-head width named ``*dim*``, ``*channels*`` or ``*head*`` (ChatGLM: ``RotaryEmbedding(rotary_dim //
    2)`` over ``kv_channels``), so only the first half of each head is rotated."""
    try:
        module = cst.parse_module(source)
    except cst.ParserSyntaxError:
        return False
    for found in m.findall(module, m.Call(args=[m.Arg(keyword=None), m.ZeroOrMore()])):
        call = cst.ensure_type(found, cst.Call)
        name = _callee_name(call.func)
        if "rotary" not in name.lower() and "rope" not in name.lower():
            continue
        first = call.args[0].value
        if not m.matches(first, m.BinaryOperation(operator=m.FloorDivide(), right=m.Integer("2"))):
            continue
        width = _callee_name(cst.ensure_type(first, cst.BinaryOperation).left).lower()
        if any(word in width for word in ("dim", "channels", "head")):
            return True
    return False


def _callee_name(node: cst.BaseExpression) -> str:
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        return node.attr.value
    return ""
