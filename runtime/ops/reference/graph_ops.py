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

The fake shapes follow the operator documentation in ``references/npu_ops.md``; the sparse
operators' (``npu_lightning_indexer``, ``npu_sparse_flash_attention``) follow torch_npu
2.13.0's own ``op_plugin/meta/_meta_registrations.py``, read from the wheel.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import SimpleNamespace
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


def capturable(name: str, fake: Callable[[SimpleNamespace], Any]) -> Callable[[Callable], Callable]:
    """Decorator for an out-of-place operator whose signature the dispatcher can type: the
    function is registered as ``kvskill::NAME`` and keeps its own signature and eager path.

    FAKE takes the call's arguments as one namespace (``args.query``, defaults filled in), so
    the operator's signature is written once, on the function itself.

    A custom operator may not take tensors as keyword-only arguments, which torch_npu's
    schemas do (``*, Tensor? block_table=None``): such a function is registered with every
    parameter positional, in its order, and the traced call passes them so."""

    def decorate(fn: Callable) -> Callable:
        params = inspect.signature(fn).parameters.values()
        if not any(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params):
            impl, to_op = fn, None
        else:
            impl, to_op = _all_positional(fn), _positional_arguments(fn)
        op = register(name, impl, _fake_taking_namespace(impl, fake))

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if compiling():
                return op(*args, **kwargs) if to_op is None else op(*to_op(args, kwargs))
            return fn(*args, **kwargs)

        call.graph_op = op  # type: ignore[attr-defined]
        return call

    return decorate


def _fake_taking_namespace(impl: Callable, fake: Callable[[SimpleNamespace], Any]) -> Callable:
    """A fake with IMPL's signature (the registration reads it) that binds the call and hands
    FAKE the arguments by name."""
    signature = inspect.signature(impl, eval_str=True)

    def bound_fake(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return fake(SimpleNamespace(**bound.arguments))

    bound_fake.__signature__ = signature  # type: ignore[attr-defined]
    bound_fake.__name__ = f"{impl.__name__}_fake"
    return bound_fake


def _all_positional(fn: Callable) -> Callable:
    """FN with its keyword-only parameters taken positionally after the others (annotations
    resolved, so the schema can be read off the new signature)."""
    signature = inspect.signature(fn, eval_str=True)
    keyword_only = [
        p.name for p in signature.parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY
    ]
    num_leading = len(signature.parameters) - len(keyword_only)

    def positional(*args: Any) -> Any:
        # the dispatcher may leave out trailing arguments at their defaults: FN's own apply
        return fn(*args[:num_leading], **dict(zip(keyword_only, args[num_leading:])))  # noqa: B905

    positional.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[
            p.replace(kind=inspect.Parameter.POSITIONAL_OR_KEYWORD)
            for p in signature.parameters.values()
        ]
    )
    positional.__name__ = fn.__name__
    return positional


def _positional_arguments(fn: Callable) -> Callable[[tuple, dict], list]:
    """(args, kwargs) of a call to FN -> every argument's value in FN's parameter order, the
    defaults filled in (plain list and dict work: dynamo traces it)."""
    params = list(inspect.signature(fn).parameters.values())
    names = [p.name for p in params]
    defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}

    def arrange(args: tuple, kwargs: dict) -> list:
        rest = [kwargs[n] if n in kwargs else defaults[n] for n in names[len(args) :]]
        return [*args, *rest]

    return arrange


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
