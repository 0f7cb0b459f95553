"""kvskill: migrate an LLM's KV cache to paged attention for Ascend NPUs."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kvskill")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+source"

__all__ = ["__version__"]
