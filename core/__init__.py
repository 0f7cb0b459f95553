"""The shared floor: what every part of kvskill uses. No module here imports another part."""

from kvskill.core.attn_types import AttnType
from kvskill.core.cache_bytes import DTYPE_BYTES, dtype_bytes, dtype_name, entry_bytes
from kvskill.core.errors import (
    BadInputError,
    CheckFailedError,
    ExitCode,
    KvskillError,
    UnsupportedModelError,
)
from kvskill.core.overrides import parse_overrides

__all__ = [
    "DTYPE_BYTES",
    "AttnType",
    "BadInputError",
    "CheckFailedError",
    "ExitCode",
    "KvskillError",
    "UnsupportedModelError",
    "dtype_bytes",
    "dtype_name",
    "entry_bytes",
    "parse_overrides",
]
