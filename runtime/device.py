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
    try:
        device = torch.device(requested)
    except (RuntimeError, TypeError) as exc:
        raise BadInputError(
            f"device {requested!r} is not a device name; use auto, cpu, cuda[:N] or npu[:N]"
        ) from exc
    if device.type == "npu" and not npu_available():
        raise BadInputError("device 'npu' requested but torch_npu or an Ascend device is missing")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise BadInputError("device 'cuda' requested but CUDA is not available")
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
