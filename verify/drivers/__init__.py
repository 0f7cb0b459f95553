"""What runs a converted model for ``verify``, one module per output kind, and the registry
that picks it.

Most outputs are compared by ``flow.py`` against a transformers reference; their driver only
runs the converted model on the prompts and checks its three chains (``base.VerifyDriver``):

  framework         the bundled runtime's engine, one process    ``engine.py``
  tensor-parallel   the same engine on N ranks                   ``tensor_parallel.py``
  standalone        the runner generated into the directory      ``runner.py``

A conversion of the framework's own Legacy model has no transformers original: its flow
builds that original, drives both and compares (``OWN_FLOWS``):

  framework-Legacy  ``framework_legacy.py`` (or against a checkout: ``legacy_checkout.py``)
  standalone-Legacy ``standalone_legacy.py``
"""

from __future__ import annotations

import os
from collections.abc import Callable
from enum import Enum
from pathlib import Path

from kvskill.implementer.record import ConvertedDir
from kvskill.verify.drivers.base import DriverRun, VerifyDriver
from kvskill.verify.drivers.engine import EngineDriver
from kvskill.verify.drivers.framework_legacy import (
    imports_the_framework,
    is_framework_legacy,
    verify_framework_legacy,
)
from kvskill.verify.drivers.legacy_checkout import verify_against_checkout
from kvskill.verify.drivers.runner import RunnerDriver
from kvskill.verify.drivers.standalone_legacy import (
    is_standalone_legacy,
    verify_standalone_legacy,
)
from kvskill.verify.drivers.tensor_parallel import TensorParallelDriver
from kvskill.verify.options import VerifyOptions
from kvskill.verify.report import VerifyReport


class OutputKind(str, Enum):
    FRAMEWORK = "framework"
    TENSOR_PARALLEL = "tensor-parallel"
    STANDALONE = "standalone"
    FRAMEWORK_LEGACY = "framework-Legacy"
    STANDALONE_LEGACY = "standalone-Legacy"


def output_kind(converted: ConvertedDir, tensor_parallel_size: int | None) -> OutputKind:
    """The kind of CONVERTED, run on TENSOR_PARALLEL_SIZE ranks (None: one)."""
    # NOTE: the Legacy checks come first: those outputs keep the framework's own model,
    # whatever their deploy mode
    if is_framework_legacy(converted):
        return OutputKind.FRAMEWORK_LEGACY
    if is_standalone_legacy(converted):
        return OutputKind.STANDALONE_LEGACY
    if converted.record.standalone is not None:
        return OutputKind.STANDALONE
    if (tensor_parallel_size or 1) > 1:
        return OutputKind.TENSOR_PARALLEL
    return OutputKind.FRAMEWORK


#: builds a driver from the converted directory, the code to run (a staged copy when the
#: config is shrunk) and the options
DriverFactory = Callable[[ConvertedDir, Path, VerifyOptions], VerifyDriver]


def _engine(converted: ConvertedDir, code_dir: Path, options: VerifyOptions) -> VerifyDriver:
    return EngineDriver(
        seed=options.seed,
        use_hybrid_blocks=options.kv_layout == "page_pool",
        graph=options.graph,
    )


def _tensor_parallel(
    converted: ConvertedDir, code_dir: Path, options: VerifyOptions
) -> VerifyDriver:
    return TensorParallelDriver(
        seed=options.seed,
        use_hybrid_blocks=options.kv_layout == "page_pool",
        tensor_parallel_size=options.tensor_parallel_size,
        backend=options.tp_backend,
        code_dir=code_dir,
        dtype=options.dtype,
    )


def _runner(converted: ConvertedDir, code_dir: Path, options: VerifyOptions) -> VerifyDriver:
    return RunnerDriver(converted_dir=code_dir, record=converted.record.standalone)


DRIVERS: dict[OutputKind, DriverFactory] = {
    OutputKind.FRAMEWORK: _engine,
    OutputKind.TENSOR_PARALLEL: _tensor_parallel,
    OutputKind.STANDALONE: _runner,
}


def _standalone_legacy(converted: ConvertedDir, options: VerifyOptions) -> VerifyReport:
    # NOTE: a model that imports the framework's own packages (executor, module) runs
    # against the checkout KVSKILL_CANN_RECIPES names, as the opt-in tests do
    root = os.environ.get("KVSKILL_CANN_RECIPES")
    return verify_standalone_legacy(converted, options, framework_root=Path(root) if root else None)


def _framework_legacy(converted: ConvertedDir, options: VerifyOptions) -> VerifyReport:
    if imports_the_framework(converted):
        # the rest of the framework (its config, parallel layers, fused MoE) comes from the
        # user's checkout
        return verify_against_checkout(converted, options)
    return verify_framework_legacy(converted, options)


#: outputs verified by their own flow: the original is the framework's model
OWN_FLOWS: dict[OutputKind, Callable[[ConvertedDir, VerifyOptions], VerifyReport]] = {
    OutputKind.FRAMEWORK_LEGACY: _framework_legacy,
    OutputKind.STANDALONE_LEGACY: _standalone_legacy,
}


def driver_for(converted: ConvertedDir, code_dir: Path, options: VerifyOptions) -> VerifyDriver:
    """The driver of CONVERTED's output kind (OPTIONS' tensor-parallel size resolved)."""
    kind = output_kind(converted, options.tensor_parallel_size)
    if kind not in DRIVERS:
        raise ValueError(f"{kind.value} outputs are verified by their own flow, not a driver")
    return DRIVERS[kind](converted, code_dir, options)


__all__ = [
    "DRIVERS",
    "OWN_FLOWS",
    "DriverRun",
    "OutputKind",
    "VerifyDriver",
    "driver_for",
    "output_kind",
]
