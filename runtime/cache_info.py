"""Cache declarations a converted model hands to its host: entries, layers, the model.

The model declares, the host allocates: each attention (or state) layer lists one
``CacheEntry`` per cache tensor it needs, the model wraps them in ``ModelCacheInfo`` from
``get_cache_info()``, and ``KVCacheManager`` sizes, allocates and injects the tensors.

These classes equal the Ascend framework's (hicann/cann-recipes-infer at ``fbc225d``,
``executor/core/kv_cache/cache_info.py``) field for field, with the same defaults and the same
construction rules, so one converted file runs in either host with only its imports changed
(``tests/runtime/test_executor_contract.py`` pins them). What kvskill's runtime adds lives
outside the fields: Legacy rows are a registered attn_type, a layer may carry a
``bind_kv_cache`` attribute for the page-pool layout, and the runtime fills the block size of
entries that leave it None. Validation of a whole model happens once, at the runtime's
boundary (``validate_cache_info``), and every message names the layer and the entry.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from enum import Enum

import torch
from kvskill.core.attn_types import AttnType
from kvskill.core.cache_bytes import block_bytes, entry_bytes
from kvskill.core.errors import BadInputError
from torch import Tensor

#: memory layouts of a paged cache tensor: [blocks, block_size, heads, dim] or
#: [blocks, heads, block_size, dim]
SUPPORTED_CACHE_LAYOUTS = ("BnBsND", "BnNBsD")


class CacheInfoError(BadInputError, ValueError):
    """A model declared caches no host can serve (bad field, unknown type, ...).

    A ValueError too, as the framework raises for the same declarations.
    """

    code = "bad_cache_info"


class CacheAllocator(str, Enum):
    """Where a cache entry's tensor is allocated."""

    HBM = "hbm"
    #: host memory the device reads through swapping (``torch_npu.empty_with_swapped_memory``)
    SWAPPED_MEMORY = "swapped_memory"


@dataclass(eq=False)
class CacheEntry:
    """One cache tensor of one layer, allocated as ``[num_blocks, block_size, num_head, *dim]``.

    ``eq=False``: entries are compared by identity, so a list of them can be searched while
    they hold tensors (field equality would compare the tensors).
    """

    #: name of the cache inside its layer, e.g. ``"k_cache"``
    cache_name: str
    #: "FullAttention" | "SlidingWindow" | "Mamba" (kvskill's runtime also serves "Legacy")
    attn_type: str
    #: trailing size per head; a list means several trailing dims (e.g. ``[D // 16, 16]``)
    dim: int | list[int]
    #: heads per rank stored in this cache (``num_key_value_heads_per_rank``; 1 for MLA latent)
    num_head: int
    dtype: torch.dtype
    #: False for caches that hold no per-block data (never allocated)
    needs_block: bool
    #: tokens per block; the framework's models set ``infer_config.scheduler_config.block_size``
    block_size: int | None = None
    #: groups entries under this key instead of ``attn_type`` (same manager class)
    manager_key: str | None = None
    #: called once with the allocated tensor (the layer stores it, e.g. as ``self.k_cache``)
    tensor_setter: Callable[[Tensor], None] | None = None
    #: window W of a SlidingWindow cache: a query at position p sees keys (p - W, p]
    sliding_window: int | None = None
    allocator: CacheAllocator = CacheAllocator.HBM
    #: tokens folded into one stored row (compressed caches store block_size // ratio rows)
    compress_ratio: int = 1
    #: the allocated tensor, set by the host
    tensor: Tensor | None = None
    #: "BnBsND" ([blocks, block_size, heads, dim]) or "BnNBsD" ([blocks, heads, block_size, dim])
    cache_layout: str = "BnBsND"

    @property
    def group_key(self) -> str:
        """Entries with the same key share one manager, one block table and one slot mapping."""
        return self.manager_key if self.manager_key is not None else self.attn_type

    def cache_dim_numel(self) -> int:
        """Elements of one head's trailing dims."""
        return math.prod(self.dims)

    @property
    def storage_block_size(self) -> int:
        """Rows one block stores: ``block_size // compress_ratio``."""
        return self.rows_per_block(self.block_size)

    @property
    def dims(self) -> tuple[int, ...]:
        return tuple(self.dim) if isinstance(self.dim, (list, tuple)) else (self.dim,)

    def rows_per_block(self, block_size: int) -> int:
        """Rows one block of BLOCK_SIZE tokens stores: one per token, or one per
        ``compress_ratio`` tokens for a compressed cache (``storage_block_size``)."""
        if block_size % self.compress_ratio:
            raise CacheInfoError(
                f"cache {self.cache_name!r} has block_size {block_size}, which "
                f"compress_ratio {self.compress_ratio} does not divide"
            )
        return block_size // self.compress_ratio

    def block_shape(self, block_size: int) -> tuple[int, ...]:
        """Shape of one block of this entry: ``(rows_per_block, num_head, *dim)``."""
        return (self.rows_per_block(block_size), self.num_head, *self.dims)

    def bytes_per_block(self, block_size: int) -> int:
        element_size = torch.empty((), dtype=self.dtype).element_size()
        self.rows_per_block(block_size)  # a named error for a ratio that does not divide
        row = entry_bytes(self.dims, self.num_head, element_size)
        return block_bytes(row, block_size, self.compress_ratio)


