"""What a mask expression is made of: its dtype class and, when built inline, its shape."""

from __future__ import annotations

import re

import libcst as cst
from kvskill.analyzer.lint.context import FileContext

FLOAT, NOT_FLOAT = "float", "not-float"

_FLOAT_DTYPES = {"float", "float16", "float32", "float64", "half", "bfloat16", "double"}
_OK_DTYPES = {"bool", "int8", "uint8", "int16", "int32", "int64", "long", "int", "short"}
_DEFAULT_FLOAT_FACTORIES = {"ones", "zeros", "empty", "rand", "randn"}
_LIKE_FACTORIES = {"ones_like", "zeros_like", "empty_like", "full_like"}
_SAME_DTYPE_METHODS = {
    "triu",
    "tril",
    "triu_",
    "tril_",
    "view",
    "reshape",
    "contiguous",
    "unsqueeze",
    "squeeze",
    "expand",
    "clone",
    "to_dense",
    "repeat",
}
_BOOL_METHODS = {
    "bool",
    "byte",
    "char",
    "int",
    "long",
    "logical_not",
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
}
_FLOAT_METHODS = {"float", "half", "bfloat16", "double"}
_NEG_INF = re.compile(r"inf\b|finfo|-\s*1e\d|-\s*\d+\.\d*e\d", re.IGNORECASE)
_DEPTH = 6


def _callee(func: cst.BaseExpression) -> tuple[str, cst.BaseExpression | None]:
    """``torch.triu`` -> ("triu", <torch>); ``mask.bool`` -> ("bool", <mask>)."""
    if isinstance(func, cst.Attribute):
        return func.attr.value, func.value
    if isinstance(func, cst.Name):
        return func.value, None
    return "", None


def _is_module(ctx: FileContext, expr: cst.BaseExpression | None) -> bool:
    """Whether ``expr`` is the torch module (so ``torch.triu(x)`` is a function call)."""
    return expr is not None and ctx.code(expr) in ("torch", "torch.Tensor", "np", "numpy")


def _arg(call: cst.Call, index: int, keyword: str) -> cst.BaseExpression | None:
    for arg in call.args:
        if arg.keyword is not None and arg.keyword.value == keyword:
            return arg.value
    positional = [a for a in call.args if a.keyword is None and not a.star]
    return positional[index].value if index < len(positional) else None


def _dtype_class(ctx: FileContext, expr: cst.BaseExpression) -> str | None:
    text = ctx.code(expr)
    last = text.rsplit(".", 1)[-1]
    if last in _FLOAT_DTYPES and "." in text:
        return FLOAT
    if last in _OK_DTYPES and "." in text:
        return NOT_FLOAT
    if text in ("float", "bool", "int"):
        return FLOAT if text == "float" else NOT_FLOAT
    # `.to(query.dtype)`: the activations' dtype is floating point by construction
    if text.endswith(".dtype") and "mask" not in text.lower():
        return FLOAT
    return None


def mask_dtype(ctx: FileContext, expr: cst.BaseExpression, depth: int = 0) -> str | None:
    """FLOAT, NOT_FLOAT, or None when the dtype of a mask expression is not known."""
    if depth > _DEPTH:
        return None
    if isinstance(expr, cst.Comparison) or (
        isinstance(expr, cst.UnaryOperation) and isinstance(expr.operator, cst.Not)
    ):
        return NOT_FLOAT
    if isinstance(expr, cst.UnaryOperation) and isinstance(expr.operator, cst.BitInvert):
        return mask_dtype(ctx, expr.expression, depth + 1)
    if isinstance(expr, cst.Subscript):
        return mask_dtype(ctx, expr.value, depth + 1)
    if isinstance(expr, cst.BinaryOperation):
        sides = (expr.left, expr.right)
        if any(isinstance(s, cst.Float) or _NEG_INF.search(ctx.code(s)) for s in sides):
            return FLOAT
        return None
    if isinstance(expr, cst.Call):
        return _call_dtype(ctx, expr, depth)
    values = ctx.assigned_values(expr)
    if not values:
        return None
    kinds = {mask_dtype(ctx, v, depth + 1) for v in values}
    return kinds.pop() if len(kinds) == 1 else None


