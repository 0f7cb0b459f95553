"""``torch_npu.profiler`` on a CPU: torch's own profiler, recording CPU activity only.

The framework builds a profiler with NPU and CPU activities, an ``_ExperimentalConfig`` (AI Core
metrics, levels) and a schedule. On a CPU there is no NPU activity to record, so ``profile``
keeps the CPU activity, drops the NPU one and the experimental config (both device-only), and
says so once through ``warnings``.
"""

from __future__ import annotations

import enum
import types
import warnings
from typing import Any

import torch.profiler


class ProfilerActivity(enum.Enum):
    CPU = "CPU"
    NPU = "NPU"


class ProfilerLevel(enum.Enum):
    Level_none = "Level_none"
    Level0 = "Level0"
    Level1 = "Level1"
    Level2 = "Level2"


class AiCMetrics(enum.Enum):
    AiCoreNone = "AiCoreNone"
    PipeUtilization = "PipeUtilization"
    ArithmeticUtilization = "ArithmeticUtilization"
    Memory = "Memory"
    MemoryL0 = "MemoryL0"
    MemoryUB = "MemoryUB"
    ResourceConflictRatio = "ResourceConflictRatio"
    L2Cache = "L2Cache"


class _ExperimentalConfig:
    """Device-only profiler options; kept so the call binds, ignored on a CPU."""

    def __init__(self, **options: Any) -> None:
        self.options = options


def profile(
    *,
    activities: list[ProfilerActivity] | None = None,
    experimental_config: _ExperimentalConfig | None = None,
    **kwargs: Any,
) -> torch.profiler.profile:
    """torch.profiler.profile over the CPU activity (the rest of ``kwargs`` passes through)."""
    wanted = set(activities or (ProfilerActivity.CPU,))
    if ProfilerActivity.NPU in wanted or experimental_config is not None:
        warnings.warn(
            "torch_npu.profiler stand-in: no NPU on this machine, recording CPU activity only",
            stacklevel=2,
        )
    cpu = [torch.profiler.ProfilerActivity.CPU] if ProfilerActivity.CPU in wanted else []
    return torch.profiler.profile(activities=cpu, **kwargs)


def build() -> types.ModuleType:
    module = types.ModuleType("torch_npu.profiler", __doc__)
    module.ProfilerActivity = ProfilerActivity
    module.ProfilerLevel = ProfilerLevel
    module.AiCMetrics = AiCMetrics
    module._ExperimentalConfig = _ExperimentalConfig
    module.profile = profile
    module.schedule = torch.profiler.schedule
    module.tensorboard_trace_handler = torch.profiler.tensorboard_trace_handler
    return module
