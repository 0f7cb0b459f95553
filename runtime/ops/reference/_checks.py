"""Argument checks shared by the reference operators: strict keywords and clear errors."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])

INT_MAX = 2147483647


class OpInputError(RuntimeError):
    """An input the hardware operator rejects.

    NOTE: torch_npu reports these as ``RuntimeError`` from the adapter or the tiling check, so
    this subclasses ``RuntimeError``: code that catches what the device raises also catches this.
    """


class BlockIdError(OpInputError):
    """A block table entry a request needs names no block of the paged cache."""


class ReferenceUnsupportedError(NotImplementedError):
    """A valid operator feature (quantisation, left padding, ...) the reference does not model."""


def strict_keywords(op_name: str, hints: Mapping[str, str]) -> Callable[[F], F]:
    """Reject unknown keyword arguments with a TypeError that names the right keyword.

    Args:
        op_name: operator name used in the message.
        hints: wrong keyword -> what to say instead, e.g. ``{"softmax_scale": "v1 takes `scale`"}``.

    NOTE: unconfirmed on hardware whether an unknown keyword surfaces as TypeError (Python
    binding) or RuntimeError (``torch.ops.npu``); the reference raises TypeError.
    """

    def decorate(fn: F) -> F:
        accepted = frozenset(inspect.signature(fn).parameters)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            for name in kwargs:
                if name not in accepted:
                    hint = hints.get(name)
                    advice = f"; {hint}" if hint else ""
                    raise TypeError(
                        f"{op_name}() got an unexpected keyword argument '{name}'{advice}"
                    )
            return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate


def reject_if_used(op_name: str, **features: Any) -> None:
    """Raise ReferenceUnsupportedError for the first feature argument that is actually set.

    A feature counts as used when it is not None and not the integer 0 / False default.
    """
    for name, value in features.items():
        if value is None or (isinstance(value, (bool, int)) and not value):
            continue
        raise ReferenceUnsupportedError(
            f"{op_name}: `{name}` is accepted by the operator but not supported by the "
            f"reference backend (got {_describe(value)}); run on an NPU or leave it unset"
        )


def int_list(name: str, value: Any) -> list[int] | None:
    """Normalise a sequence-length argument (``SymInt[]?``) to a list of Python ints.

    NOTE: the eager operator types these as integer lists. Whether 1-D integer tensors are
    officially accepted on device is unconfirmed; the reference accepts them (one host copy).
    """
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.dim() != 1 or value.is_floating_point():
            raise TypeError(f"`{name}` must be a list of ints, got {_describe(value)}")
        return [int(x) for x in value.tolist()]
    if type(value) is list and all(type(x) is int for x in value):
        return value  # already a list of plain ints (the common case): no copy
    if isinstance(value, (list, tuple)):
        out = []
        for x in value:
            if isinstance(x, bool) or not isinstance(x, int):
                raise TypeError(f"`{name}` must be a list of ints, got element {x!r}")
            out.append(int(x))
        return out
    raise TypeError(f"`{name}` must be a list of ints, got {_describe(value)}")


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return repr(value)


describe = _describe


#: the float dtypes the framework-facing operators document (float16, bfloat16, float32)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def require_dtype(op: str, name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    """A dtype limit the operator's documentation states for every product (always checked)."""
    if t.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise OpInputError(f"{op}: `{name}` must be {names}, got {t.dtype}")


def require_rank(op: str, name: str, t: torch.Tensor, low: int, high: int) -> None:
    """A documented rank range ``low <= t.dim() <= high``."""
    if not low <= t.dim() <= high:
        want = f"{low}-D" if low == high else f"{low}-D to {high}-D"
        raise OpInputError(f"{op}: `{name}` must be {want}, got {_describe(t)}")
