"""KV012: get_cache_info() that leaves out block_size or the layers."""

from __future__ import annotations

from collections.abc import Iterator

import libcst as cst
from kvskill.analyzer.lint.context import FileContext
from kvskill.analyzer.lint.model import Finding
from kvskill.analyzer.lint.rule import Rule
from kvskill.analyzer.lint.rules._examples import example

#: ModelCacheInfo(num_layers, block_size, layer_infos, is_mla_backend=False)
REQUIRED = ("num_layers", "block_size", "layer_infos")


def _model_cache_infos(ctx: FileContext, function: cst.FunctionDef) -> list[cst.Call]:
    out = []
    for call in ctx.calls:
        func = call.func
        name = func.attr.value if isinstance(func, cst.Attribute) else ctx.code(func)
        if name == "ModelCacheInfo" and function in ctx.ancestors(call):
            out.append(call)
    return out


def _arguments(call: cst.Call) -> dict[str, cst.BaseExpression]:
    positional = [a for a in call.args if a.keyword is None and not a.star]
    out = {name: arg.value for name, arg in zip(REQUIRED, positional, strict=False)}
    out.update({a.keyword.value: a.value for a in call.args if a.keyword is not None})
    return out


def _sets_block_size(ctx: FileContext) -> bool:
    """Some class in the file assigns ``self.block_size`` (or declares it in its body)."""
    for cls in ctx.classes:
        if ctx.class_attr_values(cls, "block_size"):
            return True
        for statement in cls.body.body:
            if not isinstance(statement, cst.SimpleStatementLine):
                continue
            for small in statement.body:
                target = getattr(small, "target", None) or next(
                    (t.target for t in getattr(small, "targets", ())), None
                )
                if isinstance(target, cst.Name) and target.value == "block_size":
                    return True
    return False


class CacheInfoIncomplete(Rule):
    """get_cache_info() builds a ModelCacheInfo without block_size or without its layers.

    The runtime sizes every pool from ``block_size`` and allocates one cache set per
    entry of ``layer_infos``; a missing field, an unset ``self.block_size``, an empty or
    hard-coded layer count means caches that are never injected or a pool of the wrong
    shape.
    """

    id = "KV012"
    name = "cache-info-incomplete"
    VALID = [
        example(
            """\
class ForCausalLM(nn.Module):
    def __init__(self, config, block_size=128):
        super().__init__()
        self.block_size = block_size

    def get_cache_info(self):
        layer_infos = [
            LayerCacheInfo(layer_idx=i, caches=list(layer.self_attn.cache_entries))
            for i, layer in enumerate(self.model.layers)
        ]
        return ModelCacheInfo(
            num_layers=len(layer_infos), block_size=self.block_size, layer_infos=layer_infos)
"""
        ),
    ]
    INVALID = [
        example(
            """\
class ForCausalLM(nn.Module):
    def get_cache_info(self):
        layer_infos = [
            LayerCacheInfo(layer_idx=i, caches=list(layer.self_attn.cache_entries))
            for i, layer in enumerate(self.model.layers)
        ]
        return ModelCacheInfo(num_layers=len(layer_infos), layer_infos=layer_infos)
"""
        ),
        example(
            """\
class ForCausalLM(nn.Module):
    def get_cache_info(self):
        return ModelCacheInfo(num_layers=2, block_size=self.block_size, layer_infos=[])
"""
        ),
    ]

    def check(self, ctx: FileContext) -> Iterator[Finding]:
        for function in ctx.functions:
            if function.name.value != "get_cache_info":
                continue
            for call in _model_cache_infos(ctx, function):
                yield from self._check_call(ctx, call)

    def _check_call(self, ctx: FileContext, call: cst.Call) -> Iterator[Finding]:
        if any(a.star for a in call.args):
            return
        args = _arguments(call)
        for field in REQUIRED:
            if field not in args:
                yield self.finding(
                    ctx,
                    call,
                    f"ModelCacheInfo is built without {field}",
                    "return ModelCacheInfo(num_layers=len(layer_infos), "
                    "block_size=self.block_size, layer_infos=layer_infos)",
                )
        block_size = args.get("block_size")
        if (
            block_size is not None
            and ctx.code(block_size) == "self.block_size"
            and not _sets_block_size(ctx)
        ):
            yield self.finding(
                ctx,
                block_size,
                "get_cache_info() reads self.block_size but no class here ever sets it",
                "save it in the model's __init__: self.block_size = <block size from the "
                "runtime / plan>",
            )
        layers = args.get("layer_infos")
        if isinstance(layers, cst.List) and not layers.elements:
            yield self.finding(
                ctx,
                layers,
                "layer_infos is an empty list: no cache is ever allocated",
                "build one LayerCacheInfo per attention (sub)layer from self.model.layers",
            )
        num_layers = args.get("num_layers")
        if isinstance(num_layers, cst.Integer):
            yield self.finding(
                ctx,
                num_layers,
                f"num_layers is hard-coded to {num_layers.value}",
                "use num_layers=len(layer_infos) so it always matches the layers declared",
            )