def _call_dtype(ctx: FileContext, call: cst.Call, depth: int) -> str | None:
    name, receiver = _callee(call.func)
    dtype = _arg(call, 99, "dtype")
    if name in ("to", "type"):
        target = dtype if dtype is not None else _arg(call, 0, "dtype")
        return _dtype_class(ctx, target) if target is not None else None
    if dtype is not None:
        return _dtype_class(ctx, dtype)
    if name == "get_init_attn_mask" or name in _BOOL_METHODS:
        return NOT_FLOAT
    if name in _FLOAT_METHODS:
        return FLOAT
    if name in ("masked_fill", "masked_fill_"):
        value = _arg(call, 1, "value")
        if value is not None and _NEG_INF.search(ctx.code(value)):
            return FLOAT
        return mask_dtype(ctx, receiver, depth + 1) if receiver is not None else None
    function_form = receiver is None or _is_module(ctx, receiver)
    if function_form and name in _DEFAULT_FLOAT_FACTORIES:
        return FLOAT  # torch.ones(...) without dtype is float32
    if function_form and name == "full":
        fill = _arg(call, 1, "fill_value")
        if fill is None:
            return None
        if isinstance(fill, cst.Float) or _NEG_INF.search(ctx.code(fill)):
            return FLOAT
        return NOT_FLOAT if ctx.code(fill) in ("True", "False") else None
    if name in _LIKE_FACTORIES or (name in _SAME_DTYPE_METHODS and function_form):
        source = _arg(call, 0, "input")
        return mask_dtype(ctx, source, depth + 1) if source is not None else None
    if name in _SAME_DTYPE_METHODS and receiver is not None:
        return mask_dtype(ctx, receiver, depth + 1)
    return None


_SHAPE_FACTORIES = {"ones", "zeros", "empty", "rand", "randn", "full"}
_DYNAMIC = re.compile(
    r"shape|size\(|len\(|seq|max_position|q_len|kv_len|num_tokens|tgt|src", re.IGNORECASE
)
MASK_SIDE = 2048


def inline_shape(ctx: FileContext, expr: cst.BaseExpression, depth: int = 0):
    """The size arguments of an inline-built mask, as expressions; None if not inline."""
    if depth > _DEPTH:
        return None
    if not isinstance(expr, cst.Call):
        for value in ctx.assigned_values(expr) or ():
            dims = inline_shape(ctx, value, depth + 1)
            if dims is not None:
                return dims
        return None
    name, receiver = _callee(expr.func)
    function_form = receiver is None or _is_module(ctx, receiver)
    if name == "get_init_attn_mask":
        side = _arg(expr, 0, "max_seq_len")
        return [side, side] if side is not None else None
    if function_form and name in _SHAPE_FACTORIES:
        positional = [a.value for a in expr.args if a.keyword is None and not a.star]
        size = _arg(expr, 99, "size")
        if size is None and positional:
            size = positional[0]
            if name != "full" and not isinstance(size, cst.Tuple | cst.List):
                return positional
        if isinstance(size, cst.Tuple | cst.List):
            return [e.value for e in size.elements]
        return None
    if function_form and name in ("triu", "tril"):
        source = _arg(expr, 0, "input")
        return inline_shape(ctx, source, depth + 1) if source is not None else None
    if receiver is not None and not function_form and name not in ("view", "reshape"):
        return inline_shape(ctx, receiver, depth + 1)
    return None


def shape_problem(ctx: FileContext, dims: list[cst.BaseExpression]) -> str | None:
    """Why a mask of size ``dims`` is not the compressed [2048, 2048] tile, or None when
    it is (or when that cannot be told)."""
    known: list[int | None] = []
    for dim in dims:
        values = ctx.possible_values(dim)
        if values is not None and len(values) == 1 and isinstance(next(iter(values)), int):
            known.append(next(iter(values)))
        elif _DYNAMIC.search(ctx.code(dim)):
            return f"its size follows the sequence ({ctx.code(dim)})"
        else:
            known.append(None)
    while len(known) > 2 and known[0] == 1:
        known.pop(0)
    shown = "[" + ", ".join("?" if k is None else str(k) for k in known) + "]"
    if any(k is not None and k != MASK_SIDE for k in known):
        return f"it is built as {shown}"
    if len(known) != 2 and all(k is not None for k in known):
        return f"it is built as {shown}"
    return None
