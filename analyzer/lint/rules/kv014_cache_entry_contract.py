"""KV014: a CacheEntry or MambaCacheEntry the executor's classes or validate_cache_info reject."""

from __future__ import annotations

from collections.abc import Iterator

import libcst as cst
from kvskill.analyzer.lint.context import FileContext
from kvskill.analyzer.lint.model import Finding
from kvskill.analyzer.lint.rule import Rule
from kvskill.analyzer.lint.rules._contract import (
    CACHE_ENTRY_FIELDS,
    CACHE_ENTRY_REQUIRED,
    ENTRY_BLOCK_FIX,
    MAMBA_ONLY_FIELDS,
    MAMBA_REQUIRED,
    SUPPORTED_ALLOCATORS,
    SUPPORTED_CACHE_LAYOUTS,
    TOKEN_ATTN_TYPES,
    bind_arguments,
    callee_name,
    has_star,
)
from kvskill.analyzer.lint.rules._examples import example

_ENTRY = "CacheEntry"
_MAMBA = "MambaCacheEntry"


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


class _StampsBlockSize(cst.CSTVisitor):
    """Finds ``<entry>.block_size = ...`` on anything but ``self``: a ``get_cache_info`` that
    gives every entry the run's block size before it returns them."""

    def __init__(self) -> None:
        self.found = False

    def visit_Assign(self, node: cst.Assign) -> None:
        for target in node.targets:
            t = target.target
            if (
                isinstance(t, cst.Attribute)
                and t.attr.value == "block_size"
                and not (isinstance(t.value, cst.Name) and t.value.value == "self")
            ):
                self.found = True


def _stamps_block_size(ctx: FileContext) -> bool:
    visitor = _StampsBlockSize()
    ctx.module.visit(visitor)
    return visitor.found


def _numbers(ctx: FileContext, expr: cst.BaseExpression | None) -> frozenset | None:
    """The numbers ``expr`` can be, None unless every possible value is a known number."""
    values = ctx.possible_values(expr)
    if not values or not all(
        isinstance(v, int | float) and not isinstance(v, bool) for v in values
    ):
        return None
    return values


def _is_tuple(ctx: FileContext, expr: cst.BaseExpression) -> bool:
    """``expr`` is certainly a tuple: a tuple display or ``tuple(...)``, written inline or
    bound to a name / ``self.<attr>`` first."""
    built = ctx.resolve(expr)
    return bool(built) and all(
        isinstance(v, cst.Tuple)
        or (isinstance(v, cst.Call) and isinstance(v.func, cst.Name) and v.func.value == "tuple")
        for v in built
    )


