"""The softmax scale the fused attention must be given, and where it comes from.

``head_dim^-0.5`` by default; ``query_pre_attn_scalar^-0.5`` or ``attention_multiplier`` when
the config sets one; for MLA the head dim is ``qk_nope_head_dim + qk_rope_head_dim`` and a YaRN
``mscale_all_dim`` multiplies the scale by ``mscale^2`` (as the source attention does).
"""

from __future__ import annotations

import ast
import math
import operator
from dataclasses import dataclass

from kvskill.analyzer.config import ModelSpec, text_config
from kvskill.analyzer.evidence import Notebook
from kvskill.analyzer.rules import CodeView


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN attention-temperature factor: 0.1 * mscale * ln(factor) + 1 for factor > 1."""
    if factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


def scaling_line_of(cls) -> int | None:
    """Line of ``self.scaling = ...`` (transformers 5) or ``self.softmax_scale = ...`` (remote)."""
    if cls is None:
        return None
    return cls.self_attrs.get("scaling") or cls.self_attrs.get("softmax_scale")


@dataclass(frozen=True, kw_only=True)
class ScaleDecision:
    """The softmax scale and whether it carries the YaRN ``mscale^2`` factor."""

    value: float
    #: the scale includes mscale^2 from ``rope_parameters.mscale_all_dim``
    has_yarn_mscale: bool = False


def decide_scale(spec: ModelSpec, code: CodeView, book: Notebook) -> ScaleDecision:
    cls = code.attention_class()
    scaling_line = scaling_line_of(cls)
    where = code.where(scaling_line)
    if spec.mla:
        dim = int(spec.mla["qk_nope_head_dim"] or 0) + int(spec.mla["qk_rope_head_dim"] or 0)
        label = f"(qk_nope_head_dim + qk_rope_head_dim = {dim})"
    else:
        dim = spec.head_dim
        label = f"head_dim {dim}"
    scale = dim**-0.5 if dim else 1.0
    rope = spec.rope_parameters
    mscale_all_dim = rope.get("mscale_all_dim") or 0
    # the file's YaRN helper, or an attention class reading mscale_all_dim itself
    applies_mscale = "yarn_get_mscale" in code.facts.functions or (
        cls is not None and "mscale_all_dim" in cls.names_used
    )
    if (
        applies_mscale
        and mscale_all_dim
        and rope.get("rope_type", rope.get("type", "default")) != "default"
    ):
        factor = float(rope.get("factor") or 1.0)
        mscale = yarn_mscale(factor, float(mscale_all_dim))
        scale *= mscale * mscale
        book.cite(
            "softmax_scale",
            f"{label}^-0.5 x mscale^2 with mscale = 0.1*{mscale_all_dim}*ln({factor:g})+1 = "
            f"{mscale:.6f} (YaRN mscale_all_dim) -> {scale:.8f}",
            f"{where}; {book.cfg(spec.sources.get('rope_parameters'))}",
        )
        return ScaleDecision(value=scale, has_yarn_mscale=True)
    cfg_multiplier = _explicit_scale(spec, book)
    if cfg_multiplier is not None:
        return ScaleDecision(value=cfg_multiplier)
    expr = cls.init_attr_exprs.get("scaling") if cls is not None and not spec.mla else None
    from_code = scale_of_expression(expr, dim) if expr and dim else None
    if from_code is not None and not math.isclose(from_code, scale, rel_tol=1e-9):
        # zamba2: (self.head_dim / 2) ** -0.5, not the head_dim^-0.5 default
        book.cite("softmax_scale", f"{expr} with head_dim {dim} = {from_code:.8f}", where)
        return ScaleDecision(value=from_code)
    book.cite("softmax_scale", f"{label}^-0.5 = {scale:.8f}", where)
    return ScaleDecision(value=scale)


def _explicit_scale(spec: ModelSpec, book: Notebook) -> float | None:
    cfg, prefix = text_config(book.source.config)
    if cfg.get("query_pre_attn_scalar"):
        scale = float(cfg["query_pre_attn_scalar"]) ** -0.5
        book.cite(
            "softmax_scale",
            f"query_pre_attn_scalar^-0.5 = {scale:.8f}",
            book.cfg(prefix + "query_pre_attn_scalar"),
        )
        return scale
    if cfg.get("attention_multiplier"):
        scale = float(cfg["attention_multiplier"])
        book.cite(
            "softmax_scale",
            f"attention_multiplier = {scale}",
            book.cfg(prefix + "attention_multiplier"),
        )
        return scale
    return None


_ARITHMETIC = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
}


def scale_of_expression(expr: str, head_dim: int) -> float | None:
    """The value of a ``self.scaling = <expr>`` written as arithmetic over numbers and the head
    dim (``(self.head_dim / 2) ** -0.5``, ``1 / math.sqrt(self.head_dim)``), else None: any
    other name (a config multiplier, a module attribute) is not this module's to evaluate."""
    try:
        tree = ast.parse(expr, mode="eval").body
        value = _evaluate(tree, head_dim)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, TypeError):
        return None
    return float(value) if value is not None and value > 0 else None


def _evaluate(node: ast.expr, head_dim: int) -> float | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return float(node.value)
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        if node.value.id == "self" and node.attr == "head_dim":
            return float(head_dim)
        return None
    if isinstance(node, ast.Name):
        return float(head_dim) if node.id == "head_dim" else None
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = _evaluate(node.operand, head_dim)
        return -inner if inner is not None else None
    if isinstance(node, ast.BinOp) and type(node.op) in _ARITHMETIC:
        left, right = _evaluate(node.left, head_dim), _evaluate(node.right, head_dim)
        if left is None or right is None:
            return None
        return _ARITHMETIC[type(node.op)](left, right)
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "sqrt"
        and len(node.args) == 1
        and not node.keywords
    ):
        inner = _evaluate(node.args[0], head_dim)
        return math.sqrt(inner) if inner is not None else None
    return None
