"""Layers that declare caches but do not import the runtime names yet (for KVR013 alone)."""

from torch import nn
import torch
from kvskill.runtime import CacheEntry, LayerCacheInfo, MambaCacheEntry, ModelCacheInfo, get_forward_metadata
from kvskill.runtime.ops import fla, torch_npu


class StateLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.cache_entries = [
            MambaCacheEntry(cache_name="conv_state", shape=(3, 8), dtype=None, tensor_setter=None),
        ]


class AttentionLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.cache_entries = [
            CacheEntry(
                cache_name="k_cache", attn_type="FullAttention", dim=8, num_head=1, dtype=None, tensor_setter=None
            ),
        ]
