"""The FLA entry points converted code calls, dispatched per call and reported.

On the NPU backend (``kvskill.runtime.ops.backend()``) each call that fits a torch_npu
operator goes to it through its route (``fla_npu.py``: arguments mapped to the operator's
schema, its documented limits checked first); every other call, and every call on the
reference backend, runs the PyTorch reference (``fla_reference.py``) on whatever device its
tensors are on. ``dispatch_report()`` says which backend served each entry point, how often,
and why.
"""

from __future__ import annotations

import functools
import inspect
from collections import Counter
from collections.abc import Callable
from types import ModuleType
from typing import Any

import kvskill.runtime.ops.fla_reference as fla_reference

from .fla_graph_ops import captured_call
from .fla_npu import NO_OPERATOR, ROUTES
from .fla_reference import PAD_SLOT_ID, gated_delta_scan, l2norm, selective_scan_fn

#: (entry point, backend, operator or reason) -> calls
_CALLS: Counter[tuple[str, str, str]] = Counter()
REFERENCE_BACKEND = "the operator backend is the reference"


def _no_npu() -> ModuleType | None:
    return None


#: the active torch_npu module when the operator backend is the NPU, else None; the ops
#: package installs its lookup once it has chosen a backend (this module cannot import the
#: package, which imports it)
_npu_module: Callable[[], ModuleType | None] = _no_npu


def set_npu_lookup(lookup: Callable[[], ModuleType | None]) -> None:
    """Make LOOKUP the way every entry point finds the NPU operators (called per call)."""
    global _npu_module
    _npu_module = lookup


def _dispatched(name: str, reference: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(reference)
    route = ROUTES.get(name)

    @functools.wraps(reference)
    def entry(*args: Any, **kwargs: Any) -> Any:
        npu = _npu_module()
        captured = captured_call(name, args, kwargs) if npu is None else None
        if captured is not None:  # a step being compiled: one registered operator
            return captured
        if npu is None:
            _CALLS[name, "reference", REFERENCE_BACKEND] += 1
            return reference(*args, **kwargs)
        if route is None:
            _CALLS[name, "reference", NO_OPERATOR[name]] += 1
            return reference(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        call = route.plan(bound.arguments)
        if isinstance(call, str):
            _CALLS[name, "reference", call] += 1
            return reference(*args, **kwargs)
        via = f"torch_npu.{route.operator}" + (f" ({call.note})" if call.note else "")
        _CALLS[name, "npu", via] += 1
        call.prepare()
        return call.finish(getattr(npu, route.operator)(*call.args, **call.kwargs))

    return entry


def dispatch_report() -> list[dict[str, Any]]:
    """One row per (entry point, backend, operator or reason) seen since the last reset."""
    return [
        {"entry": entry, "backend": backend, "via": via, "calls": calls}
        for (entry, backend, via), calls in sorted(_CALLS.items())
    ]


def reset_dispatch_report() -> None:
    """Forget the calls counted so far."""
    _CALLS.clear()


def dispatch_lines(rows: list[dict[str, Any]]) -> list[str]:
    """DISPATCH_REPORT rows as text lines ("entry -> backend (via) xN")."""
    return [f"{r['entry']} -> {r['backend']} ({r['via']}) x{r['calls']}" for r in rows]


causal_conv1d_fn = _dispatched("causal_conv1d_fn", fla_reference.causal_conv1d_fn)
causal_conv1d_update = _dispatched("causal_conv1d_update", fla_reference.causal_conv1d_update)
fused_recurrent_gated_delta_rule = _dispatched(
    "fused_recurrent_gated_delta_rule", fla_reference.fused_recurrent_gated_delta_rule
)
#: the name the AscendC FLA interface uses for the token-by-token gated delta rule
recurrent_gated_delta_rule = fused_recurrent_gated_delta_rule
chunk_gated_delta_rule = _dispatched("chunk_gated_delta_rule", fla_reference.chunk_gated_delta_rule)
chunk_kda = _dispatched("chunk_kda", fla_reference.chunk_kda)
fused_recurrent_kda = _dispatched("fused_recurrent_kda", fla_reference.fused_recurrent_kda)
selective_scan_fn = _dispatched("selective_scan_fn", selective_scan_fn)

__all__ = [
    "PAD_SLOT_ID",
    "causal_conv1d_fn",
    "causal_conv1d_update",
    "chunk_gated_delta_rule",
    "chunk_kda",
    "dispatch_lines",
    "dispatch_report",
    "fused_recurrent_gated_delta_rule",
    "fused_recurrent_kda",
    "gated_delta_scan",
    "l2norm",
    "recurrent_gated_delta_rule",
    "reset_dispatch_report",
    "selective_scan_fn",
]
