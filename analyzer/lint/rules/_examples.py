"""Shared prologue of the rule examples: the imports converted model code starts with."""

HEADER = """\
import torch
from torch import nn
from kvskill.runtime import CacheEntry, LayerCacheInfo, ModelCacheInfo, get_forward_metadata
from kvskill.runtime.ops import torch_npu

"""


def example(body: str) -> str:
    """A complete example file: the shared imports followed by ``body``."""
    return HEADER + body
