"""The closed set of cache attention types; values are the strings converted code and JSON use."""

from __future__ import annotations

from enum import Enum


class AttnType(str, Enum):
    """Cache groups a layer can belong to. The values are the runtime's group names.

    NOTE: ``str()`` and f-strings give the value, so a member reads as the string it stands
    for in messages, evidence and emitted code.
    """

    __str__ = str.__str__
    __format__ = str.__format__

    FULL_ATTENTION = "FullAttention"
    SLIDING_WINDOW = "SlidingWindow"
    MAMBA = "Mamba"
    #: Legacy KV: one static row of max_model_len positions per request (seed 003's
    #: ``cache_unit`` caches), for attention the fused operator cannot express
    LEGACY = "Legacy"
