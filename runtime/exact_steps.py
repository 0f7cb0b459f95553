"""Exact steps: inside ``exact_steps()``, every module a fast path switched runs its own code.

The fast paths (``prepacked_linear``, ``fused_layers``, ``screened_head``) switch forwards on
the model's modules, and the rotary embedding in its modeling file's namespace, so they stay
switched for whoever runs that module next. An exact ``LLM`` (``exact=True``) may be handed a
module an earlier fast one switched, or a model whose modeling file another model's fast
paths switched; it runs its steps inside this context, and every switched forward checks it
first, so its results are the model's own code's, bit for bit.

A captured decode step (``runtime/captured_decode.py``) decides the same at trace time: dynamo
cannot read a ``ContextVar``, so the setting is mirrored in a module-level list it reads and
guards on (a step run in the other setting is traced again, never replayed wrong).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

_EXACT: ContextVar[bool] = ContextVar("kvskill_exact_steps", default=False)


#: the innermost exact_steps() setting, for traces (steps run on one thread at a time)
_EXACT_FOR_TRACE: list[bool] = [False]


def in_exact_steps() -> bool:
    """Whether switched forwards must run their module's own code now."""
    if torch.compiler.is_compiling():
        return _EXACT_FOR_TRACE[0]
    return _EXACT.get()


@contextmanager
def exact_steps(on: bool = True) -> Iterator[None]:
    """Run the block with the fast paths bypassed (``on``) or allowed (not ``on``); the
    previous setting is restored on leaving, even on error."""
    token = _EXACT.set(on)
    previous, _EXACT_FOR_TRACE[0] = _EXACT_FOR_TRACE[0], on
    try:
        yield
    finally:
        _EXACT.reset(token)
        _EXACT_FOR_TRACE[0] = previous
