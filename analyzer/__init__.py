"""Analyzer: read a model config and modeling code, decide its KV-cache design (the Plan)."""

from kvskill.analyzer.plan import CacheEntryPlan, Evidence, LayerPlan, Plan

__all__ = ["CacheEntryPlan", "Evidence", "LayerPlan", "Plan", "analyze_model"]


def __getattr__(name: str):
    # analyze_model loads the code readers (libcst); resolved on first use so that importing
    # a light part of the analyzer (the lint registry for `kvskill --help`) stays quick
    if name == "analyze_model":
        from kvskill.analyzer.analyze import analyze_model

        return analyze_model
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
