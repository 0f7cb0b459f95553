"""Factories for toy cache declarations shared by the runtime tests."""

from __future__ import annotations

import torch
from kvskill.runtime import (
    CacheEntry,
    LayerCacheInfo,
    MambaCacheEntry,
    ModelCacheInfo,
    validate_cache_info,
)
from kvskill.runtime.cache_info import fill_block_sizes


class Sink:
    """Collects the tensors the runtime injects, keyed by ``(layer_idx, cache_name)``."""

    def __init__(self) -> None:
        self.tensors: dict[tuple[int, str], torch.Tensor] = {}

    def setter(self, layer_idx: int, name: str):
        def set_tensor(tensor: torch.Tensor) -> None:
            self.tensors[(layer_idx, name)] = tensor

        return set_tensor


def attn_layer(
    sink: Sink,
    layer_idx: int,
    attn_type: str = "FullAttention",
    *,
    num_head: int = 2,
    head_dim: int = 8,
    dtype: torch.dtype = torch.float32,
    sliding_window: int | None = None,
) -> LayerCacheInfo:
    caches = [
        CacheEntry(
            name,
            attn_type,
            head_dim,
            num_head,
            dtype,
            True,
            tensor_setter=sink.setter(layer_idx, name),
            sliding_window=sliding_window,
        )
        for name in ("k_cache", "v_cache")
    ]
    return LayerCacheInfo(layer_idx, caches)


def mamba_layer(
    sink: Sink,
    layer_idx: int,
    conv_shape=(6, 3),
    ssm_shape=(2, 4, 4),
    dtype: torch.dtype = torch.float32,
) -> LayerCacheInfo:
    caches = [
        MambaCacheEntry(
            cache_name=name,
            shape=list(shape),
            dtype=dtype,
            needs_block=True,
            tensor_setter=sink.setter(layer_idx, name),
        )
        for name, shape in (("conv_state", conv_shape), ("ssm_state", ssm_shape))
    ]
    return LayerCacheInfo(layer_idx, caches)


def model_info(layers: list[LayerCacheInfo], block_size: int = 4) -> ModelCacheInfo:
    """The model's declaration with BLOCK_SIZE on its attention entries, checked as the
    runtime checks it."""
    info = ModelCacheInfo(num_layers=len(layers), layer_infos=layers)
    fill_block_sizes(info, block_size)
    validate_cache_info(info)
    return info


def full_and_sliding(sink: Sink, *, window: int = 6, block_size: int = 4) -> ModelCacheInfo:
    """Layers 0, 2 full attention; layer 1 sliding window (the gpt-oss pattern in miniature)."""
    return model_info(
        [
            attn_layer(sink, 0),
            attn_layer(sink, 1, "SlidingWindow", sliding_window=window),
            attn_layer(sink, 2),
        ],
        block_size,
    )
