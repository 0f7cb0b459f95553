"""The reference operators as registered custom operators, for captured (compiled) steps.

Each operator is also ``torch.ops.kvskill.<name>``: a ``torch.library`` custom operator whose
fake implementation gives its outputs' shapes and dtypes without running the reference math.
The math reads lengths, indices and block ids on the host, which a compiled graph must not do
while it is traced; as one opaque node it runs with real values when the graph replays.

Eager calls keep calling the Python functions directly: the same errors, and no dispatcher
cost on a step made of microsecond operators. Under ``torch.compile`` the public function
routes to the registered operator (``torch.compiler.is_compiling()`` is a constant to dynamo).
Operators that write in place declare what they mutate and return nothing; the public
function returns the written tensors itself, as torch_npu does.

The fake shapes follow the operator documentation in ``references/npu_ops.md`` (torch_npu's
own ``op_plugin/meta/_meta_registrations.py`` is not installed here to read).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

#: the dispatcher namespace of the reference operators
NAMESPACE = "kvskill"


def register(
    name: str,
    impl: Callable[..., Any],
    fake: Callable[..., Any],
    *,
    mutates_args: Sequence[str] = (),
) -> torch.library.CustomOpDef:
    """Register IMPL as ``kvskill::NAME`` with FAKE as its fake (meta) implementation."""
    op = torch.library.custom_op(f"{NAMESPACE}::{name}", impl, mutates_args=tuple(mutates_args))
    op.register_fake(fake)
    return op


def capturable(name: str, fake: Callable[..., Any]) -> Callable[[Callable], Callable]:
    """Decorator for an out-of-place operator whose signature the dispatcher can type: the
    function is registered as ``kvskill::NAME`` and keeps its own signature and eager path."""

    def decorate(fn: Callable) -> Callable:
        op = register(name, fn, fake)

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if compiling():
                return op(*args, **kwargs)
            return fn(*args, **kwargs)

        call.graph_op = op  # type: ignore[attr-defined]
        return call

    return decorate


#: set by ``dispatched_operators``: eager calls go through the registered operators too
_route_eager_calls: list[bool] = [False]


def compiling() -> bool:
    """True while dynamo traces the caller, or inside ``dispatched_operators``: then the
    registered operator is called."""
    return torch.compiler.is_compiling() or _route_eager_calls[0]


@contextmanager
def dispatched_operators() -> Iterator[None]:
    """Route eager calls through the registered operators as well (one dispatcher call each),
    so a dispatch-level count sees each reference operator as the one kernel it is on an NPU
    instead of the many PyTorch calls that compute it on the CPU."""
    previous = _route_eager_calls[0]
    _route_eager_calls[0] = True
    try:
        yield
    finally:
        _route_eager_calls[0] = previous


def operator(name: str) -> Any:
    """``torch.ops.kvskill.NAME``."""
    return getattr(getattr(torch.ops, NAMESPACE), name)
