"""A framework model that imports more of cann-recipes-infer than kvskill answers, run on a CPU
against the user's own checkout.

kvskill answers two executor modules itself, field for field (``executor.core.kv_cache`` and
``executor.utils.forward_metadata``, ``runtime/executor_host.py``). A model such as the
framework's Qwen3.5 also imports ``executor.core.config`` (``InferenceConfig``,
``CommManager``), ``executor.model_loader``, ``executor.utils`` and ``module.*`` (parallel
linears, the fused MoE): those come from the checkout (``KVSKILL_CANN_RECIPES``, else the
checkout the model folder sits in), never from a copy inside kvskill.

What stands in for the device here, and nothing else:

- ``torch_npu`` / ``torchair``: the CPU stand-in (``npu_standin``);
- the process group: a real one-rank ``gloo`` group, so ``torch.distributed`` collectives run
  as the identity they are at one rank;
- the communication groups a model reads but registers only above one rank (Qwen3.5's
  ``moe_ep_group`` and ``moe_ep_group_mc2`` exist only when ``moe_ep_size > 1``, yet its MoE
  takes the expert-parallel path whenever ``moe_tp_size`` is 1): at one rank every group is
  rank 0 alone, so ``OneRankComm`` answers them as the default group, with a stand-in
  communicator name, and records which it answered.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from kvskill.runtime.executor_host import ANSWERED_MODULES, answered_modules
from kvskill.verify.weights import condition_weights
from torch import nn

_FRAMEWORK_IMPORT = re.compile(r"^\s*(?:from|import)\s+((?:executor|module)(?:\.\w+)*)", re.M)
#: what marks a directory as a cann-recipes-infer checkout
_CHECKOUT_MARK = Path("executor") / "core" / "kv_cache" / "cache_info.py"
#: the communicator name a one-rank group gets on the CPU (no HCCL communicator exists)
ONE_RANK_COMM_NAME = "cpu-one-rank"


def framework_packages(source: str) -> list[str]:
    """The framework's own modules SOURCE imports that only a checkout can answer."""
    found = {name for name in _FRAMEWORK_IMPORT.findall(source) if name not in ANSWERED_MODULES}
    return sorted(found)


def find_checkout(model_dir: Path) -> Path | None:
    """The checkout to import the framework from: ``KVSKILL_CANN_RECIPES`` when set, else the
    nearest folder above MODEL_DIR holding ``executor/`` and ``module/`` (a model folder
    inside the checkout, such as ``models/qwen3_5/models``)."""
    named = os.environ.get("KVSKILL_CANN_RECIPES")
    if named:
        return Path(named)
    for folder in Path(model_dir).resolve().parents:
        if (folder / _CHECKOUT_MARK).is_file() and (folder / "module").is_dir():
            return folder
    return None


def is_checkout(root: Path) -> bool:
    return (root / _CHECKOUT_MARK).is_file()


@contextmanager
def kvskill_answers_cache_and_metadata() -> Iterator[None]:
    """While the block runs, ``executor.core.kv_cache`` and ``executor.utils.forward_metadata``
    import as kvskill's equal modules even though the checkout's executor is loaded; the
    checkout's own are back on exit. Import a converted file inside it: its cache entries and
    step metadata are then the ones kvskill's runtime builds and sets.

    NOTE: the checkout's executor must already be imported (its ``executor.core`` package
    imports the whole engine from its own ``kv_cache``, which kvskill's does not replace).
    """
    import importlib

    for name in ANSWERED_MODULES:
        importlib.import_module(name)  # the checkout's, loaded before it is shadowed
    saved = {name: sys.modules[name] for name in ANSWERED_MODULES}
    sys.modules.update(answered_modules())
    try:
        yield
    finally:
        sys.modules.update(saved)


@contextmanager
def one_rank_process_group() -> Iterator[None]:
    """A real ``gloo`` process group of world size 1 for the block (CPU stand-in for the
    framework's HCCL world group); left alone when one of size 1 already exists.

    Raises:
        RuntimeError: a process group of another size is already initialised.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise RuntimeError(
                f"a process group of world size {dist.get_world_size()} is initialised; "
                "the CPU run of a framework model takes one rank"
            )
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def one_rank_comm(comm_manager_cls: type, parallel_config: Any) -> Any:
    """The checkout's ``CommManager`` at world size 1, answering every group a model reads.

    Groups the model registers are the checkout's own answers. A group it reads without
    registering it (registration skipped because its size is 1) is, at one rank, rank 0
    alone: ``get_group`` gives None (torch.distributed's default group, the one-rank gloo
    group), ``get_rank`` 0 and ``get_group_name`` ``ONE_RANK_COMM_NAME`` (there is no HCCL
    communicator to name). The names answered so are kept in ``answered_groups``.
    """
    if parallel_config.world_size != 1:
        raise ValueError(f"one_rank_comm takes world_size 1, got {parallel_config.world_size}")

    class OneRankComm(comm_manager_cls):
        answered_groups: set[str]

        def _answer(self, name: str) -> bool:
            if name in self._groups:
                return False
            self.answered_groups.add(name)
            return True

        def get_group(self, name: str):
            return None if self._answer(name) else super().get_group(name)

        def get_rank(self, group_name: str) -> int:
            return 0 if self._answer(group_name) else super().get_rank(group_name)

        def get_group_name(self, name: str) -> str:
            return ONE_RANK_COMM_NAME if self._answer(name) else super().get_group_name(name)

    comm = OneRankComm(parallel_config)
    comm.answered_groups = set()
    return comm


def build_settings(*, batch_size: int, input_truncated_len: int, max_new_tokens: int) -> dict:
    """The YAML settings of one eager rank with BATCH_SIZE rows (``InferenceConfig.from_dict``)."""
    return {
        # A3: the framework's default platform, named so that it is not read from a device
        # name (the stand-in's is not one)
        "model_config": {
            "model_name": "kvskill-verify",
            "model_path": "unused",
            "exe_mode": "eager",
            "platform_version": "A3",
        },
        "data_config": {"dataset": "default", "input_truncated_len": input_truncated_len},
        "parallel_config": {"world_size": 1},  # every tp / ep size then defaults to 1
        "scheduler_config": {"batch_size": batch_size, "max_new_tokens": max_new_tokens},
    }


def random_weights(model: nn.Module, seed: int) -> None:
    """verify's conditioned weights, plus seeded biases: the framework's parallel linears
    allocate theirs with ``torch.empty`` (a checkpoint fills them), so left as they are they
    would hold whatever the memory held."""
    condition_weights(model, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    for name, param in model.named_parameters():
        if param.dim() == 1 and name.endswith("bias"):
            param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    unset = [name for name, param in model.named_parameters() if not param.isfinite().all()]
    assert not unset, f"parameters left non-finite by the random weights: {unset[:3]}"


def after_loading(model: nn.Module) -> None:
    """What the framework's worker does once weights are in (``process_weights_after_loading``):
    each layer's quant method lays its weights out for the device (the unquantized one
    transposes them). Nothing for a model of plain ``nn.Linear``."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(module)
