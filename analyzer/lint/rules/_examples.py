"""Shared prologue of the rule examples: the imports converted model code starts with.

The examples declare caches in the executor's form (hicann/cann-recipes-infer ``fbc225d``):
``needs_block`` and a ``block_size`` on every ``CacheEntry``, no ``block_size`` on
``ModelCacheInfo``. A file for the executor imports the same names from
``executor.core.kv_cache``; only the import lines differ.
"""

HEADER = """\
import torch
from torch import nn
from kvskill.runtime import (
    CacheEntry, LayerCacheInfo, MambaCacheEntry, ModelCacheInfo, get_forward_metadata,
)
from kvskill.runtime.ops import torch_npu

"""


def example(body: str) -> str:
    """A complete example file: the shared imports followed by ``body``."""
    return HEADER + body
