"""The one error the stand-in's non-operator surface raises, and a module that raises it."""

from __future__ import annotations

import importlib.machinery
import types
from typing import NoReturn

from ..reference.refused import RefusedOperatorError

GRAPH_MODE = "graph mode (GE / npugraph_ex) compiles for an NPU; run the model eager on a CPU"


class StandinRefusal(RefusedOperatorError):
    """A torch_npu / torchair feature that has no honest CPU answer (graph mode, HCCL)."""


def refuse_feature(name: str, reason: str) -> NoReturn:
    raise StandinRefusal(f"{name}: {reason}")


class RefusingModule(types.ModuleType):
    """A module every attribute of which refuses with one reason (``torchair.ops`` etc.)."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(name, f"Refused on a CPU: {reason}.")
        self._reason = reason
        with_spec(self)

    def __getattr__(self, attr: str) -> NoReturn:
        if attr.startswith("__"):
            raise AttributeError(attr)
        refuse_feature(f"{self.__name__}.{attr}", self._reason)


def with_spec(module: types.ModuleType, *, is_package: bool = False) -> types.ModuleType:
    """Give a built module the import spec ``importlib.util.find_spec`` expects of it."""
    module.__spec__ = importlib.machinery.ModuleSpec(module.__name__, None, is_package=is_package)
    if is_package:
        module.__path__ = []
    return module
