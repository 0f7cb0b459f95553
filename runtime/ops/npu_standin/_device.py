"""``torch.npu`` / ``torch_npu.npu`` on a CPU: the device calls a framework model makes.

The answers are the CPU's own: no NPU is available (``is_available()`` is False, no devices),
and the device the stand-in computes on is the CPU, so ``current_device()`` returns
``torch.device("cpu")`` where the real call returns an NPU index. Streams and events are
torch's CPU ones (work on a CPU is already ordered); ``synchronize`` and ``empty_cache`` have
nothing to wait for or free. Graph capture (``npugraph_ex``) is refused.
"""

from __future__ import annotations

import os
import types
from typing import Any

import torch

from ._refusal import GRAPH_MODE, RefusingModule

DEVICE_NAME = "cpu (kvskill torch_npu stand-in)"


def is_available() -> bool:
    return False


def device_count() -> int:
    return 0


def current_device() -> torch.device:
    return torch.device("cpu")


def set_device(device: Any) -> None:
    """Accepted and ignored: the CPU is the only device the stand-in has."""


def synchronize(device: Any = None) -> None:
    """Nothing to wait for: CPU kernels have finished when they return."""


def empty_cache() -> None:
    """Nothing to free: the CPU allocator has no device cache."""


def manual_seed(seed: int) -> None:
    torch.manual_seed(seed)


manual_seed_all = manual_seed


def get_device_name(device: Any = None) -> str:
    return DEVICE_NAME


def mem_get_info(device: Any = None) -> tuple[int, int]:
    """(free, total) bytes of host memory: what a cache sized from it can really use here."""
    page = os.sysconf("SC_PAGE_SIZE")
    return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


def set_compile_mode(jit_compile: bool = False) -> None:
    """Accepted and ignored: operator compilation modes only exist on the device."""


def build() -> types.ModuleType:
    """A fresh ``torch_npu.npu`` module (also installed as ``torch.npu``)."""
    module = types.ModuleType("torch_npu.npu", __doc__)
    for fn in (
        is_available,
        device_count,
        current_device,
        set_device,
        synchronize,
        empty_cache,
        manual_seed,
        manual_seed_all,
        get_device_name,
        mem_get_info,
        set_compile_mode,
    ):
        setattr(module, fn.__name__, fn)
    module.Stream = torch.cpu.Stream
    module.Event = torch.cpu.Event
    module.stream = torch.cpu.stream
    module.current_stream = torch.cpu.current_stream
    # NOTE: read by models before graph capture; False is the A2/A3 default (npu_ops.md §6)
    module.config = types.SimpleNamespace(allow_internal_format=False)
    module.npugraph_ex = RefusingModule("torch.npu.npugraph_ex", GRAPH_MODE)
    return module
