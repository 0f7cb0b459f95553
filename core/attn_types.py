"""The closed set of cache attention types; values are the strings converted code and JSON use."""

from __future__ import annotations

from enum import Enum


class AttnType(str, Enum):
    """Cache groups a layer can belong to. The values are the runtime's group names."""

    FULL_ATTENTION = "FullAttention"
    SLIDING_WINDOW = "SlidingWindow"
    MAMBA = "Mamba"
