"""``torchair`` on a CPU: importable, with graph compilation refused.

torchair compiles a model into an Ascend GE graph, which only an NPU runs. Models import it at
the top and call into it only on graph-mode paths, so the import works, ``patch_for_hcom`` has
nothing to patch (no HCCL here), and everything that compiles, switches NPU streams or calls a
graph-mode operator (``get_npu_backend``, ``inference``, ``scope``, ``ops``, ``CompilerConfig()``)
refuses with one line.
"""

from __future__ import annotations

import types
from typing import Any, NoReturn

from ._refusal import GRAPH_MODE, RefusingModule, refuse_feature, with_spec


def patch_for_hcom() -> None:
    """Nothing to patch: the CPU stand-in has no HCCL collectives."""


def get_npu_backend(*args: Any, **kwargs: Any) -> NoReturn:
    refuse_feature("torchair.get_npu_backend", GRAPH_MODE)


class CompilerConfig:
    """Importable (framework modules import it at the top); constructing one is refused."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        refuse_feature("torchair.CompilerConfig", GRAPH_MODE)


def build() -> dict[str, types.ModuleType]:
    """The stand-in's modules by import name: torchair and the submodules models import."""
    root = types.ModuleType("torchair", __doc__)
    configs = types.ModuleType("torchair.configs")
    compiler_config = types.ModuleType("torchair.configs.compiler_config")
    compiler_config.CompilerConfig = root.CompilerConfig = CompilerConfig
    configs.compiler_config = compiler_config
    root.configs = configs
    root.patch_for_hcom = patch_for_hcom
    root.get_npu_backend = get_npu_backend
    for name in ("ops", "inference", "scope"):
        setattr(root, name, RefusingModule(f"torchair.{name}", GRAPH_MODE))
    # packages, so `import torchair.configs.compiler_config` works
    for module in (root, configs):
        with_spec(module, is_package=True)
    with_spec(compiler_config)
    return {m.__name__: m for m in (root, configs, compiler_config)}
