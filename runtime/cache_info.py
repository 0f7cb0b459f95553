"""Cache declarations a converted model hands to the runtime: entries, layers, the model.

The model declares, the runtime allocates: each attention (or Mamba) layer lists one
``CacheEntry`` per cache tensor it needs, the model wraps them in ``ModelCacheInfo`` from
``get_cache_info()``, and ``KVCacheManager`` sizes, allocates and injects the tensors.
Validation happens here, once, at the boundary; every message names the layer and the entry.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import torch
from kvskill.core.attn_types import AttnType
from kvskill.core.cache_bytes import entry_bytes
from kvskill.core.errors import BadInputError
from torch import Tensor


class CacheInfoError(BadInputError):
    """A model declared caches the runtime cannot serve (bad field, unknown type, ...)."""

    code = "bad_cache_info"


@dataclass(eq=False)
class CacheEntry:
    """One cache tensor of one layer, allocated as ``[num_blocks, block_size, num_head, *dim]``."""

    #: name of the cache inside its layer, e.g. ``"k_cache"``
    cache_name: str
    #: "FullAttention" | "SlidingWindow" | "Mamba" | a registered type
    attn_type: str
    #: trailing size per head; a list means several trailing dims (e.g. ``[D // 16, 16]``)
    dim: int | list[int]
    #: heads per rank stored in this cache (``num_key_value_heads_per_rank``; 1 for MLA latent)
    num_head: int
    dtype: torch.dtype
    #: called once with the allocated tensor (the layer stores it, e.g. as ``self.k_cache``)
    tensor_setter: Callable[[Tensor], None] | None
    #: window W of a SlidingWindow cache: a query at position p sees keys (p - W, p]
    sliding_window: int | None = None
    #: False for caches that hold no per-block data (never allocated by the runtime)
    needs_block: bool = True
    #: tokens per block for this entry's group; None = the model's block size
    block_size: int | None = None
    #: groups entries under this key instead of ``attn_type`` (same manager class)
    manager_key: str | None = None
    #: the allocated tensor, set by the runtime
    tensor: Tensor | None = None

    @property
    def group_key(self) -> str:
        """Entries with the same key share one manager, one block table and one slot mapping."""
        return self.manager_key or self.attn_type

    @property
    def dims(self) -> tuple[int, ...]:
        return tuple(self.dim) if isinstance(self.dim, (list, tuple)) else (self.dim,)

    def block_shape(self, block_size: int) -> tuple[int, ...]:
        """Shape of one block of this entry: ``(block_size, num_head, *dim)``."""
        return (block_size, self.num_head, *self.dims)

    def bytes_per_block(self, block_size: int) -> int:
        element_size = torch.empty((), dtype=self.dtype).element_size()
        return block_size * entry_bytes(self.dims, self.num_head, element_size)


@dataclass(init=False, eq=False)
class MambaCacheEntry(CacheEntry):
    """A recurrent state (conv or SSM) of one request: one block holds the whole ``shape``.

    Allocated as ``[num_blocks, *shape]``; a Mamba group's block size is 1 because the state
    does not grow with the sequence.
    """

    #: the state of one request, e.g. ``(conv_dim, kernel - 1)`` or ``(heads, k_dim, v_dim)``
    shape: tuple[int, ...] = field(default=())

    def __init__(
        self,
        cache_name: str,
        shape: tuple[int, ...] | list[int],
        dtype: torch.dtype,
        tensor_setter: Callable[[Tensor], None] | None,
        attn_type: str = AttnType.MAMBA.value,
        manager_key: str | None = None,
        tensor: Tensor | None = None,
    ) -> None:
        self.shape = tuple(int(s) for s in shape)
        super().__init__(
            cache_name=cache_name,
            attn_type=attn_type,
            dim=list(self.shape),
            num_head=1,
            dtype=dtype,
            tensor_setter=tensor_setter,
            block_size=1,
            manager_key=manager_key,
            tensor=tensor,
        )

    def block_shape(self, block_size: int) -> tuple[int, ...]:
        return self.shape


@dataclass(eq=False)
class LayerCacheInfo:
    """The caches of one (sub)layer, in declaration order."""

    layer_idx: int
    caches: list[CacheEntry]
    #: optional override of how this layer receives its storage: called with the layer's raw
    #: page view ``[num_blocks, page_size_bytes]`` (int8) in the page-pool layout, or with the
    #: dict ``{cache_name: tensor}`` in the contiguous layout. None = each entry's
    #: ``tensor_setter`` is called with its own view.
    bind_kv_cache: Callable[[Tensor | dict[str, Tensor]], None] | None = None


@dataclass(eq=False)
class ModelCacheInfo:
    """Everything the runtime needs to know about a model's caches."""

    num_layers: int
    #: default tokens per block for groups whose entries do not set their own
    block_size: int
    layer_infos: list[LayerCacheInfo]
    #: MLA latent caches (one head, not split across ranks)
    is_mla_backend: bool = False

    def __post_init__(self) -> None:
        # NOTE: the attn_type check needs the managers' registry; KVCacheManager runs it
        # (``known_attn_types``) before it builds anything, so this module stays below it.
        validate_cache_info(self)

    def entries(self) -> list[tuple[int, CacheEntry]]:
        """``(layer_idx, entry)`` for every entry that needs blocks, in declaration order."""
        return [
            (info.layer_idx, entry)
            for info in self.layer_infos
            for entry in info.caches
            if entry.needs_block
        ]

    def group_block_size(self, entry: CacheEntry) -> int:
        return entry.block_size or self.block_size


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _validate_entry(
    layer: LayerCacheInfo, entry: CacheEntry, known: Collection[str] | None
) -> None:
    where = f"cache {entry.cache_name!r} in layer {layer.layer_idx}"
    if known is not None and entry.attn_type not in known:
        raise CacheInfoError(
            f"{where} has unknown attn_type {entry.attn_type!r}; known types are "
            f"{sorted(known)}. Register a SingleTypeKVCacheManager subclass for it "
            "with kvskill.runtime.managers.register_attn_type."
        )
    if not all(_positive_int(d) for d in entry.dims) or not _positive_int(entry.num_head):
        raise CacheInfoError(
            f"{where} has dim={entry.dim!r}, num_head={entry.num_head!r}; both must be "
            "positive integers"
        )
    if not isinstance(entry.dtype, torch.dtype):
        raise CacheInfoError(f"{where} has dtype {entry.dtype!r}; expected a torch.dtype")
    if entry.block_size is not None and not _positive_int(entry.block_size):
        raise CacheInfoError(f"{where} has block_size {entry.block_size!r}; expected > 0")
    if entry.attn_type == AttnType.SLIDING_WINDOW.value and not _positive_int(entry.sliding_window):
        raise CacheInfoError(
            f"{where} is SlidingWindow but sliding_window={entry.sliding_window!r}; "
            "set the model's window W (a positive number of tokens)"
        )
    if entry.needs_block and entry.tensor_setter is None and layer.bind_kv_cache is None:
        raise CacheInfoError(
            f"{where} has no tensor_setter and the layer has no bind_kv_cache; the runtime "
            "cannot hand it its tensor"
        )


