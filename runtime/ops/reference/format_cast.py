"""torch_npu.npu_format_cast on CPU: values and logical shape never change (npu_ops.md §6).

A device format only changes memory layout on the NPU, so the reference returns the data as-is
and remembers the requested format id so ``get_npu_format`` answers consistently.
"""

from __future__ import annotations

import weakref

from torch import Tensor

#: ND, the format every CPU tensor has
FORMAT_ND = 2
# Keyed by id(): tensors compare element-wise, so they cannot be dictionary keys themselves.
_FORMATS: dict[int, int] = {}


def _format_id(fmt: object) -> int:
    if isinstance(fmt, Tensor):
        return get_npu_format(fmt)
    return int(getattr(fmt, "value", fmt))


def npu_format_cast(
    input: Tensor,  # noqa: A002
    acl_format: object,
    *,
    customize_dtype: int | None = None,
    input_dtype: int | None = None,
) -> Tensor:
    """A new tensor with the same values, tagged with ``acl_format`` (e.g. 29 = FRACTAL_NZ).

    ``customize_dtype`` and ``input_dtype`` are keyword-only, as in the schema; both only
    change how the device lays out the data, so the reference ignores them.

    unconfirmed: what the device returns for a private format while
    ``allow_internal_format`` is False; the reference always tags.
    """
    out = input.clone()
    _tag(out, _format_id(acl_format))
    return out


def npu_format_cast_(
    input: Tensor,  # noqa: A002
    src: object,
    *,
    customize_dtype: int | None = None,
    input_dtype: int | None = None,
) -> Tensor:
    """In-place twin: tags ``input`` with the format of ``src`` (an id, enum or tensor)."""
    _tag(input, _format_id(src))
    return input


def get_npu_format(input: Tensor) -> int:  # noqa: A002
    """The format id recorded for ``input`` (ND = 2 unless a cast tagged it)."""
    return _FORMATS.get(id(input), FORMAT_ND)


def _tag(t: Tensor, fmt: int) -> None:
    if id(t) not in _FORMATS:
        weakref.finalize(t, _FORMATS.pop, id(t), None)
    _FORMATS[id(t)] = fmt