class CacheEntryContract(Rule):
    """A CacheEntry or MambaCacheEntry that the executor's classes or validate_cache_info reject.

    In the executor (and kvskill's runtime) ``needs_block`` has no default and every entry
    carries its own ``block_size`` (``infer_config.scheduler_config.block_size``);
    ``validate_cache_info`` rejects a block-needing entry without a positive block size, a
    Mamba entry that is not a ``MambaCacheEntry``, an unknown ``cache_layout`` or
    ``allocator`` and non-positive heads or dims. ``MambaCacheEntry`` is built with keywords
    only, with ``shape`` a non-empty list of positive ints, ``block_size`` 1 and
    ``next_n`` >= 0. Each of these fails at load time, before the first token.
    """

    id = "KV014"
    name = "cache-entry-contract"
    VALID = [
        example(
            """\
class Attn(nn.Module):
    def __init__(self, config, infer_config):
        super().__init__()
        self.attn_type = "FullAttention"
        self.block_size = infer_config.scheduler_config.block_size
        self.num_key_value_heads_per_rank = max(config.num_key_value_heads // 1, 1)
        self.k_cache = torch.Tensor([])
        self.cache_entries = [
            CacheEntry(cache_name="k_cache", attn_type=self.attn_type, dim=64,
                       num_head=self.num_key_value_heads_per_rank, dtype=torch.float16,
                       needs_block=True, block_size=self.block_size,
                       tensor_setter=lambda t, layer=self: setattr(layer, "k_cache", t)),
        ]
"""
        ),
        example(
            """\
class GatedDeltaNet(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ssm_state = torch.Tensor([])
        self.cache_entries = [
            MambaCacheEntry(cache_name="ssm_state", dtype=torch.float32, needs_block=True,
                            shape=[config.num_v_heads, config.head_k_dim, config.head_v_dim],
                            tensor_setter=lambda t, layer=self: setattr(layer, "ssm_state", t)),
        ]
"""
        ),
    ]
    INVALID = [
        # the skill text's entry: no needs_block, the block size left to ModelCacheInfo
        example(
            """\
class Attn(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.k_cache = torch.Tensor([])
        self.cache_entries = [
            CacheEntry(cache_name="k_cache", attn_type="FullAttention", dim=64,
                       num_head=config.num_key_value_heads_per_rank, dtype=torch.float16,
                       tensor_setter=lambda t, layer=self: setattr(layer, "k_cache", t)),
        ]
"""
        ),
        example(
            """\
class GatedDeltaNet(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.conv_state = torch.Tensor([])
        self.cache_entries = [
            MambaCacheEntry(cache_name="conv_state", dtype=torch.float32, needs_block=True,
                            shape=(config.conv_dim, config.conv_kernel_size - 1),
                            tensor_setter=lambda t, layer=self: setattr(layer, "conv_state", t)),
        ]
"""
        ),
    ]

    def check(self, ctx: FileContext) -> Iterator[Finding]:
        for call in ctx.calls:
            name = callee_name(call)
            if name == _ENTRY:
                yield from self._check_entry(ctx, call)
            elif name == _MAMBA:
                yield from self._check_mamba(ctx, call)

    # CacheEntry --------------------------------------------------------------------------
    def _check_entry(self, ctx: FileContext, call: cst.Call) -> Iterator[Finding]:
        args, unknown = bind_arguments(call, CACHE_ENTRY_FIELDS)
        yield from self._unknown(ctx, call, _ENTRY, unknown)
        if not has_star(call):
            yield from self._missing(ctx, call, _ENTRY, args, CACHE_ENTRY_REQUIRED)
        attn_types = ctx.possible_values(args.get("attn_type"))
        if attn_types and "Mamba" in attn_types:
            yield self.finding(
                ctx,
                args["attn_type"],
                "a CacheEntry with attn_type 'Mamba': validate_cache_info wants a "
                "MambaCacheEntry for a recurrent state",
                "MambaCacheEntry(cache_name=..., dtype=..., needs_block=True, shape=[...], "
                "tensor_setter=...)",
            )
        yield from self._block_size(ctx, call, args)
        yield from self._choice(ctx, args, "cache_layout", SUPPORTED_CACHE_LAYOUTS)
        yield from self._choice(ctx, args, "allocator", SUPPORTED_ALLOCATORS)
        if attn_types is None or attn_types <= TOKEN_ATTN_TYPES:
            for field in ("num_head", "dim"):
                yield from self._positive(ctx, args.get(field), f"CacheEntry {field}")
            dim = args.get("dim")
            if isinstance(dim, cst.List):
                for element in dim.elements:
                    yield from self._positive(ctx, element.value, "CacheEntry dim")

    def _block_size(
        self, ctx: FileContext, call: cst.Call, args: dict[str, cst.BaseExpression]
    ) -> Iterator[Finding]:
        needs_block = ctx.possible_values(args.get("needs_block"))
        if needs_block == frozenset({False}) or "needs_block" not in args:
            return  # never allocated, or already reported as missing
        block_size = args.get("block_size")
        if block_size is None and not has_star(call) and not _stamps_block_size(ctx):
            yield self.finding(
                ctx,
                call,
                "CacheEntry needs blocks but has no block_size: validate_cache_info rejects "
                "block_size None (the executor's ModelCacheInfo has no block size to fall "
                "back on)",
                ENTRY_BLOCK_FIX,
            )
            return
        if block_size is None:
            return
        yield from self._positive(ctx, block_size, "CacheEntry block_size")
        if ctx.code(block_size) == "self.block_size" and not _sets_block_size(ctx):
            yield self.finding(
                ctx,
                block_size,
                "block_size=self.block_size but no class here ever sets self.block_size",
                "save it in __init__: self.block_size = infer_config.scheduler_config.block_size",
            )
        sizes, ratios = _numbers(ctx, block_size), _numbers(ctx, args.get("compress_ratio"))
        if sizes and ratios and any(s % r for s in sizes for r in ratios if r):
            yield self.finding(
                ctx,
                args["compress_ratio"],
                f"block_size {sorted(sizes)} is not divisible by compress_ratio "
                f"{sorted(ratios)}: storage_block_size raises ValueError",
                "pick a compress_ratio that divides the block size",
            )

    # MambaCacheEntry ---------------------------------------------------------------------
    def _check_mamba(self, ctx: FileContext, call: cst.Call) -> Iterator[Finding]:
        positional = [a for a in call.args if a.keyword is None and not a.star]
        if positional:
            yield self.finding(
                ctx,
                positional[0],
                "MambaCacheEntry is built with positional arguments: it is keyword-only (its "
                "positional order differs from CacheEntry's)",
                "MambaCacheEntry(cache_name=..., dtype=..., needs_block=True, shape=[...], "
                "tensor_setter=...)",
            )
            return
        args, unknown = bind_arguments(call, CACHE_ENTRY_FIELDS + MAMBA_ONLY_FIELDS)
        yield from self._unknown(ctx, call, _MAMBA, unknown)
        if not has_star(call):
            yield from self._missing(ctx, call, _MAMBA, args, MAMBA_REQUIRED)
        shape = args.get("shape")
        if shape is None and not has_star(call):
            yield self.finding(
                ctx,
                call,
                "MambaCacheEntry without shape: its __post_init__ rejects an empty shape",
                "shape=[...] with the per-request state's dims, as a list",
            )
        elif shape is not None and _is_tuple(ctx, shape):
            yield self.finding(
                ctx,
                shape,
                f"MambaCacheEntry shape `{ctx.code(shape)}` is a tuple: the executor's "
                "__post_init__ requires a list",
                f"shape=list({ctx.code(shape)}) or a list display [...]",
            )
        elif isinstance(shape, cst.List):
            if not shape.elements:
                yield self.finding(
                    ctx, shape, "MambaCacheEntry shape is empty", "give the state's dims"
                )
            for element in shape.elements:
                yield from self._positive(ctx, element.value, "MambaCacheEntry shape dim")
        block_sizes = _numbers(ctx, args.get("block_size"))
        if block_sizes and block_sizes != frozenset({1}):
            yield self.finding(
                ctx,
                args["block_size"],
                f"MambaCacheEntry block_size {sorted(block_sizes)}: a state block holds one "
                "request's whole state, so it must be 1",
                "drop block_size (it defaults to 1)",
            )
        attn_types = ctx.possible_values(args.get("attn_type"))
        if attn_types and attn_types != frozenset({"Mamba"}):
            yield self.finding(
                ctx,
                args["attn_type"],
                f"MambaCacheEntry attn_type {sorted(map(str, attn_types))}: it must stay 'Mamba'",
                "drop attn_type; group states apart with manager_key",
            )
        next_n = _numbers(ctx, args.get("next_n"))
        if next_n and min(next_n) < 0:
            yield self.finding(
                ctx, args["next_n"], "MambaCacheEntry next_n is negative", "next_n >= 0"
            )

    # shared ----------------------------------------------------------------------------
    def _unknown(
        self, ctx: FileContext, call: cst.Call, cls: str, unknown: list[cst.Arg]
    ) -> Iterator[Finding]:
        fields = CACHE_ENTRY_FIELDS + (MAMBA_ONLY_FIELDS if cls == _MAMBA else ())
        for arg in unknown:
            what = (
                f"has no field {arg.keyword.value}"
                if arg.keyword
                else f"takes {len(fields)} positional arguments at most"
            )
            yield self.finding(
                ctx,
                arg,
                f"{cls} {what}: the executor's {cls} raises TypeError",
                f"use {cls}'s fields: {', '.join(fields)}",
            )

    def _missing(
        self,
        ctx: FileContext,
        call: cst.Call,
        cls: str,
        args: dict[str, cst.BaseExpression],
        required: tuple[str, ...],
    ) -> Iterator[Finding]:
        for field in required:
            if field in args:
                continue
            fix = ENTRY_BLOCK_FIX if field == "needs_block" else f"pass {field}=..."
            yield self.finding(
                ctx,
                call,
                f"{cls} without {field}: the executor's {cls} requires it (no default)",
                fix,
            )

    def _choice(
        self,
        ctx: FileContext,
        args: dict[str, cst.BaseExpression],
        field: str,
        allowed: frozenset[str],
    ) -> Iterator[Finding]:
        values = ctx.possible_values(args.get(field))
        if values and all(isinstance(v, str) for v in values) and not values <= allowed:
            yield self.finding(
                ctx,
                args[field],
                f"{field} {sorted(values - allowed)} is not one validate_cache_info accepts",
                f"{field} one of {sorted(allowed)}",
            )

    def _positive(
        self, ctx: FileContext, expr: cst.BaseExpression | None, what: str
    ) -> Iterator[Finding]:
        values = _numbers(ctx, expr)
        if values and min(values) <= 0:
            yield self.finding(
                ctx,
                expr,
                f"{what} is {sorted(values)}: validate_cache_info wants a positive value",
                f"a positive {what.rsplit(' ', 1)[-1]}",
            )