@dataclass(eq=False)
class MambaCacheEntry(CacheEntry):
    """A recurrent state (conv or SSM) of one request: one block holds the whole ``shape``.

    Allocated as ``[num_blocks, *shape]``. Keyword arguments only, as in the framework: the
    fields below are keyword-only, which moves the positional order away from CacheEntry's.
    ``dim`` and ``num_head`` are unused; ``shape`` is the whole state of one request.
    """

    attn_type: str = field(default=AttnType.MAMBA.value, kw_only=True)
    dim: int | list[int] | None = field(default=None, kw_only=True)
    num_head: int | None = field(default=None, kw_only=True)
    block_size: int = field(default=1, kw_only=True)
    #: the state of one request, e.g. ``[kernel - 1, conv_dim]`` or ``[heads, k_dim, v_dim]``
    shape: list[int] = field(default_factory=list, kw_only=True)
    #: speculative depth: the manager keeps 1 + next_n state blocks per decoding request
    next_n: int = field(default=0, kw_only=True)

    def __post_init__(self) -> None:
        where = f"Mamba cache {self.cache_name!r}"
        if self.attn_type != AttnType.MAMBA.value:
            raise CacheInfoError(f"{where} must keep attn_type='Mamba', got {self.attn_type!r}")
        if self.block_size != 1:
            raise CacheInfoError(f"{where} must have block_size 1, got {self.block_size!r}")
        if not isinstance(self.shape, list) or not self.shape:
            raise CacheInfoError(
                f"{where} needs shape as a non-empty list (e.g. [heads, k_dim, v_dim]), "
                f"got {self.shape!r}"
            )
        if not all(_positive_int(d) for d in self.shape):
            raise CacheInfoError(f"{where} has shape {self.shape}; every dim must be > 0")
        if not isinstance(self.next_n, int) or self.next_n < 0:
            raise CacheInfoError(f"{where} has next_n {self.next_n!r}; expected >= 0")

    def cache_dim_numel(self) -> int:
        """Elements of one request's state."""
        return math.prod(self.shape)

    @property
    def dims(self) -> tuple[int, ...]:
        return tuple(self.shape)

    def block_shape(self, block_size: int) -> tuple[int, ...]:
        return tuple(self.shape)

    def bytes_per_block(self, block_size: int) -> int:
        element_size = torch.empty((), dtype=self.dtype).element_size()
        return entry_bytes(self.shape, 1, element_size)


@dataclass(eq=False)
class LayerCacheInfo:
    """The caches of one (sub)layer, in declaration order.

    kvskill's page-pool layout also honours an optional ``bind_kv_cache`` attribute set on an
    instance (not a field; the framework has none): called with the layer's raw page view
    ``[num_blocks, page_size_bytes]`` (int8), or with ``{cache_name: tensor}`` in the
    contiguous layout, instead of each entry's ``tensor_setter``.
    """

    layer_idx: int
    caches: list[CacheEntry]


