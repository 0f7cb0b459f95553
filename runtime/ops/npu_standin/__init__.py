"""Run a framework model on a CPU: install stand-in ``torch_npu`` and ``torchair`` modules.

hicann/cann-recipes-infer models import ``torch_npu`` and ``torchair`` at the top and call
torch_npu operators, ``torch.npu`` device functions and ``torch.ops.npu`` operators;
DeepSeek-V4 also imports ``custom_ops`` for ``torch.ops.custom``. Inside ``npu_standin()``
those resolve to kvskill's reference operators (the torch_npu 2.13.0 schemas and the
framework's custom schemas, documented limits enforced) and to honest CPU answers
(``_device``, ``_profiler``, ``_torchair``); quantized operators, collectives and graph mode
refuse by name with one line.

    from kvskill.runtime.ops.npu_standin import npu_standin

    with npu_standin(framework_root="/path/to/cann-recipes-infer"):
        from models.pangu_7b.models import modeling_openpangu_dense as pangu
        model = pangu.PanguEmbeddedForCausalLM(config, runner_settings)   # build and run here

On exit ``sys.modules``, ``torch.npu`` and ``torch.ops.npu`` are as before and the modules
imported from ``framework_root`` are dropped, so the next context imports them afresh. Model
objects keep working after exit only as far as they do not call ``torch.npu`` again: run the
model inside the context.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import torch

from ._custom_ops import build as build_custom_ops
from ._refusal import StandinRefusal
from ._torch_npu import OpsNamespace
from ._torch_npu import build as build_torch_npu
from ._torchair import build as build_torchair

_MISSING = object()


class StandinConflictError(RuntimeError):
    """A real torch_npu (or another stand-in) is already loaded; the two must not mix."""


@contextmanager
def npu_standin(framework_root: str | os.PathLike[str] | None = None) -> Iterator[ModuleType]:
    """Install the stand-in modules for the duration of the block; yields ``torch_npu``.

    Args:
        framework_root: a cann-recipes-infer checkout to put first on ``sys.path`` (its
            ``executor``, ``module`` and ``models`` import as top-level names, as in the
            framework's own launchers); modules imported from it are dropped on exit.

    Raises:
        StandinConflictError: ``torch_npu`` or ``torchair`` is already imported, or a real
            ``torch_npu`` is installed (run the model on it instead).
    """
    _check_free()
    modules = {**build_torch_npu(), **build_torchair(), **build_custom_ops()}
    root = str(Path(framework_root).resolve()) if framework_root is not None else None
    had_npu = getattr(torch, "npu", _MISSING)
    had_ops_npu = torch.ops.__dict__.get("npu", _MISSING)
    sys.modules.update(modules)
    torch.npu = modules["torch_npu"].npu
    torch.ops.npu = OpsNamespace()
    if root is not None:
        sys.path.insert(0, root)
    try:
        yield modules["torch_npu"]
    finally:
        for name in modules:
            sys.modules.pop(name, None)
        _restore(torch, "npu", had_npu)
        _restore(torch.ops, "npu", had_ops_npu)
        if root is not None:
            _forget_framework(root)


def _check_free() -> None:
    for name in ("torch_npu", "torchair", "custom_ops"):
        if name in sys.modules:
            raise StandinConflictError(
                f"`{name}` is already imported ({sys.modules[name]!r}); the stand-in installs "
                "its own and must not shadow a loaded one"
            )
    if importlib.util.find_spec("torch_npu") is not None:
        raise StandinConflictError(
            "a real torch_npu is installed; run the framework model on it instead of the stand-in"
        )


def _restore(owner: object, attr: str, old: object) -> None:
    if old is _MISSING:
        owner.__dict__.pop(attr, None)
    else:
        setattr(owner, attr, old)


def _forget_framework(root: str) -> None:
    if root in sys.path:
        sys.path.remove(root)
    prefix = root.rstrip(os.sep) + os.sep
    # decide for every module first: a namespace package's path is recomputed from its parent
    doomed = [name for name, module in list(sys.modules.items()) if _located_under(module, prefix)]
    for name in doomed:
        sys.modules.pop(name, None)


def _located_under(module: object, prefix: str) -> bool:
    spec = getattr(module, "__spec__", None)
    if spec is None:
        return False
    places = [spec.origin or "", *list(spec.submodule_search_locations or ())]
    return any(str(place).startswith(prefix) for place in places)


__all__ = ["StandinConflictError", "StandinRefusal", "npu_standin"]
