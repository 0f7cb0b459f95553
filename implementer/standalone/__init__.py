"""Standalone deployment: the converted modeling file plus a generated runner that owns the
KV caches, the block table, the slot mapping and kv_len (modes 1 contiguous, 2 paged, 3 MLA)."""

from kvskill.implementer.standalone.convert import convert_standalone, convert_standalone_source
from kvskill.implementer.standalone.runner import render_runner
from kvskill.implementer.standalone.spec import KvMode, MlaAbsorb, StandaloneSpec

__all__ = [
    "KvMode",
    "MlaAbsorb",
    "StandaloneSpec",
    "convert_standalone",
    "convert_standalone_source",
    "render_runner",
]
