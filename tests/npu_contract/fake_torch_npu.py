"""A stand-in ``torch_npu`` (and ``torch.ops.custom``) for dry runs of converted models on CPU.

Each operator first binds its arguments the way torch_npu 2.13.0's Python binding would, from
the schema fixture alone (positional count, keyword names, required arguments, argument
types), then hands the bound arguments to the reference operator under the strict NPU
profile, which applies the documented limits. Out-of-place results come back as zeros of the
right shape and dtype, so nothing downstream can depend on the reference's numerics; in-place
operators return their (written) first argument, as the device does.

The framework's own operator extension (``torch.ops.custom.*``, DeepSeek-V4's compressed
attention) is faked the same way, bound against its recorded registration schemas.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from aten_schema import FIXTURE, REQUIRED, Param, Schema, load_schemas
from kvskill.runtime import ops
from kvskill.runtime.ops import reference
from kvskill.runtime.ops.reference import custom as custom_reference

#: the framework's extension schemas (scripts/extract_custom_schemas.py)
CUSTOM_FIXTURE = FIXTURE.with_name("custom_schemas.json")


class BindingError(TypeError):
    """A call the real binding would refuse before any kernel runs."""


@dataclass
class CallLog:
    """Every call the fake received: (operator name, bound arguments)."""

    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def of(self, name: str) -> list[dict[str, Any]]:
        return [bound for op, bound in self.calls if op == name]

    @property
    def names(self) -> set[str]:
        return {op for op, _ in self.calls}


def bind(schema: Schema, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Bound arguments by schema name, or BindingError naming what the binding rejects."""
    positional = [p.name for p in schema.params if not p.keyword_only]
    if len(args) > len(positional):
        raise BindingError(
            f"{schema.name}() takes {len(positional)} positional arguments but {len(args)} "
            f"were given; {schema.names[len(positional)]!r} and later are keyword-only"
        )
    bound = dict(zip(positional, args, strict=False))
    for name, value in kwargs.items():
        if name not in schema.names:
            raise BindingError(f"{schema.name}() got an unexpected keyword argument '{name}'")
        if name in bound:
            raise BindingError(f"{schema.name}() got multiple values for argument '{name}'")
        bound[name] = value
    for p in schema.params:
        if p.name not in bound:
            if p.default is REQUIRED:
                raise BindingError(f"{schema.name}() missing required argument '{p.name}'")
            continue
        _check_type(schema.name, p, bound[p.name])
    return bound


def _check_type(op: str, p: Param, value: Any) -> None:
    base = p.base_type
    if value is None:
        if p.optional:
            return
        raise BindingError(f"{op}(): argument '{p.name}' ({p.type}) must not be None")
    if base == "Tensor":
        ok = isinstance(value, torch.Tensor)
    elif base in ("int", "SymInt"):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif base == "float":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif base == "bool":
        ok = isinstance(value, bool)
    elif base == "str":
        ok = isinstance(value, str)
    elif base in ("int[]", "SymInt[]"):
        # NOTE: torch's argument parser takes a list or tuple of ints here and refuses a
        # tensor (torch.zeros(torch.tensor([2, 3])) is a TypeError); the framework's models
        # pass tensors only through torch.ops.npu, lists to torch_npu.* (npu_ops.md §4).
        ok = isinstance(value, (list, tuple, torch.Size)) and all(
            isinstance(x, int) and not isinstance(x, bool) for x in value
        )
    else:
        ok = True  # a type kvskill never passes (Scalar, Tensor[] ...): left to the reference
    if not ok:
        raise BindingError(
            f"{op}(): argument '{p.name}' must be {p.type}, not {type(value).__name__}"
        )


def _zeros_like_result(result: Any) -> Any:
    if isinstance(result, torch.Tensor):
        return torch.zeros_like(result)
    if isinstance(result, tuple):
        return tuple(_zeros_like_result(r) for r in result)
    return result


def _make_op(schema: Schema, impl: Callable[..., Any], log: CallLog) -> Callable[..., Any]:
    in_place = "!" in schema.params[0].type
    # A *_metadata operator's output is the plan its attention reads, not numerics: it passes
    # through as the reference made it (the attention checks it was made for its arguments).
    keeps_result = in_place or schema.name.endswith("_metadata")

    def op(*args: Any, **kwargs: Any) -> Any:
        bound = bind(schema, args, kwargs)
        log.calls.append((schema.name, bound))
        with ops.npu_limits():
            result = impl(**bound)
        return result if keeps_result else _zeros_like_result(result)

    op.__name__ = schema.name
    return op


def build(log: CallLog) -> types.ModuleType:
    """The fake module: one operator per schema the reference implements."""
    module = types.ModuleType("torch_npu")
    module.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
    module.__doc__ = __doc__
    for name, schema in load_schemas().items():
        impl = getattr(reference, name, None)
        if impl is not None:
            setattr(module, name, _make_op(schema, impl, log))
    module.OpInputError = reference.OpInputError
    return module


def install(monkeypatch, log: CallLog) -> types.ModuleType:
    """Make ``kvskill.runtime.ops.torch_npu`` (and ``import torch_npu``) the fake, as on an NPU.

    Converted code binds ``torch_npu`` when its module is imported, so install before loading
    a model. Device selection stays on the CPU: the fake registers no ``torch.npu``.
    """
    fake = build(log)
    custom = types.SimpleNamespace(
        **{
            name: _make_op(schema, getattr(custom_reference, name), log)
            for name, schema in load_schemas(CUSTOM_FIXTURE).items()
            if hasattr(custom_reference, name)
        }
    )
    # converted code reaches the extension as torch.ops.custom once `import custom_ops` works
    monkeypatch.setitem(sys.modules, "custom_ops", types.ModuleType("custom_ops"))
    monkeypatch.setattr(torch.ops, "custom", custom)
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    monkeypatch.setattr(ops, "torch_npu", fake)
    monkeypatch.setattr(ops, "_BACKEND", ops.Backend("npu", "fake torch_npu (dry run on CPU)"))
    return fake
