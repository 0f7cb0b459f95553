"""KV008: kv_len advanced inside a model layer instead of by the runner."""

from __future__ import annotations

import re
from collections.abc import Iterator

import libcst as cst
import libcst.matchers as m
from kvskill.analyzer.lint.context import FileContext
from kvskill.analyzer.lint.model import Finding
from kvskill.analyzer.lint.rule import Rule
from kvskill.analyzer.lint.rules._examples import example

_MODULE_BASE = re.compile(r"Module|Layer|Attention|Model|Block|Decoder", re.IGNORECASE)
_OWNER_NAME = re.compile(r"Runner|Engine|Scheduler|Executor|Worker", re.IGNORECASE)
KV_LEN = "kv_len"


def _is_kv_len(target: cst.BaseExpression) -> bool:
    """``kv_len``, ``self.kv_len``, ``md.kv_len`` and subscripts of them."""
    while isinstance(target, cst.Subscript):
        target = target.value
    if isinstance(target, cst.Name):
        return target.value == KV_LEN
    return isinstance(target, cst.Attribute) and target.attr.value == KV_LEN


def _in_layer(ctx: FileContext, node: cst.CSTNode) -> bool:
    """Inside a method of an nn.Module-like class that is not the runner/engine."""
    cls = ctx.enclosing_class(node)
    if cls is None or ctx.enclosing_function(node) is None:
        return False
    if _OWNER_NAME.search(cls.name.value):
        return False
    return any(_MODULE_BASE.search(ctx.code(base.value)) for base in cls.bases)


def _increments(ctx: FileContext):
    """Every statement or call that adds to a kv_len in place."""
    for aug in ctx.aug_assigns:
        if _is_kv_len(aug.target) and isinstance(aug.operator, cst.AddAssign):
            yield aug
    for assign in m.findall(ctx.module, m.Assign(value=m.BinaryOperation(operator=m.Add()))):
        value = cst.ensure_type(cst.ensure_type(assign, cst.Assign).value, cst.BinaryOperation)
        for target in assign.targets:
            if _is_kv_len(target.target) and ctx.code(target.target) == ctx.code(value.left):
                yield assign
    for call in ctx.calls:
        func = call.func
        if isinstance(func, cst.Attribute) and func.attr.value == "add_" and _is_kv_len(func.value):
            yield call


class KvLenIncrementedInLayer(Rule):
    """kv_len is incremented inside an attention / layer module instead of by the runner.

    kv_len is the runner's variable: every layer reads the same value to place its cache
    write. A layer that advances it shifts the write position of every later layer by one
    token per layer during prefill, silently corrupting the cache.
    """

    id = "KV008"
    name = "kv-len-incremented-in-layer"
    VALID = [
        example(
            """\
class Runner:
    def step(self, model, input_ids, kv_len):
        logits = model(input_ids, kv_len=kv_len)
        kv_len += 1
        return logits, kv_len


class Attn(nn.Module):
    def forward(self, hidden, kv_len):
        positions = kv_len - 1
        return hidden, positions
"""
        ),
    ]
    INVALID = [
        example(
            """\
class Attn(nn.Module):
    def forward(self, hidden, kv_len, cache):
        torch_npu.scatter_update_(cache, kv_len, hidden, -2)
        kv_len += hidden.shape[1]
        return hidden
"""
        ),
        example(
            """\
class DecoderLayer(nn.Module):
    def forward(self, hidden, forward_metadata):
        forward_metadata.kv_len.add_(1)
        return hidden
"""
        ),
    ]

    def check(self, ctx: FileContext) -> Iterator[Finding]:
        for node in _increments(ctx):
            if not _in_layer(ctx, node):
                continue
            cls = ctx.enclosing_class(node)
            yield self.finding(
                ctx,
                node,
                f"kv_len is advanced inside {cls.name.value if cls else 'a layer'}: each "
                "layer then writes its cache at a different position",
                "treat kv_len as read-only in layers; advance it once per step in the "
                "runner (standalone) or leave it to the runtime's metadata (framework)",
            )
