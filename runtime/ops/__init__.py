"""Operator surface identical to torch_npu, with reference implementations in PyTorch.

``torch_npu`` below is the real ``torch_npu`` module on a machine with an Ascend NPU, else the
reference module ``kvskill.runtime.ops.reference``. The environment variable ``KVSKILL_OPS``
forces the choice: ``npu`` (fail if torch_npu is unusable) or ``reference``; unset or ``auto``
picks the NPU when present. ``backend()`` reports which one is active and why.

``npu_limits()`` / ``set_npu_limits()`` switch the strict NPU profile: the reference then also
enforces the limits that hold only on hardware (fp16/bf16 only, paged block sizes, fixed head
dims; see ``reference/npu_profile.py``). ``KVSKILL_NPU_LIMITS=1`` turns it on from the start.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from types import ModuleType

from . import fla, mamba, reference
from .reference.npu_profile import npu_limits, npu_limits_enabled, set_npu_limits


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


__all__ = [
    "Backend",
    "backend",
    "fla",
    "mamba",
    "npu_limits",
    "npu_limits_enabled",
    "reference",
    "set_npu_limits",
    "torch_npu",
]