@dataclass(eq=False)
class ModelCacheInfo:
    """Everything a host needs to know about a model's caches."""

    num_layers: int
    layer_infos: list[LayerCacheInfo]
    #: MLA latent caches, replicated on every attention TP rank. Set explicitly: a GQA model
    #: whose KV heads per rank come to 1 is not MLA.
    is_mla_backend: bool = False

    def merge(self, other: ModelCacheInfo) -> ModelCacheInfo:
        """This model's layers followed by OTHER's (e.g. its MTP layers), renumbered after them.

        As in the framework, OTHER's LayerCacheInfo objects are renumbered in place.
        """
        if self.is_mla_backend != other.is_mla_backend:
            raise CacheInfoError(
                "is_mla_backend differs between the merged cache infos: "
                f"{self.is_mla_backend} vs {other.is_mla_backend}"
            )
        layer_infos = list(self.layer_infos)
        offset = len(layer_infos)
        for layer in other.layer_infos:
            layer.layer_idx += offset
        layer_infos.extend(other.layer_infos)
        return ModelCacheInfo(
            num_layers=len(layer_infos),
            layer_infos=layer_infos,
            is_mla_backend=self.is_mla_backend,
        )

    def entries(self) -> list[tuple[int, CacheEntry]]:
        """``(layer_idx, entry)`` for every entry that needs blocks, in declaration order."""
        return [
            (info.layer_idx, entry)
            for info in self.layer_infos
            for entry in info.caches
            if entry.needs_block
        ]


def layer_binder(layer: LayerCacheInfo) -> Callable[[Tensor | dict[str, Tensor]], None] | None:
    """The layer's own ``bind_kv_cache``, if it set one (see ``LayerCacheInfo``)."""
    return getattr(layer, "bind_kv_cache", None)


def fill_block_sizes(info: ModelCacheInfo, block_size: int, *, override: bool = False) -> None:
    """Give growing caches (FullAttention, SlidingWindow and registered types other than
    Mamba and Legacy) ``block_size`` where they left it None, or everywhere with OVERRIDE.

    The framework's models set each entry's block size from the scheduler config; kvskill's
    runtime chooses it per run (verify runs small blocks), which is what this does.
    """
    fixed = {AttnType.MAMBA.value, AttnType.LEGACY.value}
    for _, entry in info.entries():
        if entry.attn_type in fixed or isinstance(entry, MambaCacheEntry):
            continue
        if override or entry.block_size is None:
            entry.block_size = block_size


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _validate_entry(
    layer: LayerCacheInfo, entry: CacheEntry, known: Collection[str] | None
) -> None:
    where = f"cache {entry.cache_name!r} in layer {layer.layer_idx}"
    if not isinstance(entry.needs_block, bool):
        raise CacheInfoError(f"{where} has needs_block={entry.needs_block!r}; expected a bool")
    if not entry.needs_block:
        return
    if known is not None and entry.attn_type not in known:
        raise CacheInfoError(
            f"{where} has unknown attn_type {entry.attn_type!r}; known types are "
            f"{sorted(known)}. Register a SingleTypeKVCacheManager subclass for it "
            "with kvskill.runtime.managers.register_attn_type."
        )
    if entry.attn_type == AttnType.MAMBA.value and not isinstance(entry, MambaCacheEntry):
        raise CacheInfoError(
            f"{where} declares attn_type 'Mamba' and must be a MambaCacheEntry, "
            f"not {type(entry).__name__}"
        )
    if not all(_positive_int(d) for d in entry.dims) or not (
        isinstance(entry, MambaCacheEntry) or _positive_int(entry.num_head)
    ):
        raise CacheInfoError(
            f"{where} has dim={entry.dim!r}, num_head={entry.num_head!r}; both must be "
            "positive integers"
        )
    if not isinstance(entry.dtype, torch.dtype):
        raise CacheInfoError(f"{where} has dtype {entry.dtype!r}; expected a torch.dtype")
    if not _positive_int(entry.block_size):
        raise CacheInfoError(
            f"{where} has block_size {entry.block_size!r}; every entry that needs blocks "
            "carries its own positive block size"
        )
    if entry.cache_layout not in SUPPORTED_CACHE_LAYOUTS:
        raise CacheInfoError(
            f"{where} has cache_layout {entry.cache_layout!r}; supported: "
            f"{list(SUPPORTED_CACHE_LAYOUTS)}"
        )
    try:
        CacheAllocator(entry.allocator)
    except ValueError:
        raise CacheInfoError(
            f"{where} has allocator {entry.allocator!r}; supported: "
            f"{[a.value for a in CacheAllocator]}"
        ) from None
    if not _positive_int(entry.compress_ratio):
        raise CacheInfoError(f"{where} has compress_ratio {entry.compress_ratio!r}; expected > 0")
    if entry.compress_ratio > 1:
        if entry.attn_type in (AttnType.MAMBA.value, AttnType.LEGACY.value):
            raise CacheInfoError(
                f"{where} is {entry.attn_type} with compress_ratio {entry.compress_ratio}; only "
                "token caches (a block of block_size tokens) can fold tokens into rows"
            )
        if entry.block_size % entry.compress_ratio:
            raise CacheInfoError(
                f"{where} has block_size {entry.block_size}, which compress_ratio "
                f"{entry.compress_ratio} does not divide; a block must hold whole rows"
            )
    if entry.attn_type == AttnType.SLIDING_WINDOW.value and not _positive_int(entry.sliding_window):
        raise CacheInfoError(
            f"{where} is SlidingWindow but sliding_window={entry.sliding_window!r}; "
            "set the model's window W (a positive number of tokens)"
        )
    if entry.tensor_setter is None and layer_binder(layer) is None:
        raise CacheInfoError(
            f"{where} has no tensor_setter and the layer has no bind_kv_cache; the host "
            "cannot hand it its tensor"
        )


