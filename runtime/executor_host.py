"""kvskill's runtime as a host for models written to the Ascend framework's executor contract.

A model of that contract (cann-recipes-infer at ``fbc225d``) is built from
``(config, infer_config, comm_manager)``, imports its cache classes from
``executor.core.kv_cache``, its metadata from ``executor.utils.forward_metadata`` and calls
``torch_npu``; its forward takes the packed step as ``input_ids`` / ``position_ids`` of
shape [T] with the step's ``forward_metadata`` and returns logits ``[B, 1, vocab]``.

kvskill's declarations equal the framework's field for field, so such a file runs here once
its framework imports resolve to them: ``framework_modules()`` does that while the file is
imported, ``executor_infer_config()`` is the part of the framework's inference config such a
model reads, and the engine calls an ``is_executor_model`` model with the framework's forward.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType, SimpleNamespace

from torch import nn

#: the framework modules a converted file imports, and what kvskill gives for each name
_KV_CACHE_NAMES = (
    "CacheAllocator",
    "CacheEntry",
    "LayerCacheInfo",
    "MambaCacheEntry",
    "ModelCacheInfo",
    "validate_cache_info",
)


def _package(name: str) -> ModuleType:
    module = ModuleType(name)
    module.__path__ = []  # a package, so its submodules import
    return module


def _framework_aliases() -> dict[str, ModuleType]:
    from kvskill.runtime.ops import torch_npu

    # by module path: the package re-exports a function named forward_context
    cache_info = importlib.import_module("kvskill.runtime.cache_info")
    forward_context = importlib.import_module("kvskill.runtime.forward_context")

    kv_cache = ModuleType("executor.core.kv_cache")
    kv_cache.__path__ = []
    for name in _KV_CACHE_NAMES:
        setattr(kv_cache, name, getattr(cache_info, name))
    aliases = {
        "executor": _package("executor"),
        "executor.core": _package("executor.core"),
        "executor.core.kv_cache": kv_cache,
        "executor.utils": _package("executor.utils"),
        "executor.utils.forward_metadata": forward_context,
    }
    if importlib.util.find_spec("torch_npu") is None:
        # kvskill's operator surface: the real torch_npu where it is installed, else the
        # reference operators with the same schemas
        aliases["torch_npu"] = torch_npu
    return aliases


#: the executor modules kvskill answers with its own equal classes
ANSWERED_MODULES = ("executor.core.kv_cache", "executor.utils.forward_metadata")


def answered_modules() -> dict[str, ModuleType]:
    """kvskill's module for each of ANSWERED_MODULES, by name."""
    aliases = _framework_aliases()
    return {name: aliases[name] for name in ANSWERED_MODULES}


@contextmanager
def framework_modules() -> Iterator[None]:
    """While the block runs, ``executor.core.kv_cache``, ``executor.utils.forward_metadata``
    (and ``torch_npu`` where none is installed) import as kvskill's equal classes.

    Only names not already imported are installed, and all of them are removed on exit: the
    importing module keeps the objects it bound.
    """
    installed = {
        name: module for name, module in _framework_aliases().items() if name not in sys.modules
    }
    sys.modules.update(installed)
    try:
        yield
    finally:
        for name in installed:
            sys.modules.pop(name, None)


def is_executor_model_class(cls: type) -> bool:
    """Whether CLS is built the framework's way, ``(config, infer_config, comm_manager)``."""
    try:
        params = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return False
    return "infer_config" in params


def is_executor_model(model: nn.Module) -> bool:
    return is_executor_model_class(type(model))


def executor_infer_config(*, block_size: int = 128, attn_tp_size: int = 1) -> SimpleNamespace:
    """The fields of the framework's ``InferenceConfig`` a converted model reads, with the
    framework's defaults (one rank, one request per batch row)."""
    return SimpleNamespace(
        model_config=SimpleNamespace(exe_mode="eager", with_ckpt=False, dtype="float32"),
        data_config=SimpleNamespace(input_truncated_len=256),
        parallel_config=SimpleNamespace(
            world_size=attn_tp_size,
            attn_tp_size=attn_tp_size,
            moe_tp_size=1,
            embed_tp_size=1,
            lmhead_tp_size=1,
        ),
        scheduler_config=SimpleNamespace(
            batch_size=1, batch_size_per_dp_rank=1, max_new_tokens=32, block_size=block_size
        ),
    )