def validate_cache_info(
    info: ModelCacheInfo, *, known_attn_types: Collection[str] | None = None
) -> None:
    """Check a ModelCacheInfo, before any manager is built.

    Args:
        known_attn_types: the attn_types some manager serves (``ATTN_TYPE_MANAGER_MAP``);
            None skips that check, which is how ``ModelCacheInfo`` checks itself when built.

    Raises:
        CacheInfoError: naming the layer and entry at fault, the value and what is allowed.
    """
    if not _positive_int(info.block_size):
        raise CacheInfoError(f"ModelCacheInfo.block_size is {info.block_size!r}; expected > 0")
    if info.num_layers != len(info.layer_infos):
        raise CacheInfoError(
            f"ModelCacheInfo.num_layers is {info.num_layers} but {len(info.layer_infos)} "
            "layer_infos were given; list one LayerCacheInfo per (sub)layer"
        )
    known = None if known_attn_types is None else set(known_attn_types)
    seen_layers: set[int] = set()
    group_window: dict[str, tuple[int | None, int, str]] = {}
    for layer in info.layer_infos:
        if layer.layer_idx in seen_layers:
            raise CacheInfoError(f"layer_idx {layer.layer_idx} appears twice in layer_infos")
        seen_layers.add(layer.layer_idx)
        names = [entry.cache_name for entry in layer.caches]
        if len(names) != len(set(names)):
            raise CacheInfoError(f"layer {layer.layer_idx} declares duplicate caches {names}")
        for entry in layer.caches:
            _validate_entry(layer, entry, known)
            key = entry.group_key
            shape = (entry.sliding_window, info.group_block_size(entry), entry.attn_type)
            first = group_window.setdefault(key, shape)
            if first != shape:
                raise CacheInfoError(
                    f"cache {entry.cache_name!r} in layer {layer.layer_idx} has "
                    f"(sliding_window, block_size, attn_type)={shape} but group {key!r} "
                    f"already uses {first}; give it its own manager_key"
                )
