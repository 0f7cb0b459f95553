"""KV012: a ModelCacheInfo the executor rejects: block_size given, fields or layers missing."""

from __future__ import annotations

from collections.abc import Iterator

import libcst as cst
from kvskill.analyzer.lint.context import FileContext
from kvskill.analyzer.lint.model import Finding
from kvskill.analyzer.lint.rule import Rule
from kvskill.analyzer.lint.rules._contract import (
    ENTRY_BLOCK_FIX,
    MODEL_CACHE_INFO_FIELDS,
    MODEL_CACHE_INFO_REQUIRED,
    bind_arguments,
    callee_name,
    has_star,
)
from kvskill.analyzer.lint.rules._examples import example

_FIX = "return ModelCacheInfo(num_layers=len(layer_infos), layer_infos=layer_infos)"


def _in_get_cache_info(ctx: FileContext, call: cst.Call) -> bool:
    function = ctx.enclosing_function(call)
    return function is not None and function.name.value == "get_cache_info"


class CacheInfoIncomplete(Rule):
    """A ModelCacheInfo passes block_size, or leaves out num_layers or its layers.

    The executor's ``ModelCacheInfo(num_layers, layer_infos, is_mla_backend=False)`` lost its
    ``block_size`` field in June 2026: passing one is a TypeError, and each ``CacheEntry``
    carries its own ``block_size`` instead (the skill text still shows the old form; the
    code holds). The runtime allocates one cache set per entry of ``layer_infos``, so a
    missing field, an empty or a hard-coded layer count in ``get_cache_info()`` means
    caches that are never injected or a count ``validate_cache_info`` rejects.
    """

    id = "KV012"
    name = "cache-info-incomplete"
    VALID = [
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
        layer_infos = [
            LayerCacheInfo(i, list(layer.self_attn.cache_entries))
            for i, layer in enumerate(self.model.layers)
        ]
        return ModelCacheInfo(len(layer_infos), layer_infos, True)
"""
        ),
    ]
    INVALID = [
        # the skill text's form: a TypeError in the executor
        example(
            """\
class ForCausalLM(nn.Module):
    def get_cache_info(self):
        layer_infos = [
            LayerCacheInfo(layer_idx=i, caches=list(layer.self_attn.cache_entries))
            for i, layer in enumerate(self.model.layers)
        ]
        return ModelCacheInfo(
            num_layers=len(layer_infos), block_size=self.block_size, layer_infos=layer_infos)
"""
        ),
        example(
            """\
class ForCausalLM(nn.Module):
    def get_cache_info(self):
        return ModelCacheInfo(num_layers=2, layer_infos=[])
"""
        ),
        example(
            """\
class ForCausalLM(nn.Module):
    def get_cache_info(self):
        return ModelCacheInfo(layer_infos=self.layer_infos)
"""
        ),
    ]

    def check(self, ctx: FileContext) -> Iterator[Finding]:
        for call in ctx.calls:
            if callee_name(call) == "ModelCacheInfo":
                yield from self._check_call(ctx, call)

    def _check_call(self, ctx: FileContext, call: cst.Call) -> Iterator[Finding]:
        args, unknown = bind_arguments(call, MODEL_CACHE_INFO_FIELDS)
        for arg in unknown:
            what = f"{arg.keyword.value}=" if arg.keyword is not None else "a fourth argument"
            yield self.finding(
                ctx,
                arg,
                f"ModelCacheInfo takes no {what}: the executor's ModelCacheInfo(num_layers, "
                "layer_infos, is_mla_backend) raises TypeError",
                f"{_FIX}; {ENTRY_BLOCK_FIX} on each CacheEntry",
            )
        if has_star(call):
            return
        # the old positional form ModelCacheInfo(n, self.block_size, layer_infos) binds the
        # block size to layer_infos
        layers = args.get("layer_infos")
        if layers is not None and "block_size" in ctx.code(layers):
            yield self.finding(
                ctx,
                layers,
                f"`{ctx.code(layers)}` is passed as layer_infos: ModelCacheInfo has no "
                "block_size field any more",
                _FIX,
            )
        for field in MODEL_CACHE_INFO_REQUIRED:
            if field not in args:
                yield self.finding(ctx, call, f"ModelCacheInfo is built without {field}", _FIX)
        if not _in_get_cache_info(ctx, call):
            return  # tests and examples may build a one-layer info by hand
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
