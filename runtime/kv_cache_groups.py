"""Cache groups: the entries one manager serves, gathered from a model's declarations.

Entries with the same group key (``manager_key`` or ``attn_type``) share a block size, a
window, a compress ratio, one block table and one slot mapping (none for a compressed group,
see ``managers``); ``build_groups`` collects them layer by layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvskill.runtime.cache_info import (
    CacheEntry,
    CacheInfoError,
    LayerCacheInfo,
    ModelCacheInfo,
)


@dataclass(eq=False)
class KVCacheGroup:
    """The entries served by one manager (same group key, block size and window)."""

    key: str
    attn_type: str
    block_size: int
    sliding_window: int | None
    #: tokens folded into one stored row (1: a row per token); its block of ``block_size``
    #: tokens stores ``block_size // compress_ratio`` rows
    compress_ratio: int = 1
    #: speculative depth the group is sized for: a state group keeps ``1 + next_n`` blocks
    #: per request (its Mamba entries' ``next_n``), a window group ``2 * next_n`` more tokens
    next_n: int = 0
    #: (layer info, that layer's entries of this group), in layer order
    layers: list[tuple[LayerCacheInfo, list[CacheEntry]]] = field(default_factory=list)

    @property
    def entries(self) -> list[CacheEntry]:
        return [entry for _, entries in self.layers for entry in entries]

    def bytes_per_block(self) -> int:
        """Bytes one block id costs across every layer of the group (contiguous layout)."""
        return sum(entry.bytes_per_block(self.block_size) for entry in self.entries)

    def layer_page_bytes(self) -> list[int]:
        """Payload bytes per block of each layer (what one page must hold)."""
        return [
            sum(entry.bytes_per_block(self.block_size) for entry in entries)
            for _, entries in self.layers
        ]


def build_groups(cache_info: ModelCacheInfo) -> dict[str, KVCacheGroup]:
    """Group every entry that needs blocks by its group key, in first-seen order."""
    groups: dict[str, KVCacheGroup] = {}
    for layer in cache_info.layer_infos:
        for entry in layer.caches:
            if not entry.needs_block:
                continue
            group = groups.get(entry.group_key)
            if group is None:
                group = groups[entry.group_key] = KVCacheGroup(
                    key=entry.group_key,
                    attn_type=entry.attn_type,
                    block_size=entry.block_size,
                    sliding_window=entry.sliding_window,
                    compress_ratio=entry.compress_ratio,
                )
            next_n = getattr(entry, "next_n", 0)
            if next_n != group.next_n and group.entries:
                raise CacheInfoError(
                    f"group {entry.group_key!r}: entries declare next_n {group.next_n} and "
                    f"{next_n}; one manager keeps one number of state blocks per request"
                )
            group.next_n = next_n
            if not group.layers or group.layers[-1][0] is not layer:
                group.layers.append((layer, []))
            group.layers[-1][1].append(entry)
    return groups
