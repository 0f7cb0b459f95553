"""Operator surface identical to torch_npu, with reference implementations in PyTorch.

``torch_npu`` below is the real ``torch_npu`` module on a machine with an Ascend NPU, else the
reference module ``kvskill.runtime.ops.reference``. The environment variable ``KVSKILL_OPS``
forces the choice: ``npu`` (fail if torch_npu is unusable) or ``reference``; unset or ``auto``
picks the NPU when present. ``backend()`` reports which one is active and why.

The NPU profile (``reference/npu_profile.py``) says which hardware-only limits the reference
also enforces: ``shapes`` (paged block sizes, block tables), ``dims`` (head counts and dims),
``dtypes`` (fp16/bf16 only). Direct operator calls check none of them unless
``npu_limits()`` / ``set_npu_limits()`` or ``KVSKILL_NPU_LIMITS=1`` turn all on; ``LLM``,
``kvskill run`` and ``kvskill verify`` run under ``run_profile(...)`` (shapes by default;
``cpu_only_shapes=True`` / ``KVSKILL_CPU_ONLY_SHAPES=1`` opt out).
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from types import ModuleType

from . import fla, mamba, reference
from .reference.npu_profile import (
    NpuProfile,
    check_run_block_size,
    current_profile,
    npu_limits,
    npu_limits_enabled,
    profile_line,
    profile_report,
    run_profile,
    set_npu_limits,
    use_npu_profile,
)


@dataclass(frozen=True, slots=True)
class Backend:
    """The active operator backend."""

    #: "npu" or "reference"
    name: str
    #: one line saying why this backend was chosen
    reason: str


def _select() -> tuple[ModuleType, Backend]:
    choice = os.environ.get("KVSKILL_OPS", "auto").strip().lower() or "auto"
    if choice == "reference":
        return reference, Backend("reference", "KVSKILL_OPS=reference forces the reference ops")
    if choice not in ("auto", "npu"):
        raise ValueError(f"KVSKILL_OPS must be 'auto', 'npu' or 'reference', got {choice!r}")
    try:
        real = importlib.import_module("torch_npu")
    except ImportError as exc:
        if choice == "npu":
            raise ImportError(f"KVSKILL_OPS=npu but torch_npu does not import: {exc}") from exc
        return reference, Backend("reference", "torch_npu is not installed")
    if choice == "npu":
        return real, Backend("npu", "KVSKILL_OPS=npu forces torch_npu")
    import torch

    npu = getattr(torch, "npu", None)
    if npu is not None and npu.is_available():
        return real, Backend("npu", "torch_npu imports and an NPU device is present")
    return reference, Backend("reference", "torch_npu imports but no NPU device is present")


torch_npu, _BACKEND = _select()


def backend() -> Backend:
    """Which operator backend ``torch_npu`` is, and why."""
    return _BACKEND


def _npu_operators() -> ModuleType | None:
    # read at call time, so a backend swapped in later (a test's stand-in) counts too
    return torch_npu if _BACKEND.name == "npu" else None


fla.set_npu_lookup(_npu_operators)


__all__ = [
    "Backend",
    "NpuProfile",
    "backend",
    "check_run_block_size",
    "current_profile",
    "fla",
    "mamba",
    "npu_limits",
    "npu_limits_enabled",
    "profile_line",
    "profile_report",
    "reference",
    "run_profile",
    "set_npu_limits",
    "torch_npu",
    "use_npu_profile",
]
