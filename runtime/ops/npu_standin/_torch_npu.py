"""The stand-in ``torch_npu`` module: the reference operators plus the non-operator surface."""

from __future__ import annotations

import types
from typing import Any

from .. import reference
from ._device import build as build_device
from ._profiler import build as build_profiler
from ._refusal import with_spec

#: what ``torch_npu.__version__`` reports: the wheel whose schemas the operators keep, marked
#: as this stand-in by a local version label
VERSION = "2.13.0+kvskill.cpu"


def public_attribute(name: str) -> Any:
    """A reference operator, refusal or dtype name; the reference package's internals (its
    submodules and helpers) are not part of the torch_npu surface."""
    if name.startswith("_") or (name not in reference.__all__ and name in vars(reference)):
        raise AttributeError(f"module 'torch_npu' has no attribute {name!r}")
    return getattr(reference, name)


class StandinTorchNpu(types.ModuleType):
    """``torch_npu`` whose operators, refusals and dtype names come from the reference ops."""

    def __getattr__(self, name: str) -> Any:
        return public_attribute(name)


class OpsNamespace:
    """``torch.ops.npu``: the same reference operators under the dispatcher's namespace."""

    def __getattr__(self, name: str) -> Any:
        return public_attribute(name)


def build() -> dict[str, types.ModuleType]:
    """Fresh ``torch_npu``, ``torch_npu.npu`` and ``torch_npu.profiler`` modules by name."""
    root = StandinTorchNpu("torch_npu", reference.__doc__)
    root.__version__ = VERSION
    with_spec(root, is_package=True)  # so `import torch_npu.profiler` finds the submodule
    root.npu = with_spec(build_device())
    root.profiler = with_spec(build_profiler())
    return {m.__name__: m for m in (root, root.npu, root.profiler)}
