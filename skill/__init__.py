"""kvskill: migrate an LLM's KV cache to paged attention for Ascend NPUs.

The Python API is exported here lazily, so ``import kvskill`` stays cheap (torch is loaded
on first use of ``kvskill.LLM``)::

    from kvskill import LLM, EngineConfig, SamplingParams

    llm = LLM("converted/", EngineConfig(random_weights=True))
    outputs = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8))
"""

from __future__ import annotations

#: names served from kvskill.runtime on first access
_RUNTIME_EXPORTS = ("LLM", "EngineConfig", "SamplingParams", "RequestOutput", "FinishReason")

__all__ = ["__version__", *_RUNTIME_EXPORTS]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvskill")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "0.0.0+source"


def __getattr__(name: str):
    if name == "__version__":
        value = _version()
    elif name in _RUNTIME_EXPORTS:
        import kvskill.runtime as runtime

        value = getattr(runtime, name)
    else:
        raise AttributeError(f"module 'kvskill' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
