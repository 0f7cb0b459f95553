"""``custom_ops`` on a CPU: the framework's custom operator extension, as reference math.

cann-recipes-infer's DeepSeek-V4 imports ``custom_ops`` (its ``ops/ascendc`` extension) for the
side effect of defining ``torch.ops.custom.<name>``. The stand-in module does the same with the
reference operators (``reference/custom``); an operator the reference does not implement stays
undefined, so calling it fails with torch's own "no op named" error naming it.
"""

from __future__ import annotations

import types

from ..reference.custom import register_custom_operators
from ._refusal import with_spec


def build() -> dict[str, types.ModuleType]:
    """``custom_ops``, with the reference operators registered under ``torch.ops.custom``."""
    register_custom_operators()
    module = with_spec(types.ModuleType("custom_ops", __doc__), is_package=True)
    return {module.__name__: module}