def validate_cache_info(
    info: ModelCacheInfo, *, known_attn_types: Collection[str] | None = None
) -> None:
    """Check a ModelCacheInfo before any manager is built.

    Everything the framework's own check rejects is rejected here too; kvskill adds checks
    that catch a declaration before it fails later (duplicate names, groups that disagree).

    Args:
        known_attn_types: the attn_types some manager serves (``ATTN_TYPE_MANAGER_MAP``);
            None skips that check.

    Raises:
        CacheInfoError: naming the layer and entry at fault, the value and what is allowed.
    """
    if info.num_layers != len(info.layer_infos):
        raise CacheInfoError(
            f"ModelCacheInfo.num_layers is {info.num_layers} but {len(info.layer_infos)} "
            "layer_infos were given; list one LayerCacheInfo per (sub)layer"
        )
    known = None if known_attn_types is None else set(known_attn_types)
    seen_layers: set[int] = set()
    group_shape: dict[str, tuple[int | None, int | None, str, int]] = {}
    for layer in info.layer_infos:
        if layer.layer_idx in seen_layers:
            raise CacheInfoError(f"layer_idx {layer.layer_idx} appears twice in layer_infos")
        seen_layers.add(layer.layer_idx)
        if not layer.caches:
            raise CacheInfoError(f"layer {layer.layer_idx} declares no cache entry")
        names = [entry.cache_name for entry in layer.caches]
        if len(names) != len(set(names)):
            raise CacheInfoError(f"layer {layer.layer_idx} declares duplicate caches {names}")
        for entry in layer.caches:
            _validate_entry(layer, entry, known)
            if not entry.needs_block:
                continue
            key = entry.group_key
            # One manager per group: its entries share the window, the block boundary and,
            # as the framework requires of a FullAttention group, the compress ratio.
            shape = (entry.sliding_window, entry.block_size, entry.attn_type, entry.compress_ratio)
            first = group_shape.setdefault(key, shape)
            if first != shape:
                raise CacheInfoError(
                    f"cache {entry.cache_name!r} in layer {layer.layer_idx} has "
                    f"(sliding_window, block_size, attn_type, compress_ratio)={shape} but group "
                    f"{key!r} already uses {first}; give it its own manager_key"
                )
