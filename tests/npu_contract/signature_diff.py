"""Compare a Python callable's signature with an ATen schema, as the real binding would bind it."""

from __future__ import annotations

import inspect
from collections.abc import Callable

from aten_schema import REQUIRED, Schema


def signature_differences(fn: Callable, schema: Schema) -> list[str]:
    """One line per difference: missing or extra parameter, kind, order, default."""
    sig = inspect.signature(fn)
    ours = {
        n: p for n, p in sig.parameters.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    }
    out = []
    for p in schema.params:
        mine = ours.get(p.name)
        if mine is None:
            out.append(f"{schema.name}: missing parameter `{p.name}` ({p.type})")
            continue
        want = (
            inspect.Parameter.KEYWORD_ONLY
            if p.keyword_only
            else inspect.Parameter.POSITIONAL_OR_KEYWORD
        )
        if mine.kind is not want:
            out.append(
                f"{schema.name}: `{p.name}` is {mine.kind.description}, the schema makes it {want.description}"
            )
        default = REQUIRED if mine.default is inspect.Parameter.empty else mine.default
        if not _same_default(default, p.default):
            out.append(
                f"{schema.name}: `{p.name}` defaults to {_show(default)}, the schema to {_show(p.default)}"
            )
    for name in ours:
        if name not in schema.names:
            out.append(f"{schema.name}: extra parameter `{name}` the real operator does not take")
    positional = [p.name for p in schema.params if not p.keyword_only]
    mine_positional = [
        n
        for n, p in ours.items()
        if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD and n in schema.names
    ]
    if mine_positional != positional:
        out.append(f"{schema.name}: positional order {mine_positional}, the schema's {positional}")
    return out


def _same_default(ours: object, theirs: object) -> bool:
    if ours is REQUIRED or theirs is REQUIRED:
        return ours is theirs
    if isinstance(theirs, list):
        return isinstance(ours, (list, tuple)) and list(ours) == theirs
    if type(ours) is type(theirs):
        return ours == theirs
    # An int default where the schema says float binds the same; a bool never stands for an int.
    return isinstance(theirs, float) and type(ours) is int and float(ours) == theirs


def _show(value: object) -> str:
    return "no default (required)" if value is REQUIRED else repr(value)
