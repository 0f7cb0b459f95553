"""Pick the device the runtime runs on: an Ascend NPU, else CUDA, else the CPU."""

from __future__ import annotations

import importlib.util
import logging
import os

import torch
from kvskill.core.errors import BadInputError

logger = logging.getLogger(__name__)


def npu_available() -> bool:
    """True when ``torch_npu`` imports and reports at least one device."""
    if importlib.util.find_spec("torch_npu") is None:
        return False
    try:
        import torch_npu  # noqa: F401  (registers torch.npu)
    except Exception as exc:  # a broken CANN install must not stop CPU runs
        logger.info("torch_npu is installed but failed to import: %s", exc)
        return False
    npu = getattr(torch, "npu", None)
    return bool(npu is not None and npu.is_available() and npu.device_count() > 0)


def select_device(requested: str | torch.device | None = None) -> torch.device:
    """Return ``requested`` after checking it exists, or the best device present.

    Order when nothing is requested: NPU (torch_npu + a device), CUDA, CPU. The same engine
    code runs on all three; only the operator backend differs (see ``kvskill.runtime.ops``).

    Raises:
        BadInputError: when the requested device type is not available here.
    """
    if requested is None or str(requested) == "auto":
        if npu_available():
            return torch.device("npu")
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("cpu")
    text = str(requested).strip()
    kind, _, index = text.partition(":")
    if kind not in ("cpu", "cuda", "npu") or (index and not index.isdigit()):
        raise BadInputError(
            f"device {text!r} is not a device name; use auto, cpu, cuda[:N] or npu[:N] "
            f"(available here: {', '.join(available_devices())})"
        )
    if kind == "npu":
        missing = npu_missing()
        if missing:
            raise BadInputError(f"device {text!r} requested but {missing}; use --device cpu")
    if kind == "cuda" and not torch.cuda.is_available():
        raise BadInputError(
            f"device {text!r} requested but CUDA is not available in this torch; use --device cpu"
        )
    device = torch.device(text)
    count = _device_count(kind)
    if device.index is not None and count is not None and device.index >= count:
        raise BadInputError(f"device {text!r} requested but only {count} {kind} device(s) exist")
    return device


def available_memory_bytes(device: torch.device) -> int | None:
    """Free memory on ``device`` (host RAM for the CPU), or None when unknown."""
    try:
        if device.type == "cuda":
            return torch.cuda.mem_get_info(device)[0]
        if device.type == "npu":
            return torch.npu.mem_get_info(device)[0]
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, RuntimeError, AttributeError):
        return None


def total_memory_bytes(device: torch.device) -> int | None:
    """Total memory of ``device`` (host RAM for the CPU), or None when unknown.

    Unlike free memory it is the same on every run, so budgets derived from it repeat.
    """
    try:
        if device.type == "cuda":
            return torch.cuda.mem_get_info(device)[1]
        if device.type == "npu":
            return torch.npu.mem_get_info(device)[1]
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, RuntimeError, AttributeError):
        return None


def npu_missing() -> str | None:
    """What stops the NPU from being used here, or None when it can be."""
    if importlib.util.find_spec("torch_npu") is None:
        return (
            "torch_npu is not installed (pip install 'kvskill[npu]' on an Ascend machine with CANN)"
        )
    try:
        import torch_npu  # noqa: F401  (registers torch.npu)
    except Exception as exc:
        return f"torch_npu failed to import ({type(exc).__name__}: {exc})"
    npu = getattr(torch, "npu", None)
    if npu is None or not npu.is_available() or npu.device_count() == 0:
        return "torch_npu sees no Ascend device"
    return None


def available_devices() -> list[str]:
    found = ["cpu"]
    if torch.cuda.is_available():
        found.append("cuda")
    if npu_available():
        found.append("npu")
    return found


def _device_count(kind: str) -> int | None:
    if kind == "cuda":
        return torch.cuda.device_count()
    if kind == "npu":
        return torch.npu.device_count()  # type: ignore[attr-defined]
    return None
